"""Trainer checkpoints: ``CKPT_DIR/step-NNNNNNNN/`` (default ``RUN_DIR/checkpoints``, or any fsspec URL).

A checkpoint directory is a plain open_clip ``local-dir:`` model plus the trainer's state:

- ``open_clip_config.json`` + ``open_clip_model.safetensors``: the model (``toolkit.models.weights``);
- ``trainer.json``: step (global batches consumed), samples seen, counters, world size at save time, the
  hash of the output-affecting config and that config itself (a refused resume names the keys that differ);
- ``optimizer.pt``: the optimiser's (and GradScaler's) state dict;
- ``loss_state.safetensors``: the objective's per-sample state (FastCLIP's u/τ tables as [N] columns,
  independent of the number of ranks and nodes); absent when the objective has none;
- ``checkpoint.json``: the manifest (size and sha256 of every other file), written last.

Writing: rank 0 serialises everything to bytes in memory (the only part the training waits for), then a
background thread writes the files: locally into a temporary sibling that is renamed into place; on an
object store straight into the directory with the manifest uploaded last. Either way a directory
without a manifest, or whose files do not match it, is never loaded (a warning names the file) and the
previous complete one is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

import fsspec

from toolkit.core import files
from toolkit.core.log import get_logger

CHECKPOINTS = "checkpoints"
MANIFEST = "checkpoint.json"
TRAINER = "trainer.json"
OPTIMIZER = "optimizer.pt"
LOSS_STATE = "loss_state.safetensors"
FORMAT = "cliptk-checkpoint-v1"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
NONFINITE_SUFFIX = ".nonfinite"  # checkpoints written during the non-finite steps that aborted a run


class CheckpointInvalid(ValueError):
    """A checkpoint directory is incomplete or damaged; the message names the file."""


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def _fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(files.local_path(url) if files.is_local(url) else url)


def _join(root: str, name: str) -> str:
    return files.join(root, name)


def manifest_for(blobs: dict[str, bytes], step: int) -> bytes:
    meta = {
        name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in blobs.items()
    }
    return json.dumps({"format": FORMAT, "step": step, "files": meta}, indent=2).encode()


def verify(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete, undamaged checkpoint; CheckpointInvalid naming the first bad file (or the
    folder itself: not found, not a folder, unreadable)."""
    root = str(directory)
    fs, path = _fs(root)
    _check_folder(fs, path, root)
    manifest_path = _join(root, MANIFEST)
    if not fs.isfile(_join(path, MANIFEST)):
        raise CheckpointInvalid(f"{manifest_path}: missing (the checkpoint was not completed)")
    try:
        with fs.open(_join(path, MANIFEST), "rb") as fh:
            manifest = json.loads(fh.read())
        entries = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointInvalid(f"{manifest_path}: unreadable manifest: {err}") from err
    for name, meta in entries.items():
        _verify_file(fs, _join(path, name), _join(root, name), meta)
    return manifest


def _check_folder(fs: fsspec.AbstractFileSystem, path: str, root: str) -> None:
    """A checkpoint folder that does not exist or cannot be listed is reported as such (listing it as
    empty made an unreadable folder look like an unfinished checkpoint: 'checkpoint.json: missing')."""
    if not fs.exists(path):
        raise CheckpointInvalid(f"{root}: not found")
    if not fs.isdir(path):
        raise CheckpointInvalid(f"{root}: not a checkpoint folder (a file)")
    if files.is_local(root):
        try:
            os.listdir(path)
            os.stat(os.path.join(path, MANIFEST))
        except FileNotFoundError:
            pass
        except PermissionError as err:
            raise CheckpointInvalid(
                f"{root}: unreadable ({err.strerror}): give this user read access to it, "
                "or move it out of the checkpoint folder"
            ) from err


