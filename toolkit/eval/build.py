"""``eval.build-set``: write an evaluation set in clip-benchmark's local ``wds/`` layout.

Sources (``source``): ``folder`` (one subfolder of images per class), ``csv`` (image,label or
image,caption rows), ``fashion-mnist`` (Debian ``dataset-fashion-mnist``), ``openmoji`` (the held-out
drawings that ``toolkit data demo`` writes) and ``shards`` (raw webdataset shards, e.g. held-out
img2dataset output). The output directory ``out`` is one set: pass its parent as
``--root`` and its folder name in ``--datasets`` to ``toolkit eval zeroshot``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from toolkit.core import files
from toolkit.core.config import option
from toolkit.core.log import get_logger, progress
from toolkit.core.stage import StageResult, stage_run
from toolkit.eval import sources
from toolkit.eval.datasets import SPLIT, DatasetError, check_templates, open_eval_set

KIND = "eval.build-set"


@dataclass(frozen=True)
class BuildSetConfig:
    source: Literal["folder", "csv", "fashion-mnist", "openmoji", "shards"] = option(
        doc="folder: one subfolder per class; csv: image,label / image,caption rows; fashion-mnist: the "
        "Debian package's files; openmoji: the held-out drawings of `toolkit data demo`; shards: raw "
        "webdataset shards (img2dataset's .tar files: a folder, one .tar, a glob or "
        "dir/{00000..00009}.tar), captions or class names from the caption_ext member."
    )
    out: str = option(doc="Directory of the new set (ROOT/NAME); its parent is `--root` for eval zeroshot.")
    input: str = option(
        "",
        is_input=True,
        doc="Folder, CSV file, Fashion-MNIST folder (default "
        "/usr/share/datasets/fashion-mnist), demo output folder, or "
        "the raw shards (source shards).",
    )
    task: Literal["classification", "retrieval"] = option(
        "classification",
        doc="classification (labels) or retrieval (captions); folder and fashion-mnist "
        "are classification only.",
    )
    image_column: str = option("image", doc="CSV column with image paths, relative to the CSV's folder.")
    label_column: str = option("label", doc="CSV column with class labels (classification).")
    caption_column: str = option(
        "caption",
        doc="CSV column with captions (retrieval; repeat a row per extra caption of the same image).",
    )
    caption_ext: str = option(
        "txt",
        doc="shards: the member holding each sample's caption (retrieval) or "
        "class name (classification): txt, cls, ... or json:FIELD (a string "
        "or a list of captions).",
    )
    classnames: str = option(
        "",
        is_input=True,
        doc="File with one class name per line (default: folder "
        "names / sorted CSV labels / the source's own).",
    )
    templates: str = option(
        "",
        is_input=True,
        doc="File with prompt templates containing {c}, one per line "
        "(default: the source's own or generic photo prompts).",
    )
    split: Literal["test", "train"] = option(
        "test", doc="fashion-mnist only: which original split to read; the set's split is always 'test'."
    )
    limit: int = option(0, ge=0, doc="Keep only the first N samples (0: all).")
    max_per_shard: int = option(10_000, ge=1, doc="Samples per tar shard.")
    missing_ok: bool = option(
        False,
        doc="When the input folder/file does not exist, finish without a set "
        "(a warning, counts.missing_input) instead of failing: for optional "
        "sets such as Fashion-MNIST from its Debian package. Evaluate with "
        "eval zeroshot's skip_missing.",
    )

    def __post_init__(self) -> None:
        if self.task == "retrieval" and self.source in ("folder", "fashion-mnist"):
            raise ValueError(f"task: source {self.source!r} gives classification sets only")
        if self.source in ("folder", "csv", "openmoji", "shards") and not self.input:
            raise ValueError(f"input: source {self.source!r} needs an input path")


def collect(cfg: BuildSetConfig) -> sources.EvalSamples:
    """Read the source into memory-light samples (image bytes are small eval images)."""
    names = sources.read_lines_file(cfg.classnames, "classnames") if cfg.classnames else None
    if cfg.source == "folder":
        found = sources.from_folder(cfg.input, names)
    elif cfg.source == "csv":
        found = sources.from_csv(
            cfg.input, cfg.task, cfg.image_column, cfg.label_column, cfg.caption_column, names
        )
    elif cfg.source == "fashion-mnist":
        found = sources.from_fashion_mnist(cfg.input, cfg.split, cfg.limit)  # encodes only what is kept
    elif cfg.source == "shards":  # read only as far as --limit: held-out shards can be large
        found = sources.from_shards(cfg.input, cfg.task, cfg.caption_ext, names, cfg.limit)
    else:
        found = sources.from_openmoji(cfg.input, cfg.task)
    if names and cfg.source in ("fashion-mnist", "openmoji"):
        if len(names) != len(found.classnames):
            raise DatasetError(f"{cfg.classnames}: {len(names)} names for {len(found.classnames)} classes")
        found.classnames = names
    if cfg.templates:
        found.templates = sources.read_lines_file(cfg.templates, "templates")
    elif found.kind == "classification" and not found.templates:
        found.templates = list(sources.GENERIC_TEMPLATES)
    if found.kind == "classification":
        check_templates(found.templates, cfg.templates or "templates")
    return found


def write_shards(kind: str, samples: list[tuple[bytes, str, Any]], out: Path, max_per_shard: int) -> None:
    """Write ``out/test/{0..n-1}.tar`` + nshards.txt into a temp folder renamed into place."""
    import webdataset as wds

    num_shards = -(-len(samples) // max_per_shard)
    with files.replacing_dir(out / SPLIT) as tmp:
        for shard in range(num_shards):
            with wds.TarWriter(str(tmp / f"{shard}.tar")) as sink:
                chunk = samples[shard * max_per_shard : (shard + 1) * max_per_shard]
                for i, (data, ext, target) in enumerate(
                    progress(chunk, desc=f"shard {shard}", unit="sample")
                ):
                    key = f"s{shard * max_per_shard + i:07d}"
                    label = {"txt": "\n".join(target)} if kind == "retrieval" else {"cls": str(target)}
                    sink.write({"__key__": key, ext: data, **label})
        (tmp / "nshards.txt").write_text(f"{num_shards}\n")


def write_metadata(found: sources.EvalSamples, out: Path) -> None:
    for name in ("classnames.txt", "zeroshot_classification_templates.txt", "dataset_type.txt"):
        (out / name).unlink(missing_ok=True)
    if found.kind == "retrieval":
        files.write_text_atomic(str(out / "dataset_type.txt"), "retrieval\n")
        return
    files.write_text_atomic(str(out / "classnames.txt"), "\n".join(found.classnames) + "\n")
    files.write_text_atomic(
        str(out / "zeroshot_classification_templates.txt"), "\n".join(found.templates) + "\n"
    )


def run(cfg: BuildSetConfig) -> StageResult:
    """Build the set, then re-open it with the evaluation reader as a check."""
    log = get_logger("eval")
    if not files.is_local(cfg.out):
        raise DatasetError(f"out: {cfg.out}: evaluation sets are written to local folders")
    with stage_run(KIND, cfg, cfg.out) as rec:
        source_path = cfg.input or (sources.FASHION_MNIST_DIR if cfg.source == "fashion-mnist" else "")
        if cfg.missing_ok and not Path(source_path).exists():
            hint = " (apt-get install dataset-fashion-mnist)" if cfg.source == "fashion-mnist" else ""
            log.warning("%s: not found%s: no %s set built (missing_ok)", source_path, hint, cfg.source)
            rec.counts.update(num_samples=0, missing_input=1)
            return rec.result()
        found = collect(cfg)
        if not found.samples:
            raise DatasetError(f"{cfg.input}: no samples found")
        out = Path(files.local_path(cfg.out))
        kept = found.samples[: cfg.limit] if cfg.limit else found.samples
        num = len(kept)
        write_metadata(found, out)
        write_shards(found.kind, kept, out, cfg.max_per_shard)
        eval_set = open_eval_set(out.parent, out.name)
        for reason, count in found.left_out.items():
            log.warning("%s: left out %d row(s): %s", cfg.input, count, reason)
        rec.outputs.update(dataset=str(out), root=str(out.parent), name=out.name)
        rec.counts.update(
            num_samples=num,
            num_shards=len(eval_set.shards),
            num_classes=len(found.classnames),
            left_out=dict(found.left_out),
            num_read=len(found.samples),
        )
        if found.kind == "classification":
            per_class = [0] * len(found.classnames)
            for _, _, label in kept:
                per_class[label] += 1
            rec.details["per_class"] = dict(zip(found.classnames, per_class, strict=True))
            empty = [n for n, c in zip(found.classnames, per_class, strict=True) if c == 0]
            if empty:  # kept on purpose (a distractor the model may predict), but rarely what a user meant
                log.warning(
                    "%s: %d class(es) without an image: %s; they stay classes the model can predict, and "
                    "mean per-class recall averages over the classes that have images",
                    cfg.out,
                    len(empty),
                    ", ".join(repr(n) for n in empty[:10]),
                )
        rec.details.update(task=found.kind, classnames=found.classnames, templates=found.templates)
        log.info("%s: %d %s samples in %d shard(s)", out, num, found.kind, len(eval_set.shards))
    return rec.result()
