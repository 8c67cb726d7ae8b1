"""Reading evaluation sets in clip-benchmark's local ``wds/`` layout.

::

    ROOT/NAME/
      test/nshards.txt                       number of shards n
      test/0.tar ... test/{n-1}.tar          samples: image (.png/.jpg/.jpeg/.webp) + .cls (int) or .txt
      classnames.txt                         classification: one class name per line, label i -> line i
      zeroshot_classification_templates.txt  classification: prompts with {c}, one per line
      dataset_type.txt                       'retrieval' (captions in .txt, one per line); else classification

This is the layout clip-benchmark's ``build_wds_dataset`` reads; we read it ourselves (webdataset) so any
model with ``encode_image``/``encode_text`` can be evaluated, and so errors name the missing file or sample.
"""

from __future__ import annotations

import dataclasses
import os
import tarfile
from pathlib import Path
from typing import Any

from toolkit.core.log import get_logger
from toolkit.data.raw.reader import split_member_name

# Image members an evaluation set may hold: the formats clip-benchmark's wds reader decodes (its
# webp/png/jpg/jpeg), in the order a sample's image is looked up. build-set re-encodes anything else as PNG.
SET_IMAGE_EXTS = ("png", "jpg", "jpeg", "webp")
SPLIT = "test"
TASKS = {"classification": "zeroshot_classification", "retrieval": "zeroshot_retrieval"}


class DatasetError(ValueError):
    """An evaluation set is missing or malformed; the message names the file, key or sample."""


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """A validated evaluation set: its shards, kind, class names and templates, and sample count."""

    name: str
    path: Path
    kind: str  # 'classification' or 'retrieval'
    shards: tuple[str, ...]
    num_samples: int
    classnames: tuple[str, ...] = ()
    templates: tuple[str, ...] = ()

    @property
    def task(self) -> str:
        """clip-benchmark's task name ('zeroshot_classification' / 'zeroshot_retrieval')."""
        return TASKS[self.kind]


def read_utf8(path: Path, what: str) -> str:
    """A text file's contents as UTF-8 without a byte order mark (spreadsheet exports start with one, which
    would otherwise stick to the first class name or column); DatasetError naming the file if not UTF-8."""
    data = path.read_bytes()
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DatasetError(f"{path}: UTF-16 text ({what}); save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise DatasetError(
            f"{path}: line {line}: not UTF-8 ({what}): {err.reason} at byte {err.start}"
        ) from err


def _read_lines(path: Path, what: str) -> list[str]:
    if not path.is_file():
        raise DatasetError(f"{path}: missing ({what})")
    lines = [line.strip() for line in read_utf8(path, what).splitlines()]
    if not any(lines):
        raise DatasetError(f"{path}: empty ({what})")
    if any(not line for line in lines):
        raise DatasetError(f"{path}: blank line {lines.index('') + 1} ({what}); remove it")
    return lines


def _count_samples(shard: str) -> int:
    """Number of samples (distinct keys with an image) in one tar; reads headers only."""
    keys = set()
    try:
        with tarfile.open(shard) as tar:
            for member in tar:
                split = split_member_name(member.name)
                if member.isfile() and split and split[1] in SET_IMAGE_EXTS:
                    keys.add(split[0])
    except (tarfile.TarError, OSError) as err:
        raise DatasetError(f"{shard}: not a readable tar file: {err}") from err
    return len(keys)


def open_eval_set(root: str | os.PathLike, name: str) -> EvalSet:
    """Validate ``root/name`` and return its description; DatasetError names whatever is missing."""
    path = Path(root) / name
    if not path.is_dir():
        known = sorted(p.name for p in Path(root).iterdir() if p.is_dir()) if Path(root).is_dir() else []
        where = f"; sets under {root}: {', '.join(known)}" if known else f"; {root} holds no sets"
        raise DatasetError(f"{path}: dataset directory not found{where}")
    nshards_path = path / SPLIT / "nshards.txt"
    if not nshards_path.is_file():
        raise DatasetError(f"{nshards_path}: missing (number of shards in the {SPLIT} split)")
    text = nshards_path.read_text().strip()
    if not text.isdigit() or int(text) < 1:
        raise DatasetError(f"{nshards_path}: expected a positive integer, got {text!r}")
    shards = tuple(str(path / SPLIT / f"{i}.tar") for i in range(int(text)))
    missing = [s for s in shards if not Path(s).is_file()]
    if missing:
        raise DatasetError(
            f"{missing[0]}: missing ({len(missing)} of {len(shards)} shards listed in {nshards_path})"
        )
    type_path = path / "dataset_type.txt"
    kind = type_path.read_text().strip().lower() if type_path.is_file() else "classification"
    if kind not in TASKS:
        raise DatasetError(
            f"{type_path}: unsupported dataset type {kind!r}; expected 'retrieval' or 'classification'"
        )
    counts = [_count_samples(s) for s in shards]
    num_samples = sum(counts)
    if num_samples == 0:
        raise DatasetError(
            f"{path / SPLIT}: the shards hold no samples with an image ({', '.join(SET_IMAGE_EXTS)})"
        )
    empty = [s for s, n in zip(shards, counts, strict=True) if n == 0]
    if empty:  # a shard cut short or overwritten: the results would silently cover fewer samples
        get_logger("eval").warning(
            "%s: %d of %d shards hold no sample with an image (%s); evaluating the %d samples "
            "of the others: rebuild the set if a shard was damaged",
            path,
            len(empty),
            len(shards),
            ", ".join(Path(s).name for s in empty),
            num_samples,
        )
    if kind == "retrieval":
        return EvalSet(name, path, kind, shards, num_samples)
    classnames = _read_lines(path / "classnames.txt", "one class name per line")
    templates = _read_lines(path / "zeroshot_classification_templates.txt", "prompt templates with {c}")
    check_templates(templates, str(path / "zeroshot_classification_templates.txt"))
    return EvalSet(name, path, kind, shards, num_samples, tuple(classnames), tuple(templates))


