"""Trainer checkpoints: ``RUN_DIR/checkpoints/step-NNNNNNNN/``, written atomically, verified on resume.

A checkpoint directory is a plain open_clip ``local-dir:`` model plus the trainer's state:

- ``open_clip_config.json`` + ``open_clip_model.safetensors``: the model (``toolkit.models.weights``);
- ``trainer.json``: step (global batches consumed), epoch, samples seen, counters, world size at save
  time and the hash of the output-affecting config;
- ``optimizer.pt``: the optimiser's (and GradScaler's) state dict;
- ``loss_state.safetensors``: the objective's per-sample state (FastCLIP's u/τ tables as [N] columns,
  independent of the number of ranks and nodes); absent when the objective has none;
- ``checkpoint.json``: the manifest (size and sha256 of every other file), written last.

The directory is filled under a temporary name and renamed into place, so a half-written checkpoint
never looks complete; a checkpoint whose manifest is missing or whose files do not match it is skipped
with a warning naming the file, and the previous complete one is used. Only rank 0 writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolkit.core.log import get_logger

CHECKPOINTS = "checkpoints"
MANIFEST = "checkpoint.json"
TRAINER = "trainer.json"
OPTIMIZER = "optimizer.pt"
LOSS_STATE = "loss_state.safetensors"
FORMAT = "cliptk-checkpoint-v1"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_HASH_CHUNK = 1 << 22  # 4 MiB reads while hashing


class CheckpointInvalid(ValueError):
    """A checkpoint directory is incomplete or damaged; the message names the file."""


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def checkpoints_dir(run_dir: str) -> Path:
    return Path(run_dir) / CHECKPOINTS


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path, step: int) -> None:
    """Record size and sha256 of every file in ``directory`` in ``checkpoint.json`` (written last)."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "files": files}, indent=2))


def verify(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete, undamaged checkpoint; CheckpointInvalid naming the first bad file."""
    root = Path(directory)
    path = root / MANIFEST
    if not path.is_file():
        raise CheckpointInvalid(f"{path}: missing (the checkpoint was not completed)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointInvalid(f"{path}: unreadable manifest: {err}") from err
    for name, meta in files.items():
        f = root / name
        if not f.is_file():
            raise CheckpointInvalid(f"{f}: missing")
        if f.stat().st_size != meta["bytes"]:
            raise CheckpointInvalid(f"{f}: {f.stat().st_size} bytes, the manifest says {meta['bytes']}")
        if _sha256(f) != meta["sha256"]:
            raise CheckpointInvalid(f"{f}: checksum does not match the manifest")
    return manifest


def list_checkpoints(run_dir: str) -> list[tuple[int, Path]]:
    """(step, directory) of every step-N directory under RUN_DIR/checkpoints, newest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found, reverse=True)


def latest_valid(run_dir: str) -> Path | None:
    """The newest checkpoint that verifies; each newer damaged one is reported with a warning."""
    log = get_logger("train.checkpoint")
    for _, path in list_checkpoints(run_dir):
        try:
            verify(path)
            return path
        except CheckpointInvalid as err:
            log.warning("skipping checkpoint %s: %s", path.name, err)
    return None


def save(run_dir: str, step: int, save_model: Callable[[Path, Callable[[Path], None]], None],
         write_state: Callable[[Path], None], keep: int) -> Path:
    """Write checkpoint ``step``: ``save_model(target, write_extra)`` writes the open_clip files and calls
    ``write_extra(tmp_dir)`` inside its atomic rename; there ``write_state`` adds the trainer files and the
    manifest goes last. Older checkpoints beyond ``keep`` are deleted. Called by rank 0 only."""
    target = checkpoints_dir(run_dir) / step_name(step)

    def write_extra(tmp: Path) -> None:
        write_state(tmp)
        write_manifest(tmp, step)

    save_model(target, write_extra)
    for _, old in list_checkpoints(run_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def remove_all(run_dir: str) -> int:
    """Delete every checkpoint of a run (``resume: none``); returns how many."""
    found = list_checkpoints(run_dir)
    for _, path in found:
        shutil.rmtree(path, ignore_errors=True)
    return len(found)


def read_trainer_state(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / TRAINER
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointInvalid(f"{path}: unreadable: {err}") from err
