"""Helpers for the data tests. Raw shards built from real tar files and real encoded images, with every
bad-input kind in them.

``write_raw_shard(path, samples)`` writes an img2dataset-style shard (``.tar`` + ``_stats.json`` +
``.parquet``); each sample is (key, {ext: bytes}); ``read_tar(path)`` reads one back. ``bad_inputs`` builds
the fixture set that test_bad_inputs.py and test_precompute.py check, with the exact expected outcome of every
sample.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

MODEL = "cliptk-tiny"  # 32 px, context length 32
SIZE = 32


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def random_image(rng: np.random.Generator, width: int, height: int, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "CMYK": 4, "LA": 2}[mode]
    arr = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(arr[..., 0] if channels == 1 else arr, mode)


def write_raw_shard(
    path: Path,
    samples: list[tuple[str, dict[str, bytes]]],
    parquet_keys: list[str] | None = None,
    successes: int | None = None,
) -> Path:
    """A raw shard with members in sample order; sidecars list ``parquet_keys`` (default: all keys)."""
    with tarfile.open(path, "w") as tar:
        for key, files in samples:
            for ext, data in files.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    keys = [k for k, _ in samples] if parquet_keys is None else parquet_keys
    stem = str(path)[: -len(".tar")]
    Path(stem + "_stats.json").write_text(
        json.dumps({"successes": successes if successes is not None else len(keys), "count": len(keys)})
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"key": keys, "status": ["success"] * len(keys)}), stem + ".parquet")
    return path


def read_tar(path) -> dict[str, dict[str, bytes]]:
    """Key -> {extension: member bytes} of one tar, read with tarfile independently of the toolkit."""
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            key, ext = member.name.split(".", 1)
            samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    return samples


def good_samples(rng: np.random.Generator, prefix: str, count: int, size=(48, 40)) -> list:
    """``count`` JPEG samples with distinct captions; keys prefix + 4 digits."""
    return [
        (
            f"{prefix}{i:04d}",
            {
                "jpg": encode(random_image(rng, *size), "JPEG", quality=90),
                "txt": f"photo number {i} of {prefix}".encode(),
                "json": json.dumps({"key": f"{prefix}{i:04d}"}).encode(),
            },
        )
        for i in range(count)
    ]


def _special_images(rng: np.random.Generator) -> dict:
    """Images in unusual modes with known expected 32x32 RGB pixels (where exact)."""
    thirds = np.zeros((32, 96, 3), np.uint8)
    thirds[:, :32, 0], thirds[:, 32:64, 1], thirds[:, 64:, 2] = 255, 255, 255
    exact = random_image(rng, 32, 32)
    rgba = np.zeros((32, 32, 4), np.uint8)
    rgba[:, 16:] = (200, 10, 10, 255)  # left half fully transparent -> white
    palette = Image.new("P", (32, 32), 0)
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    palette.paste(1, (0, 0, 32, 16))
    sixteen = np.full((32, 32), 65535, np.uint16)
    sixteen[16:] = 32896  # 32896 * 255 / 65535 = 128
    return {
        "thirds": (
            encode(Image.fromarray(thirds), "PNG"),
            np.broadcast_to(np.array([0, 255, 0], np.uint8), (32, 32, 3)),
        ),
        "exact": (encode(exact, "PNG"), np.asarray(exact)),
        "rgba": (
            encode(Image.fromarray(rgba, "RGBA"), "PNG"),
            np.concatenate(
                [
                    np.full((32, 16, 3), 255, np.uint8),
                    np.broadcast_to(np.array([200, 10, 10], np.uint8), (32, 16, 3)),
                ],
                axis=1,
            ),
        ),
        "palette": (
            encode(palette, "PNG", transparency=0),
            np.concatenate(
                [
                    np.broadcast_to(np.array([10, 200, 30], np.uint8), (16, 32, 3)),
                    np.full((16, 32, 3), 255, np.uint8),
                ],
                axis=0,
            ),
        ),
        "sixteen": (
            encode(Image.fromarray(sixteen), "PNG"),
            np.concatenate([np.full((16, 32, 3), 255, np.uint8), np.full((16, 32, 3), 128, np.uint8)]),
        ),
    }


def build_bad_inputs(root: Path) -> dict:
    """Four raw shards covering every bad-input kind; returns the expected outcome."""
    rng = np.random.default_rng(1234)
    special = _special_images(rng)
    good = good_samples(rng, "a", 3, size=(97, 61))
    jpeg = encode(random_image(rng, 50, 70), "JPEG")
    s0 = good + [
        ("b_thirds", {"png": special["thirds"][0], "txt": b"three stripes"}),
        ("b_exact", {"png": special["exact"][0], "txt": "  caf\u00e9 au lait  \n".encode()}),
        ("c_gray", {"jpg": encode(random_image(rng, 40, 40, "L"), "JPEG"), "txt": b"grey"}),
        ("c_cmyk", {"jpg": encode(random_image(rng, 40, 36, "CMYK"), "JPEG"), "txt": b"cmyk"}),
        ("c_palette", {"png": special["palette"][0], "txt": b"palette"}),
        ("c_rgba", {"png": special["rgba"][0], "txt": b"alpha"}),
        ("c_la", {"png": encode(random_image(rng, 33, 35, "LA"), "PNG"), "txt": b"grey alpha"}),
        ("c_16bit", {"png": special["sixteen"][0], "txt": b"sixteen bit"}),
        ("c_webp", {"webp": encode(random_image(rng, 64, 64), "WEBP"), "txt": b"webp"}),
        ("d_corrupt", {"jpg": rng.integers(0, 256, 2000, dtype=np.uint8).tobytes(), "txt": b"noise"}),
        ("d_truncimg", {"jpg": jpeg[: len(jpeg) // 2], "txt": b"half a jpeg"}),
        ("d_bomb", {"png": encode(Image.new("1", (10000, 10000)), "PNG"), "txt": b"bomb"}),
        ("e_empty", {"jpg": jpeg, "txt": b""}),
        ("e_space", {"jpg": jpeg, "txt": b" \t\n "}),
        ("e_nonutf8", {"jpg": jpeg, "txt": b"\xff\xfe bad \xfa"}),
        ("e_nocap", {"jpg": jpeg}),
        ("e_noimg", {"txt": b"caption without image"}),
        ("a0001", {"jpg": jpeg, "txt": b"duplicate within the shard"}),
    ]
    write_raw_shard(root / "00000.tar", s0)
    s1 = good_samples(rng, "f", 4) + [("a0000", {"jpg": jpeg, "txt": b"duplicate across shards"})]
    write_raw_shard(root / "00001.tar", s1)
    s2 = good_samples(rng, "g", 6)
    path = write_raw_shard(root / "00002.tar", s2)
    data = path.read_bytes()
    cut = data.index(b"g0003.jpg") + 512 + 300  # inside the 4th sample's image data
    path.write_bytes(data[:cut])
    (root / "00003.tar").write_bytes(rng.integers(0, 256, 3000, dtype=np.uint8).tobytes())
    return {
        "kept": {
            "a0000",
            "a0001",
            "a0002",
            "b_thirds",
            "b_exact",
            "c_gray",
            "c_cmyk",
            "c_palette",
            "c_rgba",
            "c_la",
            "c_16bit",
            "c_webp",
            "f0000",
            "f0001",
            "f0002",
            "f0003",
            "g0000",
            "g0001",
            "g0002",
        },
        "skipped": {
            "corrupt_image": {"d_corrupt", "d_truncimg"},
            "decompression_bomb": {"d_bomb"},
            "empty_caption": {"e_empty", "e_space"},
            "non_utf8_caption": {"e_nonutf8"},
            "missing_caption": {"e_nocap"},
            "missing_image": {"e_noimg"},
            "duplicate_key": {"a0001", "a0000"},
            "truncated_tar": {"g0003", "g0004", "g0005"},
            "unreadable_tar": {"*"},
        },
        "converted": {"L": 1, "CMYK": 1, "P+alpha": 1, "RGBA": 1, "LA": 1, "I;16": 1},
        "pixels": {
            "b_thirds": special["thirds"][1],
            "b_exact": special["exact"][1],
            "c_rgba": special["rgba"][1],
            "c_palette": special["palette"][1],
            "c_16bit": special["sixteen"][1],
        },
        "captions": {"b_exact": "caf\u00e9 au lait", "b_thirds": "three stripes"},
    }


def precompute(raw, out, **overrides):
    """Run the precompute stage with cliptk-tiny; returns the StageResult. Pixels are stored at the model's
    side (crop_scale_min 1: no crop margin) unless overridden, so that stored pixels equal decode_rgb's;
    tests/data/test_augment.py covers the default margin."""
    from toolkit.core.config import build
    from toolkit.data.trainset.precompute.stage import PrecomputeConfig, run

    cfg = build(
        PrecomputeConfig,
        {"input": str(raw), "out": str(out), "model": MODEL, "crop_scale_min": 1.0, **overrides},
    )
    return run(cfg)


def read_meta(out) -> list[dict]:
    """All meta.jsonl lines of a training folder, in id order."""
    lines = []
    for path in sorted(Path(out).glob("*.meta.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines()]
    return lines