def check_templates(templates: list[str] | tuple[str, ...], where: str) -> None:
    """Each template must fill in as clip-benchmark fills it (``template.format(c=classname)``) and use the
    class name: a stray brace, another placeholder or an escaped ``{{c}}`` is a DatasetError naming
    ``where``, the line and the template (clip-benchmark's own error named neither)."""
    for line, template in enumerate(templates, start=1):
        if "{c}" not in template:
            raise DatasetError(f"{where}: line {line}: template {template!r} has no {{c}}")
        try:
            filled = template.format(c="\0")
        except (ValueError, KeyError, IndexError) as err:
            raise DatasetError(
                f"{where}: line {line}: template {template!r} cannot be filled in with "
                f"str.format(c=CLASS): {type(err).__name__}: {err}; write a literal brace "
                "as {{ or }}"
            ) from err
        if "\0" not in filled:
            raise DatasetError(
                f"{where}: line {line}: template {template!r} never inserts the class name "
                "({{c}} is an escaped, literal {c})"
            )


def label_of(sample: dict[str, Any], eval_set: EvalSet) -> int | list[str]:
    """A webdataset sample's label index (classification) or caption list (retrieval); errors name it."""
    where = f"{sample.get('__url__', eval_set.path)}: sample {sample.get('__key__')!r}"
    if eval_set.kind == "retrieval":
        if "txt" not in sample:
            raise DatasetError(f"{where}: no captions (.txt) in a retrieval set")
        captions = [c for c in sample["txt"].decode("utf-8").splitlines() if c.strip()]
        if not captions:
            raise DatasetError(f"{where}: empty .txt (no captions)")
        return captions
    if "cls" not in sample:
        raise DatasetError(f"{where}: no label (.cls) in a classification set")
    raw = sample["cls"].decode().strip()
    if not raw.lstrip("-").isdigit() or not 0 <= int(raw) < len(eval_set.classnames):
        raise DatasetError(
            f"{where}: label {raw!r} is not an index into the "
            f"{len(eval_set.classnames)} lines of classnames.txt"
        )
    return int(raw)


def image_bytes_of(sample: dict[str, Any], eval_set: EvalSet) -> tuple[str, bytes]:
    """(extension, encoded bytes) of a sample's image member; DatasetError naming the sample if none."""
    image_key = next((k for k in SET_IMAGE_EXTS if k in sample), None)
    if image_key is None:
        raise DatasetError(
            f"{sample.get('__url__', eval_set.path)}: sample {sample.get('__key__')!r}: no image "
            f"({', '.join('.' + e for e in SET_IMAGE_EXTS)})"
        )
    return image_key, sample[image_key]


def _decode(sample: dict[str, Any], eval_set: EvalSet, transform: Any, with_digest: bool = False) -> tuple:
    """One webdataset sample -> (image tensor, label int | list of captions[, SHA-1 of the image bytes])."""
    import hashlib

    from toolkit.data.images import open_rgb

    ext, data = image_bytes_of(sample, eval_set)
    label = label_of(sample, eval_set)
    try:  # the conversions training's precompute applies (alpha on white, 16-bit scaled), not a bare convert
        image = open_rgb(data)
    except Exception as err:  # noqa: BLE001 - PIL raises several types for broken files
        raise DatasetError(
            f"{sample.get('__url__', eval_set.path)}: sample {sample.get('__key__')!r}: unreadable "
            f"image .{ext}: {err}"
        ) from err
    if with_digest:
        return transform(image), label, hashlib.sha1(data).hexdigest()
    return transform(image), label


def _collate_captions(batch: list[tuple]) -> tuple:
    import torch

    return (torch.stack([b[0] for b in batch]), *([b[i] for b in batch] for i in range(1, len(batch[0]))))


def _collate_labels(batch: list[tuple]) -> tuple:
    import torch

    images, labels = torch.utils.data.default_collate([b[:2] for b in batch])
    return (images, labels, *([b[i] for b in batch] for i in range(2, len(batch[0]))))


def make_eval_loader(
    eval_set: EvalSet, transform: Any, batch_size: int, num_workers: int = 0, with_digest: bool = False
) -> Any:
    """A DataLoader over the set in shard order: (images [B,3,S,S], labels [B] int64) for classification,
    (images, list of caption lists) for retrieval; ``with_digest`` appends the SHA-1 hex digests of the
    batch's encoded images. ``loader.dataset.classes`` is what clip-benchmark reads."""
    import functools

    import torch
    import webdataset as wds

    workers = min(num_workers, len(eval_set.shards))  # webdataset splits shards across workers
    dataset = wds.WebDataset(
        list(eval_set.shards), shardshuffle=False, nodesplitter=lambda src: src, empty_check=False
    ).map(functools.partial(_decode, eval_set=eval_set, transform=transform, with_digest=with_digest))
    dataset.classes = list(eval_set.classnames) or None
    dataset.templates = list(eval_set.templates) or None
    collate = _collate_captions if eval_set.kind == "retrieval" else _collate_labels
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, num_workers=workers, collate_fn=collate
    )
