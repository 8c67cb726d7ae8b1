"""``toolkit data precompute``: raw shards -> fixed-size training shards with dense global ids.

1. A pool of worker processes (one task per raw shard, :mod:`.precompute_worker`) validates, decodes,
   converts to RGB, resizes/crops to the model resolution (or runs a frozen image tower) and
   tokenizes (or runs a frozen text tower), writing rows to local scratch files.
2. The parent orders the kept samples by (raw shard in sorted order, key in sorted order), drops
   keys already kept from an earlier shard, and assigns ids 0..N-1 in that order: the same input and
   config give the same ids on every rerun, whatever the number of workers (:mod:`.precompute_write`,
   streaming, 8 bytes per sample held).
3. It writes ``samples_per_shard``-sized training shards (:mod:`toolkit.data.trainset.format`),
   ``dataset.json``, ``skipped.jsonl`` (every skipped sample: reason, shard, key, message) and the
   stage manifest (counts by skip reason and conversion, throughput, examples of skipped keys).
"""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import os
import re
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from typing import Literal

from toolkit.core import files
from toolkit.core.config import option
from toolkit.core.launch import LaunchConfig
from toolkit.core.log import ProgressCounter, counter, get_logger
from toolkit.core.outlock import output_lock
from toolkit.core.stage import StageResult, check_input_finished, stage_run
from toolkit.data.augment import stored_side
from toolkit.data.images import DEFAULT_MAX_IMAGE_PIXELS, ResizeMode
from toolkit.data.raw.reader import list_shards, promised_samples, shard_names
from toolkit.data.trainset import integrity, precompute_worker
from toolkit.data.trainset import precompute_resume as resume
from toolkit.data.trainset import precompute_write as writing
from toolkit.data.trainset.format import DATASET_JSON, Field, TrainDataset
from toolkit.data.trainset.precompute_dist import Ranks, check_counts, launch, tower_device, wants_launch
from toolkit.data.trainset.truncation import check_some_kept, check_truncation, first_skips
from toolkit.data.trainset.writer import remove_stale_shards
from toolkit.models.frozen import ImageTowerKind, TextTowerKind

KIND = "data.precompute"
# The files precompute replaces and deletes by name (writer.remove_stale_shards): in an --out without a
# precompute manifest they are someone else's (a raw set's shards, a user's 00001.tar), so it is refused.
OWNED_FILES = re.compile(r"\d{5}\.(tar|meta\.jsonl|xxh3|idx|jpgs)")
Storage = Literal["pixels", "jpeg", "index"]
# The manifest lists at most this many skipped keys per reason; skipped.jsonl has all of them.
MAX_KEYS_PER_REASON = 1000
# The parent reads the workers' shared sample counter this often (seconds) to move the progress display.
POLL_S = 0.5


