"""What verifying training shards on read costs: loader samples/s with and without the checks.

Generates ``--num-samples`` 256 px JPEG pairs (benchmarks/data_throughput.py's generator), precomputes
them at each resolution in ``--sizes``, and times the training loader over two copies of the output:

- ``unverified``: the folder as a toolkit before checksums wrote it (no ``.xxh3`` sidecars, no
  ``sums`` in dataset.json) and the token-id bound off: the loader of before this change;
- ``verified``: the folder as precompute writes it now: every sample's xxh3-64 and its token ids
  checked on every read.

The two are timed alternately (``--rounds`` pairs, the order flipped every round) so machine load hits
both alike; the table gives the median samples/s of each and the slowdown. Run:
``PYTHONPATH=. python benchmarks/loader_integrity.py`` (JSON to benchmarks/results/loader_integrity.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data_throughput import make_raw  # noqa: E402


def strip_checksums(src: str, dst: str) -> None:
    """Copy a training folder, removing what a precompute before checksums did not write."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "dataset.json")) as fh:
        meta = json.load(fh)
    for shard in meta["shards"]:
        shard.pop("sums", None)
    meta["extra"].pop("vocab_size", None)
    with open(os.path.join(dst, "dataset.json"), "w") as fh:
        json.dump(meta, fh)
    for name in os.listdir(dst):
        if name.endswith(".xxh3"):
            os.remove(os.path.join(dst, name))


def time_pass(path: str, args, verified: bool) -> float:
    """Samples/s of ``--passes`` passes through the loader, after its first batch (worker start-up excluded)."""
    from toolkit.data.trainset import integrity
    from toolkit.data.trainset.loader import make_loader

    saved = integrity.vocab_size
    if not verified:  # the old loader had no token bound; an old folder would otherwise resolve it by model
        integrity.vocab_size = lambda ds: None
    try:
        loader = make_loader(path, batch_size=args.batch_size, num_workers=args.workers,
                             num_steps=args.passes * (args.num_samples // args.batch_size))
    finally:
        integrity.vocab_size = saved
    # workers 0: the main process does all the reading, so its CPU time is the loader's cost, which other
    # processes' load does not inflate the way it inflates wall time; with workers, wall time is all we have
    clock = time.process_time if args.workers == 0 else time.perf_counter
    start, count = None, 0
    for batch in loader:
        if start is None:
            start = clock()
        else:
            count += len(batch["index"])
    return count / (clock() - start)


def bench_size(raw: str, work: str, size: int, args) -> dict:
    from toolkit.core.config import build
    from toolkit.data.trainset.precompute import PrecomputeConfig, run

    verified = os.path.join(work, f"train{size}")
    unverified = verified + "-old"
    run(build(PrecomputeConfig, {"input": raw, "out": verified, "model": args.model, "image_size": size,
                                 "num_workers": args.workers, "samples_per_shard": args.per_shard}))
    strip_checksums(verified, unverified)
    from toolkit.data.trainset.format import TrainDataset

    sample_bytes = TrainDataset.open(verified).sample_bytes
    rates: dict[str, list[float]] = {"verified": [], "unverified": []}
    for r in range(args.rounds):
        order = ["unverified", "verified"] if r % 2 == 0 else ["verified", "unverified"]
        for name in order:
            rates[name].append(time_pass(verified if name == "verified" else unverified, args, name == "verified"))
    row = {"size": size, "sample_bytes": sample_bytes,
           **{f"{k}_samples_per_s": statistics.median(v) for k, v in rates.items()}, "rounds": rates}
    # the median of per-round ratios: each pair ran back to back, under about the same load
    row["slowdown_pct"] = 100 * (1 - statistics.median(v / u for v, u in zip(rates["verified"],
                                                                              rates["unverified"], strict=True)))
    shutil.rmtree(verified), shutil.rmtree(unverified)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-samples", type=int, default=4000)
    parser.add_argument("--per-shard", type=int, default=500)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 224])
    parser.add_argument("--model", default="cliptk-tiny")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--passes", type=int, default=2, help="passes over the data per timing")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved (unverified, verified) pairs")
    parser.add_argument("--json", default="benchmarks/results/loader_integrity.json")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="integrity-bench-")
    try:
        raw = os.path.join(work, "raw")
        os.makedirs(raw)
        make_raw(raw, args.num_samples, args.per_shard)
        rows = [bench_size(raw, work, size, args) for size in args.sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    unit = "samples per CPU-second of the reading process" if args.workers == 0 else "samples/s (wall)"
    print(f"\n{args.num_samples} samples, {args.workers} workers, batch {args.batch_size}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}: median {unit} of {args.rounds} interleaved rounds; slowdown: median of "
          "the rounds' ratios\n")
    print("| model res | sample bytes | unverified (before) | verified (checksums + token bound) | slowdown |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['sample_bytes']} | {r['unverified_samples_per_s']:.0f} | "
              f"{r['verified_samples_per_s']:.0f} | {r['slowdown_pct']:+.1f} % |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"args": vars(args), "rows": rows}, fh, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
