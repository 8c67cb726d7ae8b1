"""Section 5: JPEG decoding throughput: libjpeg-turbo (torchvision.io.decode_jpeg) and PIL per CPU core,
nvJPEG batched on the GPU (``decode_jpeg(list, device="cuda")``), and the loader's own batch decoder
(``toolkit.data.decode``, decode + resize + crop) on each device it supports. The images are the check's
synthetic 256-px JPEGs (the trainer section's), read into memory first: only decoding is timed."""

from __future__ import annotations

import io
import time

from benchmarks.gpu.common import Context, Section, synchronize

GPU_BATCH, GPU_IMAGES, CPU_IMAGES = 256, 2048, 256
DRY_IMAGES = 16


def _rate(fn, count: int, device: str) -> float:
    fn()  # warm-up (nvJPEG handles, kernels)
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return count / (time.perf_counter() - start)


def _encoded(ctx: Context, count: int) -> list[bytes]:
    paths = ctx.shared.get("images") or []
    if not paths:
        from benchmarks.gpu.data import _write_image

        folder = ctx.work / "decode_images"
        folder.mkdir(parents=True, exist_ok=True)
        paths = [_write_image((folder, i, 256)) for i in range(min(count, 64))]
    return [paths[i % len(paths)].read_bytes() for i in range(count)]


def _cpu_rows(blobs: list[bytes]) -> list[dict]:
    import torch
    import torchvision.io as tio
    from PIL import Image

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per core
    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    try:
        rows = [
            {
                "decoder": "torchvision decode_jpeg (libjpeg-turbo)",
                "device": "cpu, 1 thread",
                "images_per_s": _rate(lambda: [tio.decode_jpeg(t) for t in tensors], len(blobs), "cpu"),
            },
            {
                "decoder": "PIL Image.open + convert RGB",
                "device": "cpu, 1 thread",
                "images_per_s": _rate(
                    lambda: [Image.open(io.BytesIO(b)).convert("RGB").load() for b in blobs],
                    len(blobs),
                    "cpu",
                ),
            },
        ]
    finally:
        torch.set_num_threads(threads)
    return rows


def _gpu_rows(blobs: list[bytes]) -> list[dict]:
    import torch
    import torchvision.io as tio

    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    batches = [tensors[i : i + GPU_BATCH] for i in range(0, len(tensors), GPU_BATCH)]

    def decode_resize():
        for batch in batches:
            images = tio.decode_jpeg(batch, device="cuda")
            torch.nn.functional.interpolate(
                torch.stack(images).float(), size=(224, 224), mode="bicubic", antialias=True
            )

    return [
        {
            "decoder": "nvJPEG decode_jpeg(list, device=cuda)",
            "device": f"cuda, batch {GPU_BATCH}",
            "images_per_s": _rate(
                lambda: [tio.decode_jpeg(b, device="cuda") for b in batches], len(blobs), "cuda"
            ),
        },
        {
            "decoder": "nvJPEG + bicubic resize to 224",
            "device": f"cuda, batch {GPU_BATCH}",
            "images_per_s": _rate(decode_resize, len(blobs), "cuda"),
        },
    ]


def _loader_rows(blobs: list[bytes], devices: list[str], sec: Section) -> list[dict]:
    """toolkit.data.decode's batch decoder (decode + resize + crop to 224), where the tree has it."""
    try:
        from toolkit.data.decode import decode_batch
    except ImportError:
        sec.notes.append("toolkit.data.decode is not in this tree: the loader's decoder is not timed")
        return []
    rows = []
    for device in devices:
        try:
            rate = _rate(lambda d=device: decode_batch(blobs, 224, None, d), len(blobs), device)
            rows.append(
                {"decoder": "toolkit.data.decode.decode_batch", "device": device, "images_per_s": rate}
            )
        except Exception as err:  # reported, not fatal: the other rows still stand
            rows.append(
                {
                    "decoder": "toolkit.data.decode.decode_batch",
                    "device": device,
                    "status": f"error: {type(err).__name__}: {str(err)[:160]}",
                }
            )
    return rows


def _crop_rows(devices: list[str], count: int, sec: Section) -> list[dict]:
    """toolkit.data.augment.resize_crops: the random crop's batched resize (crop_on=device), 249 -> 224 px
    crops of the default RandomResizedCrop, on each device, where the tree has it."""
    try:
        from toolkit.data.augment import AugmentConfig, crop_boxes, crop_draws, resize_crops
    except ImportError:
        sec.notes.append(
            "toolkit.data.augment.resize_crops is not in this tree: the device crop is not timed"
        )
        return []
    import numpy as np
    import torch

    rows = []
    for device in devices:
        n = count if device == "cuda" else min(count, 32)  # ~50 images/s on one CPU core: for scale only
        boxes = torch.from_numpy(crop_boxes(249, 249, crop_draws(AugmentConfig(), 0, 0, np.arange(n)), n))
        images = torch.randint(0, 256, (n, 249, 249, 3), dtype=torch.uint8, device=device)
        rate = _rate(lambda i=images, b=boxes: resize_crops(i, b, 224), n, device)
        rows.append(
            {
                "decoder": "toolkit.data.augment.resize_crops (249 -> 224 crops)",
                "device": device,
                "images_per_s": rate,
            }
        )
    return rows


def run(ctx: Context, sec: Section) -> None:
    cpu_blobs = _encoded(ctx, DRY_IMAGES if ctx.dry_run else CPU_IMAGES)
    sec.rows += _cpu_rows(cpu_blobs)
    devices = ["cpu"]
    if ctx.device == "cuda":
        gpu_blobs = _encoded(ctx, GPU_IMAGES)
        sec.rows += _gpu_rows(gpu_blobs)
        devices.append("cuda")
    else:
        sec.skip("nvJPEG", "no CUDA device")
    sec.rows += _loader_rows(cpu_blobs, devices, sec)
    sec.rows += _crop_rows(devices, DRY_IMAGES if ctx.dry_run else GPU_BATCH, sec)