@dataclass(frozen=True)
class PrecomputeConfig:
    input: str = option(is_input=True, doc="Raw shards: a folder of .tar files, one .tar, a glob or a brace "
                                           "pattern (dir/{00000..00009}.tar); local or any fsspec URL.")
    out: str = option(doc="Output folder (local or fsspec URL) for training shards, dataset.json, manifest.")
    model: str = option(doc="Model name or config JSON: sets the image resolution and the tokenizer.")
    image_size: int = option(0, ge=0, doc="Square image side in pixels; 0: the model's image size.")
    resize_mode: ResizeMode = option("center_crop", doc="center_crop: scale the short side, crop the centre; "
                                                        "pad: fit the whole image, pad with white.")
    storage: Storage = option("pixels", doc="How images are stored. pixels: decoded and resized (fastest to "
                                            "train from, ~W*H*3 bytes a sample). jpeg: re-encoded at the model "
                                            "size (decoded by the loader, ~1/10 of pixels' disk). index: no copy, "
                                            "a table of byte ranges into the raw shards (<2 % extra disk; keep "
                                            "the raw shards where they are). See docs/data-format.md.")
    jpeg_quality: int = option(90, ge=1, le=100, doc="JPEG quality of storage jpeg (PIL's scale, 4:2:0 chroma).")
    crop_scale_min: float = option(0.9, gt=0, le=1,
                                   doc="Crop margin of stored pixels: they are ceil(image_size / this) px wide, "
                                       "so the trainer's random crops of at least this area fraction (open_clip's "
                                       "0.9; --set augment.scale_min) never upsample (224 -> 249 px, 1.24x the "
                                       "bytes). 1: exactly image_size, no margin.")
    samples_per_shard: int = option(1000, ge=1, doc="Samples per training shard (the last one may hold fewer).")
    num_workers: int = option(0, ge=0, affects_output=False,
                              doc="Worker processes; 0: one per CPU core, at most one per raw shard.")
    max_image_pixels: int = option(DEFAULT_MAX_IMAGE_PIXELS, ge=1,
                                   doc="Images with more pixels are skipped as decompression bombs.")
    caption_ext: str = option("txt", doc="Caption member of each raw sample: txt (its text), or json / json:FIELD "
                                         "(the string FIELD, default caption, of the .json member: img2dataset "
                                         "writes the caption there too).")
    image_tower: ImageTowerKind = option("none", doc="Store this frozen image tower's features instead of "
                                                     "pixels (LiT): none, open_clip or efficientnet_lite0.")
    image_tower_model: str = option("", doc="open_clip model name of an open_clip image tower.")
    image_tower_size: int = option(0, ge=0, doc="Square side in pixels the efficientnet_lite0 tower runs at "
                                                "(its features are pooled, so any side works; the saved model "
                                                "evaluates at it too); 0: its ImageNet 224. Time grows as the "
                                                "side squared.")
    image_tower_weights: str = option("", is_input=True, doc="Local weights for the image tower (default: the "
                                                             "packaged ones, or a seeded random init).")
    text_tower: TextTowerKind = option("none", doc="Store this frozen text tower's features instead of tokens "
                                                   "(LiT): none, open_clip or minilm.")
    text_tower_model: str = option("", doc="open_clip model name of an open_clip text tower.")
    text_tower_weights: str = option("", is_input=True, doc="Local weights for the text tower (default: the "
                                                            "packaged ones, or a seeded random init).")
    reference_model: str = option("", doc="Also store a reference (teacher) model's L2-normalised image and text "
                                          "embeddings per sample (float16 fields ref_image, ref_text, read by "
                                          "--loss distill / drrho): an open_clip model name or config JSON with "
                                          "--reference-weights, or a model folder (open_clip_config.json + weights, "
                                          "e.g. a cliptk run's model/). It sees each raw image through its own "
                                          "preprocessing and each caption through its own tokenizer. Any storage "
                                          "mode. Empty: none.")
    reference_weights: str = option("", is_input=True, doc="Local weights file of --reference-model (needed with a "
                                                           "model name or config; a model folder's own weights "
                                                           "otherwise). Nothing is downloaded.")
    max_truncated_share: float = option(0.05, ge=0, le=1, affects_output=False,
                                        doc="Fail, naming the shards, when more than this share of the samples read "
                                            "is lost to truncated or unreadable raw shards (a fetch cut short); "
                                            "1: keep whatever is left.")
    allow_unfinished_input: bool = option(False, affects_output=False,
                                          doc="Precompute a raw folder whose manifest says its fetch (or shard) "
                                              "did not finish (failed, interrupted, running): only the shards it "
                                              "finished are read. Default: refused, naming the status.")
    launch: LaunchConfig = option(factory=LaunchConfig, doc="Processes and nodes (torchrun, as `toolkit train`): "
                                                            "rank r of K processes raw shards r, r+K, ...; the "
                                                            "output is the same as one process's.")
    tmp_dir: str = option("", affects_output=False, doc="Local scratch folder for processed raw shards (default: "
                                                        "OUT/_tmp for a local OUT, else the system temp folder). "
                                                        "Kept when a run fails or is killed, so that a rerun with "
                                                        "the same tmp_dir resumes; removed at the end.")

    def __post_init__(self) -> None:
        from toolkit.models.frozen import check_weights_value

        check_weights_value("image_tower_weights", self.image_tower_weights)
        if self.image_tower_size and self.image_tower != "efficientnet_lite0":
            raise ValueError(f"image_tower_size: applies to image_tower efficientnet_lite0 only (got "
                             f"{self.image_tower})")
        check_weights_value("text_tower_weights", self.text_tower_weights)
        try:
            check_weights_value("reference_weights", self.reference_weights)
        except ValueError:  # its message is about frozen towers, whose weights may be omitted
            raise ValueError(f"reference_weights: {self.reference_weights[:200]!r} is not a local file; a reference "
                             "model's weights are read from a local file only (nothing is downloaded)") from None
        if self.reference_weights and not self.reference_model:
            raise ValueError("reference_weights: given without reference_model (which model do they belong to?)")
        precompute_worker.check_caption_ext(self.caption_ext)
        if self.storage != "pixels" and (self.image_tower != "none" or self.text_tower != "none"):
            raise ValueError(f"storage {self.storage}: stores images and tokens; frozen-tower features need "
                             "storage pixels (the default)")


