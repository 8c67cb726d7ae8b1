"""The methods the convergence benchmark compares, and how each is tuned on the validation split.

A method is a name, the ``LossConfig`` fields that make it (nested sections with dotted keys:
``"neuclip.lr"``) and its tuning grid: {field: candidate values}. Adding an objective to the benchmark
is one more ``Method(...)`` line; one whose ``kind`` is not registered in this checkout (an objective
still on its way to main) is skipped with a note, not an error.

Tuning is a coordinate search on the validation score (mean of image→text and text→image R@1 on the
training artists' held-back drawings, averaged over the tuning seeds, at the last step): knobs in the
order given, each swept with the others at their best so far. When a knob's best value is at an end
of its grid, the grid is extended one step past that end (geometric steps: the ratio of the last two
values), up to ``MAX_EXTENSIONS`` times, so a reported best is never a grid end unless the limit or a
bound stopped the search — the report says so when that happens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from toolkit.core.config import build, deep_merge
from toolkit.core.config_load import set_path
from toolkit.train.losses import LossConfig
from toolkit.train.losses.config import MOVED_KEYS
from toolkit.train.losses.registry import specs

# FastCLIP's γ decays over this share of a cell's epochs for every method without its own rule: the CC3M
# preset's 18 of its 37 epochs (the share the benchmark has always used; the trainer's default decays γ over
# all the planned epochs since issue 40)
GAMMA_DECAY_FRACTION = 18 / 37

MAX_EXTENSIONS = 3  # per knob and end: beyond 3 steps past a grid the objective is not the limiting factor


@dataclass(frozen=True)
class Method:
    """A row of the benchmark: ``name``, LossConfig ``fields``, tuning ``grid`` {field: values} (in order)."""

    name: str
    fields: dict[str, Any]
    grid: dict[str, tuple[float, ...]] = field(default_factory=dict)
    is_openclip: bool = False  # a candidate for "the best OpenCLIP" every other method is compared with
    note: str = ""
    bounds: dict[str, tuple[float, float]] = field(default_factory=dict)  # hard limits of a knob
    # (method, knobs): start from that method's tuned values of these knobs in the same cell (tuned first)
    inherits: tuple[str, tuple[str, ...]] | None = None
    # γ decays over all the cell's epochs (DRRho-CLIP's rule: E = the run's epochs, as `toolkit train` sets
    # gamma_decay_epochs for gamma_rule drrho) instead of the benchmark's 18/37 of them (the CC3M preset's
    # share)
    gamma_over_all_epochs: bool = False

    @property
    def kind(self) -> str:
        return str(self.fields.get("kind", "fastclip"))


TAUS = (0.02, 0.03, 0.05, 0.07, 0.1)
# FastCLIP's final inner lr γ (the moving average's weight of the new batch estimate; 1: no averaging, u = g),
# tuned after τ, lr_tau and ρ; the CC3M preset's 0.2 sits between the first two values; searched from the
# middle
GAMMAS = (0.1, 0.3, 1.0)
GAMMA_BOUNDS = {"gamma_min": (1e-3, 1.0)}  # γ ≤ 1 (a convex combination); the option's own bound is γ > 0


def fixed_tau_floors(fields: dict[str, Any]) -> tuple[Method, ...]:
    """C (``fields``: the default before its τ floor, spelled as the benchmark spells loss keys) with its
    learned τ kept at or above each of the untuned floors both benchmarks measured, γ over the run."""
    return tuple(
        Method(
            f"fastclip-v3 (u_drift, γ over the run, τ floor {floor:g})",
            {**fields, "tau_floor": floor},
            gamma_over_all_epochs=True,
            note=f"the default before its floor (C) with its learned τ kept at or above {floor:g} (0.03: the "
            "default since 2026-12-07); nothing tuned",
        )
        for floor in (0.02, 0.03)
    )


METHODS: tuple[Method, ...] = (
    Method(
        "openclip (learnable τ)",
        {"kind": "openclip", "mode": "gather", "learn_tau": True},
        {"lr_tau": (1e-4, 1e-3, 1e-2)},
        is_openclip=True,
        note="what users run by default: τ starts at 0.07 and is learned with its own lr",
    ),
    Method(
        "openclip (fixed τ)",
        {"kind": "openclip", "mode": "gather", "learn_tau": False},
        {"tau_init": TAUS},
        is_openclip=True,
    ),
    Method(
        "fastclip-v1",
        {"kind": "fastclip", "version": "v1", "gamma_min": 0.2},
        {"tau_init": TAUS, "gamma_min": GAMMAS},
        bounds=GAMMA_BOUNDS,
        note="initial τ and final γ tuned",
    ),
    Method(
        "fastclip-v3",
        {"kind": "fastclip", "version": "v3", "lr_tau_schedule": "step_thresh", "gamma_min": 0.2},
        {"tau_init": TAUS, "lr_tau": (2e-5, 2e-4, 2e-3), "rho": (4.0, 6.5, 9.0), "gamma_min": GAMMAS},
        bounds=GAMMA_BOUNDS,
        note="the CC3M preset's rule (step_thresh); initial τ, lr_tau, ρ and final γ tuned",
    ),
    Method(
        "fastclip-v3 (u_drift)",
        {
            "kind": "fastclip",
            "version": "v3",
            "lr_tau_schedule": "step_thresh",
            "gamma_min": 0.2,
            "u_drift": "batch",
        },
        {"tau_init": TAUS, "lr_tau": (2e-5, 2e-4, 2e-3), "rho": (4.0, 6.5, 9.0), "gamma_min": GAMMAS},
        bounds=GAMMA_BOUNDS,
        note="v3 with the batch drift correction of its estimators (docs/fastclip.md), tuned as v3",
    ),
    # the γ rules replace γ's tuning: each starts from the drift-corrected v3's tuned τ, lr_tau and ρ of the
    # cell (the same loss and τ rule; only how the estimators u are updated differs)
    Method(
        "fastclip-v3 (u_drift, drrho γ)",
        {
            "kind": "fastclip",
            "version": "v3",
            "lr_tau_schedule": "step_thresh",
            "u_drift": "batch",
            "gamma_rule": "drrho",
        },
        inherits=("fastclip-v3 (u_drift)", ("tau_init", "lr_tau", "rho")),
        gamma_over_all_epochs=True,
        note="DRRho-CLIP's γ rule: final γ = min(1, 4.177·E^-0.7265) reached over all E epochs (γ = 1 up to "
        "7 epochs); τ, lr_tau and ρ from the drift-corrected v3 of the cell, nothing else tuned",
    ),
    Method(
        "fastclip-v3 (scent)",
        {
            "kind": "fastclip",
            "version": "v3",
            "lr_tau_schedule": "step_thresh",
            "u_update": "scent",
            "gamma_schedule": "constant",
        },
        {"scent_gamma": (1.0, 3.0, 10.0)},
        inherits=("fastclip-v3 (u_drift)", ("tau_init", "lr_tau", "rho")),
        note="SCENT's estimator update (per-sample step σ(log u_i + γ_s), γ_s constant after epoch 0 as in "
        "SCENT's scripts), without u_drift as published; γ_s tuned; τ, lr_tau and ρ from the "
        "drift-corrected v3 of the cell",
    ),
    # m = 256 prototypes, not the paper's 4,096: the paper's m serves millions of samples, these runs train on
    # ~1,000–4,800 pairs (and 4,096 made a step ~6x a FastCLIP step on the quick synthetic set here)
    # the same robust loss as v3: its τ and ρ start from v3's tuned values (a NeuCLIP step costs several v3
    # steps here, so its own search covers the network's lr)
    Method(
        "neuclip",
        {
            "kind": "neuclip",
            "mode": "fastclip",
            "lr_tau_schedule": "step_thresh",
            "neuclip.num_prototypes": 256,
        },
        {"neuclip.lr": (1e-3, 1e-2, 1e-1)},
        inherits=("fastclip-v3", ("tau_init", "lr_tau", "rho")),
        note="v3's loss and τ rule with v3's tuned initial τ, lr_tau and ρ of the cell; 256 prototypes; the "
        "network's lr tuned; its other settings at their documented defaults",
    ),
    Method(
        "siglip",
        {"kind": "siglip", "mode": "gather"},
        {"siglip_scale_init": (5.0, 10.0, 20.0)},
        note="sigmoid loss, learnable scale and bias (bias starts at −10); the initial scale tuned",
    ),
    # not a candidate for "the best OpenCLIP": the trainer's default before issue 40 for runs of more than
    # 12 planned epochs up to batch 128 (its runs are the learnable-τ OpenCLIP's at that lr_tau: the cache
    # shares them)
    Method(
        "openclip (long-run default)",
        {"kind": "openclip", "mode": "gather", "learn_tau": True, "lr_tau": 1e-4},
        note="the trainer's former default objective for runs of more than 12 planned epochs up to batch "
        "128, as it was: nothing tuned",
    ),
    # candidates for one default at every batch and run length (issue 40), each as the trainer runs FastCLIP
    # when asked for nothing else: τ from 0.07 learned at the model's lr (cosine), ρ 8, γ from 1 to 0.2;
    # nothing tuned. They differ only in how long γ takes to reach its minimum.
    Method(
        "fastclip-v3 (u_drift, γ over the run)",
        {"kind": "fastclip", "version": "v3", "u_drift": "batch"},
        gamma_over_all_epochs=True,
        note="the drift-corrected v3 at the trainer's defaults with γ decaying over all the planned epochs "
        "(a schedule that scales with the run); nothing tuned",
    ),
    Method(
        "fastclip-v3 (u_drift), defaults",
        {"kind": "fastclip", "version": "v3", "u_drift": "batch"},
        note="the trainer's former short-run default as it was: the drift-corrected v3 at the trainer's "
        "defaults, γ decaying over 18/37 of the planned epochs; nothing tuned",
    ),
    # the τ rules tried against the default's one miss (30 epochs at batch 32, where τ learned at the
    # model's lr fell to 0.0145 while the best OpenCLIP kept it near 0.07): the same objective, τ slowed
    Method(
        "fastclip-v3 (u_drift, γ over the run, τ step_thresh)",
        {"kind": "fastclip", "version": "v3", "u_drift": "batch", "lr_tau_schedule": "step_thresh"},
        gamma_over_all_epochs=True,
        note="the default with the reference's τ rule: τ's lr (the model's) divided by 3 once τ <= 0.03; "
        "nothing tuned",
    ),
    Method(
        "fastclip-v3 (u_drift, γ over the run, ρ tuned)",
        {"kind": "fastclip", "version": "v3", "u_drift": "batch"},
        {"rho": (2.0, 4.0, 8.0)},
        gamma_over_all_epochs=True,
        note="the default with ρ tuned (8 is its default): at ρ 8 its τ-gradient, about ρ − KL(p ‖ uniform) "
        "over a batch's negatives with KL ≤ ln(B − 1), stays positive and τ falls all run",
    ),
    Method(
        "fastclip-v3 (u_drift, γ over the run, ρ 2)",
        {"kind": "fastclip", "version": "v3", "u_drift": "batch", "rho": 2.0},
        gamma_over_all_epochs=True,
        note="the default with ρ 2 instead of 8 (on these heads τ still ends where ρ 8's does); "
        "nothing tuned",
    ),
    Method(
        "fastclip-v3 (u_drift, γ over the run, τ floor tuned)",
        {"kind": "fastclip", "version": "v3", "u_drift": "batch"},
        {"tau_floor": (0.02, 0.03, 0.05)},
        gamma_over_all_epochs=True,
        note="the default before its floor (C) with a higher floor under its learned τ (loss.tau_floor; "
        "C's is 0.01): at ρ 8 its τ falls every step, to 0.0145 after 30 epochs at batch 32 (the best "
        "OpenCLIP's: ~0.07)",
    ),
    *fixed_tau_floors({"kind": "fastclip", "version": "v3", "u_drift": "batch"}),
    Method(
        "fastclip-v3 (u_drift, γ over the run, lr_tau lr/10)",
        {"kind": "fastclip", "version": "v3", "u_drift": "batch", "lr_tau": 1e-4},
        gamma_over_all_epochs=True,
        note="the default with τ learned at a tenth of the model's lr (1e-4 at the benchmark's lr 1e-3); "
        "nothing tuned",
    ),
)


def loss_config(fields: dict[str, Any], source: str) -> LossConfig:
    """LossConfig from the benchmark's fields (validated as YAML would be): dotted keys for nested sections;
    a section's knob named by its own name (``gamma_min``, ``siglip_scale_init``), as the run cache and the
    result files have named them since before the sections, goes into its section (``MOVED_KEYS``)."""
    data: dict[str, Any] = {}
    for key, value in fields.items():
        path = MOVED_KEYS.get(key, key).split(".")
        if isinstance(value, dict):
            value = deep_merge(get_path(data, path) or {}, value)
        set_path(data, path, value)
    return build(LossConfig, data, source=source)


def get_path(data: dict[str, Any], path: list[str]) -> Any:
    for part in path:
        data = data.get(part) if isinstance(data, dict) else None
    return data


def unavailable(method: Method) -> str:
    """Why ``method`` cannot run in this checkout ('' when it can)."""
    if method.kind not in specs():
        return f"loss kind {method.kind!r} is not registered in this checkout"
    try:
        loss_config({**method.fields, **{k: v[0] for k, v in method.grid.items()}}, method.name)
    except (ValueError, TypeError) as err:
        return f"its fields do not fit this checkout's LossConfig: {err}"
    return ""


def _extend(values: tuple[float, ...], upward: bool, bounds: tuple[float, float] | None) -> float | None:
    """The next grid value past the upper (or lower) end, geometric; None past a bound."""
    ratio = values[-1] / values[-2] if upward else values[0] / values[1]
    nxt = (values[-1] if upward else values[0]) * ratio
    if bounds is not None and not bounds[0] <= nxt <= bounds[1]:
        return None
    return float(f"{nxt:.3g}")


@dataclass
class Search:
    """Coordinate search of one method in one (regime, batch) cell; scores come from validation runs."""

    method: Method
    scores: dict[tuple, float] = field(default_factory=dict)  # knob values (in grid order) -> val score
    knob: int = 0
    grids: dict[str, tuple[float, ...]] = field(default_factory=dict)
    extensions: dict[str, int] = field(default_factory=dict)
    ends_at_best: list[str] = field(default_factory=list)  # knobs whose best stayed at a grid end (limit hit)
    adopted_from: str = ""  # knobs taken from another cell's tuning instead of searched here
    inherited: dict[str, Any] = field(default_factory=dict)  # knobs fixed from another method's search
    max_extensions: int = (
        MAX_EXTENSIONS  # per knob and end (the from-scratch benchmark lowers it: runs cost minutes)
    )

    def __post_init__(self) -> None:
        self.grids = {k: tuple(sorted(v)) for k, v in self.method.grid.items()}
        self.best = {k: v[len(v) // 2] for k, v in self.grids.items()}  # middle of each grid to start

    def _point(self, **change: float) -> tuple:
        return tuple({**self.best, **change}[k] for k in self.grids)

    def pending(self) -> list[dict[str, float]]:
        """Knob settings still to score for the current knob ([] when the search is done)."""
        if self.knob >= len(self.grids):
            return []
        name = list(self.grids)[self.knob]
        points = [self._point(**{name: v}) for v in self.grids[name]]
        return [dict(zip(self.grids, p, strict=True)) for p in points if p not in self.scores]

    def record(self, knobs: dict[str, float], score: float) -> None:
        self.scores[tuple(knobs[k] for k in self.grids)] = score

    def advance(self) -> None:
        """After the pending points are scored: fix the current knob at its best, extending its grid first
        when the best is at an end."""
        while self.knob < len(self.grids) and not self.pending():
            name = list(self.grids)[self.knob]
            values = self.grids[name]
            scores = [self.scores[self._point(**{name: v})] for v in values]
            tied = [v for v, sc in zip(values, scores, strict=True) if sc == max(scores)]
            best = tied[len(tied) // 2]  # a tie is no reason to extend: the middle of the tied values
            self.best[name] = best
            at_end = len(values) > 1 and best in (values[0], values[-1])
            if at_end and self.extensions.get(name, 0) < self.max_extensions:
                nxt = _extend(values, best == values[-1], self.method.bounds.get(name))
                if nxt is not None:
                    self.extensions[name] = self.extensions.get(name, 0) + 1
                    self.grids[name] = tuple(sorted((*values, nxt)))
                    continue
            if at_end:
                self.ends_at_best.append(name)
            self.knob += 1

    def adopt(self, chosen: dict[str, Any], source: str) -> None:
        """Take ``chosen`` knob values tuned elsewhere (``source``) and end the search."""
        self.best, self.knob, self.adopted_from = dict(chosen), len(self.grids), source

    def inherit(self, knobs: dict[str, Any]) -> None:
        """Fix knobs tuned by another method of the cell (``Method.inherits``) before searching."""
        self.inherited = dict(knobs)

    def best_fields(self) -> dict[str, Any]:
        return {**self.method.fields, **self.inherited, **self.best}

    def report(self) -> dict[str, Any]:
        """The grids as searched, every scored point and the chosen values (for the JSON)."""
        return {
            "grids": {k: list(v) for k, v in self.grids.items()},
            "chosen": {**self.inherited, **self.best},
            "inherited": dict(self.inherited),
            "ends_at_best": list(self.ends_at_best),
            "adopted_from": self.adopted_from,
            "scores": [
                {**dict(zip(self.grids, p, strict=True)), "val_r1": s} for p, s in self.scores.items()
            ],
        }


def describe(knobs: dict[str, Any]) -> str:
    """'lr_tau=0.0002, rho=6.5' (for tables and logs)."""
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in knobs.items())
