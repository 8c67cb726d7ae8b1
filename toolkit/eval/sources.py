"""Where evaluation samples come from: a class-per-folder tree, a CSV, Fashion-MNIST, the OpenMoji demo CSV.

Each reader returns an :class:`EvalSamples`: samples as (image bytes, extension, label index | captions),
class names and templates (classification), and counts of rows it left out on purpose (with the reason),
so the builder can report them instead of dropping anything silently.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import io
import os
import re
import struct
from pathlib import Path
from typing import Any

from toolkit.data.acquire import demo
from toolkit.data.images import DEFAULT_MAX_IMAGE_PIXELS, IMAGE_EXTS, to_rgb
from toolkit.eval.datasets import DatasetError, read_utf8

GENERIC_TEMPLATES = (
    "a photo of a {c}.",
    "a photo of the {c}.",
    "a close-up photo of a {c}.",
    "a good photo of a {c}.",
    "a blurry photo of a {c}.",
    "a cropped photo of the {c}.",
)
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_FILES = {
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
}
FASHION_MNIST_CLASSES = (
    "t-shirt or top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)
FASHION_MNIST_TEMPLATES = (
    "a photo of a {c}.",
    "a black and white photo of a {c}.",
    "a low resolution photo of a {c}.",
    "a grayscale photo of a {c}.",
    "a photo of the {c}, a type of clothing.",
    "a product photo of a {c}.",
)
# Unicode emoji groups (emoji-test.txt order) by slug -> class name used in prompts.
EMOJI_GROUPS = {
    "smileys-emotion": "smileys and emotion",
    "people-body": "people and body",
    "component": "component",
    "animals-nature": "animals and nature",
    "food-drink": "food and drink",
    "travel-places": "travel and places",
    "activities": "activities",
    "objects": "objects",
    "symbols": "symbols",
    "flags": "flags",
}
EMOJI_GROUP_TEMPLATES = (
    "an emoji from the group {c}.",
    "a drawing of an emoji about {c}.",
    "an emoji icon of {c}.",
    "a {c} emoji.",
)


@dataclasses.dataclass
class EvalSamples:
    """Samples ready to write: (image bytes, extension, int label or list of captions)."""

    kind: str  # 'classification' | 'retrieval'
    samples: list[tuple[bytes, str, Any]]
    classnames: list[str] = dataclasses.field(default_factory=list)
    templates: list[str] = dataclasses.field(default_factory=list)
    left_out: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> number of rows


def read_image(path: Path, where: str) -> tuple[bytes, str]:
    """Bytes + wds extension of an image file, re-encoded as PNG when its format is not png/jpg/webp."""
    if not path.is_file():
        raise DatasetError(f"{where}: image file not found: {path}")
    return image_bytes(path.read_bytes(), where, str(path))


def image_bytes(data: bytes, where: str, path: str) -> tuple[bytes, str]:
    """``data`` (an image file's bytes, ``path`` naming it in errors) as ``read_image`` returns it."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            pixels = img.width * img.height
            if pixels > DEFAULT_MAX_IMAGE_PIXELS:  # checked before decoding: 20000x20000 would need 400 MB+
                raise DatasetError(
                    f"{where}: {path}: {img.width}x{img.height} = {pixels:,} pixels, more than "
                    f"{DEFAULT_MAX_IMAGE_PIXELS:,} (decompression bomb?); remove or shrink it"
                )
            img.load()
            fmt = (img.format or "").lower()
            if fmt in ("png", "jpeg", "webp"):
                return data, "jpg" if fmt == "jpeg" else fmt
            buf = io.BytesIO()
            to_rgb(img)[0].save(buf, format="PNG")  # as training converts it: alpha on white, 16-bit scaled
            return buf.getvalue(), "png"
    except DatasetError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise DatasetError(f"{where}: unreadable image {path}: {err}") from err


def read_lines_file(path: str, what: str) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"{what} file not found: {p}")
    lines = [line.strip() for line in read_utf8(p, what).splitlines() if line.strip()]
    if not lines:
        raise DatasetError(f"{p}: empty ({what})")
    return lines