def _prepare_state(cfg: PrecomputeConfig) -> list[Field]:
    """Load tokenizer/towers into precompute_worker.STATE (before the pool forks); return the sample fields."""
    from toolkit.data.trainset import reference
    from toolkit.models import frozen
    from toolkit.models.registry import image_size, tokenizer

    state = precompute_worker.STATE
    state.clear()
    state["reference"] = (reference.load_reference(cfg.reference_model, cfg.reference_weights, tower_device())
                          if cfg.reference_model else None)
    state["image_tower"] = (frozen.load_image_tower(cfg.image_tower, cfg.image_tower_model,
                                                    cfg.image_tower_weights) if cfg.image_tower != "none" else None)
    if cfg.image_tower_size:
        state["image_tower"].image_size = cfg.image_tower_size
    state["text_tower"] = (frozen.load_text_tower(cfg.text_tower, cfg.text_tower_model, cfg.text_tower_weights)
                           if cfg.text_tower != "none" else None)
    state["tokenizer"] = tokenizer(cfg.model)
    towers = [t for t in (state["image_tower"], state["text_tower"]) if t is not None]
    device = tower_device() if towers else "cpu"
    for tower in towers if device != "cpu" else ():
        frozen.place_tower(tower, device)
    if state["image_tower"] is not None:
        image = Field.make("image_features", (state["image_tower"].dim,))
    else:
        side = stored_side(cfg.image_size or image_size(cfg.model), cfg.crop_scale_min)
        image = Field.make("image", (side, side, 3))
    if state["text_tower"] is not None:
        text = Field.make("text_features", (state["text_tower"].dim,))
    else:
        text = Field.make("tokens", (int(state["tokenizer"](["a"]).shape[1]),))
    ref = reference.fields(state["reference"].dim) if state["reference"] is not None else []
    return [image, text, *ref]


def _worker_init(parent_pid: int) -> None:
    from toolkit.core.procs import die_with_parent

    die_with_parent(parent_pid=parent_pid)  # a SIGKILLed precompute leaves no worker running
    # One intra-op thread per worker: the pool already uses every core.
    state = precompute_worker.STATE
    if any(state.get(k) is not None for k in ("image_tower", "text_tower", "reference")):
        import torch

        torch.set_num_threads(1)


