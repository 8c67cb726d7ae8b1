"""The training set a checkpoint was trained on, and the refusal to resume it onto other data.

A resume continues the data order, the per-sample tables (FastCLIP's u, SigLIP's bias) and the sample
count of the checkpoint, so resuming onto a training set re-precomputed at the same path (600 samples, now
400) either failed deep in the loss (``column 'log_u_image' has shape (600,), expected (400,)``, naming
neither) or, with an objective without tables, resumed silently on other data. Every checkpoint records
the data's fingerprint (``trainer.json``'s ``data``: path, sample count and the sha256 of its
``dataset.json``, which holds every shard's checksum), and a resume onto a set with another fingerprint is
refused naming both, unless ``checkpoint.allow_other_data`` says to go on. Torch-free: the launcher checks
before any rank starts (``run.preflight``), and every rank again when it loads (``StateIO.resume``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from toolkit.core import files
from toolkit.data.trainset.format import DATASET_JSON
from toolkit.train.checkpoint import format as ckpt
from toolkit.train.config import CheckpointConfig


class DataMismatch(ValueError):
    """A checkpoint trained on another training set than the one this run reads."""


def fingerprint(data: str) -> dict[str, Any]:
    """{path, num_samples, sha256 of dataset.json} of training folder ``data`` (any rank, any process)."""
    with files.open_file(files.join(data, DATASET_JSON), "rb") as fh:
        raw = fh.read()
    try:
        num = json.loads(raw).get("num_samples")
    except (ValueError, AttributeError):
        num = None
    return {"path": data, "num_samples": num, "dataset_sha256": hashlib.sha256(raw).hexdigest()}


def _describe(fp: Mapping[str, Any]) -> str:
    return (
        f"{fp.get('path')} ({fp.get('num_samples')} samples, dataset.json sha256 "
        f"{str(fp.get('dataset_sha256'))[:12]})"
    )


def check_data(
    path: str,
    saved: Mapping[str, Any],
    checkpoint: CheckpointConfig,
    data: str,
    current: Mapping[str, Any] | None = None,
) -> None:
    """Raise :class:`DataMismatch` unless checkpoint ``path`` (``saved``: its trainer.json) was trained on
    what the training set ``data`` holds now (``current``: its fingerprint, when read already), or
    ``checkpoint.allow_other_data`` is set. Checkpoints from before the fingerprint was recorded pass."""
    old = saved.get("data")
    if not isinstance(old, Mapping) or checkpoint.allow_other_data:
        return
    new = current or fingerprint(data)
    if old.get("dataset_sha256") == new["dataset_sha256"]:
        return
    raise DataMismatch(
        f"{path} was trained on {_describe(old)}, but this run reads {_describe(new)}: the data "
        "changed, so its order, sample count and per-sample tables no longer match; resume with "
        "the data it was trained on, start afresh (--resume none, or another --out), or set "
        "checkpoint.allow_other_data=true to continue on the new data anyway"
    )


def refuse_other_data(checkpoint: CheckpointConfig, out: str, data: str) -> None:
    """Before any rank starts: :class:`DataMismatch` when the newest readable checkpoint the run (run folder
    ``out``, training set ``data``) would resume from was trained on other data (the ranks check the one they
    actually load again)."""
    from toolkit.train.checkpoint.resume import checkpoints_dir

    how = checkpoint.resume
    if how == "none" or checkpoint.allow_other_data:
        return
    candidates = (
        [p for _, p in ckpt.list_checkpoints(checkpoints_dir(checkpoint, out))]
        if how in ("auto", "latest")
        else [how]
    )
    for path in candidates:  # newest first
        try:
            saved = ckpt.read_trainer_state(path)
        except (ckpt.CheckpointInvalid, OSError, ValueError):
            continue
        check_data(path, saved, checkpoint, data)
        return
