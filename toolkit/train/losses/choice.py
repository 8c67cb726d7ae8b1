"""The objective ``toolkit train`` uses when none is named: the winner of the convergence evidence at the
run's global batch size and planned epochs (torch-free: config building calls it).

``BY_BATCH`` (runs of up to ``SHORT_EPOCHS_MAX`` epochs, and runs planned by ``steps``, whose epoch count
is unknown when the config is built) and ``BY_BATCH_LONG`` (longer runs) hold (largest global batch, the
``LossConfig`` fields of the objective to use up to it); each table's last row applies to every larger
batch. The evidence is ``benchmarks/objectives/results/convergence.md`` (6 and 30 epochs) and
``convergence_gamma.md`` (30 epochs, every knob tuned on the long regime's own validation split, γ
included) from ``benchmarks/objectives/convergence/``: held-out retrieval of LiT heads on emoji drawings,
paired seeds. docs/objectives.md explains the choice. An explicit ``--loss`` / ``loss.kind`` or a
``--preset`` always wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The benchmark measured 6 and 30 epochs only; the boundary between them is not measured: 12 is about their
# geometric middle (sqrt(6 * 30) = 13.4), rounded down so that a doubled short run still counts as short.
SHORT_EPOCHS_MAX = 12
# FastCLIP's γ decays over this share of the planned epochs, as in every benchmark cell (the CC3M preset's 18
# of its 37 epochs); without it the trainer's gamma_decay_epochs default (18) would decay γ over more epochs
# than a short run has, a schedule the evidence never measured.
GAMMA_DECAY_FRACTION = 18 / 37
# Keys of a (sectioned) loss mapping that only FastCLIP-style objectives read: its ``fastclip`` section
# (estimators u, γ) and the robust loss's ρ and ε: a loss that sets one without a kind asks for FastCLIP, not
# for the long-run OpenCLIP
FASTCLIP_KNOBS = frozenset({"rho", "eps", "fastclip"})

# benchmarks/objectives/results/convergence.md (LiT heads on 3 training artists' 4,882 pairs, all ~1,900
# concepts, scored on a 4th artist, knobs tuned on validation, 5 paired seeds): after 6 epochs FastCLIP-v3
# with drift-corrected estimators (u_drift: batch) is the best cliptk objective by validation at batch 32 and
# 256 and ahead of the best-tuned OpenCLIP at 32, 64 and 256 (+0.94, +0.67, +0.64 R@1), while plain v3 trails
# OpenCLIP at every batch (-0.78, -1.19, -3.42). (NeuCLIP wins batch 64, +1.78, but costs ~5 v3 steps of CPU
# per LiT step and trails after 30 epochs.) The table keeps its batch rows so new evidence can split it.
BY_BATCH: tuple[tuple[int | None, dict[str, Any]], ...] = (
    (None, {"kind": "fastclip", "fastclip": {"version": "v3", "u_drift": "batch"}}),
)
# After 30 epochs, up to batch 64, no cliptk objective keeps up with a tuned OpenCLIP, even with γ tuned; at
# batch 256 the drift-corrected v3 is ahead. convergence_gamma.md (30 epochs, every knob tuned on the long
# regime's own validation split, FastCLIP's final γ included, 5 paired seeds): batch 64: the best OpenCLIP is
# the learnable τ with lr_tau 1e-4 (16.52 R@1); drift-corrected v3 with γ tuned (0.3) -0.93 ± 0.39, with
# DRRho's γ rule -0.98, with SCENT's update -1.12. Batch 256: drift-corrected v3 +0.81 ± 0.26 ahead of the
# best OpenCLIP (learnable τ, lr_tau 1e-5: 16.56); OpenCLIP with lr_tau 1e-4 +0.05 ± 0.09. convergence.md
# (batch 32, knobs from the short regime, 5 seeds): the best OpenCLIP is the fixed τ 0.07, the learnable τ
# with lr_tau 1e-4 +0.01 ± 0.10, drift-corrected v3 -0.78 ± 0.50. So long runs get OpenCLIP with τ learned
# slowly from 0.07 (lr_tau 1e-4 against the benchmark's model lr 1e-3; at lr_tau 1e-3 it trailed by 1.7 points
# at batch 64 on the tuning seed) up to batch 128 (unmeasured: the geometric middle of 64 and 256), and the
# short runs' FastCLIP above.
BY_BATCH_LONG: tuple[tuple[int | None, dict[str, Any]], ...] = (
    (128, {"kind": "openclip", "mode": "gather", "learn_tau": True, "lr_tau": 1e-4}),
    (None, {"kind": "fastclip", "fastclip": {"version": "v3", "u_drift": "batch"}}),
)


def _row(table: tuple[tuple[int | None, dict[str, Any]], ...], batch_size: int) -> dict[str, Any]:
    for largest, fields in table:
        if largest is None or batch_size <= largest:
            return {k: dict(v) if isinstance(v, Mapping) else v for k, v in fields.items()}
    raise AssertionError("a choice table must end with a row for every larger batch")


def default_loss(
    batch_size: int, epochs: int | None = None, given: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """LossConfig fields of the objective the evidence picks at global batch ``batch_size`` for a run of
    ``epochs`` planned epochs (None: not known, as for a run planned by steps: the short-run table).
    ``given``: the loss keys the user set without naming a kind, sectioned as ``LossConfig`` is; FastCLIP's
    own knobs among them
    (``FASTCLIP_KNOBS``) make it a FastCLIP run, so the short-run table's FastCLIP row applies at any epochs.
    For FastCLIP with more than one epoch, γ decays over ``GAMMA_DECAY_FRACTION`` of them as benchmarked
    (unless DRRho's γ rule is asked for: it plans its own decay, over all the epochs)."""
    given = given or {}
    long_run = epochs is not None and epochs > SHORT_EPOCHS_MAX and not FASTCLIP_KNOBS & set(given)
    fields = _row(BY_BATCH_LONG if long_run else BY_BATCH, batch_size)
    section = given.get("fastclip") if isinstance(given.get("fastclip"), Mapping) else {}
    drrho = section.get("gamma_rule") == "drrho"  # the tables' rows leave the γ rule at its default
    if epochs is not None and epochs > 1 and fields["kind"] == "fastclip" and not drrho:
        decay_epochs = max(1, round(epochs * GAMMA_DECAY_FRACTION))
        fields.setdefault("fastclip", {}).setdefault("gamma_decay_epochs", decay_epochs)
    return fields


def _name(fields: dict[str, Any]) -> str:
    """'fastclip-v3 (u_drift: batch)': the --loss name, then the row's other keys (a section's by their own
    name)."""
    section = fields.get("fastclip", {})
    name = fields["kind"] + (f"-{section['version']}" if "version" in section else "")
    rest = {
        **{k: v for k, v in fields.items() if k not in ("kind", "fastclip")},
        **{k: v for k, v in section.items() if k != "version"},
    }
    return name + "".join(f" ({k}: {v})" for k, v in rest.items())


def _describe_table(table: tuple[tuple[int | None, dict[str, Any]], ...]) -> str:
    parts = [
        f"{_name(f)} up to batch {largest}" if largest is not None else f"{_name(f)} above"
        for largest, f in table
    ]
    if len(parts) == 1:
        return parts[0].removesuffix(" above") + " at every batch"
    return ", ".join(parts)


def describe() -> str:
    """'fastclip-v3 (u_drift: batch) at every batch', or 'X up to batch N, Y above': for runs of more than
    SHORT_EPOCHS_MAX epochs first, then for the others (for --help and docs)."""
    short, long = _describe_table(BY_BATCH), _describe_table(BY_BATCH_LONG)
    if short == long:
        return short
    return f"for more than {SHORT_EPOCHS_MAX} planned epochs {long}; otherwise {short}"
