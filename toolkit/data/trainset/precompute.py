"""``toolkit data precompute``: raw shards -> fixed-size training shards with dense global ids.

1. A pool of worker processes (one task per raw shard, :mod:`.precompute_worker`) validates, decodes,
   converts to RGB, resizes/crops to the model resolution (or runs a frozen image tower) and
   tokenizes (or runs a frozen text tower), writing rows to local scratch files.
2. The parent orders the kept samples by (raw shard in sorted order, key in sorted order), drops
   keys already kept from an earlier shard, and assigns ids 0..N-1 in that order: the same input and
   config give the same ids on every rerun, whatever the number of workers.
3. It writes ``samples_per_shard``-sized training shards (:mod:`toolkit.data.trainset.format`),
   ``dataset.json``, ``skipped.jsonl`` (every skipped sample: reason, shard, key, message) and the
   stage manifest (counts by skip reason and conversion, throughput, examples of skipped keys).
"""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from toolkit.core import files
from toolkit.core.config import option
from toolkit.core.log import ProgressCounter, counter, get_logger, progress
from toolkit.core.outlock import output_lock
from toolkit.core.stage import StageResult, stage_run
from toolkit.data.images import DEFAULT_MAX_IMAGE_PIXELS, ResizeMode
from toolkit.data.raw.reader import list_shards, promised_samples, shard_basename
from toolkit.data.trainset import integrity, precompute_worker
from toolkit.data.trainset import precompute_resume as resume
from toolkit.data.trainset.format import (
    DATASET_JSON,
    Field,
    TrainDataset,
    TrainShardWriter,
    remove_stale_shards,
)
from toolkit.data.trainset.truncation import check_truncation
from toolkit.models.frozen import ImageTowerKind, TextTowerKind

KIND = "data.precompute"
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
    samples_per_shard: int = option(1000, ge=1, doc="Samples per training shard (the last one may hold fewer).")
    num_workers: int = option(0, ge=0, affects_output=False,
                              doc="Worker processes; 0: one per CPU core, at most one per raw shard.")
    max_image_pixels: int = option(DEFAULT_MAX_IMAGE_PIXELS, ge=1,
                                   doc="Images with more pixels are skipped as decompression bombs.")
    caption_ext: str = option("txt", doc="Extension of the caption member of each raw sample.")
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
    max_truncated_share: float = option(0.05, ge=0, le=1, affects_output=False,
                                        doc="Fail, naming the shards, when more than this share of the samples read "
                                            "is lost to truncated or unreadable raw shards (a fetch cut short); "
                                            "1: keep whatever is left.")
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


def _prepare_state(cfg: PrecomputeConfig) -> list[Field]:
    """Load tokenizer/towers into precompute_worker.STATE (before the pool forks); return the sample fields."""
    from toolkit.models import frozen
    from toolkit.models.registry import image_size, tokenizer

    state = precompute_worker.STATE
    state.clear()
    state["image_tower"] = (frozen.load_image_tower(cfg.image_tower, cfg.image_tower_model,
                                                    cfg.image_tower_weights) if cfg.image_tower != "none" else None)
    if cfg.image_tower_size:
        state["image_tower"].image_size = cfg.image_tower_size
    state["text_tower"] = (frozen.load_text_tower(cfg.text_tower, cfg.text_tower_model, cfg.text_tower_weights)
                           if cfg.text_tower != "none" else None)
    state["tokenizer"] = tokenizer(cfg.model)
    if state["image_tower"] is not None:
        image = Field.make("image_features", (state["image_tower"].dim,))
    else:
        side = cfg.image_size or image_size(cfg.model)
        image = Field.make("image", (side, side, 3))
    if state["text_tower"] is not None:
        text = Field.make("text_features", (state["text_tower"].dim,))
    else:
        text = Field.make("tokens", (int(state["tokenizer"](["a"]).shape[1]),))
    return [image, text]


def _worker_init(parent_pid: int) -> None:
    from toolkit.core.procs import die_with_parent

    die_with_parent(parent_pid=parent_pid)  # a SIGKILLed precompute leaves no worker running
    # One intra-op thread per worker: the pool already uses every core.
    state = precompute_worker.STATE
    if state.get("image_tower") is not None or state.get("text_tower") is not None:
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


def assign_ids(results: list[precompute_worker.ShardResult]) -> tuple[list[tuple[int, int]], list[dict]]:
    """Global order of kept samples as (result index, row) and every skip record.

    Order: raw shards in sorted-URL order, then keys in sorted order; a key already kept from an
    earlier shard is skipped as ``duplicate_key``. Position in the returned list is the global id.
    """
    order: list[tuple[int, int]] = []
    skips: list[dict] = []
    owner: dict[str, str] = {}
    for i, res in enumerate(results):
        name = shard_basename(res.url)
        skips.extend({"reason": r, "shard": name, "key": k, "message": m} for r, k, m in res.skips)
        for row in sorted(range(len(res.keys)), key=res.keys.__getitem__):
            key = res.keys[row]
            if key in owner:
                skips.append({"reason": "duplicate_key", "shard": name, "key": key,
                              "message": f"key already kept from {owner[key]}"})
                continue
            owner[key] = name
            order.append((i, row))
    return order, skips


