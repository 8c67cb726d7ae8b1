"""``toolkit data precompute``: raw shards -> fixed-size training shards with dense global ids.

0. The job (:mod:`.job`): the storage mode, tokenizer, towers and fields, decided and loaded once.
1. Worker processes (:mod:`toolkit.core.forkpool`, one task per raw shard, :mod:`.worker`) validate, decode,
   convert to RGB, resize/crop to the model resolution (or run a frozen image tower) and
   tokenize (or run a frozen text tower), writing rows to local scratch files (:mod:`.resume` keeps them).
2. The parent orders the kept samples by (raw shard in sorted order, key in sorted order), drops
   keys already kept from an earlier shard, and assigns ids 0..N-1 in that order: the same input and
   config give the same ids on every rerun, whatever the number of workers (:mod:`.ids`,
   streaming, 8 bytes per sample held).
3. The storage mode writes the training files (:mod:`toolkit.data.trainset.storage`); then ``dataset.json``,
   ``skipped.jsonl`` (every skipped sample: reason, shard, key, message) and the
   stage manifest (counts by skip reason and conversion, throughput, examples of skipped keys).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass

from toolkit.core import files, forkpool
from toolkit.core.config import option
from toolkit.core.launch import LaunchConfig
from toolkit.core.log import counter, get_logger, progress
from toolkit.core.outlock import output_lock
from toolkit.core.stage import StageResult, check_input_finished, stage_run
from toolkit.data.images import DEFAULT_MAX_IMAGE_PIXELS, ResizeMode
from toolkit.data.raw.captions import check_caption_ext
from toolkit.data.raw.reader import list_shards, promised_samples, shard_names
from toolkit.data.trainset import storage
from toolkit.data.trainset.format import DATASET_JSON, TrainDataset
from toolkit.data.trainset.precompute import ids, resume, worker
from toolkit.data.trainset.precompute.dist import Ranks, check_counts, launch, wants_launch
from toolkit.data.trainset.precompute.job import Job, prepare
from toolkit.data.trainset.truncation import check_some_kept, check_truncation, first_skips
from toolkit.models.frozen import ImageTowerKind, TextTowerKind

KIND = "data.precompute"
# The manifest lists at most this many skipped keys per reason; skipped.jsonl has all of them.
MAX_KEYS_PER_REASON = 1000


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


def _process_all(job: Job, tasks: list[worker.ShardTask], num_workers: int, on_done, count) -> list:
    """Run every task (in forked workers when num_workers > 1), calling ``on_done(result)`` as each finishes.

    Progress is in samples read (``count``), not in shards: one big shard would sit at 0/1 until the end.
    """
    results = []
    if num_workers <= 1:
        for task in tasks:
            results.append(worker.process_shard(job, task, count.advance))
            on_done(results[-1])
        return results
    base = count.done  # samples of resumed shards

    def done(res) -> None:
        results.append(res)
        on_done(res)

    # worker.process_shard is looked up now, in the parent: the workers run what this process would
    forkpool.run(
        worker.process_shard,
        job,
        tasks,
        num_workers,
        done,
        start=job.worker_start,
        on_progress=lambda read: count.advance(base + read - count.done),
        name="precompute",
    )
    return results


def _record(
    rec, cfg: PrecomputeConfig, urls: list[str], results, num_samples: int, skips, timing: dict
) -> None:
    by_reason = Counter(s["reason"] for s in skips)
    converted, names = sum((r.converted for r in results), Counter()), shard_names(urls)
    num_read = sum(r.num_read for r in results)
    read_now = num_read - timing["num_resumed_samples"]  # rates are of this run's work, not a resumed run's
    if num_read != num_samples + len(skips):
        raise RuntimeError(
            f"internal count mismatch: read {num_read}, kept {num_samples}, skipped {len(skips)}"
        )
    examples: dict[str, list[str]] = {}
    first = first_skips((s["reason"], s["shard"], s["key"], s["message"]) for s in skips)
    for s in skips:
        lst = examples.setdefault(s["reason"], [])
        if len(lst) < MAX_KEYS_PER_REASON:
            lst.append(f"{s['shard']}:{s['key']}")
    total_s = timing["process_s"] + timing["write_s"]
    rec.counts.update(
        {
            "num_samples": num_samples,
            "num_read": num_read,
            "num_skipped": len(skips),
            "num_raw_shards": len(urls),
            "num_shards": timing["num_shards"],
            "num_damaged_tars": sum(1 for r in results if r.tar_error),
            "skipped": dict(sorted(by_reason.items())),
            "converted": dict(sorted(converted.items())),
            "num_captions_cut": sum(r.num_captions_cut for r in results),
            "samples_per_s": round(read_now / max(total_s, 1e-9), 1),
        }
    )
    rec.details.update(
        {
            "throughput": {
                **timing,
                "process_samples_per_s": round(read_now / max(timing["process_s"], 1e-9), 1),
                # worker-seconds of the reference pass, summed over raw shards (resumed ones included)
                **(
                    {"reference_s": round(sum(r.reference_s for r in results), 3)}
                    if cfg.reference_model
                    else {}
                ),
                "write_samples_per_s": round(num_samples / max(timing["write_s"], 1e-9), 1),
            },
            "skipped_keys": examples,
            "skipped_first": dict(sorted(first.items())),
            "tar_errors": {names[r.url]: r.tar_error for r in results if r.tar_error},
            "dataset": DATASET_JSON,
            "skipped_file": "skipped.jsonl",
        }
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
    _process(job, urls, work, log, ranks)
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
                results, timing = _process(job, urls, work, log, ranks)
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
        _record(rec, cfg, urls, results, num_samples, skips, timing)
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


def _process(
    job: Job, urls: list[str], work: str, log, ranks: Ranks
) -> tuple[list[worker.ShardResult], dict]:
    """Every raw shard's result in URL order: reused from ``work`` if finished earlier, else processed
    (this rank's share of them, then every rank's results read back from ``work``)."""
    cfg = job.cfg
    ref = (
        job.reference.identity() if job.reference is not None else None
    )  # a model folder may change in place
    key = resume.process_key(cfg)
    scratch = job.scratch_fields
    if ranks.rank == 0:  # rank 0 prunes the scratch folder before any other rank writes into it
        done = resume.load(work, urls, key, scratch, reference=ref)
        ranks.barrier()
    else:
        ranks.barrier()
        done = resume.load(work, urls, key, scratch, prune=False, reference=ref)
    if done and ranks.rank == 0:
        log.info(
            "precompute: resuming: %d of %d raw shards were processed by an earlier run", len(done), len(urls)
        )
    tasks = [
        job.task(index=i, url=u, work=work) for i, u in enumerate(urls) if i not in done and ranks.owns(i)
    ]
    cores = max(1, len(os.sched_getaffinity(0)) // ranks.local_world)  # this node's cores among its ranks
    workers = max(1, min(cfg.num_workers or cores, len(tasks)))
    if job.on_device:
        workers = 1  # a CUDA tower cannot be used in forked workers: this rank's GPU encodes inline
    log.info(
        "precompute: processing %d of %d raw shards with %d workers -> %s",
        len(tasks),
        len(urls),
        workers,
        cfg.out,
    )
    start = time.monotonic()
    resumed = sum(r.num_read for i, r in done.items() if ranks.owns(i))
    mine = [u for i, u in enumerate(urls) if ranks.owns(i)]
    with counter(promised_samples(mine), desc="precompute", unit="samples") as count:
        count.advance(resumed)
        fresh = _process_all(job, tasks, workers, lambda r: resume.save(work, r, key, ref), count)
    if ranks.world > 1:  # every rank's counts, then rank 0 reads the others' records from the scratch folder
        gathered = ranks.gather_counts({r.index: r.num_read for r in fresh})
        if ranks.rank == 0:
            theirs = resume.load(work, urls, key, scratch, reference=ref)
            check_counts(gathered, {i: r.num_read for i, r in theirs.items()}, urls, work)
            fresh = [r for i, r in theirs.items() if i not in done]
    timing = {
        "process_s": round(time.monotonic() - start, 3),
        "num_workers": workers,
        "num_resumed_raw_shards": len(done),
        "num_resumed_samples": resumed,
    }
    return sorted([*done.values(), *fresh], key=lambda r: r.index), timing


def _kept(results: list[worker.ShardResult], skips: list[dict], names: dict[str, str], desc: str):
    """(result, scratch row, meta line) of every kept sample in id order (:func:`.ids.kept_samples`), with
    progress; every skip record lands in ``skips``."""
    total = sum(r.num_kept for r in results)
    samples = progress(ids.kept_samples(results, skips), total=total, desc=desc, unit="samples")
    for res, row, key, caption in samples:
        yield res, row, {"caption": caption, "source": names[res.url], "key": key}
