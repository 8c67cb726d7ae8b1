"""``TrainingLoss``: the one interface the trainer sees, whatever the objective and distributed mode.

Called by every rank of ``group`` each optimiser step, with the same local batch size b on every rank:

    share = loss(image_features [b, d], text_features [b, d], logit_scale a (0-d, = exp(p)), index [b],
                 logit_bias=None)                      # the model's learnable bias (sigmoid losses), 0-d

- ``share`` (0-d) is this rank's share of the global-batch objective: its mean over ranks is the
  objective's value, and its backward gives rank r K × its share of the gradient (features: its own
  rows; a: its anchors' terms), so DDP's mean over ranks gives exactly the gradient of the single-process
  run on the concatenated global batch. Scale ``share`` only by factors equal on every rank (a
  GradScaler's scale, 1/n): the fastclip mode has no backward communication to learn another rank's.

The hooks the trainer calls, in the order of one step (every rank calls each one; none is optional):

- ``begin_step(step, steps_per_epoch)``: before the forward; schedules that live in the loss (γ).
- ``forward(...)`` as above, once per step (the gradient cache calls it once on the whole local batch).
- ``global_value()``: the forward's value over the global batch, for logging and the non-finite check
  (collective: call it on every rank or on none).
- ``end_step(applied)``: after the optimiser step (``applied``) or after the trainer skipped a
  non-finite step (not applied: undo this step's per-sample updates). Collective. An objective with its
  own learned state (a normaliser network) updates it here.
- ``metrics()``: {name: number} the objective reports with the step's metrics (γ, ...); no collectives.
- ``temperature(logit_scale)``: τ for logging.
- ``sync_state()``: collective, before ``state_dict()`` is read outside forward (a checkpoint).
- ``state_dict()`` / ``load_state_dict()``: everything a resume needs, as flat tensors (saved with
  safetensors), world-size independent (one [N] column per per-sample quantity, whatever the number of
  ranks or nodes).

Class attributes the trainer reads: ``needs_data_size`` (per-sample state indexed by dense sample ids:
``build_loss`` refuses a missing ``data_size``). ``check_sizes`` (constructor option, default True):
refuse unequal local batches across ranks with one tiny all_gather per step; the trainer turns it off
because its loader gives every rank exactly B/K samples.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

from toolkit.train.losses.config import LossConfig


class TrainingLoss(nn.Module):
    """Base of every objective ``build_loss`` returns (module docstring); subclasses implement forward
    and ``global_value`` and override the hooks they need (the defaults do nothing)."""

    needs_data_size: ClassVar[bool] = False

    def __init__(self, cfg: LossConfig, group=None, *, check_sizes: bool = True):
        super().__init__()
        self.cfg, self.group, self.check_sizes = cfg, group, check_sizes

    def begin_step(self, step: int, steps_per_epoch: int) -> None:
        """Before the forward of optimiser step ``step`` (0-based; epoch = step // steps_per_epoch)."""

    def global_value(self) -> Tensor:
        """The last forward's global objective value (0-d, detached). Collective (every rank calls it)."""
        raise NotImplementedError

    def end_step(self, applied: bool) -> None:
        """After the optimiser step (``applied``) or a skipped step (undo the last forward's per-sample
        updates). Collective."""

    def metrics(self) -> dict[str, float]:
        """Numbers this objective reports with each logged step (no collectives)."""
        return {}

    def sync_state(self) -> None:
        """Collective: every rank's state writes are done (before ``state_dict`` for a checkpoint)."""

    def temperature(self, logit_scale: Tensor) -> float:
        """τ for logging: 1/a of the global scale a (0-d)."""
        return float(1.0 / logit_scale.detach().float())
