"""Everything a training run holds, built once per rank: ``build_setup(cfg) -> Setup``.

``Setup`` owns the process group, the data order and loader, the model (DDP-wrapped), the objective,
the optimiser with its schedules, the GradScaler, and rank 0's reporting; the loop (``loop.py``) calls
its small methods in order. Every method is called by every rank unless it says otherwise.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from toolkit.core import dist as D
from toolkit.core.log import get_logger
from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.loader import make_loader
from toolkit.data.trainset.order import BatchOrder
from toolkit.models import weights
from toolkit.train import checkpoint as ckpt
from toolkit.train import model as model_lib
from toolkit.train.config import TrainConfig
from toolkit.train.ddp import wrap_ddp
from toolkit.train.hostmem import release_freed_memory
from toolkit.train.losses import build_loss
from toolkit.train.losses.temperature import TemperatureControl
from toolkit.train.metrics import MetricsWriter, Progress, SampleAudit
from toolkit.train.optim import build_optimizer, logit_scale_group
from toolkit.train.resume import check_config, checkpoints_dir, find_checkpoint, output_config, output_hash
from toolkit.train.schedule import set_lr


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; expected auto, cpu or cuda")
    return torch.device(device)


def steps_per_epoch(cfg: TrainConfig, num_samples: int) -> int:
    """Global batches per (virtual) epoch: train_num_samples (or the dataset) // batch_size, at least 1."""
    return max(1, (cfg.train_num_samples or num_samples) // cfg.batch_size)


class Setup:
    def __init__(self, cfg: TrainConfig):
        self.cfg, self.log = cfg, get_logger("train")
        backend = None if cfg.launch.backend == "auto" else cfg.launch.backend
        info = D.init_from_env(backend, cfg.launch.timeout_s)
        self.rank, self.group_size = info.rank, info.world_size
        self.device = info.device if info.device.type == "cuda" else resolve_device(cfg.device)
        if cfg.release_freed_memory:  # before the model build and the loader's forked workers
            release_freed_memory(self.device.type)
        self.dataset = TrainDataset.open(cfg.data)
        # refuse a batch larger than the data or not divisible by the ranks before building anything
        BatchOrder(self.dataset.num_samples, cfg.batch_size, cfg.seed, cfg.loader.shuffle_block).batch_ids(
            0, self.rank, self.group_size)
        self.steps_per_epoch = steps_per_epoch(cfg, self.dataset.num_samples)
        self.total_steps = cfg.steps or cfg.epochs * self.steps_per_epoch
        self.built = model_lib.build(cfg.model, cfg.init, self.dataset, cfg.loss.initial_tau,
                                     cfg.loss.learns_logit_scale, cfg.seed, logit_bias=cfg.loss.init_logit_bias)
        self.clip = self.built.model.clip
        self.built.model.to(self.device).train()
        cuda = self.device.type == "cuda"
        self.model = wrap_ddp(self.built.model, grad_dtype=cfg.grad_dtype,
                              device_ids=[self.device.index] if cuda else None)
        self.loss_fn = build_loss(cfg.loss, data_size=self.dataset.num_samples, check_sizes=False)
        self.optimizer = build_optimizer(self.clip, cfg.optim, cfg.loss.lr_tau)
        self.tau_ctl = self._temperature_control()
        self.scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
        self.micro_batch_size = cfg.micro_batch_size
        if cfg.micro_batch_size == "auto":
            from toolkit.train import automicro

            self.micro_batch_size = automicro.choose(self)
        self.last_checkpoint: int | None = None
        self.checkpoints = ckpt.AsyncWriter()
        self.writer: MetricsWriter | None = None
        self.progress: Progress | None = None
        self.audit: SampleAudit | None = None
        D.LEDGER.reset()

    def _temperature_control(self) -> TemperatureControl | None:
        group = logit_scale_group(self.optimizer)
        if group is None:
            return None
        lc = self.cfg.loss
        return TemperatureControl(self.clip.logit_scale, group, lr_tau=lc.lr_tau or self.cfg.optim.lr,
                                  schedule=lc.lr_tau_schedule)

    # ------------------------------------------------------------------ data
    def batches(self, start_step: int):
        """This rank's slices of global batches start_step .. total_steps-1 (each dict has its ``step``)."""
        resume_step = start_step if start_step or self.last_checkpoint is not None else None
        if self.rank == 0:
            self.writer = MetricsWriter(self.cfg.out, self.cfg.tensorboard, resume_step)
            self.progress = Progress(self.total_steps, start_step)
            SampleAudit.reset(self.cfg.out, resume_step)
        D.barrier()  # no rank records before rank 0 has cut the logs back to the resume point
        if self.cfg.audit_samples:
            self.audit = SampleAudit(self.cfg.out, self.rank, self.group_size)
        if start_step >= self.total_steps:
            return iter(())
        lc = self.cfg.loader
        return iter(make_loader(self.dataset, batch_size=self.cfg.batch_size, rank=self.rank,
                                world_size=self.group_size, seed=self.cfg.seed, block=lc.shuffle_block,
                                start_step=start_step, num_steps=self.total_steps - start_step,
                                num_workers=lc.num_workers, prefetch_factor=lc.prefetch_batches,
                                pin_memory=self.device.type == "cuda"))

    @property
    def offloaded(self) -> bool:
        """Gradient cache on: the batch stays in host memory, only the micro-batch in flight moves."""
        local = self.cfg.batch_size // self.group_size
        return 0 < self.micro_batch_size < local

    def to_device(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(image, text, index): index on the device; image and text too unless offloaded (then the
        gradient cache moves each micro-batch itself, non-blocking from pinned memory on CUDA)."""
        image = batch["image"] if "image" in batch else batch["image_features"]
        text = batch["tokens"] if "tokens" in batch else batch["text_features"]
        if not self.offloaded:
            image, text = image.to(self.device, non_blocking=True), text.to(self.device, non_blocking=True)
        return image, text, batch["index"].to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ the update
    def autocast(self):
        if self.cfg.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.cfg.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def scale(self, share: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(share) if self.scaler is not None else share

    def set_lr(self, step: int) -> float:
        lr = set_lr(self.optimizer, step, self.total_steps, self.cfg.optim)
        if self.tau_ctl is not None and self.cfg.loss.lr_tau_schedule != "cosine":
            self.tau_ctl.before_step(step)  # step_thresh / const own the τ group's lr
        return lr

    def unscale_and_clip(self) -> float:
        """Global gradient norm after DDP's average (identical on every rank), clipped if configured."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.clip.parameters() if p.grad is not None]
        max_norm = self.cfg.optim.grad_clip_norm or math.inf
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0

    def optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.loss_fn.end_step(applied=True)
        if self.tau_ctl is not None:
            self.tau_ctl.after_step()

    def skip_step(self) -> None:
        """No optimiser step; the objective's per-sample updates of this step are undone."""
        self.loss_fn.end_step(applied=False)
        if self.scaler is not None:
            self.scaler.update()  # lowers the scale after an overflow, as scaler.step would have

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def tau(self) -> float:
        return self.loss_fn.temperature(self.clip.logit_scale.detach().exp())

    # ------------------------------------------------------------------ state
    def loss_fn_sync(self) -> None:
        self.loss_fn.sync_state()

    def sync_buffers(self) -> None:
        """Average floating-point buffers (BatchNorm running statistics) over ranks, so every rank and
        every checkpoint holds the same model."""
        if self.group_size == 1:
            return
        for buf in self.clip.buffers():
            if buf.is_floating_point():
                D.all_reduce_sum(buf, category=D.CHECKS).div_(self.group_size)

    @property
    def ckpt_dir(self) -> str:
        return checkpoints_dir(self.cfg)

    def write_checkpoint(self, state: dict[str, Any]) -> None:
        """Rank 0: serialise checkpoint ``state['step']`` now, write it on the background thread."""
        from safetensors.torch import save

        meta = {"state": state, "config_hash": output_hash(self.cfg), "config": output_config(self.cfg),
                "world_size": self.group_size, "total_steps": self.total_steps, "model": self.built.name}
        blobs = weights.model_files(self.clip, self.built.model_cfg, self.built.preprocess_cfg)
        blobs[ckpt.TRAINER] = json.dumps(meta, indent=2).encode()
        opt = {"optimizer": self.optimizer.state_dict()}
        if self.scaler is not None:
            opt["scaler"] = self.scaler.state_dict()
        buf = io.BytesIO()
        torch.save(opt, buf)
        blobs[ckpt.OPTIMIZER] = buf.getvalue()
        loss_state = {k: v.contiguous() for k, v in self.loss_fn.state_dict().items()}
        if loss_state:
            blobs[ckpt.LOSS_STATE] = save(loss_state)
        self.checkpoints.submit(self.ckpt_dir, state["step"], blobs, self.cfg.checkpoint.keep)
        if self.writer is not None:
            from toolkit.train.metrics import write_plots

            write_plots(self.cfg.out)

    def resume_path(self) -> str | None:
        """The checkpoint to resume from per ``checkpoint.resume`` (auto, latest, none or a directory)."""
        how = self.cfg.checkpoint.resume
        if how == "none":
            if self.rank == 0 and ckpt.remove_all(self.ckpt_dir):
                self.log.info("resume: none: removed the old checkpoints in %s", self.ckpt_dir)
            D.barrier()
            return None
        return find_checkpoint(how, self.ckpt_dir)

    def load_checkpoint(self, path: str, saved: dict[str, Any]) -> None:
        """Load weights, optimiser, scaler and loss state of ``path``; refuse a different configuration."""
        from safetensors.torch import load

        check_config(path, saved, self.cfg)
        local, temporary = ckpt.local_file(path, weights.WEIGHTS_NAME)
        try:
            weights.load_weights(self.clip, local)
        finally:
            if temporary:
                os.unlink(local)
        opt = torch.load(io.BytesIO(ckpt.read_bytes(path, ckpt.OPTIMIZER)), map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(opt["optimizer"])
        if self.scaler is not None and "scaler" in opt:
            self.scaler.load_state_dict(opt["scaler"])
        try:
            self.loss_fn.load_state_dict(load(ckpt.read_bytes(path, ckpt.LOSS_STATE)))
        except FileNotFoundError:
            pass  # an objective without per-sample state
        self.last_checkpoint = saved["state"]["step"]
        D.barrier()  # shared tables: every local rank sees local rank 0's loaded copy before step 1

    # ------------------------------------------------------------------ reporting (rank 0)
    def comm_and_memory(self, steps: int) -> dict[str, Any]:
        """Bytes this rank sent per step since the last call, and peak memory (CUDA: allocated; CPU: RSS)."""
        comm = D.LEDGER.step()
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return {"comm_bytes": comm["comm/total/sent_bytes"] / max(steps, 1), "peak_mem_bytes": int(peak)}

    def log_metrics(self, state, metrics: dict[str, Any], quiet: bool = False) -> None:
        if self.writer is None or not metrics:
            return
        epoch = metrics.pop("epoch", (state.step - 1) // self.steps_per_epoch)
        self.writer.write({"step": state.step, "epoch": epoch, "samples_seen": state.samples_seen,
                           "skipped_steps": state.skipped_steps, **metrics})
        if not quiet and self.progress is not None:
            self.progress.update(state.step, metrics.get("loss", float("nan")), metrics.get("samples_per_s", 0.0))

    def finish(self, state, preempted: bool) -> dict[str, Any]:
        """Rank 0 writes OUT/model (the final open_clip model) and the plots; every rank returns the summary."""
        model_dir = str(Path(self.cfg.out) / "model")
        self.checkpoints.wait()
        if self.rank == 0 and not preempted:
            weights.save_model(self.clip, self.built.model_cfg, model_dir, self.built.preprocess_cfg)
        if self.rank == 0:
            from toolkit.train.metrics import write_plots

            write_plots(self.cfg.out)
        D.barrier()
        return {"step": state.step, "total_steps": self.total_steps, "samples_seen": state.samples_seen,
                "skipped_steps": state.skipped_steps, "preempted": preempted, "world_size": self.group_size,
                "model": None if preempted else model_dir, "steps_per_epoch": self.steps_per_epoch}

    def close(self) -> None:
        self.checkpoints.wait()  # a checkpoint being written when training stops is completed first
        if self.progress is not None:
            self.progress.close()
        if self.writer is not None:
            self.writer.close()


def build_setup(cfg: TrainConfig) -> Setup:
    """Build every rank's ``Setup`` (collective: process group, DDP, FastCLIP's shared tables)."""
    return Setup(cfg)
