"""CPU JPEG decoders for the loader: torchvision.io.decode_jpeg (libjpeg-turbo) vs Pillow, one core.

For each source side in ``--sides`` it encodes ``--num-images`` photo-like JPEGs (quality 90) and
times, single-threaded, ``toolkit.data.decode.decode_batch`` to ``--size`` px (centre square + bicubic
resize) with backend ``torchvision``, ``pil`` (Pillow with DCT-domain draft decoding) and ``auto``
(the per-image rule the loader uses), plus Pillow's plain full decode + resize (no draft), the way
open_clip's transform decodes. Prints a markdown table and writes JSON + markdown to
benchmarks/data/results/decode_backends.*. Run: ``python -m benchmarks.data.decode_backends``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

import numpy as np
from PIL import Image


def photo_like(rng, side: int, num: int) -> list[bytes]:
    """``num`` JPEGs (quality 90) of side x round(side*3/4): smooth colour fields plus grain."""
    out = []
    for _ in range(num):
        low = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        size = (side, round(side * 3 / 4))
        img = np.asarray(Image.fromarray(low).resize(size, Image.Resampling.BICUBIC), np.int16)
        img = np.clip(img + rng.integers(-12, 13, img.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def pil_plain(data: list[bytes], size: int) -> None:
    """Pillow full decode + centre square + bicubic resize (what open_clip's PIL transform costs)."""
    for d in data:
        img = Image.open(io.BytesIO(d)).convert("RGB")
        side = min(img.size)
        left, top = (img.width - side) // 2, (img.height - side) // 2
        np.asarray(
            img.resize((size, size), Image.Resampling.BICUBIC, box=(left, top, left + side, top + side))
        )


def time_it(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sides", type=int, nargs="+", default=[256, 512, 1024], help="Source image widths (px)."
    )
    ap.add_argument("--size", type=int, default=224, help="Output side (px).")
    ap.add_argument("--num-images", type=int, default=64, help="Images per source side.")
    ap.add_argument("--repeats", type=int, default=3, help="Timed repeats; the best is kept.")
    ap.add_argument("--out", default="benchmarks/data/results/decode_backends", help="Output path stem.")
    args = ap.parse_args(argv)
    import torch

    from toolkit.data.decode import decode_batch

    torch.set_num_threads(1)
    rng, rows = np.random.default_rng(0), []
    for side in args.sides:
        data = photo_like(rng, side, args.num_images)
        row = {"source_side": side, "mean_kib": round(sum(map(len, data)) / len(data) / 1024, 1)}
        for name in ("torchvision", "pil", "auto"):
            row[name] = round(
                len(data)
                / time_it(lambda n=name, d=data: decode_batch(d, args.size, backend=n), args.repeats),
                1,
            )
        row["pil_plain"] = round(len(data) / time_it(lambda d=data: pil_plain(d, args.size), args.repeats), 1)
        rows.append(row)
    head = "| source px | KiB | torchvision img/s | pil (draft) img/s | auto img/s | pil plain img/s |"
    lines = [head, "|---|---|---|---|---|---|"] + [
        f"| {r['source_side']} | {r['mean_kib']} | {r['torchvision']} | {r['pil']} | {r['auto']} | "
        f"{r['pil_plain']} |"
        for r in rows
    ]
    table = "\n".join(lines)
    print(table)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    meta = {
        "size": args.size,
        "num_images": args.num_images,
        "threads": 1,
        "load_avg": os.getloadavg()[0],
        "torch": torch.__version__,
    }
    with open(args.out + ".json", "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    with open(args.out + ".md", "w") as fh:
        fh.write(
            f"# CPU JPEG decode to {args.size} px, one thread (images/s, best of {args.repeats})\n\n"
            f"Command: `python -m benchmarks.data.decode_backends {' '.join(sys.argv[1:])}`; load average "
            f"{meta['load_avg']:.1f} on a 2-core machine.\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