def from_folder(root: str, classnames: list[str] | None) -> EvalSamples:
    """Classification from ``root/<class>/<image>``: classes are the sorted subfolder names (``_`` -> space)
    unless ``classnames`` gives one display name per subfolder in sorted order."""
    base = Path(root)
    if not base.is_dir():
        raise DatasetError(f"input folder not found: {base}")
    entries = sorted(base.iterdir())
    # hidden folders (.ipynb_checkpoints, .git, .thumbnails) are not classes; files beside the class folders
    # belong to no class: both are counted as left out, not silently dropped or made a class
    folders = [p for p in entries if p.is_dir() and not p.name.startswith(".")]
    if not folders:
        raise DatasetError(f"{base}: no class subfolders (expected one folder of images per class)")
    names = classnames or [f.name.replace("_", " ") for f in folders]
    if len(names) != len(folders):
        raise DatasetError(f"classnames: {len(names)} names for {len(folders)} class folders in {base}")
    out = EvalSamples("classification", [], list(names))
    _count_left_out(out, "hidden folder", sum(p.is_dir() and p.name.startswith(".") for p in entries))
    _count_left_out(
        out,
        f"file outside the class folders of {base}",
        sum(p.is_file() and not p.name.startswith(".") for p in entries),
    )
    for label, folder in enumerate(folders):
        files = sorted(
            p
            for p in folder.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        )
        images = [p for p in files if p.suffix.lower().lstrip(".") in IMAGE_EXTS]
        _count_left_out(out, "not an image file", len(files) - len(images))
        for p in images:
            out.samples.append((*read_image(p, str(folder)), label))
    return out


def _count_left_out(out: EvalSamples, reason: str, count: int) -> None:
    if count:
        out.left_out[reason] = out.left_out.get(reason, 0) + count


def _read_csv(path: Path, required: tuple[str, ...]) -> list[dict[str, str]]:
    if not path.is_file():
        raise DatasetError(f"CSV file not found: {path}")
    with io.StringIO(read_utf8(path, "CSV"), newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in required if c not in (reader.fieldnames or [])]
        if missing:
            raise DatasetError(f"{path}: missing column(s) {', '.join(missing)}; has {reader.fieldnames}")
        rows = list(reader)
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return rows


def from_csv(
    path: str, kind: str, image_col: str, label_col: str, caption_col: str, classnames: list[str] | None
) -> EvalSamples:
    """Rows of ``image,label`` (classification) or ``image,caption`` (retrieval; several rows with the
    same image give it several captions). Image paths are relative to the CSV's folder."""
    csv_path = Path(path)
    col = label_col if kind == "classification" else caption_col
    rows = _read_csv(csv_path, (image_col, col))
    for i, row in enumerate(rows):
        if not (row[image_col] or "").strip() or not (row[col] or "").strip():
            raise DatasetError(f"{csv_path}: row {i + 2}: empty {image_col!r} or {col!r}")
    if kind == "retrieval":
        return _group_captions(csv_path, rows, image_col, caption_col)
    names = classnames or sorted({row[label_col].strip() for row in rows})
    index = _label_index(csv_path, [row[label_col].strip() for row in rows], names)
    out = EvalSamples("classification", [], list(names))
    for i, row in enumerate(rows):
        label = row[label_col].strip()
        if label not in index:
            raise DatasetError(f"{csv_path}: row {i + 2}: label {label!r} is not in the class names")
        out.samples.append(
            (*read_image(csv_path.parent / row[image_col].strip(), f"{csv_path}: row {i + 2}"), index[label])
        )
    return out


