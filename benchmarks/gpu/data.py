"""The check's data, made once and shared by the trainer, open_clip_train and decoding sections:
synthetic JPEG images with captions -> raw shards (webdataset tars of ``KEY.jpg`` + ``KEY.txt``, what
img2dataset writes and open_clip_train reads; written here rather than by ``toolkit data shard`` because
that re-encodes through img2dataset's resizer, whose albumentations/OpenCV stack a lent GPU machine
lacks) -> training shards (``toolkit data precompute``, what ``toolkit train`` reads).

The images are smooth random fields (a coarse noise grid upsampled bicubically), so they compress about
like photographs rather than like white noise."""

from __future__ import annotations

import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.gpu.common import Context, Section, run_cmd, tail, toolkit_cmd

WORDS = (
    "red",
    "green",
    "blue",
    "small",
    "large",
    "striped",
    "round",
    "square",
    "dog",
    "cat",
    "car",
    "tree",
    "house",
    "boat",
    "bird",
    "flower",
    "at night",
    "in snow",
    "on grass",
    "near water",
)


def caption(i: int) -> str:
    """A short caption that differs between samples (<= 12 BPE tokens)."""
    w = WORDS
    return f"a {w[i % 8]} {w[8 + (i // 8) % 8]} {w[16 + (i // 64) % 4]} number {i}"


def _write_image(args: tuple[Path, int, int]) -> Path:
    import numpy as np
    from PIL import Image

    folder, i, px = args
    rng = np.random.default_rng(i)
    coarse = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    path = folder / f"{i:06d}.jpg"
    coarse.resize((px, px), Image.BICUBIC).save(path, quality=90)
    (folder / f"{i:06d}.txt").write_text(caption(i))
    return path


def write_raw_shards(images: list[Path], raw: Path, per_shard: int) -> None:
    """Raw shards ``00000.tar``, ... of the images and their sidecar captions, in order."""
    raw.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(images), per_shard):
        with tarfile.open(raw / f"{start // per_shard:05d}.tar", "w") as tar:
            for i, path in enumerate(images[start : start + per_shard], start):
                tar.add(path, arcname=f"{i:09d}.jpg")
                tar.add(path.with_suffix(".txt"), arcname=f"{i:09d}.txt")


def prepare(ctx: Context, sec: Section, num_samples: int, raw_px: int, model: str) -> bool:
    """Build images, raw shards and training shards under ctx.work (once); False (noted) on failure."""
    if "train" in ctx.shared:
        return True
    images, raw, train = ctx.work / "images", ctx.work / "raw", ctx.work / "train"
    images.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(16) as pool:  # PIL's encoder releases the GIL
        paths = list(pool.map(_write_image, [(images, i, raw_px) for i in range(num_samples)]))
    write_raw_shards(paths, raw, 512)
    log = ctx.work / "data_precompute.log"
    code, wall = run_cmd(
        toolkit_cmd(
            "data",
            "precompute",
            "--in",
            str(raw),
            "--out",
            str(train),
            "--model",
            model,
            "--samples-per-shard",
            "1024",
        ),
        max(sec.left_s(), 60.0),
        log,
    )
    if code != 0:
        sec.error = f"toolkit data precompute failed ({code}): {tail(log)}"
        return False
    sec.notes.append(f"data: toolkit data precompute of {num_samples} samples took {wall:.1f} s")
    ctx.shared.update(images=paths, raw=raw, train=train, num_samples=num_samples, model=model)
    return True
