"""``TrainingLoss``: the one interface the trainer sees, whatever the objective and distributed mode.

Called by every rank of ``group`` each optimiser step, with the same local batch size b on every rank:

    share = loss(image_features [b, d], text_features [b, d], logit_scale a (0-d, = exp(p)), index [b])

- ``share`` (0-d) is this rank's share of the global-batch objective: its mean over ranks is the
  objective's value, and its backward gives rank r K × its share of the gradient (features: its own
  rows; a: its anchors' terms), so DDP's mean over ranks gives exactly the gradient of the single-process
  run on the concatenated global batch. Scale ``share`` only by factors equal on every rank (a
  GradScaler's scale, 1/n): the fastclip mode has no backward communication to learn another rank's.
- ``global_value()`` the last forward's objective value over the global batch, for logging
  (collective: call it on every rank or on none).
- ``set_epoch(epoch)`` / ``set_step(step, steps_per_epoch)``: schedules that live in the loss (γ).
- ``state_dict()`` / ``load_state_dict()``: per-sample state (FastCLIP's u and τ tables), world-size
  independent (one [N] column per quantity, whatever the number of ranks or nodes).
- ``temperature(logit_scale)``: τ for logging (v2: the mean per-sample τ of the last batch).
- ``rollback()``: undo the last forward's per-sample updates (the trainer skips a non-finite step);
  collective, called by every rank or none.
"""

from __future__ import annotations

from torch import Tensor, nn

from toolkit.train.losses.config import LossConfig


class TrainingLoss(nn.Module):
    """Base of every objective ``build_loss`` returns (module docstring); subclasses implement forward."""

    def __init__(self, cfg: LossConfig, group=None):
        super().__init__()
        self.cfg, self.group = cfg, group

    def set_epoch(self, epoch: int) -> None:
        """Start of epoch ``epoch`` (0-based); no-op unless the objective has epoch schedules."""

    def set_step(self, step: int, steps_per_epoch: int) -> None:
        """Before the forward of optimiser step ``step``; no-op unless the objective has step schedules."""

    def global_value(self) -> Tensor:
        """The last forward's global objective value (0-d, detached). Collective (every rank calls it)."""
        raise NotImplementedError

    def rollback(self) -> None:
        """Undo the per-sample state updates of the last forward (no-op without per-sample state)."""

    def temperature(self, logit_scale: Tensor) -> float:
        """τ for logging: 1/a of the global scale a (0-d)."""
        return float(1.0 / logit_scale.detach().float())
