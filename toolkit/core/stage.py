"""Stage bookkeeping shared by every ``run(cfg)``: manifest.json, resolved config, JSON-lines log.

Every stage writes into its output directory ``out``:
- ``config.yaml``: the resolved config;
- ``manifest.json``: kind, status (running/done/failed/interrupted, or an outcome such as preempted), config
  hash, input fingerprints, outputs, counts, details, start/end time, error;
- ``log.jsonl``: every toolkit log record emitted while the stage ran;
- ``.lock``: held while the stage runs (:mod:`toolkit.core.outlock`), so a second run into the folder fails.
The pipeline runner skips a stage whose manifest says done with the same config hash and inputs.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import os
import re
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from toolkit import __version__
from toolkit.core import files
from toolkit.core.config import ConfigError, config_hash, dump_yaml, input_paths, to_dict
from toolkit.core.leftovers import remove_dead_temps
from toolkit.core.log import get_logger, jsonl_log
from toolkit.core.outlock import output_lock
from toolkit.core.pathguard import check_output_apart, check_url_schemes

MANIFEST = "manifest.json"
# Directory fingerprints stat at most this many files: enough for shard folders, bounded for huge trees.
MAX_FINGERPRINT_FILES = 100_000
# Stage kinds whose output folder a stage may take over: fetch --overwrite replaces a data.shard's shards
# (fetch checks its own cases first). Any other stage's manifest in --out means another stage's folder.
_MAY_TAKE_OVER = {"data.fetch": ("data.shard",)}
# Path -> fingerprint inside a ``fingerprints_once()`` block (None outside one: always measure).
_MEASURED: ContextVar[dict[str, str] | None] = ContextVar("toolkit_fingerprints", default=None)


@dataclasses.dataclass
class StageResult:
    """What ``run(cfg)`` returns: output paths by key, counts, and where the manifest is."""

    out: str
    outputs: dict[str, str]
    counts: dict[str, Any]
    config_hash: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    status: str = "done"  # or an outcome the stage reports short of done ("preempted": rerun to continue)


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


@contextmanager
def fingerprints_once() -> Iterator[None]:
    """Measure each path's fingerprint at most once inside the block.

    The pipeline wraps one stage's up-to-date check and its run in this, so the inputs that
    :func:`up_to_date` measured are what :class:`StageRecorder` records, without walking a large
    input folder a second time. Keep a block to one stage: an earlier stage may change a later one's inputs.
    :func:`stage_run` forgets the measurements once its recorder has them, so a stage run nested in
    another one measures afresh.
    """
    token = _MEASURED.set({})
    try:
        yield
    finally:
        _MEASURED.reset(token)


def fingerprint(path: str) -> str:
    """A string that changes when the data at ``path`` changes (missing paths give 'missing')."""
    measured = _MEASURED.get()
    if measured is None:
        return _measure(path)
    if path not in measured:
        measured[path] = _measure(path)
    return measured[path]


def _measure(path: str) -> str:
    if not files.exists(path):
        return "missing"
    m = read_manifest(path)  # a stage's output folder: its manifest says when it changed
    if m is not None:
        key = [m.get("config_hash"), m.get("finished_at"), m.get("outputs")]
        return "manifest:" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    if not files.is_local(path):
        import fsspec

        fs, p = fsspec.core.url_to_fs(path)
        info = fs.info(p)
        return (
            f"remote:{info.get('size')}:{info.get('mtime') or info.get('LastModified') or info.get('ETag')}"
        )
    local = files.local_path(path)
    if os.path.isfile(local):
        st = os.stat(local)
        return f"file:{st.st_size}:{st.st_mtime_ns}"
    digest, num_files = hashlib.sha256(), 0
    for root, dirs, names in os.walk(local):
        dirs.sort()
        for name in sorted(names):
            st = os.stat(os.path.join(root, name))
            digest.update(
                f"{os.path.relpath(os.path.join(root, name), local)}:{st.st_size}:{st.st_mtime_ns};".encode()
            )
            num_files += 1
            if num_files >= MAX_FINGERPRINT_FILES:
                return f"dir:{digest.hexdigest()[:16]}+"
    return f"dir:{digest.hexdigest()[:16]}"


def read_manifest(out: str) -> dict | None:
    path = files.join(out, MANIFEST)
    if not files.exists(path):
        return None
    try:
        return files.read_json(path)
    except (OSError, ValueError):
        return None


def up_to_date(kind: str, cfg: Any, out: str) -> tuple[bool, str]:
    """(True, why) when ``out`` holds a done manifest for this kind, config hash and inputs."""
    m = read_manifest(out)
    if m is None:
        return False, "no manifest"
    if m.get("status") != "done":
        return False, f"last run {m.get('status')}"
    if m.get("kind") != kind or m.get("config_hash") != config_hash(cfg, kind):
        return False, "config changed"
    current = {k: fingerprint(p) for k, p in input_paths(cfg).items()}
    recorded = {k: v.get("fingerprint") for k, v in (m.get("inputs") or {}).items()}
    if current != recorded:
        changed = sorted(k for k in set(current) | set(recorded) if current.get(k) != recorded.get(k))
        return False, f"inputs changed: {', '.join(changed)}"
    return True, "up to date"


class StageRecorder:
    """Collects outputs/counts/details during a stage; ``result()`` builds the :class:`StageResult`."""

    def __init__(self, kind: str, cfg: Any, out: str):
        self.kind, self.cfg, self.out = kind, cfg, out
        self.hash = config_hash(cfg, kind)
        self.outputs: dict[str, str] = {}
        self.lock_fd: int | None = None  # set by stage_run: the output lock's descriptor (None: not locked)
        self.counts: dict[str, Any] = {}
        self.details: dict[str, Any] = {}
        self.status = "done"  # what the manifest records when the body returns (a stage may set another)
        self.manifest: dict[str, Any] = {
            "kind": kind,
            "status": "running",
            "config_hash": self.hash,
            "toolkit_version": __version__,
            "config": to_dict(cfg),
            "started_at": _now(),
            "finished_at": None,
            "duration_s": None,
            "inputs": {k: {"path": p, "fingerprint": fingerprint(p)} for k, p in input_paths(cfg).items()},
            "outputs": {},
            "counts": {},
            "details": {},
            "error": None,
        }

    def write(self, **updates: Any) -> None:
        self.manifest.update(updates, outputs=self.outputs, counts=self.counts, details=self.details)
        files.write_json_atomic(files.join(self.out, MANIFEST), self.manifest)

    def result(self) -> StageResult:
        return StageResult(
            self.out, dict(self.outputs), dict(self.counts), self.hash, dict(self.details), self.status
        )


class OutputNotOurs(ConfigError):
    """The output folder holds another stage's output or files the stage did not write (exit code 2)."""


