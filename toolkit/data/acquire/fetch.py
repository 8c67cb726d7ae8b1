"""``toolkit data fetch``: download a URL list into raw webdataset shards with img2dataset.

img2dataset does the downloading, resizing and writing (:mod:`.fetch_worker` runs it in a subprocess);
this module validates the URL list, decides which shards are already finished (rerunning resumes:
finished shards are never downloaded again), watches progress, and writes the summary of successes and
failures by reason plus the throughput into the stage manifest (``counts`` and ``details``).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

import toolkit
from toolkit.core import files
from toolkit.core.config import config_hash, option, to_dict
from toolkit.core.log import get_logger, progress
from toolkit.core.stage import StageResult, fingerprint, read_manifest, stage_run
from toolkit.data.acquire import urllist
from toolkit.data.acquire.urllist import check_url_list, detect_format
from toolkit.data.raw import layout, reasons

KIND = "data.fetch"
log = get_logger("data.fetch")

InputFormat = Literal["auto", "txt", "csv", "tsv", "parquet", "jsonl", "json",
                      "txt.gz", "csv.gz", "tsv.gz", "jsonl.gz", "json.gz"]
ResizeMode = Literal["border", "center_crop", "keep_ratio", "keep_ratio_largest", "no"]
Distributor = Literal["multiprocessing", "pyspark", "ray"]
# Lines of worker output kept for the error message when the worker fails.
ERROR_TAIL_LINES = 40
# Seconds between SIGTERM and SIGKILL when a run exceeds run_timeout_s.
KILL_GRACE_S = 5.0


@dataclass(frozen=True)
class FetchConfig:
    urls: str = option(doc="URL list (csv, tsv, parquet, jsonl, json or txt, optionally .gz; local or fsspec URL), "
                           "or a folder of such files.", is_input=True)
    out: str = option(doc="Output folder (local or fsspec URL) for the raw shards and the manifest.")
    input_format: InputFormat = option("auto", doc="Format of the URL list; 'auto' reads it from the extension.")
    url_col: str = option("url", doc="Column holding the image URL (not used for txt lists: one URL a line).")
    caption_col: str = option("caption", doc="Column holding the caption; '' for none (txt lists have none).")
    image_size: int = option(256, ge=1, doc="Target image side in pixels (see resize_mode).")
    resize_mode: ResizeMode = option("border", doc="img2dataset resize mode: border (fit, pad white), center_crop, "
                                                   "keep_ratio (shorter side), keep_ratio_largest, no.")
    resize_only_if_bigger: bool = option(False, doc="Only shrink images; never upscale smaller ones.")
    encode_quality: int = option(95, ge=1, le=100, doc="JPEG quality of the stored images.")
    min_image_size: int = option(0, ge=0, doc="Skip images whose shorter side is below this (reason image_too_small).")
    max_image_area: float | None = option(None, gt=0, doc="Skip images with more pixels than this (default: no limit).")
    max_aspect_ratio: float | None = option(None, ge=1, doc="Skip images whose long/short side ratio exceeds this.")
    strict_decode: bool = option(True, doc="Fully decode every image with Pillow first, rejecting truncated files "
                                           "and decompression bombs that OpenCV would accept or pad.")
    samples_per_shard: int = option(10000, ge=1, doc="URLs per shard; a shard is the unit of resume.")
    num_processes: int = option(1, ge=1, affects_output=False, doc="Download processes (distributor workers).")
    num_threads: int = option(32, ge=1, affects_output=False, doc="Download threads per process.")
    timeout_s: float = option(10.0, gt=0, affects_output=False,
                              doc="Per-request socket timeout: a dead or stalled host fails the URL as 'timeout'.")
    retries: int = option(0, ge=0, affects_output=False, doc="Extra attempts per failed URL.")
    max_shard_retry: int = option(1, ge=0, affects_output=False, doc="Extra attempts per shard that crashed.")
    distributor: Distributor = option("multiprocessing", affects_output=False,
                                      doc="img2dataset distributor: multiprocessing, or pyspark / ray for clusters.")
    subjob_size: int = option(1000, ge=1, affects_output=False, doc="Shards per pyspark job.")
    run_timeout_s: float | None = option(None, gt=0, affects_output=False,
                                         doc="Stop the whole run after this many seconds; finished shards stay and a "
                                             "rerun resumes (default: no limit).")
    overwrite: bool = option(False, affects_output=False,
                             doc="Delete the shards already in `out` first instead of resuming.")


# ---------------------------------------------------------------- resume bookkeeping


def _changed_fields(previous: dict, cfg: FetchConfig) -> list[str]:
    import dataclasses

    now = to_dict(cfg)
    return [f.name for f in dataclasses.fields(cfg) if f.metadata.get("affects_output", True)
            and previous.get("config", {}).get(f.name) != now[f.name]]


def check_resumable(cfg: FetchConfig, out: str) -> str:
    """Refuse to mix shards of another config or URL list into ``out`` (unless ``overwrite``).

    Returns the URL list's sha256 (reused from the last manifest when the file is untouched): a shard is
    identified by its rows' position in the list, so finished shards are only valid for the same bytes.
    """
    previous = read_manifest(out) or {}
    same_file = ((previous.get("inputs") or {}).get("urls") or {}).get("fingerprint") == fingerprint(cfg.urls)
    recorded = (previous.get("details") or {}).get("urls_sha256")
    digest = recorded if same_file and recorded else urllist.list_digest(cfg.urls)
    if cfg.overwrite or not layout.shard_files(out):
        return digest
    if not previous:
        log.warning("%s holds shards but no manifest; resuming on the assumption they come from %s", out, cfg.urls)
        return digest
    if previous.get("kind") != KIND:
        raise ValueError(f"{out} holds the output of a {previous.get('kind')!r} stage; choose another --out "
                         "or pass --overwrite to delete its shards")
    if previous.get("config_hash") != config_hash(cfg, KIND):
        changed = ", ".join(_changed_fields(previous, cfg)) or "config"
        raise ValueError(f"{out} holds shards fetched with different settings ({changed} changed); pass "
                         "--overwrite to delete them and fetch again, or choose another --out")
    if recorded and recorded != digest:
        raise ValueError(f"{cfg.urls} changed since {out} was fetched from it (its rows decide which shard "
                         "holds which URL); pass --overwrite to fetch again, or choose another --out")
    return digest


def verified_shards(rec, out: str) -> set[int]:
    """Finished shards whose tar, parquet and stats agree; the others are deleted to be fetched again.

    Each redone shard and why is logged and recorded (``details.shards_redone``, ``counts.num_shards_redone``):
    a shard left half-written by an interrupted run, or damaged by a second run or a full disk.
    """
    from toolkit.data.raw.verify import check_shard

    present = layout.shard_files(out)
    redo = {i: f"unfinished: only {', '.join(sorted(kinds))} written" for i, kinds in present.items()
            if not {".tar", ".parquet", "_stats.json"} <= kinds}
    for shard_id in sorted(set(present) - set(redo)):
        why = check_shard(out, shard_id, deep=files.is_local(out))
        if why is not None:
            redo[shard_id] = why
    for shard_id, why in sorted(redo.items()):
        log.warning("fetch: shard %s is fetched again: %s", layout.shard_stem(shard_id), why)
        layout.remove_shard(out, shard_id)
    rec.details["shards_redone"] = {layout.shard_stem(i): why for i, why in sorted(redo.items())}
    rec.counts["num_shards_redone"] = len(redo)
    return set(present) - set(redo)


def worker_spec(cfg: FetchConfig, fmt: str, caption_col: str | None, out: str, done: set[int]) -> dict[str, Any]:
    """The JSON document ``fetch_worker`` reads."""
    spec = {k: v for k, v in to_dict(cfg).items() if k not in ("urls", "out", "input_format", "caption_col")}
    return {**spec, "url_list": layout.absolute(cfg.urls), "input_format": fmt, "caption_col": caption_col,
            "output_folder": out, "tmp_path": f"{out}/_tmp", "done_shards": sorted(done)}


# ---------------------------------------------------------------- the worker process


class WorkerRun:
    """Runs ``fetch_worker`` in its own process group; yields its events; kills it on timeout."""

    def __init__(self, spec: dict, run_timeout_s: float | None, lock_fd: int | None = None):
        fd, self.spec_path = tempfile.mkstemp(prefix="cliptk-fetch-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(spec, fh)
        # The folder holding this very toolkit package, so the worker imports the same tree as its parent.
        root = os.path.dirname(os.path.dirname(os.path.abspath(toolkit.__file__)))
        env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "toolkit.data.acquire.fetch_worker", self.spec_path], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace", env=env,
            start_new_session=True,
            # the worker holds the output lock too: if this process dies first, the folder stays locked
            # until the worker writing into it is gone as well
            pass_fds=(lock_fd,) if lock_fd is not None else ())
        self.tail: collections.deque[str] = collections.deque(maxlen=ERROR_TAIL_LINES)
        self.timed_out = False
        self.timer = threading.Timer(run_timeout_s, self._on_timeout) if run_timeout_s else None
        if self.timer:
            self.timer.daemon = True
            self.timer.start()

    def _on_timeout(self) -> None:
        self.timed_out = True
        self.kill()

    def kill(self) -> None:
        """SIGTERM the worker's process group (img2dataset's pool included), SIGKILL after a grace period."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(KILL_GRACE_S)
                return
            except subprocess.TimeoutExpired:
                continue

    def events(self):
        """Parsed events from the worker's stdout; other lines go to the debug log and the error tail."""
        from toolkit.data.acquire.fetch_worker import EVENT_PREFIX

        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            for part in line.rstrip("\n").split("\r"):  # tqdm redraws with carriage returns
                if part.startswith(EVENT_PREFIX):
                    yield json.loads(part[len(EVENT_PREFIX):])
                elif part.strip():
                    self.tail.append(part)
                    log.debug("img2dataset: %s", part)

    def close(self) -> int:
        if self.timer:
            self.timer.cancel()
        if self.proc.poll() is None:
            try:
                code = self.proc.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                self.kill()
                code = self.proc.wait()
        else:
            code = self.proc.returncode
        os.unlink(self.spec_path)
        return code


