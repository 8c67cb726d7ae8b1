"""The parameter update of one step: ``Update(clip, loss_fn, optim_cfg, loss_cfg, total_steps, precision)``.

Owns the optimiser, the fp16 GradScaler and the τ control, and runs the schedules and the update in
the loop's order:

    lr = update.begin(step, steps_per_epoch)   # model lr, the τ group's lr, the objective's γ
    ... forward_backward(..., scale=update.scale) ...
    outcome = update.finish(loss_fn.global_value())   # unscale, clip, finite? step : skip, zero grads

The finite decision is the step's one host sync: the loss value and the gradient norm stay tensors
(``Outcome``) until someone logs them. Every rank calls every method (the norm is of DDP's averaged
gradients, so every rank decides alike). Usable without the rest of the trainer (the convergence
benchmark drives it directly).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from toolkit.train.losses.base import TrainingLoss
from toolkit.train.losses.config import LossConfig
from toolkit.train.losses.temperature import TemperatureControl
from toolkit.train.optim import OptimConfig, build_optimizer, logit_scale_group
from toolkit.train.schedule import set_lr


@dataclass
class Outcome:
    """What ``Update.finish`` decided: ``applied`` (False: a non-finite value or gradient, step skipped),
    the global loss ``value`` and gradient ``grad_norm`` (0-d tensors, before clipping)."""

    applied: bool
    value: Tensor
    grad_norm: Tensor

    def what_failed(self) -> str:
        return "loss" if not math.isfinite(float(self.value)) else "gradient"


class Update:
    """Schedules and the update (module docstring). ``clip``: the open_clip model whose trainable
    parameters are optimised (its ``logit_scale`` with lr_tau when the objective learns it)."""

    def __init__(
        self,
        clip: nn.Module,
        loss_fn: TrainingLoss,
        optim: OptimConfig,
        loss: LossConfig,
        total_steps: int,
        precision: str = "fp32",
    ):
        self.clip, self.loss_fn, self.optim_cfg, self.total_steps = clip, loss_fn, optim, total_steps
        self.optimizer = build_optimizer(clip, optim, loss.lr_tau)
        group = logit_scale_group(self.optimizer)
        self.tau_ctl = (
            None
            if group is None
            else TemperatureControl(
                clip.logit_scale,
                group,
                lr_tau=loss.lr_tau or optim.lr,
                schedule=loss.lr_tau_schedule,
                max_logit_scale=math.log(1.0 / loss.tau_floor),
            )
        )
        # the cosine τ schedule follows the model's lr curve (set_lr scales the group's initial lr); the
        # other two set the τ group's lr themselves each step
        self.tau_sets_lr = self.tau_ctl is not None and loss.lr_tau_schedule != "cosine"
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        self.max_norm = optim.grad_clip_norm or math.inf
        # listed once: walking a LiT model's frozen trunks (hundreds of modules) every step was 15% of a
        # heads-only step's CPU time (cProfile, benchmarks/objectives/convergence/, batch 32)
        self.params = [p for p in clip.parameters() if p.requires_grad]
        self.clip_grad_norm = torch.nn.utils.clip_grad_norm_  # --fsdp: train/fsdp.py's, over sharded grads

    def begin(self, step: int, steps_per_epoch: int) -> float:
        """Before the forward of step ``step`` (0-based): every learning rate and the objective's own
        schedules (γ). Returns the model lr."""
        self.loss_fn.begin_step(step, steps_per_epoch)
        lr = set_lr(self.optimizer, step, self.total_steps, self.optim_cfg)
        if self.tau_sets_lr:
            self.tau_ctl.before_step(step)
        return lr

    def scale(self, share: Tensor) -> Tensor:
        """What is back-propagated: the share times the GradScaler's scale (fp16), else the share."""
        return self.scaler.scale(share) if self.scaler is not None else share

    def finish(self, value: Tensor) -> Outcome:
        """After the backward: unscale, clip to ``grad_clip_norm``, then the optimiser step and the
        objective's ``end_step(applied=True)`` if ``value`` and the gradient norm are finite, else a skip
        (``end_step(applied=False)`` undoes the objective's per-sample updates). Gradients are zeroed."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        params = [p for p in self.params if p.grad is not None]
        grad_norm = (
            self.clip_grad_norm(params, self.max_norm) if params else torch.zeros((), device=value.device)
        )
        applied = bool(torch.isfinite(value) & torch.isfinite(grad_norm.to(value.device)))
        if applied:
            self._step()
        elif self.scaler is not None:
            self.scaler.update()  # lowers the scale after an overflow, as scaler.step would have
        self.loss_fn.end_step(applied=applied)
        self.optimizer.zero_grad(set_to_none=True)
        return Outcome(applied, value, grad_norm)

    def _step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.tau_ctl is not None:
            self.tau_ctl.after_step()

    def temperature(self) -> float:
        """τ now (the objective's view of the model's scale a = exp(p)); a host sync, for logging."""
        return self.loss_fn.temperature(self.clip.logit_scale.detach().exp())

    def state_dict(self) -> dict[str, Any]:
        """Optimiser (and GradScaler) state, as checkpoints store it."""
        out: dict[str, Any] = {"optimizer": self.optimizer.state_dict()}
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if (
            self.tau_ctl is not None
        ):  # torch's load_state_dict replaces the group dicts: τ's lr went to a stale one
            self.tau_ctl.group = logit_scale_group(self.optimizer)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
