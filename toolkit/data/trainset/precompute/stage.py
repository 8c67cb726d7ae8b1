"""``toolkit data precompute``: raw shards -> fixed-size training shards with dense global ids.

0. The job (:mod:`.job`): the storage mode, tokenizer, towers and fields, decided and loaded once.
1. Worker processes (:mod:`.process`: :mod:`toolkit.core.forkpool`, one task per raw shard, :mod:`.worker`)
   validate, decode,
   convert to RGB, resize/crop to the model resolution (or run a frozen image tower) and
   tokenize (or run a frozen text tower), writing rows to local scratch files (:mod:`.resume` keeps them).
2. The parent orders the kept samples by (raw shard in sorted order, key in sorted order), drops
   keys already kept from an earlier shard, and assigns ids 0..N-1 in that order: the same input and
   config give the same ids on every rerun, whatever the number of workers (:mod:`.ids`,
   streaming, 8 bytes per sample held).
3. The storage mode writes the training files (:mod:`toolkit.data.trainset.storage`); then ``dataset.json``,
   ``skipped.jsonl`` (every skipped sample: reason, shard, key, message) and the stage manifest
   (:mod:`.record`: counts by skip reason and conversion, throughput, examples of skipped keys).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass

from toolkit.core import files
from toolkit.core.config import option
from toolkit.core.launch import LaunchConfig
from toolkit.core.log import get_logger, progress
from toolkit.core.outlock import output_lock
from toolkit.core.stage import StageResult, check_input_finished, stage_run
from toolkit.data.images import DEFAULT_MAX_IMAGE_PIXELS, ResizeMode
from toolkit.data.raw.captions import check_caption_ext
from toolkit.data.raw.reader import list_shards, shard_names
from toolkit.data.trainset import storage
from toolkit.data.trainset.format import DATASET_JSON, TrainDataset
from toolkit.data.trainset.precompute import ids, resume, worker
from toolkit.data.trainset.precompute.dist import Ranks, launch, wants_launch
from toolkit.data.trainset.precompute.job import Job, prepare
from toolkit.data.trainset.precompute.process import process_shards
from toolkit.data.trainset.precompute.record import record
from toolkit.data.trainset.truncation import check_some_kept, check_truncation
from toolkit.models.frozen import ImageTowerKind, TextTowerKind

KIND = "data.precompute"


@dataclass(frozen=True)
class PrecomputeConfig:
    input: str = option(
        is_input=True,
        doc="Raw shards: a folder of .tar files, one .tar, a glob or a brace "
        "pattern (dir/{00000..00009}.tar); local or any fsspec URL.",
    )
    out: str = option(doc="Output folder (local or fsspec URL) for training shards, dataset.json, manifest.")
    model: str = option(doc="Model name or config JSON: sets the image resolution and the tokenizer.")
    image_size: int = option(0, ge=0, doc="Square image side in pixels; 0: the model's image size.")
    resize_mode: ResizeMode = option(
        "center_crop",
        doc="center_crop: scale the short side, crop the centre; pad: fit the whole image, pad with white.",
    )
    storage: str = option(
        "pixels",
        doc="How images are stored (a storage mode). pixels: decoded and resized "
        "(fastest to train from, ~W*H*3 bytes a sample). jpeg: re-encoded at the "
        "model size (decoded by the loader, ~1/10 of pixels' disk). index: no copy, "
        "a table of byte ranges into the raw shards (<2 % extra disk; keep "
        "the raw shards where they are). See docs/data-format.md.",
    )
    jpeg_quality: int = option(
        90, ge=1, le=100, doc="JPEG quality of storage jpeg (PIL's scale, 4:2:0 chroma)."
    )
    crop_scale_min: float = option(
        0.9,
        gt=0,
        le=1,
        doc="Crop margin of stored pixels: they are ceil(image_size / this) px wide, "
        "so the trainer's random crops of at least this area fraction (open_clip's "
        "0.9; --set augment.scale_min) never upsample (224 -> 249 px, 1.24x the "
        "bytes). 1: exactly image_size, no margin.",
    )
    samples_per_shard: int = option(
        1000, ge=1, doc="Samples per training shard (the last one may hold fewer)."
    )
    num_workers: int = option(
        0, ge=0, affects_output=False, doc="Worker processes; 0: one per CPU core, at most one per raw shard."
    )
    max_image_pixels: int = option(
        DEFAULT_MAX_IMAGE_PIXELS, ge=1, doc="Images with more pixels are skipped as decompression bombs."
    )
    caption_ext: str = option(
        "txt",
        doc="Caption member of each raw sample: txt (its text), or json / json:FIELD "
        "(the string FIELD, default caption, of the .json member: img2dataset "
        "writes the caption there too).",
    )
    image_tower: ImageTowerKind = option(
        "none",
        doc="Store this frozen image tower's features instead of "
        "pixels (LiT): none, open_clip or efficientnet_lite0.",
    )
    image_tower_model: str = option("", doc="open_clip model name of an open_clip image tower.")
    image_tower_size: int = option(
        0,
        ge=0,
        doc="Square side in pixels the efficientnet_lite0 tower runs at "
        "(its features are pooled, so any side works; the saved model "
        "evaluates at it too); 0: its ImageNet 224. Time grows as the "
        "side squared.",
    )
    image_tower_weights: str = option(
        "",
        is_input=True,
        doc="Local weights for the image tower (default: the packaged ones, or a seeded random init).",
    )
    text_tower: TextTowerKind = option(
        "none",
        doc="Store this frozen text tower's features instead of tokens (LiT): none, open_clip or minilm.",
    )
    text_tower_model: str = option("", doc="open_clip model name of an open_clip text tower.")
    text_tower_weights: str = option(
        "",
        is_input=True,
        doc="Local weights for the text tower (default: the packaged ones, or a seeded random init).",
    )
    reference_model: str = option(
        "",
        doc="Also store a reference (teacher) model's L2-normalised image and text "
        "embeddings per sample (float16 fields ref_image, ref_text, read by "
        "--loss distill / drrho): an open_clip model name or config JSON with "
        "--reference-weights, or a model folder (open_clip_config.json + weights, "
        "e.g. a cliptk run's model/). It sees each raw image through its own "
        "preprocessing and each caption through its own tokenizer. Any storage "
        "mode. Empty: none.",
    )
    reference_weights: str = option(
        "",
        is_input=True,
        doc="Local weights file of --reference-model (needed with a "
        "model name or config; a model folder's own weights "
        "otherwise). Nothing is downloaded.",
    )
    max_truncated_share: float = option(
        0.05,
        ge=0,
        le=1,
        affects_output=False,
        doc="Fail, naming the shards, when more than this share of the samples read "
        "is lost to truncated or unreadable raw shards (a fetch cut short); "
        "1: keep whatever is left.",
    )
    allow_unfinished_input: bool = option(
        False,
        affects_output=False,
        doc="Precompute a raw folder whose manifest says its fetch (or shard) "
        "did not finish (failed, interrupted, running): only the shards it "
        "finished are read. Default: refused, naming the status.",
    )
    launch: LaunchConfig = option(
        factory=LaunchConfig,
        doc="Processes and nodes (torchrun, as `toolkit train`): "
        "rank r of K processes raw shards r, r+K, ...; the "
        "output is the same as one process's.",
    )
    tmp_dir: str = option(
        "",
        affects_output=False,
        doc="Local scratch folder for processed raw shards (default: "
        "OUT/_tmp for a local OUT, else the system temp folder). "
        "Kept when a run fails or is killed, so that a rerun with "
        "the same tmp_dir resumes; removed at the end.",
    )

    def __post_init__(self) -> None:
        from toolkit.models.frozen import check_weights_value

        check_weights_value("image_tower_weights", self.image_tower_weights)
        if self.image_tower_size and self.image_tower != "efficientnet_lite0":
            raise ValueError(
                f"image_tower_size: applies to image_tower efficientnet_lite0 only (got {self.image_tower})"
            )
        check_weights_value("text_tower_weights", self.text_tower_weights)
        try:
            check_weights_value("reference_weights", self.reference_weights)
        except ValueError:  # its message is about frozen towers, whose weights may be omitted
            raise ValueError(
                f"reference_weights: {self.reference_weights[:200]!r} is not a local file; a reference "
                "model's weights are read from a local file only (nothing is downloaded)"
            ) from None
        if self.reference_weights and not self.reference_model:
            raise ValueError(
                "reference_weights: given without reference_model (which model do they belong to?)"
            )
        check_caption_ext(self.caption_ext)
        mode = storage.get(self.storage)  # an unknown name is refused, naming the registered ones
        if not mode.holds_features and (self.image_tower != "none" or self.text_tower != "none"):
            raise ValueError(
                f"storage {self.storage}: stores images and tokens; frozen-tower features need "
                "storage pixels (the default)"
            )


def run(cfg: PrecomputeConfig) -> StageResult:
    """Precompute training shards into ``cfg.out``; ValueError if no sample is valid (names the input).

    A rerun after a run was killed, interrupted or failed reuses the raw shards it finished
    (:mod:`.resume`); the output is the same as an uninterrupted run's. A raw folder whose own
    manifest says it is unfinished is refused unless ``allow_unfinished_input``.
    """
    log = get_logger("data.precompute")
    check_input_finished(KIND, "input", cfg.input, "--allow-unfinished-input", cfg.allow_unfinished_input)
    if wants_launch(cfg):
        return launch(cfg)  # torchrun starts the ranks, which come back here (.dist)
    ranks = Ranks.join(cfg.launch)
    try:
        if ranks.rank != 0:
            _follow(cfg, ranks, log)
            return StageResult(cfg.out, {"train": cfg.out}, {}, "", {}, "done")
        return _lead(cfg, ranks, log)
    finally:
        ranks.close()


def _follow(cfg: PrecomputeConfig, ranks: Ranks, log) -> None:
    """Ranks 1..K-1: process this rank's raw shards into rank 0's scratch folder (:mod:`.dist`)."""
    urls = list_shards(cfg.input)
    job = prepare(cfg)
    work = resume.work_dir(cfg)
    os.makedirs(work, exist_ok=True)
    process_shards(job, urls, work, log, ranks)
    ranks.barrier()  # rank 0 has written the output


def _lead(cfg: PrecomputeConfig, ranks: Ranks, log) -> StageResult:
    """One process, or rank 0 of a job: the stage books, ids and the training shards (module docstring)."""
    with stage_run(KIND, cfg, cfg.out, owned=storage.part_file_pattern()) as rec:
        urls = list_shards(cfg.input)
        job = prepare(cfg)
        resume.remove_stale_scratch(cfg, log)
        work = resume.work_dir(cfg)
        os.makedirs(work, exist_ok=True)
        with output_lock(work):
            try:
                results, timing = process_shards(job, urls, work, log, ranks)
                names = shard_names(urls)
                check_truncation(
                    [{"reason": r, "shard": names[res.url]} for res in results for r, _, _ in res.skips],
                    sum(r.num_read for r in results),
                    cfg.max_truncated_share,
                    cfg.input,
                )
                check_some_kept([(names[r.url], r.num_kept, r.skips) for r in results], cfg.input)
                start, skips = time.monotonic(), []
                kept = _kept(results, skips, names, f"write {job.mode.parts_noun}")
                shards, data_root, data_files = job.mode.write(job, kept, urls)
                num_samples = sum(s.num_samples for s in shards)
                timing.update(write_s=round(time.monotonic() - start, 3), num_shards=len(shards))
            except BaseException:
                log.warning(
                    "precompute: processed raw shards are kept in %s; a rerun into %s resumes from them",
                    work,
                    cfg.out,
                )
                raise
            shutil.rmtree(work, ignore_errors=True)
        if not cfg.tmp_dir and files.is_local(cfg.out):
            resume.remove_empty_dir(os.path.dirname(work))  # OUT/_tmp; never a shared or system temp folder
        storage.remove_stale_parts(cfg.out, len(shards), job.mode)
        _write_dataset(cfg, job, shards, num_samples, data_root, data_files, skips)
        record(rec, urls, results, num_samples, skips, timing, with_reference=bool(cfg.reference_model))
        rec.outputs["train"] = cfg.out
        log.info(
            "precompute: kept %d of %d samples (%d skipped) in %d shards, %.1f samples/s",
            num_samples,
            rec.counts["num_read"],
            len(skips),
            len(shards),
            rec.counts["samples_per_s"],
        )
    ranks.barrier()  # the other ranks end with rank 0 (a failure here ends the job through torchrun)
    return rec.result()


def _write_dataset(
    cfg: PrecomputeConfig, job: Job, shards, num_samples: int, data_root, data_files, skips: list[dict]
) -> None:
    """OUT/dataset.json (with the storage mode's bytes per sample) and OUT/skipped.jsonl (every skip)."""
    dataset = TrainDataset(
        num_samples,
        job.fields,
        shards,
        cfg.samples_per_shard,
        cfg.input,
        cfg.model,
        job.extra(),
        storage=job.mode.name,
        data_root=data_root,
        data_files=data_files,
        root=cfg.out,
    )
    files.write_json_atomic(
        files.join(cfg.out, DATASET_JSON),
        {**dataset.to_json(), "sample_bytes": job.mode.sample_bytes(dataset)},
    )
    files.write_text_atomic(
        files.join(cfg.out, "skipped.jsonl"),
        "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in skips),
    )


def _kept(results: list[worker.ShardResult], skips: list[dict], names: dict[str, str], desc: str):
    """(result, scratch row, meta line) of every kept sample in id order (:func:`.ids.kept_samples`), with
    progress; every skip record lands in ``skips``."""
    total = sum(r.num_kept for r in results)
    samples = progress(ids.kept_samples(results, skips), total=total, desc=desc, unit="samples")
    for res, row, key, caption in samples:
        yield res, row, {"caption": caption, "source": names[res.url], "key": key}