def check_out_owner(kind: str, out: str, owned: re.Pattern[str] | None = None) -> None:
    """Refuse (:class:`OutputNotOurs`, naming the folder and the culprit) an ``out`` whose manifest.json is
    another stage kind's (a raw set, a training set, a run: its manifest, config.yaml and log.jsonl would be
    overwritten) or not a stage manifest at all, and one without a manifest of ``kind`` that holds file
    names matching ``owned`` (the names the stage writes and deletes, e.g. precompute's ``NNNNN.tar``):
    they are someone else's. Called by :func:`stage_run` before anything is written (``owned`` from stages
    that delete or replace files by name)."""
    if not files.is_local(out) or not os.path.isdir(files.local_path(out)):
        return
    local = files.local_path(out)
    m, has_manifest = read_manifest(out), os.path.lexists(os.path.join(local, MANIFEST))
    found = m.get("kind") if isinstance(m, dict) else None
    if has_manifest and found != kind and found not in _MAY_TAKE_OVER.get(kind, ()):
        who = f"the output of a {found!r} stage" if found else "a manifest.json no cliptk stage wrote"
        raise OutputNotOurs(
            kind,
            "out",
            f"{out} holds {who} ({os.path.join(local, MANIFEST)}); writing a "
            f"{kind} here would overwrite its manifest, config and log: choose another folder",
        )
    if found == kind or owned is None:
        return
    theirs = sorted(n for n in os.listdir(local) if owned.fullmatch(n))
    if theirs:
        raise OutputNotOurs(
            kind,
            "out",
            f"{out} holds {len(theirs)} file(s) named like {kind}'s output (e.g. "
            f"{theirs[0]}) but no {kind} manifest: they are not {kind}'s to replace or delete; "
            "choose an empty folder or move them away",
        )