def download(spec: dict, run_timeout_s: float | None, lock_fd: int | None = None) -> dict[str, Any]:
    """Run the worker with progress over shards; returns the number of shards planned and if it timed out."""
    worker = WorkerRun(spec, run_timeout_s, lock_fd)
    planned = 0
    try:
        events = worker.events()
        for event in events:
            if "plan" in event:
                planned = event["plan"]["num_shards"]
                log.info("fetch: %d shards to download (%d already finished)", planned, len(spec["done_shards"]))
                break
        for _ in progress(_first_attempts(events, worker), total=planned, desc="fetch", unit="shards"):
            pass
    except BaseException:
        worker.kill()
        raise
    finally:
        code = worker.close()
    if code != 0 and not worker.timed_out:
        last = worker.tail[-1] if worker.tail else "no output"
        tail = "\n".join(worker.tail)
        raise RuntimeError(f"img2dataset worker exited with code {code}: {last}\n--- output tail:\n{tail}")
    return {"num_shards_planned": planned, "timed_out": worker.timed_out}


def _first_attempts(events, worker: WorkerRun):
    """Shard events, each shard once (img2dataset retries failed shards); failures are logged with why."""
    seen: set[int] = set()
    for event in events:
        if "shard" not in event:
            continue
        if not event["ok"]:
            why = worker.tail[-1] if worker.tail else "no output"
            log.warning("fetch: shard %s failed (%s); img2dataset retries it max_shard_retry times", event["shard"], why)
        if event["shard"] not in seen:
            seen.add(event["shard"])
            yield event