def _label_index(csv_path: Path, labels: list[str], names: list[str]) -> dict[str, int]:
    """Label text -> class index: the class names themselves, or, when no label is a class name and every
    one is an integer 0..len(names)-1, line numbers of the class names file (clip-benchmark's own .cls
    convention, and how ImageNet-style label columns are written)."""
    by_name = {n: i for i, n in enumerate(names)}
    if any(label in by_name for label in labels):
        return by_name
    if all(label.isdigit() for label in labels):
        bad = next((i for i, label in enumerate(labels) if int(label) >= len(names)), None)
        if bad is not None:
            raise DatasetError(
                f"{csv_path}: row {bad + 2}: label {labels[bad]!r}: no label is a class name, so labels "
                f"are line numbers of the class names, which has {len(names)} (0..{len(names) - 1})"
            )
        from toolkit.core.log import get_logger

        get_logger("eval").info(
            "%s: labels are integers 0..%d and none is a class name: read as line numbers of the class names",
            csv_path,
            len(names) - 1,
        )
        return {label: int(label) for label in set(labels)}
    return by_name


def _group_captions(
    csv_path: Path, rows: list[dict[str, str]], image_col: str, caption_col: str
) -> EvalSamples:
    captions: dict[str, list[str]] = {}
    first_row: dict[str, int] = {}
    for i, row in enumerate(rows):
        # one image, however its rows spell the path ('img/a.png', './img/a.png'): as two samples with the
        # same pixels, each caption would have two equally right images and R@1 would depend on tie order
        image = os.path.normpath(csv_path.parent / row[image_col].strip())
        text = " ".join(row[caption_col].split())  # one caption per line in the wds .txt
        captions.setdefault(image, []).append(text)
        first_row.setdefault(image, i + 2)
    out = EvalSamples("retrieval", [])
    for image, texts in captions.items():
        out.samples.append((*read_image(Path(image), f"{csv_path}: row {first_row[image]}"), texts))
    return out


def _read_idx(path: Path, magic: int) -> tuple[tuple[int, ...], bytes]:
    with gzip.open(path, "rb") as fh:
        data = fh.read()
    ndim = data[3]
    header = struct.unpack(f">I{ndim}I", data[: 4 + 4 * ndim])
    if header[0] != magic:
        raise DatasetError(f"{path}: not an IDX file with magic {magic} (got {header[0]})")
    return header[1:], data[4 + 4 * ndim :]


def from_fashion_mnist(root: str, split: str = "test", limit: int = 0) -> EvalSamples:
    """Fashion-MNIST (Debian package ``dataset-fashion-mnist``) as 28x28 grayscale PNGs, 10 classes.

    Only the first ``limit`` images (all when 0) are PNG-encoded: the train split has 60,000."""
    from PIL import Image

    base = Path(root or FASHION_MNIST_DIR)
    image_file, label_file = (base / f for f in FASHION_MNIST_FILES[split])
    for p in (image_file, label_file):
        if not p.is_file():
            hint = (
                " (install it with `apt-get install dataset-fashion-mnist`)"
                if str(base) == FASHION_MNIST_DIR
                else ""
            )
            raise DatasetError(f"Fashion-MNIST file not found: {p}{hint}")
    (num, rows, cols), pixels = _read_idx(image_file, 2051)
    (num_labels,), labels = _read_idx(label_file, 2049)
    if num != num_labels:
        raise DatasetError(f"{image_file}: {num} images but {label_file} has {num_labels} labels")
    out = EvalSamples("classification", [], list(FASHION_MNIST_CLASSES), list(FASHION_MNIST_TEMPLATES))
    size = rows * cols
    for i in range(min(num, limit) if limit else num):
        buf = io.BytesIO()
        Image.frombytes("L", (cols, rows), pixels[i * size : (i + 1) * size]).save(buf, format="PNG")
        out.samples.append((buf.getvalue(), "png", int(labels[i])))
    return out


