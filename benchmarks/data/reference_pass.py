"""What `toolkit data precompute --reference-model` costs: seconds per 1,000 samples of the reference pass on
the CPU, and the bytes per sample it adds, per storage mode.

The same raw shards (``--num-samples`` random 256x192 JPEGs with captions, made here) are precomputed for the
student ``cliptk-tiny`` without and with a reference, interleaved over ``--repeats``; the reference pass costs
the difference of the manifests' processing times (``details.throughput.process_s``: decode, resize, tokenize,
plus the reference's decode, transform and forward passes), over the pool of ``--workers`` processes. The
references are random initialisations saved as model folders (no registry ships CLIP weights; a forward pass
costs the same with trained weights): ``cliptk-tiny`` (32 px, d 128) and ``ViT-B-32`` (224 px, d 512; fewer
samples, ``--vit-samples``). Bytes are read from the written sets (``dataset.json``'s fields / table records).

    python -m benchmarks.data.reference_pass                       # 1,000 samples, 64 for ViT-B-32
    python -m benchmarks.data.reference_pass --models tiny --num-samples 2000
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import tarfile
import time
from pathlib import Path

import numpy as np

MODELS = {"tiny": "cliptk-tiny", "vit-b-32": "ViT-B-32"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models", nargs="+", default=list(MODELS), choices=list(MODELS), help="references to time"
    )
    p.add_argument("--num-samples", type=int, default=1000, help="samples for the tiny reference")
    p.add_argument("--vit-samples", type=int, default=64, help="samples for ViT-B-32")
    p.add_argument("--workers", type=int, default=2, help="precompute worker processes")
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats (without, with)")
    p.add_argument("--work", type=Path, default=Path("runs/bench/reference_pass"), help="scratch folder")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/data/results/reference_pass"),
        help="writes OUT.json and OUT.md",
    )
    return p.parse_args(argv)


def make_raw(folder: Path, num_samples: int, per_shard: int = 250) -> Path:
    """Raw shards of random 256x192 JPEG photos-to-be with captions (img2dataset's member names)."""
    from PIL import Image

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for shard in range(-(-num_samples // per_shard)):
        with tarfile.open(folder / f"{shard:05d}.tar", "w") as tar:
            for i in range(shard * per_shard, min(num_samples, (shard + 1) * per_shard)):
                buf = io.BytesIO()
                smooth = rng.integers(
                    0, 256, (12, 16, 3), dtype=np.uint8
                )  # upscaled: JPEG-sized like a photo
                Image.fromarray(smooth).resize((256, 192), Image.Resampling.BICUBIC).save(
                    buf, "JPEG", quality=90
                )
                for ext, data in (("jpg", buf.getvalue()), ("txt", f"a photo of thing {i}".encode())):
                    info = tarfile.TarInfo(f"{i:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return folder


def save_reference(name: str, folder: Path) -> Path:
    from toolkit.models import load_model, save_model

    loaded = load_model(name, seed=0)
    return save_model(loaded.model, loaded.model_cfg, folder)


def precompute_s(raw: Path, out: Path, workers: int, storage: str, reference: str) -> tuple[float, dict]:
    """(processing seconds, dataset.json) of one precompute run."""
    from toolkit.core.config import build
    from toolkit.data.trainset.precompute.stage import PrecomputeConfig, run

    shutil.rmtree(out, ignore_errors=True)
    cfg = build(
        PrecomputeConfig,
        {
            "input": str(raw),
            "out": str(out),
            "model": "cliptk-tiny",
            "storage": storage,
            "num_workers": workers,
            "reference_model": reference,
        },
    )
    result = run(cfg)
    return float(result.details["throughput"]["process_s"]), json.loads((out / "dataset.json").read_text())


def measure(a, key: str) -> dict:
    n = a.vit_samples if key == "vit-b-32" else a.num_samples
    raw = make_raw(a.work / f"raw-{n}", n, min(250, -(-n // a.workers)))  # at least one raw shard per worker
    ref = save_reference(MODELS[key], a.work / f"ref-{key}")
    without, with_ref = [], []
    for _ in range(a.repeats):
        without.append(precompute_s(raw, a.work / "out", a.workers, "pixels", "")[0])
        start = time.monotonic()
        seconds, ds = precompute_s(raw, a.work / "out", a.workers, "pixels", str(ref))
        with_ref.append(seconds)
        wall = time.monotonic() - start
    from toolkit.data.trainset.format import TrainDataset

    pixels = TrainDataset.open(str(a.work / "out"))
    added = {"pixels": sum(f.padded_bytes for f in pixels.fields[2:])}
    dim = pixels.fields[2].shape[0]
    added["jpeg/index"] = 4 * dim  # two float16 [d] columns in the table record
    base, refd = statistics.median(without), statistics.median(with_ref)
    return {
        "reference": MODELS[key],
        "d_ref": dim,
        "image_size": ds["extra"]["reference"]["preprocess"]["size"],
        "num_samples": n,
        "workers": a.workers,
        "process_s_without": round(base, 2),
        "process_s_with": round(refd, 2),
        "wall_s_with": round(wall, 2),
        "reference_s_per_1000": round(1000 * (refd - base) / n, 2),
        "bytes_added_per_sample": added,
    }


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    a.work.mkdir(parents=True, exist_ok=True)
    rows = [measure(a, key) for key in a.models]
    load = os.getloadavg()[0]
    lines = [
        f"# Reference pass of `toolkit data precompute` (CPU, {os.cpu_count()} cores, load {load:.1f})",
        "",
        "| reference | d_ref | px | samples | process s without / with | reference s per 1,000 | "
        "bytes added per sample (pixels; jpeg/index) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["bytes_added_per_sample"]
        lines.append(
            f"| {r['reference']} | {r['d_ref']} | {r['image_size']} | {r['num_samples']} | "
            f"{r['process_s_without']} / {r['process_s_with']} | **{r['reference_s_per_1000']}** | "
            f"{b['pixels']:,}; {b['jpeg/index']:,} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps({"load": load, "rows": rows}, indent=2) + "\n")
    a.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