def _rows(path: str, field: Field, count: int) -> np.ndarray:
    """Scratch file of ``count`` fixed-size rows -> uint8 memmap [count, field.nbytes]."""
    if count == 0:
        return np.zeros((0, field.nbytes), np.uint8)
    size = os.path.getsize(path)
    if size != count * field.nbytes:
        raise RuntimeError(f"{path}: {size} bytes, expected {count} rows of {field.nbytes}")
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(count, field.nbytes))


def _write_shards(cfg: PrecomputeConfig, fields: list[Field], results: list[precompute_worker.ShardResult],
                  order: list[tuple[int, int]]) -> list:
    writer = TrainShardWriter(cfg.out, fields, cfg.samples_per_shard)
    try:
        return _write_rows(writer, fields, results, order)
    except OSError as err:  # a full disk: name the shard and free its space for the failed manifest
        shard = writer.discard()
        raise OSError(err.errno, f"{err.strerror or err} while writing the training shard {shard or cfg.out} "
                                 f"(into --out {cfg.out}); free space there and rerun (processed raw shards are "
                                 "kept)") from err


def _write_rows(writer: TrainShardWriter, fields: list[Field], results: list[precompute_worker.ShardResult],
                order: list[tuple[int, int]]) -> list:
    image_f, text_f = fields
    rows = {}
    for sample_id, (i, row) in enumerate(progress(order, desc="write shards", unit="samples")):
        if i not in rows:
            rows.clear()  # results arrive in order: keep one shard's memmaps open at a time
            res = results[i]
            rows[i] = (_rows(res.image_path, image_f, len(res.keys)), _rows(res.text_path, text_f, len(res.keys)))
        images, texts = rows[i]
        res = results[i]
        writer.add(sample_id, [images[row].tobytes(), texts[row].tobytes()],
                   {"caption": res.captions[row], "source": shard_basename(res.url), "key": res.keys[row]})
    return writer.close()


def _record(rec, cfg: PrecomputeConfig, urls: list[str], results, order, skips, timing: dict) -> None:
    by_reason = Counter(s["reason"] for s in skips)
    converted = sum((r.converted for r in results), Counter())
    num_read = sum(r.num_read for r in results)
    read_now = num_read - timing["num_resumed_samples"]  # rates are of this run's work, not a resumed run's
    if num_read != len(order) + len(skips):
        raise RuntimeError(f"internal count mismatch: read {num_read}, kept {len(order)}, skipped {len(skips)}")
    examples: dict[str, list[str]] = {}
    for s in skips:
        lst = examples.setdefault(s["reason"], [])
        if len(lst) < MAX_KEYS_PER_REASON:
            lst.append(f"{s['shard']}:{s['key']}")
    total_s = timing["process_s"] + timing["write_s"]
    rec.counts.update({
        "num_samples": len(order), "num_read": num_read, "num_skipped": len(skips),
        "num_raw_shards": len(urls), "num_shards": timing["num_shards"],
        "num_damaged_tars": sum(1 for r in results if r.tar_error),
        "skipped": dict(sorted(by_reason.items())), "converted": dict(sorted(converted.items())),
        "samples_per_s": round(read_now / max(total_s, 1e-9), 1),
    })
    rec.details.update({
        "throughput": {**timing, "process_samples_per_s": round(read_now / max(timing["process_s"], 1e-9), 1),
                       "write_samples_per_s": round(len(order) / max(timing["write_s"], 1e-9), 1)},
        "skipped_keys": examples, "tar_errors": {shard_basename(r.url): r.tar_error for r in results if r.tar_error},
        "dataset": DATASET_JSON, "skipped_file": "skipped.jsonl",
    })


