"""``TrainingLoss``: the one interface the trainer sees, whatever the objective and distributed mode.

Called by every rank of ``group`` each optimiser step, with the same local batch size b on every rank:

    share = loss(image_features [b, d], text_features [b, d], logit_scale a (0-d, = exp(p)), index [b],
                 logit_bias=None)                      # the model's learnable bias (sigmoid losses), 0-d

An objective with ``reads_reference = True`` is called with one more keyword,
``reference=(ref_image [b, d_ref], ref_text [b, d_ref])``: a reference (teacher) model's L2-normalised
embeddings of the same b samples, in the same row order, from a training set precomputed with
``--reference-model`` (d_ref may differ from d). The trainer refuses a training set without them for
such an objective (``batches.check_reference``).

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
``build_loss`` refuses a missing ``data_size``); ``reads_reference`` (forward takes ``reference=``, above).
``check_sizes`` (constructor option, default True): refuse unequal local batches across ranks with one tiny
all_gather per step; the trainer turns it off because its loader gives every rank exactly B/K samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor, nn

from toolkit.train.losses.config import LossConfig
from toolkit.train.losses.modes.contrastive import mean_over_ranks


def reference_rows(reference: object, b: int, objective: str) -> tuple[Tensor, Tensor]:
    """(ref_image, ref_text) [b, d_ref] of an objective that ``reads_reference`` (named ``objective`` in the
    errors), after refusing a missing reference, one that is not a pair, and rows that are not both [b, d_ref]
    for the local batch's b. Called by every rank in the objective's forward, before any collective."""
    if reference is None:
        raise ValueError(
            f"{objective} needs reference=(ref_image, ref_text): the reference model's features of the "
            "batch (build the training set with --reference-model)"
        )
    if not isinstance(reference, (tuple, list)) or len(reference) != 2:
        raise ValueError(
            f"{objective}: reference must be (ref_image [b, d_ref], ref_text [b, d_ref]), got "
            f"{type(reference).__name__}"
        )
    ref_image, ref_text = reference
    if ref_image.dim() != 2 or ref_image.shape != ref_text.shape or ref_image.shape[0] != b:
        raise ValueError(
            f"{objective}: reference features ref_image {tuple(ref_image.shape)} and ref_text "
            f"{tuple(ref_text.shape)} must both be [b, d_ref] with b = {b} (the batch's rows)"
        )
    return ref_image, ref_text


@dataclass(frozen=True)
class StatePart:
    """State an objective keeps outside nn.Module parameters (FastCLIP's tables, NeuCLIP's network), saved in
    its state dict as ``NAME.KEY`` flat tensors. ``obj`` has ``state() -> {KEY: Tensor}`` and
    ``load({KEY: Tensor}, source=)``; ``required``: keys whose absence is a missing key; ``owned``: the keys
    it claims on load (None: every ``NAME.`` key)."""

    name: str
    obj: Any
    required: tuple[str, ...]
    owned: tuple[str, ...] | None = None


class TrainingLoss(nn.Module):
    """Base of every objective ``build_loss`` returns (module docstring); subclasses implement forward,
    keep its detached value in ``self._last``, and override the hooks they need (the defaults do nothing)."""

    needs_data_size: ClassVar[bool] = False
    # True when forward needs the reference model's features of the batch: the trainer then passes
    # reference=(ref_image [b, d_ref], ref_text [b, d_ref]) and refuses a training set without them
    reads_reference: ClassVar[bool] = False
    # True when forward already returns the global value on every rank (the fastclip-mode objectives)
    value_is_global: ClassVar[bool] = False

    def __init__(self, cfg: LossConfig, group=None, *, check_sizes: bool = True):
        super().__init__()
        self.cfg, self.group, self.check_sizes = cfg, group, check_sizes
        self.ledger = None  # a CommLedger counting the collectives, where the objective takes one
        self._last: Tensor | None = None  # the last forward's value (detached, 0-d): this rank's share

    def begin_step(self, step: int, steps_per_epoch: int) -> None:
        """Before the forward of optimiser step ``step`` (0-based; epoch = step // steps_per_epoch)."""

    def global_value(self) -> Tensor:
        """The last forward's global objective value (0-d, detached): the mean of the ranks' shares, or the
        value itself when ``value_is_global``. Collective (every rank calls it)."""
        if self._last is None:
            raise RuntimeError("global_value() before the first forward")
        return self._last if self.value_is_global else mean_over_ranks(self._last, self.group, self.ledger)

    def end_step(self, applied: bool) -> None:
        """After the optimiser step (``applied``) or a skipped step (undo the last forward's per-sample
        updates). Collective."""

    def metrics(self) -> dict[str, float]:
        """Numbers this objective reports with each logged step (no collectives)."""
        return {}

    def sync_state(self) -> None:
        """Collective: every rank's state writes are done (before ``state_dict`` for a checkpoint)."""

    def state_parts(self) -> list[StatePart]:
        """The objective's state outside its parameters and buffers (saved and loaded by the hooks below)."""
        return []

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for part in self.state_parts():
            for key, t in part.obj.state().items():
                destination[f"{prefix}{part.name}.{key}"] = t

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        for part in self.state_parts():
            pre = f"{prefix}{part.name}."

            def claimed(key: str, part: StatePart = part, pre: str = pre) -> bool:
                return key.startswith(pre) and (part.owned is None or key[len(pre) :] in part.owned)

            unexpected_keys[:] = [k for k in unexpected_keys if not claimed(k)]
            missing = [pre + k for k in part.required if pre + k not in state_dict]
            if missing:
                missing_keys.extend(missing)
                continue
            try:
                part.obj.load(
                    {k[len(pre) :]: v for k, v in state_dict.items() if claimed(k)}, source="state_dict"
                )
            except (KeyError, ValueError) as err:
                error_msgs.append(str(err))

    def temperature(self, logit_scale: Tensor) -> float:
        """τ for logging: 1/a of the global scale a (0-d)."""
        return float(1.0 / logit_scale.detach().float())
