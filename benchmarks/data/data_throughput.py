"""Data throughput: precompute samples/s, and the training-shard loader vs decoding raw JPEGs on the fly.

Generates ``--num-samples`` 256 px JPEG image-text pairs in img2dataset's raw shard layout, then for
each model resolution in ``--sizes``:

- precompute (``toolkit.data.trainset.precompute.stage.run``) with ``--workers`` processes;
- loader: ``make_loader`` over the training shards (uint8 pixels + tokens), ``--workers`` DataLoader
  workers, batches of ``--batch-size``;
- decode on the fly, the same images from the raw shards through a webdataset pipeline with the same
  workers and batch size, two ways: cliptk's ``decode_rgb`` (JPEG draft decoding + one bicubic
  resample, the fastest PIL path we know) + tokenizer, and the open_clip_train way (PIL decode,
  torchvision Resize(bicubic) + CenterCrop + ToTensor) + tokenizer.

Prints a markdown table and writes JSON. Run: ``python -m benchmarks.data.data_throughput``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import tarfile
import tempfile
import time

import numpy as np
from PIL import Image


def make_raw(root: str, num_samples: int, per_shard: int, side: int = 256) -> list[str]:
    """Raw shards of smooth random 256 px JPEGs (photo-like file sizes, ~15-25 kB) with captions."""
    rng = np.random.default_rng(0)
    urls = []
    for shard in range(-(-num_samples // per_shard)):
        url = os.path.join(root, f"{shard:05d}.tar")
        with tarfile.open(url, "w") as tar:
            for i in range(shard * per_shard, min(num_samples, (shard + 1) * per_shard)):
                low = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
                img = Image.fromarray(low).resize((side, side), Image.Resampling.BICUBIC)
                noisy = np.clip(np.asarray(img, np.int16) + rng.integers(-12, 13, (side, side, 3)), 0, 255)
                buf = io.BytesIO()
                Image.fromarray(noisy.astype(np.uint8)).save(buf, "JPEG", quality=90)
                for ext, data in (
                    ("jpg", buf.getvalue()),
                    ("txt", f"a generated picture number {i}".encode()),
                ):
                    info = tarfile.TarInfo(f"{i:09d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        urls.append(url)
    return urls


def _time_loader(loader) -> tuple[float, int, int]:
    """(seconds after the first batch arrived, samples after it, all samples): steady state, so worker
    start-up (the same for every loader) does not dominate a few thousand samples."""
    start, count, total = None, 0, 0
    for batch in loader:
        n = len(batch["tokens"])
        total += n
        if start is None:
            start = time.perf_counter()
        else:
            count += n
    return time.perf_counter() - start, count, total


def on_the_fly_loader(urls: list[str], size: int, model: str, batch_size: int, workers: int, style: str):
    """DataLoader decoding raw shards on the fly (webdataset, split by worker)."""
    import torch
    import webdataset as wds
    from torchvision import transforms

    from toolkit.data.images import decode_rgb
    from toolkit.models.registry import tokenizer

    tok = tokenizer(model)
    tv = transforms.Compose(
        [
            transforms.Resize(size, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.CenterCrop(size),
            transforms.ToTensor(),
        ]
    )

    def image(data: bytes):
        if style == "decode_rgb":
            return torch.from_numpy(decode_rgb(data, size)[0].copy())
        return tv(Image.open(io.BytesIO(data)).convert("RGB"))

    def collate(samples):
        return {
            "image": torch.stack([image(s["jpg"]) for s in samples]),
            "tokens": tok([s["txt"].decode() for s in samples]),
        }

    ds = wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.split_by_worker,
        wds.tarfile_to_samples(),
        wds.batched(batch_size, collation_fn=collate, partial=True),
    )
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)


def bench_size(raw: str, urls: list[str], work: str, size: int, args) -> dict:
    from toolkit.core.config import build
    from toolkit.data.trainset.loader import make_loader
    from toolkit.data.trainset.precompute.stage import PrecomputeConfig, run

    out = os.path.join(work, f"train{size}")
    cfg = build(
        PrecomputeConfig,
        {
            "input": raw,
            "out": out,
            "model": args.model,
            "image_size": size,
            "num_workers": args.workers,
            "samples_per_shard": args.per_shard,
        },
    )
    start = time.perf_counter()
    result = run(cfg)
    pre_s = time.perf_counter() - start
    row = {
        "size": size,
        "samples": result.counts["num_samples"],
        "precompute_samples_per_s": result.counts["num_read"] / pre_s,
    }
    for name, make in [
        ("loader", lambda: make_loader(out, batch_size=args.batch_size, num_workers=args.workers)),
        (
            "decode_rgb",
            lambda: on_the_fly_loader(urls, size, args.model, args.batch_size, args.workers, "decode_rgb"),
        ),
        (
            "torchvision",
            lambda: on_the_fly_loader(urls, size, args.model, args.batch_size, args.workers, "torchvision"),
        ),
    ]:
        best = None
        for _ in range(args.repeats):
            seconds, count, total = _time_loader(make())
            assert total == row["samples"], (name, total)
            best = seconds if best is None else min(best, seconds)
        row[f"{name}_samples_per_s"] = count / best
    row["speedup_vs_decode_rgb"] = row["loader_samples_per_s"] / row["decode_rgb_samples_per_s"]
    row["speedup_vs_torchvision"] = row["loader_samples_per_s"] / row["torchvision_samples_per_s"]
    shutil.rmtree(out, ignore_errors=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-samples", type=int, default=4000)
    parser.add_argument("--per-shard", type=int, default=500, help="samples per raw and training shard")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 224])
    parser.add_argument("--model", default="cliptk-tiny", help="tokenizer source (context length 32)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many passes per loader")
    parser.add_argument("--json", default="benchmarks/data/results/data_throughput.json")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="data-bench-")
    try:
        raw = os.path.join(work, "raw")
        os.makedirs(raw)
        urls = make_raw(raw, args.num_samples, args.per_shard)
        rows = [bench_size(raw, urls, work, size, args) for size in args.sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\n{args.num_samples} generated 256 px JPEGs, {args.workers} workers, batch {args.batch_size}, "
        f"{os.cpu_count()} CPUs (samples/s after the first batch, best of {args.repeats})\n"
    )
    print(
        "| model res | precompute | training-shard loader | on-the-fly decode_rgb | on-the-fly torchvision "
        "| loader / decode_rgb | loader / torchvision |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['size']} | {r['precompute_samples_per_s']:.0f} | {r['loader_samples_per_s']:.0f} | "
            f"{r['decode_rgb_samples_per_s']:.0f} | {r['torchvision_samples_per_s']:.0f} | "
            f"{r['speedup_vs_decode_rgb']:.1f}x | {r['speedup_vs_torchvision']:.1f}x |"
        )
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"args": vars(args), "rows": rows}, fh, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