def _process_all(tasks: list[precompute_worker.ShardTask], num_workers: int, on_done,
                 count: ProgressCounter) -> list[precompute_worker.ShardResult]:
    """Run every task (a fork pool when num_workers > 1), calling ``on_done(result)`` as each finishes.

    Progress is in samples read (``count``), not in shards: one big shard would sit at 0/1 until the end.
    Workers add to a shared counter that the parent reads twice a second.
    """
    state, results = precompute_worker.STATE, []
    if num_workers <= 1:
        state["on_read"] = count.advance
        try:
            for task in tasks:
                results.append(precompute_worker.process_shard(task))
                on_done(results[-1])
        finally:
            state["on_read"] = None
        return results
    fork = mp.get_context("fork")
    read, base = fork.Value("q", 0), count.done  # base: samples of resumed shards
    state["on_read"] = functools.partial(_add_shared, read)
    try:
        with fork.Pool(num_workers, initializer=_worker_init, initargs=(os.getpid(),)) as pool:
            pending = pool.imap_unordered(precompute_worker.process_shard, tasks)
            while len(results) < len(tasks):
                try:
                    results.append(pending.next(timeout=POLL_S))
                    on_done(results[-1])
                except mp.TimeoutError:
                    pass
                count.advance(base + read.value - count.done)
    finally:
        state["on_read"] = None
    return results


def _add_shared(value, n: int) -> None:
    """Runs in pool workers: add ``n`` samples read to the parent's shared counter."""
    with value.get_lock():
        value.value += n


def _record(rec, cfg: PrecomputeConfig, urls: list[str], results, num_samples: int, skips, timing: dict) -> None:
    by_reason = Counter(s["reason"] for s in skips)
    converted, names = sum((r.converted for r in results), Counter()), shard_names(urls)
    num_read = sum(r.num_read for r in results)
    read_now = num_read - timing["num_resumed_samples"]  # rates are of this run's work, not a resumed run's
    if num_read != num_samples + len(skips):
        raise RuntimeError(f"internal count mismatch: read {num_read}, kept {num_samples}, skipped {len(skips)}")
    examples: dict[str, list[str]] = {}
    first = first_skips((s["reason"], s["shard"], s["key"], s["message"]) for s in skips)
    for s in skips:
        lst = examples.setdefault(s["reason"], [])
        if len(lst) < MAX_KEYS_PER_REASON:
            lst.append(f"{s['shard']}:{s['key']}")
    total_s = timing["process_s"] + timing["write_s"]
    rec.counts.update({
        "num_samples": num_samples, "num_read": num_read, "num_skipped": len(skips),
        "num_raw_shards": len(urls), "num_shards": timing["num_shards"],
        "num_damaged_tars": sum(1 for r in results if r.tar_error),
        "skipped": dict(sorted(by_reason.items())), "converted": dict(sorted(converted.items())),
        "num_captions_cut": sum(r.num_captions_cut for r in results),
        "samples_per_s": round(read_now / max(total_s, 1e-9), 1),
    })
    rec.details.update({
        "throughput": {**timing, "process_samples_per_s": round(read_now / max(timing["process_s"], 1e-9), 1),
                       # worker-seconds of the reference pass, summed over raw shards (resumed ones included)
                       **({"reference_s": round(sum(r.reference_s for r in results), 3)} if cfg.reference_model else {}),
                       "write_samples_per_s": round(num_samples / max(timing["write_s"], 1e-9), 1)},
        "skipped_keys": examples, "skipped_first": dict(sorted(first.items())), "tar_errors": {names[r.url]: r.tar_error for r in results if r.tar_error},
        "dataset": DATASET_JSON, "skipped_file": "skipped.jsonl",
    })


def run(cfg: PrecomputeConfig) -> StageResult:
    """Precompute training shards into ``cfg.out``; ValueError if no sample is valid (names the input).

    A rerun after a run was killed, interrupted or failed reuses the raw shards it finished
    (:mod:`.precompute_resume`); the output is the same as an uninterrupted run's. A raw folder whose own
    manifest says it is unfinished is refused unless ``allow_unfinished_input``.
    """
    log = get_logger("data.precompute")
    check_input_finished(KIND, "input", cfg.input, "--allow-unfinished-input", cfg.allow_unfinished_input)
    if wants_launch(cfg):
        return launch(cfg)  # torchrun starts the ranks, which come back here (precompute_dist)
    ranks = Ranks.join(cfg.launch)
    try:
        if ranks.rank != 0:
            _follow(cfg, ranks, log)
            return StageResult(cfg.out, {"train": cfg.out}, {}, "", {}, "done")
        return _lead(cfg, ranks, log)
    finally:
        ranks.close()


