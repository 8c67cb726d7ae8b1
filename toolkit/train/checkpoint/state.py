"""Training state on disk: ``StateIO`` writes checkpoints and resumes from them; ``TrainState`` counts.

A checkpoint (``checkpoint.py`` has the file format) holds the open_clip model files, ``trainer.json``
(``TrainState``, config hash and config, world size, total steps), the optimiser and GradScaler state,
and the objective's state (flat tensors). ``StateIO`` chooses the checkpoint to resume from
(``checkpoint.resume``), refuses one of another configuration, loads it into the model, the update and
the objective, and writes new ones on a background thread (rank 0). Every rank calls every method.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import asdict

import torch
from torch import nn

from toolkit.core import dist as D
from toolkit.core.log import get_logger
from toolkit.models import weights
from toolkit.train.batches import StepCounts
from toolkit.train.checkpoint import format as ckpt
from toolkit.train.checkpoint.datacheck import check_data, fingerprint
from toolkit.train.checkpoint.resume import (
    check_config,
    checkpoints_dir,
    find_checkpoint,
    nonfinite_abort_note,
    output_config,
    output_hash,
)
from toolkit.train.config import TrainConfig
from toolkit.train.losses.base import TrainingLoss
from toolkit.train.model import BuiltModel
from toolkit.train.runtime import Runtime
from toolkit.train.trainstate import TrainState
from toolkit.train.update import Update


def sync_buffers(clip: nn.Module, world_size: int) -> None:
    """Average floating-point buffers (BatchNorm running statistics) over ranks, so every rank and every
    checkpoint holds the same model. Collective."""
    if world_size == 1:
        return
    for buf in clip.buffers():
        if buf.is_floating_point():
            D.all_reduce_sum(buf, category=D.CHECKS).div_(world_size)


class StateIO:
    """Checkpoints of one run (module docstring); ``last_step``: the step of the newest checkpoint
    written or loaded (None: none yet)."""

    def __init__(
        self,
        cfg: TrainConfig,
        rt: Runtime,
        steps: StepCounts,
        built: BuiltModel,
        update: Update,
        loss_fn: TrainingLoss,
    ):
        self.cfg, self.rank, self.world_size, self.built = cfg, rt.rank, rt.world_size, built
        self.update, self.loss_fn = update, loss_fn
        self.steps_per_epoch, self.total_steps = steps
        self.dir = checkpoints_dir(cfg.checkpoint, cfg.out)
        self._data: dict | None = None  # the training set's fingerprint (``data``), read when first needed
        self.last_step: int | None = None
        self.writer = ckpt.AsyncWriter()
        self.ema = None  # train/ema.EMA when --ema-decay is set: saved and loaded with the rest
        self.sharded = None  # train/fsdp.Sharded with --fsdp: checkpoints are sharded (checkpoint/sharded.py)

    @property
    def data(self) -> dict:
        """The training set's fingerprint, recorded in every checkpoint (a resume onto other data is refused);
        read on first use, so parts built around in-memory data (the convergence benchmark) never need it."""
        if self._data is None:
            self._data = fingerprint(self.cfg.data)
        return self._data

    def resume(self, skip_config_check: str = "") -> TrainState:
        """The state to start from: the checkpoint ``checkpoint.resume`` names, loaded into the model, the
        update and the objective, or a fresh state. ``skip_config_check``: why the refusal of a checkpoint
        of another configuration need not run here (it ran once already, run.py names who ran it)."""
        path = self._resume_path()
        if path is None:
            return TrainState()
        saved = ckpt.read_trainer_state(path)
        if skip_config_check:
            get_logger("train").debug("checkpoint configuration check skipped: %s", skip_config_check)
        else:
            check_config(path, saved, self.cfg)
        check_data(path, saved, self.cfg.checkpoint, self.cfg.data, self.data)
        same_data = (saved.get("data") or {}).get("dataset_sha256", self.data["dataset_sha256"]) == self.data[
            "dataset_sha256"
        ]
        self._load(path, same_data)
        self.last_step = saved["state"]["step"]
        fields = TrainState.__dataclass_fields__
        state = TrainState(**{k: v for k, v in saved["state"].items() if k in fields})
        get_logger("train").info(
            "resumed from %s: step %d, %d samples seen", path, state.step, state.samples_seen
        )
        return state

    def _resume_path(self) -> str | None:
        how = self.cfg.checkpoint.resume
        if how == "none":
            if self.rank == 0 and ckpt.remove_all(self.dir):
                get_logger("train").info("resume: none: removed the old checkpoints in %s", self.dir)
            D.barrier()
            return None
        return find_checkpoint(how, self.dir)

    def _load(self, path: str, same_data: bool = True) -> None:
        from safetensors.torch import load

        from toolkit.train.checkpoint import sharded

        if sharded.is_sharded(path):  # an --fsdp checkpoint, loaded at this run's world size and wrapping
            sharded.load(self, path)
        elif self.sharded is not None:
            raise ValueError(
                f"{path} was written without --fsdp: resume it without --fsdp, or start from "
                f"its weights with --init {path}"
            )
        else:
            self._load_whole(path)
        try:
            state = load(ckpt.read_bytes(path, ckpt.LOSS_STATE))
        except FileNotFoundError:
            state = None  # an objective without state of its own
        if (
            state is not None and not same_data
        ):  # checkpoint.allow_other_data: its tables index the old samples
            get_logger("train").warning(
                "resume onto other data (checkpoint.allow_other_data): the objective's "
                "per-sample state of %s is not loaded; it starts afresh",
                path,
            )
        elif state is not None:
            self.loss_fn.load_state_dict(state)
        if self.ema is not None and not sharded.is_sharded(path):
            self._load_ema(path)
        D.barrier()  # shared tables: every local rank sees local rank 0's loaded copy before step 1

    def _load_whole(self, path: str) -> None:
        """The model's and the optimiser's state from a checkpoint of whole tensors (rank 0 wrote it)."""
        local, temporary = ckpt.local_file(path, weights.WEIGHTS_NAME)
        try:
            weights.load_weights(self.built.model.clip, local)
        finally:
            if temporary:
                os.unlink(local)
        raw = ckpt.read_bytes(path, ckpt.OPTIMIZER)
        self.update.load_state_dict(torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True))

    def save(self, state: TrainState) -> bool:
        """Checkpoint ``state.step`` unless it is the newest already; rank 0 serialises now and writes on
        the background thread. Returns whether one was written."""
        self.loss_fn.sync_state()
        sync_buffers(self.built.model.clip, self.world_size)
        fresh = self.last_step != state.step
        if fresh and self.sharded is not None:  # every rank writes its shards (checkpoint/sharded.py)
            from toolkit.train.checkpoint import sharded

            sharded.save(self, state)
        elif self.rank == 0 and fresh:
            self.writer.submit(self.dir, state.step, self._blobs(state), self.cfg.checkpoint.keep)
        self.last_step = state.step
        D.barrier()
        return fresh

    def trainer_blobs(self, state: TrainState) -> dict[str, bytes]:
        """trainer.json and the objective's state (when it has one), serialised (rank 0)."""
        from safetensors.torch import save

        meta = {
            "state": asdict(state),
            "config_hash": output_hash(self.cfg),
            "config": output_config(self.cfg),
            "world_size": self.world_size,
            "total_steps": self.total_steps,
            "steps_per_epoch": self.steps_per_epoch,
            "model": self.built.name,
            "data": self.data,
        }
        blobs = {ckpt.TRAINER: json.dumps(meta, indent=2).encode()}
        loss_state = {k: v.contiguous() for k, v in self.loss_fn.state_dict().items()}
        if loss_state:
            blobs[ckpt.LOSS_STATE] = save(loss_state)
        return blobs

    def _blobs(self, state: TrainState) -> dict[str, bytes]:
        from safetensors.torch import save

        blobs = weights.model_files(self.built.model.clip, self.built.model_cfg, self.built.preprocess_cfg)
        blobs.update(self.trainer_blobs(state))
        buf = io.BytesIO()
        torch.save(self.update.state_dict(), buf)
        blobs[ckpt.OPTIMIZER] = buf.getvalue()
        if self.ema is not None:
            from toolkit.train.ema import FILE

            blobs[FILE] = save(self.ema.state_dict())
        return blobs

    def _load_ema(self, path: str) -> None:
        """The checkpoint's EMA weights, or (a checkpoint written without --ema-decay) the loaded weights."""
        from safetensors.torch import load

        from toolkit.train.ema import FILE

        try:
            self.ema.load_state_dict(load(ckpt.read_bytes(path, FILE)))
        except FileNotFoundError:
            get_logger("train").warning(
                "%s holds no EMA weights: the average restarts from its weights", path
            )
            self.ema.restart_from(self.built.model.clip)

    def check_writes(self) -> None:
        """Raise the failure of a background checkpoint write (rank 0), naming its folder and step."""
        self.writer.check()

    def close(self) -> None:
        """Wait for a checkpoint being written (it is completed before the run ends)."""
        self.writer.wait()


def nonfinite_note(io: StateIO, first_bad_step: int) -> str:
    """The end of the message of a run aborted for non-finite steps (every rank calls it). Rank 0 first
    finishes its pending write, then renames the checkpoints written from ``first_bad_step`` on to
    ``*.nonfinite`` so that a rerun resumes from the last one written before it, which retention kept
    (``ckpt.retire``) and which the note names. The other ranks only read the folder names at or before
    that step."""
    before = first_bad_step - 1
    moved: list[str] = []
    if io.rank == 0:
        try:
            io.writer.wait()
        except ckpt.CheckpointWriteFailed as err:
            moved.append(f"(and a write failed: {err})")
        moved[:0] = ckpt.set_aside_after(io.dir, before)
    return nonfinite_abort_note(ckpt.last_at_or_before(io.dir, before), first_bad_step, moved)