# ---------------------------------------------------------------- the stage


def run(cfg: FetchConfig) -> StageResult:
    """Fetch ``cfg.urls`` into ``cfg.out``; resume finished shards; summary in the manifest.

    Raises FileNotFoundError/ValueError for a bad URL list (naming file and column), RuntimeError when no
    image was downloaded at all or shards are left unfinished (rerun to resume them).
    """
    _check_distributor(cfg.distributor)
    fmt = detect_format(cfg.urls, cfg.input_format)
    caption_col = check_url_list(cfg.urls, fmt, cfg.url_col, cfg.caption_col)
    out = layout.absolute(cfg.out)
    digest = check_resumable(cfg, out)
    with stage_run(KIND, cfg, cfg.out) as rec:
        rec.outputs["shards"] = cfg.out
        rec.details["urls_sha256"] = digest
        rec.write()  # recorded before downloading, so even a killed run's shards can be checked on resume
        if cfg.overwrite:
            log.info("fetch: --overwrite: removed %d shard files from %s", layout.remove_shards(out), out)
        done_before = verified_shards(rec, out)
        if layout.remove_tmp(out):  # a failed run leaves img2dataset's _tmp/ behind: start clean
            log.info("fetch: removed %s/_tmp left by an interrupted run", out)
        start = time.monotonic()
        outcome = download(worker_spec(cfg, fmt, caption_col, out, done_before), cfg.run_timeout_s, rec.lock_fd)
        wall_s = time.monotonic() - start
        summary = _record(rec, out, done_before, outcome, wall_s)
        _report(summary)
        _raise_if_incomplete(cfg, summary, outcome)
    return rec.result()