def _follow(cfg: PrecomputeConfig, ranks: Ranks, log) -> None:
    """Ranks 1..K-1: process this rank's raw shards into rank 0's scratch folder (precompute_dist)."""
    urls = list_shards(cfg.input)
    fields = _prepare_state(cfg)
    work = resume.work_dir(cfg)
    os.makedirs(work, exist_ok=True)
    _process(cfg, urls, fields, work, log, ranks)
    ranks.barrier()  # rank 0 has written the output


def _lead(cfg: PrecomputeConfig, ranks: Ranks, log) -> StageResult:
    """One process, or rank 0 of a job: the stage books, ids and the training shards (module docstring)."""
    with stage_run(KIND, cfg, cfg.out, owned=OWNED_FILES) as rec:
        urls = list_shards(cfg.input)
        fields = _prepare_state(cfg)
        resume.remove_stale_scratch(cfg, log)
        work = resume.work_dir(cfg)
        os.makedirs(work, exist_ok=True)
        with output_lock(work):
            try:
                results, timing = _process(cfg, urls, fields, work, log, ranks)
                names = shard_names(urls)
                check_truncation([{"reason": r, "shard": names[res.url]} for res in results
                                  for r, _, _ in res.skips], sum(r.num_read for r in results),
                                 cfg.max_truncated_share, cfg.input)
                check_some_kept([(names[r.url], r.num_kept, r.skips) for r in results], cfg.input)
                start, skips = time.monotonic(), []
                write = writing.write_pixels if cfg.storage == "pixels" else writing.write_refs
                shards, data_root, data_files = write(cfg, fields, results, urls, skips)
                num_samples = sum(s.num_samples for s in shards)
                timing.update(write_s=round(time.monotonic() - start, 3), num_shards=len(shards))
            except BaseException:
                log.warning("precompute: processed raw shards are kept in %s; a rerun into %s resumes from them",
                            work, cfg.out)
                raise
            shutil.rmtree(work, ignore_errors=True)
        if not cfg.tmp_dir and files.is_local(cfg.out):
            resume.remove_empty_dir(os.path.dirname(work))  # OUT/_tmp; never a shared or system temp folder
        remove_stale_shards(cfg.out, len(shards), cfg.storage)
        dataset = TrainDataset(num_samples, fields, shards, cfg.samples_per_shard, cfg.input, cfg.model,
                               _extra(cfg, fields), storage=cfg.storage, data_root=data_root,
                               data_files=data_files, root=cfg.out)
        files.write_json_atomic(files.join(cfg.out, DATASET_JSON), dataset.to_json())
        files.write_text_atomic(files.join(cfg.out, "skipped.jsonl"),
                                "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in skips))
        _record(rec, cfg, urls, results, num_samples, skips, timing)
        rec.outputs["train"] = cfg.out
        log.info("precompute: kept %d of %d samples (%d skipped) in %d shards, %.1f samples/s",
                 num_samples, rec.counts["num_read"], len(skips), len(shards), rec.counts["samples_per_s"])
    ranks.barrier()  # the other ranks end with rank 0 (a failure here ends the job through torchrun)
    return rec.result()


def _process(cfg: PrecomputeConfig, urls: list[str], fields: list[Field], work: str, log,
             ranks: Ranks) -> tuple[list[precompute_worker.ShardResult], dict]:
    """Every raw shard's result in URL order: reused from ``work`` if finished earlier, else processed
    (this rank's share of them, then every rank's results read back from ``work``)."""
    ref = precompute_worker.STATE.get("reference")
    ref = ref.identity() if ref is not None else None  # in each record: a model folder may change in place
    key = resume.process_key(cfg)
    scratch = writing.scratch_fields(cfg.storage, fields)
    if ranks.rank == 0:  # rank 0 prunes the scratch folder before any other rank writes into it
        done = resume.load(work, urls, key, scratch, reference=ref)
        ranks.barrier()
    else:
        ranks.barrier()
        done = resume.load(work, urls, key, scratch, prune=False, reference=ref)
    if done and ranks.rank == 0:
        log.info("precompute: resuming: %d of %d raw shards were processed by an earlier run", len(done), len(urls))
    side = fields[0].shape[0] if fields[0].role == "image" else 0
    tasks = [precompute_worker.ShardTask(i, u, resume.stem(work, u), side, cfg.resize_mode,
                                         cfg.max_image_pixels, cfg.caption_ext, cfg.storage, cfg.jpeg_quality)
             for i, u in enumerate(urls) if i not in done and ranks.owns(i)]
    cores = max(1, len(os.sched_getaffinity(0)) // ranks.local_world)  # this node's cores among its ranks
    workers = max(1, min(cfg.num_workers or cores, len(tasks)))
    if any(getattr(precompute_worker.STATE.get(k), "device", "cpu") != "cpu"
           for k in ("image_tower", "text_tower", "reference")):
        workers = 1  # a CUDA tower cannot be used in forked workers: this rank's GPU encodes inline
    log.info("precompute: processing %d of %d raw shards with %d workers -> %s", len(tasks), len(urls), workers,
             cfg.out)
    start = time.monotonic()
    resumed = sum(r.num_read for i, r in done.items() if ranks.owns(i))
    mine = [u for i, u in enumerate(urls) if ranks.owns(i)]
    with counter(promised_samples(mine), desc="precompute", unit="samples") as count:
        count.advance(resumed)
        fresh = _process_all(tasks, workers, lambda r: resume.save(work, r, key, ref), count)
    if ranks.world > 1:  # every rank's counts, then rank 0 reads the others' records from the scratch folder
        gathered = ranks.gather_counts({r.index: r.num_read for r in fresh})
        if ranks.rank == 0:
            theirs = resume.load(work, urls, key, scratch, reference=ref)
            check_counts(gathered, {i: r.num_read for i, r in theirs.items()}, urls, work)
            fresh = [r for i, r in theirs.items() if i not in done]
    timing = {"process_s": round(time.monotonic() - start, 3), "num_workers": workers,
              "num_resumed_raw_shards": len(done), "num_resumed_samples": resumed}
    return sorted([*done.values(), *fresh], key=lambda r: r.index), timing


def _extra(cfg: PrecomputeConfig, fields: list[Field]) -> dict:
    """Provenance the loader does not need but users and the trainer may: towers, resize mode."""
    extra: dict = {"resize_mode": cfg.resize_mode}
    if cfg.storage == "jpeg":
        extra["jpeg_quality"] = cfg.jpeg_quality
    state = precompute_worker.STATE
    if state.get("image_tower") is not None:
        t = state["image_tower"]
        extra["image_tower"] = {"kind": cfg.image_tower, "name": t.name, "dim": t.dim, "image_size": t.image_size,
                                "mean": list(t.mean), "std": list(t.std), "weights": cfg.image_tower_weights}
    else:  # image_size: the model's side; the stored side (the field's shape) adds the crop margin
        from toolkit.models.registry import image_size

        extra["image_size"] = cfg.image_size or image_size(cfg.model)
        extra["crop_scale_min"] = cfg.crop_scale_min
    if state.get("text_tower") is not None:
        t = state["text_tower"]
        extra["text_tower"] = {"kind": cfg.text_tower, "name": t.name, "dim": t.dim,
                               "context_length": t.context_length, "weights": cfg.text_tower_weights}
    else:
        extra["context_length"] = fields[1].shape[0]
        extra["vocab_size"] = integrity.tokenizer_vocab_size(state["tokenizer"])  # the loader's token-id bound
    if state.get("reference") is not None:
        extra["reference"] = state["reference"].info()
    return extra