class UnfinishedInput(ConfigError):
    """An input folder's own manifest says the stage that wrote it did not finish (exit code 2)."""


def check_input_finished(kind: str, key: str, path: str, allow_flag: str, allowed: bool = False) -> None:
    """Refuse (:class:`UnfinishedInput`) input folder ``path`` when its manifest.json says the stage that
    wrote it did not finish (failed, interrupted, running): reading it would silently use part of the set.
    ``allow_flag`` is the option that accepts it (``allowed``: given; then a warning says what is used)."""
    if not files.is_local(path) or not os.path.isdir(files.local_path(path)):
        return  # a file, a glob or a URL: the shards were chosen one by one
    m = read_manifest(path)
    status = m.get("status") if isinstance(m, dict) else None
    if status is None or status == "done":
        return
    error = str(m.get("error") or "").splitlines()[0][:200] if m.get("error") else ""
    what = f"{path}: its manifest.json says the {m.get('kind', 'stage')} that wrote it is {status!r}" + (
        f" ({error})" if error else ""
    )
    if allowed:
        get_logger("stage").warning("%s: %s; only what it finished is read (%s)", kind, what, allow_flag)
        return
    raise UnfinishedInput(
        kind,
        key,
        f"{what}, so only part of its samples are there; rerun that stage to finish "
        f"it, or pass {allow_flag} to use what it finished",
    )


@contextmanager
def stage_run(kind: str, cfg: Any, out: str, owned: re.Pattern[str] | None = None) -> Iterator[StageRecorder]:
    """Wrap a stage body: writes config.yaml and a running manifest, then done or failed (re-raising).

    Called by every stage's ``run(cfg)`` on the process that owns ``out`` (rank 0 in distributed runs).
    A local ``out`` is locked for the whole stage (:mod:`toolkit.core.outlock`): a second run into the
    same folder raises :class:`~toolkit.core.outlock.OutputLocked` before anything is written, naming the
    run that holds it. ``rec.lock_fd`` is the lock's descriptor, for worker processes that must hold it too.
    An ``out`` that is one of the config's inputs, holds one or lies inside one is refused first
    (:class:`~toolkit.core.pathguard.OutputIsInput`), however either is spelled, and so is an ``out`` that
    holds another stage's manifest, or files named as in ``owned`` without a manifest of ``kind``
    (:func:`check_out_owner`).
    """
    check_url_schemes(kind, {**input_paths(cfg), "out": out})
    check_output_apart(kind, out, input_paths(cfg))
    check_out_owner(kind, out, owned)
    files.makedirs(out)
    with output_lock(out) as lock_fd:
        if lock_fd is not None:  # the lock is ours: temps of writers that are gone are a killed run's
            removed = remove_dead_temps(files.local_path(out))
            if removed:
                get_logger("stage").info(
                    "%s: removed %d temp file(s) a killed run left in %s: %s",
                    kind,
                    len(removed),
                    out,
                    ", ".join(removed[:10]) + (" ..." if len(removed) > 10 else ""),
                )
        files.write_text_atomic(files.join(out, "config.yaml"), dump_yaml(cfg))
        rec = StageRecorder(kind, cfg, out)
        rec.lock_fd = lock_fd
        measured = _MEASURED.get()
        if measured is not None:  # the check's measurements served this recorder; the body may change inputs
            measured.clear()
        rec.write()
        with jsonl_log(files.join(out, "log.jsonl")) if files.is_local(out) else _nullcontext():
            yield from _recorded(rec, kind)


