"""``toolkit data inspect``: what is in a folder of raw shards or training shards.

Reports sample counts, skip reasons (a precompute folder's manifest; for raw shards, the fetch
stage's manifest and img2dataset's ``_stats.json`` files if present, plus damage found while
reading), a caption-length histogram in words, and a contact sheet PNG of the first samples with
their captions. Results go to ``out/report.json``, ``out/contact_sheet.png`` and the manifest.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from io import BytesIO
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from toolkit.core import files
from toolkit.core.config import option
from toolkit.core.log import get_logger, progress
from toolkit.core.stage import StageResult, read_manifest, stage_run
from toolkit.data.images import ImageError, decode_rgb
from toolkit.data.raw import reasons
from toolkit.data.raw.captions import caption_of, check_caption_ext
from toolkit.data.raw.reader import RawShardReader, list_shards, shard_names, sidecar
from toolkit.data.trainset import storage
from toolkit.data.trainset.format import DATASET_JSON, TrainDataset, meta_file
from toolkit.data.trainset.segment import Segment

KIND = "data.inspect"
# Upper edges of the caption-length histogram bins, in words (the last bin is open-ended).
WORD_BINS = (0, 1, 2, 4, 8, 16, 32, 64)
CAPTION_LINE_PX = 12


@dataclass(frozen=True)
class InspectConfig:
    input: str = option(
        is_input=True,
        doc="Folder of raw shards (.tar) or of training shards (dataset.json); local or fsspec URL.",
    )
    out: str = option(doc="Report folder: report.json, contact_sheet.png, manifest.json.")
    num_contact: int = option(64, ge=0, doc="Samples on the contact sheet (0: no sheet).")
    thumb_size: int = option(64, ge=8, doc="Side of each contact-sheet tile in pixels.")
    max_samples: int = option(0, ge=0, doc="Read at most this many samples for counts and captions (0: all).")
    caption_ext: str = option(
        "txt",
        doc="Raw shards: the caption member, as precompute's --caption-ext (txt, "
        "json: the .json member's caption string, json:FIELD).",
    )

    def __post_init__(self) -> None:
        check_caption_ext(self.caption_ext)


def histogram(lengths: list[int]) -> list[dict[str, Any]]:
    """Caption lengths in words -> [{'words': '3-4', 'count': n}, ...] over WORD_BINS."""
    counts, labels, low = Counter(), [], 0
    for high in WORD_BINS:
        labels.append(str(high) if low == high else f"{low}-{high}")
        low = high + 1
    labels.append(f"{low}+")
    for n in lengths:
        idx = next((i for i, high in enumerate(WORD_BINS) if n <= high), len(WORD_BINS))
        counts[idx] += 1
    return [{"words": label, "count": counts[i]} for i, label in enumerate(labels)]


def contact_sheet(tiles: list[tuple[np.ndarray, str]], thumb: int) -> Image.Image:
    """Grid of (uint8 [h, w, 3] image, caption) tiles, captions in a line under each image."""
    cols = max(1, int(np.ceil(np.sqrt(len(tiles)))))
    rows = max(1, -(-len(tiles) // cols))
    sheet = Image.new("RGB", (cols * thumb, rows * (thumb + CAPTION_LINE_PX)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for i, (pixels, caption) in enumerate(tiles):
        x, y = (i % cols) * thumb, (i // cols) * (thumb + CAPTION_LINE_PX)
        img = Image.fromarray(np.ascontiguousarray(pixels))
        sheet.paste(img if img.size == (thumb, thumb) else img.resize((thumb, thumb)), (x, y))
        draw.text((x + 1, y + thumb), caption[: max(1, thumb // 6)], fill=(0, 0, 0))
    return sheet


def storage_report(ds: TrainDataset) -> dict[str, Any]:
    """The storage mode and what it costs on disk: ``stored_bytes`` of the folder's per-sample files
    (parts, their meta sidecars, and what the mode keeps beside them: checksums, .jpgs) and
    ``bytes_per_sample`` = that / N. An index's images stay in the raw shards, not counted here."""
    import fsspec

    names = (
        [s.name for s in ds.shards]
        + [meta_file(i) for i in range(len(ds.shards))]
        + storage.of(ds).stored_files(ds)
    )
    fs, base = fsspec.core.url_to_fs(ds.root)
    stored = sum(fs.size(f"{base.rstrip('/')}/{name}") for name in names)
    return {
        "storage": ds.storage,
        "stored_bytes": int(stored),
        "bytes_per_sample": round(stored / max(ds.num_samples, 1), 1),
    }


