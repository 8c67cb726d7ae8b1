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
from dataclasses import asdict, dataclass

import torch
from torch import nn

from toolkit.core import dist as D
from toolkit.core.log import get_logger
from toolkit.models import weights
from toolkit.train import checkpoint as ckpt
from toolkit.train.config import TrainConfig
from toolkit.train.losses.base import TrainingLoss
from toolkit.train.model import BuiltModel
from toolkit.train.resume import check_config, checkpoints_dir, find_checkpoint, output_config, output_hash
from toolkit.train.update import Update


@dataclass
class TrainState:
    """What a checkpoint carries besides weights, optimiser and loss state."""

    step: int = 0  # global batches consumed (= the next batch's index t)
    samples_seen: int = 0
    skipped_steps: int = 0
    nonfinite_in_row: int = 0


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

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, built: BuiltModel, update: Update,
                 loss_fn: TrainingLoss, total_steps: int, steps_per_epoch: int):
        self.cfg, self.rank, self.world_size, self.built = cfg, rank, world_size, built
        self.update, self.loss_fn = update, loss_fn
        self.total_steps, self.steps_per_epoch = total_steps, steps_per_epoch
        self.dir = checkpoints_dir(cfg)
        self.last_step: int | None = None
        self.writer = ckpt.AsyncWriter()
        self.ema = None  # train/ema.EMA when --ema-decay is set: saved and loaded with the rest

    def resume(self, config_checked: bool = False) -> TrainState:
        """The state to start from: the checkpoint ``checkpoint.resume`` names, loaded into the model, the
        update and the objective, or a fresh state. ``config_checked``: this process's preflight has
        refused a checkpoint of another configuration already."""
        path = self._resume_path()
        if path is None:
            return TrainState()
        saved = ckpt.read_trainer_state(path)
        if not config_checked:
            check_config(path, saved, self.cfg)
        self._load(path)
        self.last_step = saved["state"]["step"]
        fields = TrainState.__dataclass_fields__
        state = TrainState(**{k: v for k, v in saved["state"].items() if k in fields})
        get_logger("train").info("resumed from %s: step %d, %d samples seen", path, state.step, state.samples_seen)
        return state

    def _resume_path(self) -> str | None:
        how = self.cfg.checkpoint.resume
        if how == "none":
            if self.rank == 0 and ckpt.remove_all(self.dir):
                get_logger("train").info("resume: none: removed the old checkpoints in %s", self.dir)
            D.barrier()
            return None
        return find_checkpoint(how, self.dir)

    def _load(self, path: str) -> None:
        from safetensors.torch import load

        local, temporary = ckpt.local_file(path, weights.WEIGHTS_NAME)
        try:
            weights.load_weights(self.built.model.clip, local)
        finally:
            if temporary:
                os.unlink(local)
        raw = ckpt.read_bytes(path, ckpt.OPTIMIZER)
        self.update.load_state_dict(torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True))
        try:
            self.loss_fn.load_state_dict(load(ckpt.read_bytes(path, ckpt.LOSS_STATE)))
        except FileNotFoundError:
            pass  # an objective without state of its own
        if self.ema is not None:
            self._load_ema(path)
        D.barrier()  # shared tables: every local rank sees local rank 0's loaded copy before step 1

    def save(self, state: TrainState) -> bool:
        """Checkpoint ``state.step`` unless it is the newest already; rank 0 serialises now and writes on
        the background thread. Returns whether one was written."""
        self.loss_fn.sync_state()
        sync_buffers(self.built.model.clip, self.world_size)
        fresh = self.last_step != state.step
        if self.rank == 0 and fresh:
            self.writer.submit(self.dir, state.step, self._blobs(state), self.cfg.checkpoint.keep)
        self.last_step = state.step
        D.barrier()
        return fresh

    def _blobs(self, state: TrainState) -> dict[str, bytes]:
        from safetensors.torch import save

        meta = {"state": asdict(state), "config_hash": output_hash(self.cfg), "config": output_config(self.cfg),
                "world_size": self.world_size, "total_steps": self.total_steps,
                "steps_per_epoch": self.steps_per_epoch, "model": self.built.name}
        blobs = weights.model_files(self.built.model.clip, self.built.model_cfg, self.built.preprocess_cfg)
        blobs[ckpt.TRAINER] = json.dumps(meta, indent=2).encode()
        buf = io.BytesIO()
        torch.save(self.update.state_dict(), buf)
        blobs[ckpt.OPTIMIZER] = buf.getvalue()
        loss_state = {k: v.contiguous() for k, v in self.loss_fn.state_dict().items()}
        if loss_state:
            blobs[ckpt.LOSS_STATE] = save(loss_state)
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
            get_logger("train").warning("%s holds no EMA weights: the average restarts from its weights", path)
            self.ema.restart_from(self.built.model.clip)

    def check_writes(self) -> None:
        """Raise the failure of a background checkpoint write (rank 0), naming its folder and step."""
        self.writer.check()

    def close(self) -> None:
        """Wait for a checkpoint being written (it is completed before the run ends)."""
        self.writer.wait()
