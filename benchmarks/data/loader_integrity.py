"""What verifying training shards on read costs: loader samples/s before and after checksums.

Generates ``--num-samples`` 256 px JPEG pairs (benchmarks/data/data_throughput.py's generator), precomputes
them at each resolution in ``--sizes`` with this tree, and times two loaders, each in its own process:

- ``before``: the toolkit at ``--base`` (the last commit before checksums; ``git archive`` into a temp
  folder) reading the folder as it wrote it (no ``.xxh3`` sidecars, no ``sums`` in dataset.json);
- ``after``: this tree reading the folder as precompute writes it now: every sample's xxh3-64 and every
  batch's token ids checked on read;
- ``after_unverified``: this tree reading the old folder (nothing to verify; token ids still bounded),
  which isolates what hashing costs from the rest of this change (the reader now reads into one reused
  buffer instead of a fresh one per run).

The two are timed alternately (``--rounds`` pairs, the order flipped every round) so machine load hits
both alike; the slowdown is the median of the rounds' after/before ratios. With ``--workers 0`` the
reading happens in the timed process, whose CPU time is then the measure (other processes' load inflates
wall time much more than CPU time); with workers, wall time after the first batch. Run:
``python -m benchmarks.data.loader_integrity`` (JSON to benchmarks/data/results/loader_integrity.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.data.data_throughput import make_raw

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def time_child(path: str, workers: int, batch_size: int, num_steps: int) -> float:
    """In the child process: samples/s of ``num_steps`` batches after the first (CPU time with 0 workers)."""
    from toolkit.data.trainset.loader import make_loader

    clock = time.process_time if workers == 0 else time.perf_counter
    start, count = None, 0
    for batch in make_loader(path, batch_size=batch_size, num_workers=workers, num_steps=num_steps):
        if start is None:
            start = clock()
        else:
            count += len(batch["index"])
    return count / (clock() - start)


def time_arm(root: str, path: str, args) -> float:
    """Run :func:`time_child` in a fresh process importing the toolkit from ``root``."""
    steps = args.passes * (args.num_samples // args.batch_size)
    # run by path, not -m: -m would put the working directory (this checkout's toolkit) before ``root``;
    # REPO after ``root`` only supplies the benchmarks package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, REPO]), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            path,
            "--workers",
            str(args.workers),
            "--batch-size",
            str(args.batch_size),
            "--steps",
            str(steps),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(proc.stdout.strip().splitlines()[-1])


def base_tree(rev: str, work: str) -> str:
    """The toolkit package at ``rev``, extracted with git archive; returns the folder to put on PYTHONPATH."""
    root = os.path.join(work, "base")
    os.makedirs(root)
    archive = subprocess.run(["git", "-C", REPO, "archive", rev, "toolkit"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", root], input=archive.stdout, check=True)
    return root


def bench_size(raw: str, work: str, base: str, size: int, args) -> dict:
    from toolkit.core.config import build
    from toolkit.data.trainset.format import TrainDataset
    from toolkit.data.trainset.precompute.stage import PrecomputeConfig, run

    after = os.path.join(work, f"train{size}")
    before = after + "-old"
    run(
        build(
            PrecomputeConfig,
            {
                "input": raw,
                "out": after,
                "model": args.model,
                "image_size": size,
                "num_workers": 2,
                "samples_per_shard": args.per_shard,
            },
        )
    )
    strip_checksums(after, before)
    # after_unverified: this tree on the old folder (no checksums to verify; token ids still bounded)
    arms = {"before": (base, before), "after": (REPO, after), "after_unverified": (REPO, before)}
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            rates[name].append(time_arm(*arms[name], args))
    row = {
        "size": size,
        "sample_bytes": TrainDataset.open(after).sample_bytes,
        **{f"{k}_samples_per_s": statistics.median(v) for k, v in rates.items()},
        "rounds": rates,
    }
    # the median of per-round ratios: each pair ran back to back, under about the same load
    row["slowdown_pct"] = 100 * (
        1 - statistics.median(a / b for a, b in zip(rates["after"], rates["before"], strict=True))
    )
    row["checksum_cost_pct"] = 100 * (
        1 - statistics.median(a / b for a, b in zip(rates["after"], rates["after_unverified"], strict=True))
    )
    shutil.rmtree(after), shutil.rmtree(before)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-samples", type=int, default=4000)
    parser.add_argument("--per-shard", type=int, default=500)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 224])
    parser.add_argument("--model", default="cliptk-tiny")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers of the timed loaders")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--passes", type=int, default=2, help="passes over the data per timing")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the three loaders")
    parser.add_argument("--base", default="c1f16c8", help="git revision of the loader before checksums")
    parser.add_argument("--json", default="benchmarks/data/results/loader_integrity.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(time_child(args.child, args.workers, args.batch_size, args.steps))
        return
    work = tempfile.mkdtemp(prefix="integrity-bench-")
    try:
        raw = os.path.join(work, "raw")
        os.makedirs(raw)
        make_raw(raw, args.num_samples, args.per_shard)
        base = base_tree(args.base, work)
        rows = [bench_size(raw, work, base, size, args) for size in args.sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    unit = "samples per CPU-second of the reading process" if args.workers == 0 else "samples/s (wall)"
    print(
        f"\n{args.num_samples} samples, {args.workers} workers, batch {args.batch_size}, {os.cpu_count()} "
        "CPUs, "
        f"load {os.getloadavg()[0]:.1f}: median {unit} of {args.rounds} interleaved rounds; slowdown: "
        "median of "
        f"the rounds' after/before ratios; before = {args.base}\n"
    )
    print(
        "| model res | sample bytes | before (no checks) | after (checksums + token bound) | slowdown | "
        "after, old folder (token bound only) | cost of the checksums |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['size']} | {r['sample_bytes']} | {r['before_samples_per_s']:.0f} | "
            f"{r['after_samples_per_s']:.0f} | {r['slowdown_pct']:+.1f} % | "
            f"{r['after_unverified_samples_per_s']:.0f} | {r['checksum_cost_pct']:+.1f} % |"
        )
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"args": vars(args), "rows": rows}, fh, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