def _verify_file(fs: fsspec.AbstractFileSystem, f: str, shown: str, meta: dict) -> None:
    if not fs.isfile(f):
        raise CheckpointInvalid(f"{shown}: missing")
    size = fs.size(f)
    if size != meta["bytes"]:
        raise CheckpointInvalid(f"{shown}: {size} bytes, the manifest says {meta['bytes']}")
    try:
        digest = files.file_sha256(f, fs=fs)
    except OSError as err:
        raise CheckpointInvalid(f"{shown}: unreadable ({err.strerror or err})") from err
    if digest != meta["sha256"]:
        raise CheckpointInvalid(f"{shown}: checksum does not match the manifest")


def list_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, directory) of every step-N directory under ``ckpt_dir``, newest first."""
    fs, path = _fs(ckpt_dir)
    if not fs.isdir(path):
        return []
    found = []
    for entry in fs.ls(path, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        if (m := _STEP_DIR.match(name)) and entry["type"] == "directory":
            found.append((int(m.group(1)), _join(ckpt_dir, name)))
    return sorted(found, reverse=True)


def latest_valid(ckpt_dir: str) -> str | None:
    """The newest checkpoint that verifies; each newer damaged one is reported with a warning."""
    log = get_logger("train.checkpoint")
    for _, path in list_checkpoints(ckpt_dir):
        try:
            verify(path)
            return path
        except CheckpointInvalid as err:
            log.warning("skipping checkpoint %s: %s", path.rsplit("/", 1)[-1], err)
    return None


def remove(path: str) -> None:
    """Delete a checkpoint folder, one its owner made unreadable included (``files.remove_tree``)."""
    if files.is_local(path):
        files.remove_tree(path)
        return
    fs, p = _fs(path)
    if fs.exists(p):
        fs.rm(p, recursive=True)


def remove_all(ckpt_dir: str) -> int:
    """Delete every checkpoint of a run (``resume: none``); returns how many."""
    found = list_checkpoints(ckpt_dir)
    for _, path in found:
        remove(path)
    return len(found)


def write_blobs(ckpt_dir: str, step: int, blobs: dict[str, bytes], keep: int) -> str:
    """Write checkpoint ``step`` from in-memory files (the manifest last, see module docstring) and delete
    the ones beyond the newest ``keep`` (``retire``). Returns its directory. Rank 0 only."""
    target = _join(ckpt_dir, step_name(step))
    manifest = manifest_for(blobs, step)
    if files.is_local(ckpt_dir):
        with files.replacing_dir(target) as tmp:
            for name, data in [*blobs.items(), (MANIFEST, manifest)]:
                _write_file(tmp / name, data)
    else:
        fs, path = _fs(target)
        if fs.exists(path):
            fs.rm(path, recursive=True)
        fs.makedirs(path, exist_ok=True)
        for name, data in [*blobs.items(), (MANIFEST, manifest)]:
            fs.pipe_file(_join(path, name), data)
    retire(ckpt_dir, keep)
    return target


def _write_file(path: Path, data: bytes) -> None:
    """Write and fsync one local file with os-level calls: the folder is renamed into place next, and a
    rename of unsynced data can leave empty files after a power cut."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _nonfinite_in_row(path: str) -> int | None:
    """The count of non-finite steps in a row a checkpoint was written after (None: unreadable)."""
    try:
        return int(read_trainer_state(path)["state"].get("nonfinite_in_row", 0))
    except (CheckpointInvalid, KeyError, TypeError, ValueError, AttributeError):
        return None


def retire(ckpt_dir: str, keep: int) -> None:
    """Delete the checkpoints beyond the newest ``keep``, except the newest one written after a finite step
    (``nonfinite_in_row`` 0 in its trainer.json): while steps are non-finite it is the one to go back to,
    and the later ones must not push it out. A folder that cannot be deleted is reported, not fatal: the
    new checkpoint is complete."""
    found = list_checkpoints(ckpt_dir)
    clean = next((path for _, path in found if _nonfinite_in_row(path) == 0), None)
    for _, old in found[keep:]:
        if old == clean:
            continue
        try:
            remove(old)
        except OSError as err:
            get_logger("train.checkpoint").warning("could not delete the old checkpoint %s: %s", old, err)


