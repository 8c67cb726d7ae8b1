"""Loader samples/s per CPU core: decoding JPEG shards (cliptk) vs open_clip's webdataset pipeline vs pixels.

On the same generated raw shards (img2dataset's layout, photo-like JPEGs of ``--source-side`` x 3/4 px,
quality 90), each loader runs in one process with one torch thread (samples/s = per core), producing
training batches of ``--batch-size`` at ``--size`` px with open_clip's train crop:

- ``open_clip``: ``open_clip_train.data.get_wds_dataset`` (its tar streaming, sample shuffle buffer, PIL
  decode, ``image_transform(is_train=True)``: RandomResizedCrop(0.9-1, bicubic), ToTensor, Normalize, and
  per-sample tokenization), exactly as open_clip_train builds it;
- ``cliptk_jpeg``: the sample's JPEG bytes read by seeking into the raw tar (offsets from one scan, as an
  index over the shards stores them; token ids precomputed, as such an index stores them), crops drawn by
  ``toolkit.data.augment.crop_draws`` and ``toolkit.data.decode.decode_batch`` (libjpeg-turbo through
  torchvision, crop, antialiased bicubic resize); uint8 out, normalised later on the device;
- ``cliptk_index``: the trainer's real path on the same shards: ``toolkit data precompute --storage index``
  (default crop margin), then ``make_loader`` with the trainer's random crop in the loader
  (``refs.RefReader``:
  each image decoded by ``images.decode_rgb`` to the stored 249 px square, libjpeg-turbo for these JPEGs,
  then cropped and resized to 224); ``cliptk_index_pil``: the same with decode_rgb's Pillow path forced (the
  decoder before libjpeg-turbo was shared with precompute), for comparison in one run;
- ``pixels_crop`` / ``pixels``: ``make_loader`` over the same images precomputed as pixels (with the
  default crop margin and the trainer's random crop resized in the loader, ``augment.crop_on=loader``; and
  stored at the model's side without a crop);
- ``pixels_device_crop``: the same margin set with ``augment.crop_on=device`` (the default on CUDA): the
  loader reads the stored pixels and draws the crop boxes, the resize runs later on the training device.
  Its device half (``toolkit.data.augment.resize_crops``) is timed on this CPU too (``device_resize_cpu``,
  one thread), for scale: on CUDA it is a few elementwise passes over the batch.

Prints a table and writes JSON + markdown to benchmarks/data/results/loader_decode.*. Self-contained (imports
no other benchmark file). Run: ``python -m benchmarks.data.loader_decode``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from types import SimpleNamespace

import numpy as np
from PIL import Image


def make_raw(root: str, num_samples: int, per_shard: int, side: int) -> list[str]:
    """Raw shards of photo-like JPEGs (side x 3/4 side, quality 90) with captions and _stats.json."""
    rng = np.random.default_rng(0)
    urls = []
    for shard in range(-(-num_samples // per_shard)):
        url = os.path.join(root, f"{shard:05d}.tar")
        count = 0
        with tarfile.open(url, "w") as tar:
            for i in range(shard * per_shard, min(num_samples, (shard + 1) * per_shard)):
                low = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
                img = np.asarray(
                    Image.fromarray(low).resize((side, side * 3 // 4), Image.Resampling.BICUBIC), np.int16
                )
                img = np.clip(img + rng.integers(-12, 13, img.shape), 0, 255).astype(np.uint8)
                buf = io.BytesIO()
                Image.fromarray(img).save(buf, "JPEG", quality=90)
                for ext, data in (("jpg", buf.getvalue()), ("txt", f"a generated photo number {i}".encode())):
                    info = tarfile.TarInfo(f"{i:09d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                count += 1
        with open(os.path.join(root, f"{shard:05d}_stats.json"), "w") as fh:
            json.dump({"successes": count}, fh)
        urls.append(url)
    return urls


# open_clip_torch 3.3.0's training extra pins webdataset<=0.2.86: newer tar iterators drop the 'fname' key its
# group_by_keys_nothrow reads (KeyError: 'fname'). Its pipeline is timed in a child process that sees 0.2.86
# first on its path (pip --target into a cache folder, never into the venv).
OPEN_CLIP_WEBDATASET = "0.2.86"
DEPS = os.path.expanduser("~/.cache/cliptk-bench/open_clip_deps")


def open_clip_rate(urls: list[str], args: argparse.Namespace) -> float:
    """open_clip's loader samples/s, measured in a child process with webdataset 0.2.86 importable."""
    import subprocess
    from importlib.metadata import version

    env = dict(os.environ)
    if tuple(int(x) for x in version("webdataset").split(".")[:3]) > (0, 2, 86):
        if not os.path.isdir(os.path.join(DEPS, "webdataset")):
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--no-deps",
                    "--target",
                    DEPS,
                    f"webdataset=={OPEN_CLIP_WEBDATASET}",
                ],
                check=True,
            )
        env["PYTHONPATH"] = os.pathsep.join([DEPS, os.getcwd(), env.get("PYTHONPATH", "")])
    child = [
        sys.executable,
        __file__,
        "--open-clip-child",
        "::".join(urls),
        "--num-samples",
        str(args.num_samples),
        "--size",
        str(args.size),
        "--batch-size",
        str(args.batch_size),
        "--model",
        args.model,
        "--repeats",
        str(args.repeats),
    ]
    out = subprocess.run(child, env=env, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def open_clip_loader(urls: str, num_samples: int, size: int, batch_size: int, model: str):
    import open_clip
    from open_clip_train.data import get_wds_dataset

    from toolkit.models.registry import tokenizer

    args = SimpleNamespace(
        train_data=urls,
        train_num_samples=num_samples,
        dataset_resampled=False,
        train_data_upsampling_factors=None,
        seed=0,
        batch_size=batch_size,
        workers=0,
        world_size=1,
        distributed=False,
    )
    preprocess = open_clip.image_transform(size, is_train=True)
    return get_wds_dataset(args, preprocess, is_train=True, tokenizer=tokenizer(model)).dataloader


class JpegIndexLoader:
    """Global batches of JPEG bytes read by offset from raw tars, decoded with random crops (cliptk path)."""

    def __init__(self, urls: list[str], size: int, batch_size: int, model: str):
        from toolkit.models.registry import tokenizer

        self.entries, captions = [], []
        for u, url in enumerate(urls):  # one scan per tar: (shard, offset, length) of each image
            with tarfile.open(url) as tar:
                members = {m.name: m for m in tar.getmembers()}
                for name, m in members.items():
                    if name.endswith(".jpg"):
                        self.entries.append((u, m.offset_data, m.size))
                        captions.append(tar.extractfile(members[name[:-3] + "txt"]).read().decode())
        self.tokens = tokenizer(model)(captions).numpy().astype(np.int32)  # stored in the index
        self.urls, self.size, self.batch_size = urls, size, batch_size

    def __iter__(self):
        import torch

        from toolkit.data.augment import AugmentConfig, crop_draws
        from toolkit.data.decode import decode_batch
        from toolkit.data.trainset.order import BatchOrder

        order = BatchOrder(len(self.entries), self.batch_size, seed=0)
        files = [open(u, "rb") for u in self.urls]
        try:
            for t in range(order.batches_per_pass):
                ids = order.batch_ids(t)
                encoded = []
                for i in ids:
                    shard, offset, length = self.entries[i]
                    files[shard].seek(offset)
                    encoded.append(files[shard].read(length))
                image = decode_batch(encoded, self.size, crop_draws(AugmentConfig(), 0, t, ids))
                yield {"image": image, "tokens": torch.from_numpy(self.tokens[ids].astype(np.int64))}
        finally:
            for fh in files:
                fh.close()


def pixels_loader(
    raw: str, work: str, size: int, batch_size: int, model: str, margin: bool, on_device: bool = False
):
    from toolkit.core.config import build
    from toolkit.data.augment import AugmentConfig, DeviceCrop, PixelTransform
    from toolkit.data.trainset.loader import make_loader
    from toolkit.data.trainset.precompute.stage import PrecomputeConfig, run

    out = os.path.join(work, f"pixels-{margin}")
    if not os.path.exists(os.path.join(out, "dataset.json")):
        run(
            build(
                PrecomputeConfig,
                {
                    "input": raw,
                    "out": out,
                    "model": model,
                    "image_size": size,
                    "crop_scale_min": 0.9 if margin else 1.0,
                    "samples_per_shard": 1000,
                },
            )
        )
    transform = (DeviceCrop if on_device else PixelTransform)(size, 0, AugmentConfig()) if margin else None
    return make_loader(out, batch_size=batch_size, num_workers=0, image_transform=transform)


def device_resize_rate(loader, size: int) -> float:
    """samples/s of resize_crops (the device half of crop_on=device) on this CPU, one thread, best of 2."""
    from toolkit.data.augment import resize_crops

    batch = next(iter(loader))
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        resize_crops(batch["image"], batch["crop_box"], size)
        best = max(best, len(batch["image"]) / (time.perf_counter() - start))
    return best


def index_loader(raw: str, work: str, size: int, batch_size: int, model: str):
    """make_loader over an index-mode set of the raw shards (built once), with the trainer's loader crop."""
    from toolkit.core.config import build
    from toolkit.data.augment import AugmentConfig, PixelTransform
    from toolkit.data.trainset.loader import make_loader
    from toolkit.data.trainset.precompute.stage import PrecomputeConfig, run

    out = os.path.join(work, "index")
    if not os.path.exists(os.path.join(out, "dataset.json")):
        run(
            build(
                PrecomputeConfig,
                {
                    "input": raw,
                    "out": out,
                    "model": model,
                    "image_size": size,
                    "storage": "index",
                    "samples_per_shard": 1000,
                },
            )
        )
    return make_loader(
        out, batch_size=batch_size, num_workers=0, image_transform=PixelTransform(size, 0, AugmentConfig())
    )


class PillowOnly:
    """Within the block, decode_rgb takes its Pillow path for every image (its decoder before
    libjpeg-turbo)."""

    def __enter__(self):
        from toolkit.data import images

        self.saved, images._turbo_square = images._turbo_square, lambda *args: None

    def __exit__(self, *exc):
        from toolkit.data import images

        images._turbo_square = self.saved


def time_loader(make, repeats: int) -> tuple[float, int]:
    """(best samples/s after the first batch, samples per pass): steady state, start-up excluded."""
    best, total = 0.0, 0
    for _ in range(repeats):
        start, count, total = None, 0, 0
        for batch in make():
            n = len(batch["image"] if isinstance(batch, dict) else batch[0])
            total += n
            if start is None:
                start = time.perf_counter()
            else:
                count += n
        best = max(best, count / (time.perf_counter() - start))
    return best, total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-samples", type=int, default=2048, help="Generated image-text pairs.")
    ap.add_argument("--per-shard", type=int, default=512, help="Samples per raw shard.")
    ap.add_argument(
        "--source-side",
        type=int,
        default=341,
        help="Width of the generated JPEGs (img2dataset's keep_ratio at 256 gives 341 x 256).",
    )
    ap.add_argument("--size", type=int, default=224, help="Model input side (px).")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--model", default="cliptk-tiny", help="Tokenizer source.")
    ap.add_argument("--repeats", type=int, default=2, help="Passes per loader; the best is kept.")
    ap.add_argument("--out", default="benchmarks/data/results/loader_decode", help="Output path stem.")
    ap.add_argument("--open-clip-child", default="", help=argparse.SUPPRESS)  # internal: time open_clip only
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.open_clip_child:
        make = lambda: open_clip_loader(  # noqa: E731
            args.open_clip_child,
            args.num_samples,
            args.size,
            args.batch_size,
            args.model,
        )
        print(time_loader(make, args.repeats)[0])
        return
    work = tempfile.mkdtemp(prefix="loader-decode-")
    try:
        raw = os.path.join(work, "raw")
        os.makedirs(raw)
        urls = make_raw(raw, args.num_samples, args.per_shard, args.source_side)
        rates = {"open_clip": open_clip_rate(urls, args)}
        makers = {
            "cliptk_jpeg": lambda: JpegIndexLoader(urls, args.size, args.batch_size, args.model),
            "pixels_crop": lambda: pixels_loader(raw, work, args.size, args.batch_size, args.model, True),
            "pixels": lambda: pixels_loader(raw, work, args.size, args.batch_size, args.model, False),
            "pixels_device_crop": lambda: pixels_loader(
                raw, work, args.size, args.batch_size, args.model, True, on_device=True
            ),
        }
        makers["cliptk_index"] = lambda: index_loader(raw, work, args.size, args.batch_size, args.model)
        for name, make in makers.items():
            make()  # build once untimed (precompute, index scan), then time passes over it
            rates[name], _ = time_loader(make, args.repeats)
        with PillowOnly():
            rates["cliptk_index_pil"], _ = time_loader(makers["cliptk_index"], args.repeats)
        rates["device_resize_cpu"] = device_resize_rate(
            pixels_loader(raw, work, args.size, args.batch_size, args.model, True, on_device=True), args.size
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(args, rates)


def report(args: argparse.Namespace, rates: dict[str, float]) -> None:
    ratios = {
        "cliptk_jpeg / open_clip": rates["cliptk_jpeg"] / rates["open_clip"],
        "cliptk_index / open_clip": rates["cliptk_index"] / rates["open_clip"],
        "cliptk_index_pil / open_clip": rates["cliptk_index_pil"] / rates["open_clip"],
        "pixels_crop / cliptk_jpeg": rates["pixels_crop"] / rates["cliptk_jpeg"],
        "pixels_device_crop / cliptk_jpeg": rates["pixels_device_crop"] / rates["cliptk_jpeg"],
        "pixels / cliptk_jpeg": rates["pixels"] / rates["cliptk_jpeg"],
    }
    lines = ["| loader | samples/s per core |", "|---|---|"]
    lines += [f"| {k} | {v:.0f} |" for k, v in rates.items()]
    lines += [
        "",
        "| ratio | value | target |",
        "|---|---|---|",
        f"| cliptk_jpeg / open_clip | {ratios['cliptk_jpeg / open_clip']:.2f}x | >= 1.5x |",
        f"| cliptk_index / open_clip | {ratios['cliptk_index / open_clip']:.2f}x | >= 1.5x |",
        f"| cliptk_index_pil / open_clip | {ratios['cliptk_index_pil / open_clip']:.2f}x | (before) |",
        f"| pixels_crop / cliptk_jpeg | {ratios['pixels_crop / cliptk_jpeg']:.2f}x | >= 10x |",
        f"| pixels_device_crop / cliptk_jpeg | {ratios['pixels_device_crop / cliptk_jpeg']:.2f}x | >= 10x |",
        f"| pixels / cliptk_jpeg | {ratios['pixels / cliptk_jpeg']:.2f}x | >= 10x |",
    ]
    table = "\n".join(lines)
    print(table)
    meta = {**vars(args), "threads": 1, "workers": 0, "load_avg": os.getloadavg()[0]}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as fh:
        json.dump({"meta": meta, "samples_per_s": rates, "ratios": ratios}, fh, indent=1)
    with open(args.out + ".md", "w") as fh:
        fh.write(
            f"# Loader samples/s per CPU core, {args.source_side} px JPEG sources -> {args.size} px, batch "
            f"{args.batch_size}, {args.num_samples} samples (best of {args.repeats} passes)\n\n"
            f"Command: `python -m benchmarks.data.loader_decode {' '.join(sys.argv[1:])}`; one process, "
            f"one torch thread, "
            f"load average {meta['load_avg']:.1f} on a 2-core machine.\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
