"""The objectives that learn from the reference model, as convergence-benchmark methods, by registry kind.

A method here is a ``convergence.methods.Method`` whose ``kind`` reads the reference's embeddings. Nothing is
imported for a kind at module import: ``check_registered`` asks the loss registry when the method is chosen,
so ``--methods distill`` in a checkout without the distill objective stops with the registry's "unknown loss
kind" message instead of a crash, and works unchanged once that objective is registered.

- ``drrho``: DRRho-CLIP on FastCLIP v3's estimators (the benchmark's v3 settings: step_thresh τ rule, γ_min
  0.2). Tuned on validation: β (``drrho.ref_weight``) and the initial τ, starting from FastCLIP v3's tuned τ
  of the
  cell; v3's tuned lr_tau and ρ of the cell are kept.
- ``drrho (β = 0)``: the same objective and chosen knobs without the reference term (a control: what the
  reference itself adds).
- ``distill``: MobileCLIP-style (1 − λ)·CLIP + λ·KL(teacher ‖ student) on the best OpenCLIP of the cell (its
  fields and tuned knobs), λ (``distill.weight``) tuned; the teacher's τ is the reference run's final τ.
  ``distill_scratch``: the same for the from-scratch cell, tuned there (λ up to 1; optionally the teacher's
  τ).
"""

from __future__ import annotations

from typing import Any

from benchmarks.objectives.convergence import methods as cm

# objective kinds that read a reference model's embeddings (a run's cache key then includes the reference)
READS_REFERENCE = {"drrho", "distill"}
DRRHO_FIELDS = {
    "kind": "drrho",
    "mode": "fastclip",
    "version": "v3",
    "lr_tau_schedule": "step_thresh",
    "gamma_min": 0.2,
}
KNOWN = ("drrho", "distill")
CONTROL = "drrho (β = 0)"
# the from-scratch cell's own λ grid (``--scratch-tune``): a student far weaker than its teacher is
# MobileCLIP's setting, where the KL term dominates (λ near 1), so the grid reaches the objective's bound 1
# (distillation only); 0.125 is the LiT batch-64 cell's choice. The teacher's τ, when tuned too, spans half to
# twice the reference's.
SCRATCH_WEIGHTS = (0.125, 0.25, 0.5, 0.75, 1.0)
SCRATCH_KNOBS = ("distill.weight", "distill.teacher_tau")


def check_registered(kind: str) -> str:
    """'' when objective ``kind`` is registered in this checkout, else the registry's error message."""
    from toolkit.train.losses import registry

    try:
        registry.spec(kind)
    except ValueError as err:
        return str(err)
    return ""


def drrho(quick: bool) -> cm.Method:
    # ρ is not searched (v3's tuned ρ of the cell is kept): each search point costs a run, and on this shared
    # machine β and τ were what the budget allowed
    grid = {"drrho.ref_weight": (0.25, 0.5, 1.0), "tau_init": cm.TAUS}
    if quick:  # the smoke run: β alone
        grid = {"drrho.ref_weight": (0.5, 1.0)}
    return cm.Method(
        "drrho",
        DRRHO_FIELDS,
        grid,
        bounds={"drrho.ref_weight": (0.0, 8.0)},
        note="DRRho-CLIP on v3's estimators; β and initial τ tuned from v3's tuned τ; v3's lr_tau and ρ",
    )


def control() -> cm.Method:
    return cm.Method(
        CONTROL,
        {**DRRHO_FIELDS, "drrho.ref_weight": 0.0},
        note="drrho's chosen knobs with β = 0: the same loss without the reference",
    )


def distill(openclip_fields: dict[str, Any], teacher_tau: float) -> cm.Method:
    fields = {**openclip_fields, "kind": "distill", "distill.teacher_tau": round(teacher_tau, 5)}
    return cm.Method(
        "distill",
        fields,
        {"distill.weight": (0.25, 0.5, 0.75)},
        bounds={"distill.weight": (0.0, 1.0)},
        note="the best OpenCLIP of the cell plus λ·KL to the reference's similarities; λ tuned",
    )


def distill_scratch(openclip_fields: dict[str, Any], teacher_tau: float, knobs: list[str]) -> cm.Method:
    """distill for the from-scratch cell, tuned on that cell's own validation split: λ over
    ``SCRATCH_WEIGHTS`` and, when ``knobs`` names it, the teacher's τ over (τ/2, τ, 2τ) of the reference's τ
    (the middle value, where the search starts, is the LiT cells' fixed choice, so the λ sweep reuses their
    run keys)."""
    unknown = set(knobs) - set(SCRATCH_KNOBS)
    if unknown or "distill.weight" not in knobs:
        raise SystemExit(
            f"--scratch-tune {' '.join(knobs)}: tunes distill.weight and optionally "
            f"distill.teacher_tau (got {sorted(unknown) or 'no distill.weight'})"
        )
    method = distill(openclip_fields, teacher_tau)
    tau = method.fields["distill.teacher_tau"]
    grid = {"distill.weight": SCRATCH_WEIGHTS}
    if "distill.teacher_tau" in knobs:
        grid["distill.teacher_tau"] = (round(tau / 2, 5), tau, round(2 * tau, 5))
    return cm.Method(
        method.name,
        method.fields,
        grid,
        bounds={"distill.weight": (0.0, 1.0), "distill.teacher_tau": (1e-3, 1.0)},
        note="distill tuned on the from-scratch cell's own validation split: λ up to 1 (KL only)"
        + (" and the teacher's τ" if len(grid) > 1 else ""),
    )


def choose(names: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """(the methods to run, {left out: why}): ``names`` given must all be registered (else SystemExit with
    the registry's message); by default every registered one of ``KNOWN``."""
    unknown = set(names or ()) - set(KNOWN)
    if unknown:
        raise SystemExit(f"unknown method(s) {sorted(unknown)}; known: {list(KNOWN)}")
    chosen, skipped = [], {}
    for name in names or KNOWN:
        why = check_registered(name)
        if why and names:
            raise SystemExit(f"--methods {name}: {why} (this checkout has no {name} objective)")
        if why:
            skipped[name] = why
        else:
            chosen.append(name)
    return chosen, skipped