def set_aside_after(ckpt_dir: str, step: int) -> list[str]:
    """Rename every checkpoint newer than ``step`` to ``step-N.nonfinite`` (resume and retention no longer
    see them; the files stay for inspection). Returns the new names. Rank 0, after its writer finished."""
    moved = []
    for n, path in reversed(list_checkpoints(ckpt_dir)):
        if n > step:
            fs, p = _fs(path)
            fs.mv(p, p + NONFINITE_SUFFIX, recursive=True)
            moved.append(path + NONFINITE_SUFFIX)
    return moved


def last_at_or_before(ckpt_dir: str, step: int) -> str | None:
    """The newest checkpoint folder of a step <= ``step`` (not verified), or None."""
    return next((path for n, path in list_checkpoints(ckpt_dir) if n <= step), None)


class CheckpointWriteFailed(RuntimeError):
    """The background write of a checkpoint failed; the message names its folder and step and the newest
    checkpoint kept."""


def _write_failure(ckpt_dir: str, step: int, err: BaseException) -> CheckpointWriteFailed:
    earlier = [(s, p) for s, p in list_checkpoints(ckpt_dir) if s < step]
    kept = (
        f"the previous checkpoints are kept (newest: {earlier[0][1]}); rerun the same command after fixing "
        "this to resume from it"
        if earlier
        else "no earlier checkpoint exists"
    )
    why = f"[Errno {err.errno}] {err.strerror}" if isinstance(err, OSError) and err.strerror else f"{err}"
    return CheckpointWriteFailed(
        f"writing checkpoint step {step} to {_join(ckpt_dir, step_name(step))} failed: "
        f"{type(err).__name__}: {why}; {kept}"
    )


class AsyncWriter:
    """Writes one checkpoint at a time on a background thread; ``submit`` waits for the previous write
    (so at most one serialised checkpoint is held in memory), ``check`` raises a failed write without
    waiting (the loop calls it after every step, so a failure stops training at the next step instead of
    at the next checkpoint) and ``wait`` waits, then raises a failed write. Rank 0 only writes; the other
    ranks' writers stay idle."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: CheckpointWriteFailed | None = None

    def submit(self, ckpt_dir: str, step: int, blobs: dict[str, bytes], keep: int) -> None:
        self.wait()

        def work() -> None:
            try:
                path = write_blobs(ckpt_dir, step, blobs, keep)
                get_logger("train").info("checkpoint %s", path)
            except BaseException as err:  # noqa: BLE001 - raised on the training thread by check()/wait()
                self._error = _write_failure(ckpt_dir, step, err)
                self._error.__cause__ = err

        self._thread = threading.Thread(target=work, name=f"checkpoint-{step}", daemon=False)
        self._thread.start()

    def check(self) -> None:
        """Raise CheckpointWriteFailed if the last write has finished and failed; never blocks."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err


def read_bytes(directory: str, name: str) -> bytes:
    with files.open_file(_join(directory, name), "rb") as fh:
        return fh.read()


def read_trainer_state(directory: str) -> dict[str, Any]:
    try:
        return json.loads(read_bytes(directory, TRAINER))
    except (OSError, ValueError) as err:
        raise CheckpointInvalid(f"{_join(directory, TRAINER)}: unreadable: {err}") from err


def local_file(directory: str, name: str) -> tuple[str, bool]:
    """A local path of ``directory/name`` (a temporary copy for a remote checkpoint: (path, True))."""
    if files.is_local(directory):
        return files.local_path(_join(directory, name)), False
    fd, tmp = tempfile.mkstemp(prefix=f"cliptk-{uuid.uuid4().hex[:6]}-", suffix=Path(name).suffix)
    with os.fdopen(fd, "wb") as fh:
        fh.write(read_bytes(directory, name))
    return tmp, True