def group_slug(name: str) -> str:
    """'Smileys & Emotion' and 'smileys-emotion' -> 'smileys-emotion'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("&", " ")).strip("-")


def from_openmoji(demo_dir: str, kind: str) -> EvalSamples:
    """The held-out OpenMoji drawings from ``toolkit data demo`` (DIR/openmoji.csv: path,caption,group,
    subgroup,codepoints). Retrieval: image <-> its Unicode name. Classification: the Unicode emoji group;
    rows of a non-Unicode group (OpenMoji's extras) are left out and counted."""
    csv_path = Path(demo_dir) / demo.artist_csv("openmoji")
    if not csv_path.is_file():
        raise DatasetError(f"{csv_path}: missing; create it with `toolkit data demo --out {demo_dir}`")
    rows = _read_csv(csv_path, demo.COLUMNS)
    if kind == "retrieval":
        return _group_captions(csv_path, rows, "path", "caption")
    slugs = [group_slug(row["group"] or "") for row in rows]
    present = [s for s in EMOJI_GROUPS if s in set(slugs)]
    if not present:
        raise DatasetError(f"{csv_path}: no row has a Unicode emoji group ({', '.join(EMOJI_GROUPS)})")
    out = EvalSamples("classification", [], [EMOJI_GROUPS[s] for s in present], list(EMOJI_GROUP_TEMPLATES))
    index = {s: i for i, s in enumerate(present)}
    for i, (row, slug) in enumerate(zip(rows, slugs, strict=True)):
        if slug not in index:
            reason = f"group {row['group']!r} is not a Unicode emoji group"
            out.left_out[reason] = out.left_out.get(reason, 0) + 1
            continue
        out.samples.append(
            (*read_image(csv_path.parent / row["path"], f"{csv_path}: row {i + 2}"), index[slug])
        )
    return out


def from_shards(
    source: str, kind: str, caption_ext: str, classnames: list[str] | None, limit: int = 0
) -> EvalSamples:
    """Held-out raw webdataset shards (img2dataset's layout; a folder, one .tar, a glob or a brace pattern):
    each sample's image, and its caption (retrieval) or class name (classification) from the member
    ``caption_ext`` (``txt``, ``cls``, or ``json:FIELD``). Read with the training data's robust reader: a
    damaged tar gives what it holds and a warning; a sample without an image or caption, or whose image does
    not decode, is counted as left out with the reason. ``limit``: stop after that many samples."""
    from toolkit.data.raw.reader import RawShardReader, list_shards, shard_basename

    try:
        urls = list_shards(source)
    except FileNotFoundError as err:
        raise DatasetError(f"input: {err}") from None
    member, _, json_field = caption_ext.partition(":")
    out, texts = EvalSamples(kind, []), []
    for url in urls:
        if limit and len(out.samples) >= limit:
            break
        reader = RawShardReader(url, caption_ext)
        for sample in reader.samples():
            if limit and len(out.samples) >= limit:
                break
            found = sample.image()
            text = _member_text(sample.files.get(member), json_field)
            if found is None or not text:
                _count_left_out(
                    out,
                    "sample without an image member"
                    if found is None
                    else f"sample without a {caption_ext} caption",
                    1,
                )
                continue
            try:
                data, ext = image_bytes(found[1], shard_basename(url), f"{url}#{sample.key}.{found[0]}")
            except DatasetError:
                _count_left_out(out, "image that does not decode", 1)
                continue
            out.samples.append((data, ext, text))
            texts.append(text)
        if reader.error is not None:
            _count_left_out(out, f"the rest of a damaged tar ({reader.error_kind}: {shard_basename(url)})", 1)
    if kind == "retrieval":
        return out
    labels = [t[0].strip() for t in texts]
    out.classnames = classnames or sorted(set(labels))
    index = {name: i for i, name in enumerate(out.classnames)}
    unknown = sorted(set(labels) - set(index))
    if unknown:
        raise DatasetError(
            f"{source}: class name(s) {unknown[:5]} of the {caption_ext} members are not in "
            f"classnames ({len(out.classnames)} names)"
        )
    out.samples = [
        (data, ext, index[label]) for (data, ext, _), label in zip(out.samples, labels, strict=True)
    ]
    return out


def _member_text(raw: bytes | None, json_field: str) -> list[str]:
    """The caption(s) in a member: its UTF-8 text, or a JSON field (a string or a list of strings)."""
    if raw is None:
        return []
    text = raw.decode("utf-8", errors="replace")
    if json_field:
        import json

        try:
            value = json.loads(text).get(json_field)
        except (ValueError, AttributeError):
            return []
        values = value if isinstance(value, list) else [value]
        return [str(v).strip() for v in values if v is not None and str(v).strip()]
    return [text.strip()] if text.strip() else []