def _inspect_train(cfg: InspectConfig) -> tuple[dict, list]:
    ds = TrainDataset.open(cfg.input)
    report: dict[str, Any] = {
        "kind": "training",
        "num_samples": ds.num_samples,
        "num_shards": len(ds.shards),
        "fields": {f.role: {"dtype": f.dtype, "shape": list(f.shape)} for f in ds.fields},
        "model": ds.model,
        "source": ds.source,
        **storage_report(ds),
    }
    if ds.extra.get("reference"):  # precompute --reference-model: what it is and what it costs per sample
        from toolkit.data.trainset.reference import bytes_per_sample

        report["reference"] = ds.extra["reference"]
        report["reference_bytes_per_sample"] = bytes_per_sample(ds)
    manifest = read_manifest(cfg.input) or {}
    counts = manifest.get("counts", {})
    report["skipped"] = {"precompute": counts.get("skipped", {})} if counts else {}
    report["converted"] = counts.get("converted", {})
    report["num_read"] = counts.get("num_read")
    lengths, captions = [], []
    limit = cfg.max_samples or ds.num_samples
    for i in range(len(ds.shards)):
        if len(lengths) >= limit:
            break
        with files.open_file(files.join(cfg.input, meta_file(i)), "r") as fh:
            for line in fh:
                if len(lengths) >= limit:
                    break
                caption = json.loads(line)["caption"]
                lengths.append(len(caption.split()))
                if len(captions) < cfg.num_contact:
                    captions.append(caption)
    tiles = []
    if ds.field("image") is not None and cfg.num_contact:
        segment = Segment(0, 0, min(cfg.num_contact, ds.shards[0].num_samples))
        for sample in storage.of(ds).read_segment(ds, segment):
            tiles.append((sample["image"], captions[len(tiles)] if len(tiles) < len(captions) else ""))
    elif cfg.num_contact:
        report["contact_sheet_note"] = "no pixels stored (frozen-tower features): no contact sheet"
    report["caption_words"] = histogram(lengths)
    return report, tiles


def _raw_samples(urls: list[str], errors: dict[str, str], caption_ext: str):
    """Every sample of every shard in order, a cut tar's last one kept as precompute keeps it
    (``caption_ext``); each damaged shard's error lands in ``errors``."""
    names = shard_names(urls)
    for url in urls:
        reader = RawShardReader(url, caption_ext)
        yield from reader.samples()
        if reader.error:
            errors[names[url]] = reader.error


def _inspect_raw(cfg: InspectConfig) -> tuple[dict, list]:
    urls = list_shards(cfg.input)
    report: dict[str, Any] = {"kind": "raw", "num_shards": len(urls)}
    exts, lengths, tiles, errors, problems, no_caption = Counter(), [], [], {}, Counter(), Counter()
    skipped, expected = _raw_skip_reasons(cfg.input, urls)
    num = 0
    # progress in samples, not shards: one big shard would sit at 0/1 until the end
    for sample in progress(
        _raw_samples(urls, errors, cfg.caption_ext), total=expected, desc="inspect", unit="samples"
    ):
        num += 1
        exts.update(sample.files.keys())
        text, problem = caption_of(sample, cfg.caption_ext)  # what precompute would keep as the caption
        if problem is None:
            lengths.append(len(text.split()))
        else:
            no_caption[problem[0]] += 1
            text = ""
        image = sample.image()
        if len(tiles) < cfg.num_contact and image is not None:
            try:
                tiles.append((decode_rgb(image[1], cfg.thumb_size)[0], text.strip()))
            except ImageError as err:
                problems[err.reason] += 1
        if cfg.max_samples and num >= cfg.max_samples:
            break
    report.update(
        {
            "num_samples": num,
            "members_by_ext": dict(sorted(exts.items())),
            "tar_errors": errors,
            "contact_sheet_decode_errors": dict(problems),
            "caption_words": histogram(lengths),
            "caption_problems": dict(sorted(no_caption.items())),
        }
    )  # outside the histogram: no caption kept
    report["skipped"] = skipped
    return report, tiles


def _raw_skip_reasons(source: str, urls: list[str]) -> tuple[dict[str, dict[str, int]], int | None]:
    """Failures the producer recorded, by reason: ``shards`` (fetch/shard: each shard's _stats.json
    status messages, classified like fetch's manifest) and ``url_list`` (rows fetch skipped, from its
    manifest); plus the number of samples the stats files promise (None if one has none)."""
    found: dict[str, dict[str, int]] = {}
    m = read_manifest(source) if "*" not in source and "{" not in source else None
    if m is not None and (m.get("counts") or {}).get("skipped_rows"):
        found["url_list"] = dict(m["counts"]["skipped_rows"])
    stats, expected = {}, 0
    for i, url in enumerate(urls):
        path = sidecar(url, "_stats.json")
        try:
            data = files.read_json(path) if files.exists(path) else None
            expected = expected + int(data["successes"]) if expected is not None and data else None
        except (OSError, ValueError, KeyError, TypeError):
            data, expected = None, None
        if data and "status_dict" in data:
            stats[i] = data
    failed = reasons.summarize(stats)["failed_by_reason"] if stats else {}
    if failed:
        found["shards"] = failed
    return found, expected


def run(cfg: InspectConfig) -> StageResult:
    """Inspect ``cfg.input`` (training shards if it holds dataset.json, else raw shards)."""
    log = get_logger("data.inspect")
    with stage_run(KIND, cfg, cfg.out) as rec:
        is_train = files.exists(files.join(cfg.input, DATASET_JSON))
        report, tiles = _inspect_train(cfg) if is_train else _inspect_raw(cfg)
        if report["num_samples"] == 0:
            raise ValueError(f"{cfg.input}: no samples found")
        files.write_json_atomic(files.join(cfg.out, "report.json"), report)
        rec.outputs["out"] = cfg.out
        rec.outputs["report"] = files.join(cfg.out, "report.json")
        if tiles:
            path = files.join(cfg.out, "contact_sheet.png")
            buf = BytesIO()
            contact_sheet(tiles, cfg.thumb_size).save(buf, "PNG")
            files.write_bytes_atomic(path, buf.getvalue())
            rec.outputs["contact_sheet"] = path
        rec.counts.update(
            {
                "num_samples": report["num_samples"],
                "num_shards": report["num_shards"],
                "num_contact": len(tiles),
            }
        )
        rec.details.update(report)
        log.info("inspect %s: %s shards, %d samples", cfg.input, report["num_shards"], report["num_samples"])
    return rec.result()