class StageInterrupted(RuntimeError):
    """A stage stopped on a signal (SIGTERM, SIGINT, SLURM's SIGUSR1); its manifest says "interrupted", not
    "failed", and the message says what was kept and how to continue. ``signum``: the signal, when known
    (the command then exits 128 + it, as a shell expects)."""

    def __init__(self, message: str, signum: int | None = None):
        super().__init__(message)
        self.signum = signum


def settle_manifest(out: str, err: BaseException) -> None:
    """After a job's processes ended with ``err``: a manifest in ``out`` that still says running (its writer
    was killed, or stopped by torchrun inside a collective, before it could record why), or interrupted while
    the job failed (another rank's failure), says failed or interrupted with ``err``; one that says failed
    with a rank's own error (perhaps the symptom: gloo's "connection closed by peer" on rank 0 after rank 1
    was killed) gets the launcher's first failure in front of it. Called by a launcher (precompute's), which
    outlives its ranks."""
    m = read_manifest(out)
    status = m.get("status") if isinstance(m, dict) else None
    why = f"{type(err).__name__}: {describe_error(err)}"
    if status == "failed" and status_of(err) == "failed":
        if why in str(m.get("error")):
            return
        m["error"] = f"{why}; a rank recorded: {m.get('error')}"
    # a rank that torchrun stopped with SIGTERM because another rank failed recorded "interrupted": the
    # launcher knows better
    elif not (status == "running" or (status == "interrupted" and status_of(err) == "failed")):
        return
    else:
        m.update(status=status_of(err), finished_at=_now(), error=why)
    try:
        files.write_json_atomic(files.join(out, MANIFEST), m)
    except OSError as write_err:
        get_logger("stage").warning(
            "could not record %s in %s (%s)", m["status"], files.join(out, MANIFEST), write_err
        )


def status_of(err: BaseException) -> str:
    """The manifest status of a stage that raised ``err``: interrupted (a signal) or failed."""
    return "interrupted" if isinstance(err, (StageInterrupted, KeyboardInterrupt)) else "failed"


def describe_error(err: BaseException) -> str:
    """A one-line description of why a stage stopped; never empty (Ctrl-C's KeyboardInterrupt has no text)."""
    if isinstance(err, KeyboardInterrupt):  # SIGTERM/SIGHUP raise one that says which (toolkit.core.procs)
        return str(err) or "interrupted (Ctrl-C or SIGINT); finished work is kept, rerun to resume"
    if isinstance(err, SystemExit):
        return f"exited with code {err.code}"
    return str(err) if str(err).strip() else f"{type(err).__name__} (no message)"


def _recorded(rec: StageRecorder, kind: str) -> Iterator[StageRecorder]:
    """Yield ``rec`` to the stage body; record ``rec.status`` (done unless the body set another outcome), or
    failed / interrupted with the error (re-raised)."""
    start = time.monotonic()
    try:
        yield rec
    except BaseException as err:
        status = status_of(err)
        if status == "failed":
            get_logger("stage").error("%s failed: %s", kind, describe_error(err))
        else:
            get_logger("stage").warning("%s stopped: %s", kind, describe_error(err))
        try:
            rec.write(
                status=status,
                finished_at=_now(),
                duration_s=round(time.monotonic() - start, 3),
                error=f"{type(err).__name__}: {describe_error(err)}",
                traceback=traceback.format_exc(limit=20),
            )
        except OSError as write_err:  # a full disk: the stage's own error stays the one reported
            get_logger("stage").warning(
                "%s: could not record %s in %s (%s)", kind, status, files.join(rec.out, MANIFEST), write_err
            )
        raise
    rec.write(status=rec.status, finished_at=_now(), duration_s=round(time.monotonic() - start, 3))


@contextmanager
def _nullcontext() -> Iterator[None]:
    yield
