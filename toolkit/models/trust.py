"""What a loaded model must prove before it is evaluated: its checkpoint's recorded checksums, finite weights.

Training writes ``checkpoint.json`` last in every checkpoint folder, with each file's size and sha256
(``toolkit.train.checkpoint.format``), and its resume skips a folder whose files do not match. ``eval zeroshot
--model RUN/checkpoints/step-N`` used to load the same damaged folder and report metrics, and weights full
of NaN gave metrics too. :func:`verify_recorded` checks the manifest of a folder that has one (a folder
without one, such as RUN/model or an open_clip export, is taken as it is), and :func:`check_finite` names
the tensors that hold NaN or infinity. Called by :func:`toolkit.models.factory.load_model`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolkit.core.files import file_sha256
from toolkit.models.weights import CheckpointError

RECORD = "checkpoint.json"  # toolkit.train.checkpoint.format.MANIFEST (the train layer sits above this one)
MAX_NAMED = 5  # tensors named in the error; the count says how many more


def verify_recorded(directory: str | Path) -> dict[str, str]:
    """CheckpointError naming the first file of ``directory`` whose size or sha256 differs from what its
    ``checkpoint.json`` recorded (or a manifest that cannot be read); nothing when there is no manifest.
    Returns {file name: sha256} of the files it read (empty without a manifest), so that a caller needing
    one of those digests (a reference model's weights) does not read the file again."""
    record = Path(directory) / RECORD
    if not record.is_file():
        return {}
    try:
        entries = json.loads(record.read_text())["files"]
        items = [(str(name), int(meta["bytes"]), str(meta["sha256"])) for name, meta in entries.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(
            f"{record}: unreadable checkpoint manifest ({type(err).__name__}: {err})"
        ) from err
    verified = {}
    for name, size, sha in items:
        path = Path(directory) / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing, though {record} lists it (the checkpoint is incomplete)")
        if path.stat().st_size != size:
            raise CheckpointError(
                f"{path}: {path.stat().st_size} bytes, {record} recorded {size}: the checkpoint "
                "is damaged or was changed after it was written"
            )
        if file_sha256(path) != sha:
            raise CheckpointError(
                f"{path}: sha256 differs from the one {record} recorded: the checkpoint is "
                "damaged or was changed after it was written"
            )
        verified[name] = sha
    return verified


def check_finite(model: Any, source: str) -> None:
    """ValueError naming the parameters and buffers of ``model`` (loaded from ``source``) that hold NaN or
    infinity: metrics computed from them would mean nothing."""
    import torch

    # parameters must be finite; buffers may hold -inf on purpose (the text tower's attention mask), not NaN
    bad = [
        name
        for name, t in model.named_parameters()
        if t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]
    bad += [name for name, t in model.named_buffers() if t.is_floating_point() and bool(torch.isnan(t).any())]
    if bad:
        more = f" and {len(bad) - MAX_NAMED} more" if len(bad) > MAX_NAMED else ""
        raise ValueError(
            f"{source}: non-finite weights (NaN or infinity) in {', '.join(bad[:MAX_NAMED])}{more}; "
            "evaluate an earlier checkpoint"
        )
