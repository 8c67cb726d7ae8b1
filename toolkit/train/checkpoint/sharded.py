"""Sharded checkpoints (``--fsdp`` runs): ``CKPT_DIR/step-NNNNNNNN/`` written by every rank through
``torch.distributed.checkpoint`` (DCP).

The folder holds DCP's files (``.metadata`` and one ``__R_0.distcp`` per rank R: the rank's shards of the
model, the optimiser state and the EMA weights, under the keys ``model.*``, ``optim.*``, ``ema.*`` of
``get_state_dict``, i.e. parameter names, so they load at any world size), rank 0's ``trainer.json`` and
``loss_state.safetensors`` (as in ``format.py``), ``model.json`` (the open_clip config and preprocessing, so
:func:`consolidate` can rebuild the whole model) and, last, the manifest ``checkpoint.json`` with the size and
sha256 of every other file: ``format.verify`` refuses a damaged or missing shard by name, and ``latest_valid``
skips such a folder as it does a damaged DDP checkpoint. Everything is written into a hidden sibling that
rank 0 renames into place once the manifest is in it (``files.replacing_dir``), so a killed job leaves
either the previous checkpoint or a complete new one. The write is synchronous (every rank waits for its
shard file); ranks must share the checkpoint folder's filesystem.

Loading (``load``) reshards: DCP reads every rank's piece of every tensor from whichever files hold it, so
a checkpoint of K ranks resumes at any other K' (FSDP or not: a DDP run loads it into whole tensors).
``io`` below is the run's ``state.StateIO`` and ``state`` its ``TrainState`` (state.py imports this module).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import Any

import torch

from toolkit.core import dist as D
from toolkit.core import files
from toolkit.train.checkpoint import format as ckpt

METADATA = ".metadata"  # DCP's index of the tensors and the files holding them
MODEL_JSON = "model.json"


def is_sharded(path: str) -> bool:
    """Whether checkpoint folder ``path`` was written by :func:`save` (DCP's metadata file is in it)."""
    return files.is_local(path) and os.path.isfile(os.path.join(files.local_path(path), METADATA))


def _ema_state(ema: Any) -> dict[str, torch.Tensor]:
    """The EMA tensors to save or load in place: the sharded copy (``fsdp.ShardedEMA``) or a whole model's."""
    return ema.shadow if hasattr(ema, "shadow") else ema.model.state_dict()


def _state(io: Any, with_ema: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(io.built.model, [io.update.optimizer])
    out = {"model": model_sd, "optim": optim_sd}
    if with_ema:
        out["ema"] = _ema_state(io.ema)
    return out


def save(io: Any, state: Any) -> str:
    """Write checkpoint ``state.step`` (module docstring); every rank calls it (collective). Returns the
    folder."""
    import torch.distributed.checkpoint as dcp

    target = files.join(io.dir, ckpt.step_name(state.step))
    writing = files.replacing_dir(target) if io.rank == 0 else contextlib.nullcontext()
    with writing as tmp:
        where = [str(tmp) if io.rank == 0 else None]
        if D.get_world_size() > 1:
            torch.distributed.broadcast_object_list(where, src=0)
        writer = dcp.FileSystemWriter(where[0], sync_files=True)
        dcp.save(_state(io, io.ema is not None), storage_writer=writer)
        if io.rank == 0:
            _finish(io, state, where[0])
        D.barrier()  # no rank goes on (and may write the next checkpoint) before this one is complete
    if io.rank == 0:
        ckpt.retire(io.dir, io.cfg.checkpoint.keep)
    D.barrier()
    return target


def _finish(io: Any, state: Any, folder: str) -> None:
    """Rank 0: the trainer's own files, then the manifest over every file of the folder (written last)."""
    blobs = io.trainer_blobs(state)
    info = {"model_cfg": io.built.model_cfg, "preprocess_cfg": io.built.preprocess_cfg}
    blobs[MODEL_JSON] = json.dumps(info, indent=2, default=list).encode()
    for name, data in blobs.items():
        ckpt._write_file(_path(folder, name), data)
    meta = {}
    for name in sorted(os.listdir(folder)):
        path = _path(folder, name)
        meta[name] = {"bytes": os.path.getsize(path), "sha256": files.file_sha256(path)}
    ckpt._write_file(
        _path(folder, ckpt.MANIFEST),
        json.dumps(
            {"format": ckpt.FORMAT, "sharded": True, "step": state.step, "files": meta}, indent=2
        ).encode(),
    )


def _path(folder: str, name: str):
    from pathlib import Path

    return Path(folder) / name


def _saved_keys(path: str) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(files.local_path(path)).read_metadata().state_dict_metadata)


def load(io: Any, path: str) -> None:
    """Load checkpoint ``path`` into the model, the optimiser and the EMA of this run, at this run's world
    size and wrapping (FSDP shards or whole DDP tensors). Every rank calls it (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from toolkit.core.log import get_logger
    from toolkit.train.optim import logit_scale_group

    with_ema = io.ema is not None and any(k.startswith("ema.") for k in _saved_keys(path))
    state = _state(io, with_ema)
    dcp.load(state, storage_reader=dcp.FileSystemReader(files.local_path(path)))
    set_state_dict(
        io.built.model,
        [io.update.optimizer],
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    update = io.update
    if update.tau_ctl is not None:  # the optimiser's group dicts were replaced: τ's lr goes to the new one
        update.tau_ctl.group = logit_scale_group(update.optimizer)
    if io.ema is not None and not with_ema:
        get_logger("train").warning("%s holds no EMA weights: the average restarts from its weights", path)
        io.ema.restart_from(io.built.model.clip)


def consolidate(path: str) -> tuple[torch.nn.Module, dict[str, Any], dict[str, Any]]:
    """(the whole open_clip model, its config, its preprocessing) of sharded checkpoint ``path``, read in this
    one process without a process group (``toolkit export``; any number of ranks wrote it). Verifies the
    checkpoint first (a damaged shard is refused by name)."""
    import torch.distributed.checkpoint as dcp

    from toolkit.models.factory import build_model

    ckpt.verify(path)
    info = json.loads(ckpt.read_bytes(path, MODEL_JSON))
    clip = build_model(info["model_cfg"])
    state = {"model": {f"clip.{k}": v for k, v in clip.state_dict().items()}}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(files.local_path(path)), no_dist=True)
    clip.load_state_dict({k.removeprefix("clip."): v for k, v in state["model"].items()})
    return clip.eval(), info["model_cfg"], info["preprocess_cfg"]
