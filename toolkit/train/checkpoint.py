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
_HASH_CHUNK = 1 << 22  # 4 MiB reads while verifying


class CheckpointInvalid(ValueError):
    """A checkpoint directory is incomplete or damaged; the message names the file."""


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def _fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(files.local_path(url) if files.is_local(url) else url)


def _join(root: str, name: str) -> str:
    return files.join(root, name)


def manifest_for(blobs: dict[str, bytes], step: int) -> bytes:
    meta = {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in blobs.items()}
    return json.dumps({"format": FORMAT, "step": step, "files": meta}, indent=2).encode()


def verify(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete, undamaged checkpoint; CheckpointInvalid naming the first bad file."""
    root = str(directory)
    fs, path = _fs(root)
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
        f = _join(path, name)
        if not fs.isfile(f):
            raise CheckpointInvalid(f"{_join(root, name)}: missing")
        size = fs.size(f)
        if size != meta["bytes"]:
            raise CheckpointInvalid(f"{_join(root, name)}: {size} bytes, the manifest says {meta['bytes']}")
        digest = hashlib.sha256()
        with fs.open(f, "rb") as fh:
            while chunk := fh.read(_HASH_CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != meta["sha256"]:
            raise CheckpointInvalid(f"{_join(root, name)}: checksum does not match the manifest")
    return manifest


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
    the ones beyond the newest ``keep``. Returns its directory. Rank 0 only."""
    target = _join(ckpt_dir, step_name(step))
    manifest = manifest_for(blobs, step)
    if files.is_local(ckpt_dir):
        with files.replacing_dir(target) as tmp:
            for name, data in blobs.items():
                (tmp / name).write_bytes(data)
            (tmp / MANIFEST).write_bytes(manifest)
    else:
        fs, path = _fs(target)
        if fs.exists(path):
            fs.rm(path, recursive=True)
        fs.makedirs(path, exist_ok=True)
        for name, data in [*blobs.items(), (MANIFEST, manifest)]:
            fs.pipe_file(_join(path, name), data)
    for _, old in list_checkpoints(ckpt_dir)[keep:]:
        remove(old)
    return target


class AsyncWriter:
    """Writes one checkpoint at a time on a background thread; ``submit`` waits for the previous write
    (so at most one serialised checkpoint is held in memory) and ``wait`` re-raises a failed write."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, ckpt_dir: str, step: int, blobs: dict[str, bytes], keep: int) -> None:
        self.wait()

        def work() -> None:
            try:
                path = write_blobs(ckpt_dir, step, blobs, keep)
                get_logger("train").info("checkpoint %s", path)
            except BaseException as err:  # noqa: BLE001 - re-raised on the training thread by wait()
                self._error = err

        self._thread = threading.Thread(target=work, name=f"checkpoint-{step}", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint failed: {type(err).__name__}: {err}") from err


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