def _check_distributor(name: str) -> None:
    """pyspark and ray are optional cluster dependencies: say so before starting anything."""
    import importlib.util

    if name != "multiprocessing" and importlib.util.find_spec(name) is None:
        raise ValueError(f"distributor {name!r} needs the {name} package (pip install {name}); "
                         "or use --distributor multiprocessing")


def _record(rec, out: str, done_before: set[int], outcome: dict, wall_s: float) -> dict[str, Any]:
    stats = layout.read_stats(out)
    total = reasons.summarize(stats)
    new = reasons.summarize({i: s for i, s in stats.items() if i not in done_before})
    num_unfinished = max(0, outcome["num_shards_planned"] - len(set(stats) - done_before))
    rec.counts.update({
        "num_urls": total["num_samples"], "num_success": total["num_success"], "num_failed": total["num_failed"],
        "failed_by_reason": total["failed_by_reason"], "num_shards": len(stats),
        "num_shards_resumed": len(done_before & set(stats)), "num_shards_unfinished": num_unfinished,
    })
    rec.details.update({
        "this_run": {"num_urls": new["num_samples"], "num_success": new["num_success"],
                     "failed_by_reason": new["failed_by_reason"], "wall_s": round(wall_s, 3),
                     "urls_per_s": round(new["num_samples"] / wall_s, 2) if wall_s > 0 else None,
                     "success_per_s": round(new["num_success"] / wall_s, 2) if wall_s > 0 else None,
                     # first shard start to last shard end: the rate without process start-up and imports
                     "download_s": new["span_s"],
                     "download_urls_per_s": round(new["num_samples"] / new["span_s"], 2) if new["span_s"] else None},
        "error_messages": total["messages"], "timed_out": outcome["timed_out"],
    })
    return {**rec.counts, **rec.details}


def _report(summary: dict[str, Any]) -> None:
    this = summary["this_run"]
    failures = ", ".join(f"{k} {v}" for k, v in summary["failed_by_reason"].items()) or "none"
    log.info("fetch: %d URLs, %d ok, %d failed (%s); %d shards (%d resumed)", summary["num_urls"],
             summary["num_success"], summary["num_failed"], failures, summary["num_shards"],
             summary["num_shards_resumed"])
    log.info("fetch: this run %d URLs in %.1f s = %s URLs/s (%s images/s stored); downloading alone %.1f s = "
             "%s URLs/s", this["num_urls"], this["wall_s"], this["urls_per_s"], this["success_per_s"],
             this["download_s"], this["download_urls_per_s"])


def _raise_if_incomplete(cfg: FetchConfig, summary: dict[str, Any], outcome: dict) -> None:
    if outcome["timed_out"]:
        raise RuntimeError(f"fetch stopped after run_timeout_s={cfg.run_timeout_s}; "
                           f"{summary['num_shards']} shards finished; rerun the same command to resume")
    if summary["num_shards_unfinished"]:
        raise RuntimeError(f"{summary['num_shards_unfinished']} shards did not finish (see log.jsonl); "
                           "rerun the same command to resume them")
    if summary["num_success"] == 0:
        failures = ", ".join(f"{k}: {v}" for k, v in summary["failed_by_reason"].items()) or "no URLs in the list"
        raise RuntimeError(f"no image downloaded from {cfg.urls} ({summary['num_urls']} URLs; {failures})")