def run(cfg: PrecomputeConfig) -> StageResult:
    """Precompute training shards into ``cfg.out``; ValueError if no sample is valid (names the input).

    A rerun after a run was killed, interrupted or failed reuses the raw shards it finished
    (:mod:`.precompute_resume`); the output is the same as an uninterrupted run's.
    """
    log = get_logger("data.precompute")
    with stage_run(KIND, cfg, cfg.out) as rec:
        urls = list_shards(cfg.input)
        fields = _prepare_state(cfg)
        _remove_stale_scratch(cfg, log)
        work = resume.work_dir(cfg)
        os.makedirs(work, exist_ok=True)
        with output_lock(work):
            try:
                results, timing = _process(cfg, urls, fields, work, log)
                order, skips = assign_ids(results)
                check_truncation(skips, sum(r.num_read for r in results), cfg.max_truncated_share, cfg.input)
                if not order:
                    reasons = ", ".join(f"{k}: {v}" for k, v in Counter(s["reason"] for s in skips).items())
                    raise ValueError(f"{cfg.input}: no valid sample in {len(urls)} raw shard(s) "
                                     f"({reasons or 'empty'})")
                start = time.monotonic()
                shards = _write_shards(cfg, fields, results, order)
                timing.update(write_s=round(time.monotonic() - start, 3), num_shards=len(shards))
            except BaseException:
                log.warning("precompute: processed raw shards are kept in %s; a rerun into %s resumes from them",
                            work, cfg.out)
                raise
            shutil.rmtree(work, ignore_errors=True)
        if not cfg.tmp_dir and files.is_local(cfg.out):
            _remove_empty_dir(os.path.dirname(work))  # OUT/_tmp; never a shared or system temp folder
        remove_stale_shards(cfg.out, len(shards))
        dataset = TrainDataset(len(order), fields, shards, cfg.samples_per_shard, cfg.input, cfg.model,
                               _extra(cfg, fields), root=cfg.out)
        files.write_json_atomic(files.join(cfg.out, DATASET_JSON), dataset.to_json())
        files.write_text_atomic(files.join(cfg.out, "skipped.jsonl"),
                                "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in skips))
        _record(rec, cfg, urls, results, order, skips, timing)
        rec.outputs["train"] = cfg.out
        log.info("precompute: kept %d of %d samples (%d skipped) in %d shards, %.1f samples/s",
                 len(order), rec.counts["num_read"], len(skips), len(shards), rec.counts["samples_per_s"])
    return rec.result()


def _process(cfg: PrecomputeConfig, urls: list[str], fields: list[Field], work: str,
             log) -> tuple[list[precompute_worker.ShardResult], dict]:
    """Every raw shard's result in URL order: reused from ``work`` if finished earlier, else processed."""
    key = resume.process_key(cfg)
    done = resume.load(work, urls, key, fields)
    if done:
        log.info("precompute: resuming: %d of %d raw shards were processed by an earlier run", len(done), len(urls))
    side = fields[0].shape[0] if fields[0].role == "image" else 0
    tasks = [precompute_worker.ShardTask(i, u, resume.stem(work, u), side, cfg.resize_mode,
                                         cfg.max_image_pixels, cfg.caption_ext)
             for i, u in enumerate(urls) if i not in done]
    workers = max(1, min(cfg.num_workers or len(os.sched_getaffinity(0)), len(tasks)))
    log.info("precompute: processing %d of %d raw shards with %d workers -> %s", len(tasks), len(urls), workers,
             cfg.out)
    start = time.monotonic()
    resumed = sum(r.num_read for r in done.values())
    with counter(promised_samples(urls), desc="precompute", unit="samples") as count:
        count.advance(resumed)
        fresh = _process_all(tasks, workers, lambda r: resume.save(work, r, key), count)
    timing = {"process_s": round(time.monotonic() - start, 3), "num_workers": workers,
              "num_resumed_raw_shards": len(done), "num_resumed_samples": resumed}
    return sorted([*done.values(), *fresh], key=lambda r: r.index), timing


def _remove_stale_scratch(cfg: PrecomputeConfig, log) -> None:
    """Delete the ``precompute-*`` scratch folders of killed runs (OUT/_tmp's all: we hold OUT's lock)."""
    if cfg.tmp_dir:
        parent: str | None = cfg.tmp_dir
    elif files.is_local(cfg.out):
        parent = os.path.join(files.local_path(cfg.out), "_tmp")
    else:
        parent = tempfile.gettempdir()
    whole = not cfg.tmp_dir and files.is_local(cfg.out)
    for name in files.remove_stale_temp_dirs(parent, "precompute-", whole):
        log.info("precompute: removed %s left by a run that was killed", name)


def _remove_empty_dir(path: str) -> None:
    try:
        os.rmdir(path)  # only succeeds when empty: a concurrent run's scratch stays
    except OSError:
        pass


def _extra(cfg: PrecomputeConfig, fields: list[Field]) -> dict:
    """Provenance the loader does not need but users and the trainer may: towers, resize mode."""
    extra: dict = {"resize_mode": cfg.resize_mode}
    state = precompute_worker.STATE
    if state.get("image_tower") is not None:
        t = state["image_tower"]
        extra["image_tower"] = {"kind": cfg.image_tower, "name": t.name, "dim": t.dim, "image_size": t.image_size,
                                "mean": list(t.mean), "std": list(t.std), "weights": cfg.image_tower_weights}
    else:
        extra["image_size"] = fields[0].shape[0]
    if state.get("text_tower") is not None:
        t = state["text_tower"]
        extra["text_tower"] = {"kind": cfg.text_tower, "name": t.name, "dim": t.dim,
                               "context_length": t.context_length, "weights": cfg.text_tower_weights}
    else:
        extra["context_length"] = fields[1].shape[0]
        extra["vocab_size"] = integrity.tokenizer_vocab_size(state["tokenizer"])  # the loader's token-id bound
    return extra
