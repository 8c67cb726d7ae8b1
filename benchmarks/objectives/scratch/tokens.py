"""Quality per unit of compute on the glyph benchmark: full tokens vs FLIP's patch dropout vs CLIPA's
low-resolution stage with a full-resolution finish, at equal counted tower FLOPs.

The data, the runs and their cache are the from-scratch benchmark's (``glyphset.GlyphSet``, ``runs.Runner``:
real ``toolkit train`` processes, one torch thread each, the trainer's zero-shot evaluation at
``--eval-points`` steps on the validation and held-out styles). Variants (``--variants``, ``VARIANTS``):

- ``full``: every patch at the model's resolution, ``--epochs`` at global batch ``--batch`` (the scratch
  benchmark's short budget: its untuned run of the default objective's method in that cell, e.g.
  ``fastclip-v3 (u_drift)``, shared through the run cache);
- ``patch dropout 0.5`` / ``0.75`` (``toolkit train --patch-dropout``);
- ``half res 0.8, full 0.2``: ``--stages '<S/2>px:0.8;:0.2'`` with one lr schedule over the run. CLIPA-v2's
  recipes spend ~95 % of the samples at reduced resolution (H/14: 12.8B at 84 px, then 0.64B at 224/336 px);
  here the finish gets 20 %: with one cosine over a run of a few hundred steps a 5 % finish would train at
  under 1 % of the peak lr for a few dozen steps, too little to adapt to 4x the image tokens; at 20 % it
  starts at ~10 % of the peak. Half the side is CLIPA's 224 -> 112 px cut (4x fewer patches).

Equal compute: every variant gets the full run's counted tower FLOPs (``toolkit.models.flops``: forward +
backward per step), so a cheaper step buys more steps (the budget rounded to whole steps); the lr schedule
(10 % warmup, cosine) spans each run's own steps. The objective is the same in every variant: the one
``toolkit train`` picks for the full run, spelled out as a loss section (the same run as one without;
``--objective NAME``: one of the scratch benchmark's methods, untuned, instead); FastCLIP's γ decays over
all of each run's epochs, as the trainer's rule has it (a method of the scratch benchmark with γ over 18/37
of the epochs keeps that share of every run; a 1-epoch full run keeps the option's 18 decay epochs).

Reported (``tokens_report``) per variant over ``--seeds`` paired seeds: final held-out R@1 and its paired Δ
vs full, the FLOPs and training time (the runner's ``train_s``: logged step times, evaluation excluded) at
which its seed-mean curve first reaches the full run's final R@1 (linear between evaluations, the start at
chance) as ratios to the full run's, and R@1 at the full run's training time; the issue's targets beside
them; a PNG of R@1 against samples, FLOPs and training time.

    python -m benchmarks.objectives.scratch.tokens --quick     # CI smoke: tiny set, 2 variants, ~1-2 min
    python -m benchmarks.objectives.scratch.tokens             # 4 variants x 3 seeds: hours on 2 cores
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.objectives.convergence.methods import GAMMA_DECAY_FRACTION, Method
from benchmarks.objectives.scratch import methods as sm
from benchmarks.objectives.scratch import tokens_report as tr
from benchmarks.objectives.scratch.glyphset import GlyphSet, add_set_arguments
from benchmarks.objectives.scratch.runs import WARMUP_FRACTION, Runner, add_run_arguments

LOW_RES_SHARE = 0.8  # of the steps at half the side (module docstring: why not CLIPA's ~95 %)
VARIANTS: dict[str, dict[str, Any]] = {  # top-level TrainConfig keys; {SIDE}: half the model's image side
    "full": {},
    "patch dropout 0.5": {"patch_dropout": 0.5},
    "patch dropout 0.75": {"patch_dropout": 0.75},
    f"half res {LOW_RES_SHARE:g}, full {1 - LOW_RES_SHARE:g}": {
        "stages": f"{{SIDE}}px:{LOW_RES_SHARE:g};:{1 - LOW_RES_SHARE:.10g}",
        "stage_lr": "run",
    },
}
QUICK_VARIANTS = ["full", "patch dropout 0.5"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default="runs/scratch", help="the glyph set and every finished run (shared)")
    add_set_arguments(p)
    p.add_argument("--batch", type=int, default=128, help="global batch of every variant")
    p.add_argument("--epochs", type=int, default=6, help="epochs of the full-token run (sets the FLOPs)")
    p.add_argument("--seeds", type=int, default=3, help="paired seeds per variant")
    p.add_argument(
        "--variants", nargs="+", default=None, help=f"variant names (default: all): {', '.join(VARIANTS)}"
    )
    p.add_argument(
        "--objective",
        default=None,
        help="a scratch benchmark method, untuned, for every variant (default: the objective `toolkit "
        f"train` picks for the full run); known: {', '.join(m.name for m in sm.METHODS)}",
    )
    add_run_arguments(p)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 60 characters in >= 12 styles, batch 32, 1 epoch, 1 seed, 2 evaluations, "
        f"variants {' and '.join(QUICK_VARIANTS)}",
    )
    p.add_argument("--out", default="benchmarks/objectives/results/tokens.json")
    args = p.parse_args(argv)
    if args.quick:
        args.min_fonts, args.limit, args.batch, args.epochs = 12, 60, 32, 1
        args.seeds, args.eval_points = 1, 2
        args.variants = args.variants or list(QUICK_VARIANTS)
    args.variants = args.variants or list(VARIANTS)
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}")
    if "full" not in args.variants:
        p.error("the variant 'full' is the reference every other is compared with: keep it in --variants")
    if args.objective is not None and args.objective not in {m.name for m in sm.METHODS}:
        p.error(f"unknown --objective {args.objective!r}; known: {[m.name for m in sm.METHODS]}")
    return args


def _dotted(fields: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'fastclip': {'version': 'v3'}} -> {'fastclip.version': 'v3'} (the runner's loss field layout)."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, dict):
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def objective(args: argparse.Namespace) -> Method:
    """Every variant's method: ``--objective``'s, else the objective ``toolkit train`` picks for the full run
    (``choice.default_loss``) spelled out: the full run is then the same as one without a loss section, the
    other variants (planned by steps, and longer) keep it, and the full run's key is the scratch
    benchmark's untuned run of that method (its cached runs are shared): the drift-corrected v3 with γ over
    the whole run. γ's decay epochs come from each cell (``plan_variants``; ``runs.Runner.task``)."""
    if args.objective is not None:
        method = next(m for m in sm.METHODS if m.name == args.objective)
        if method.fields:
            return method
    from toolkit.train.losses.choice import default_loss

    fields = _dotted(default_loss(args.epochs))
    over_run = fields.pop("fastclip.gamma_decay_epochs", None) == args.epochs
    same = next(
        (m for m in sm.METHODS if m.fields == fields and m.gamma_over_all_epochs == over_run),
        None,
    )
    return same or Method("trainer default (as for the full run)", fields)


class StepFlops:
    """Counted tower FLOPs of a variant's steps: ``at(step)`` summed over its first ``step`` steps."""

    def __init__(self, model_cfg: dict, batch: int, train: dict[str, Any], total_steps: int):
        from toolkit.models.flops import step_flops, tower_flops
        from toolkit.train.stages import parse, schedule

        drop = float(train.get("patch_dropout", 0.0))
        plan = schedule(parse(train["stages"]), total_steps) if train.get("stages") else None
        stages = plan or [None]
        self.ranges = [(s.start, s.stop) if s else (0, total_steps) for s in stages]
        self.per_step = [
            step_flops(
                tower_flops(
                    model_cfg,
                    image_size=(s.image_px or None) if s else None,
                    text_tokens=(s.text_tokens or None) if s else None,
                    patch_dropout=drop,
                ),
                batch,
            )
            for s in stages
        ]

    def at(self, step: int) -> float:
        return sum(
            f * max(0, min(step, stop) - start)
            for f, (start, stop) in zip(self.per_step, self.ranges, strict=True)
        )


def equal_flops_steps(model_cfg: dict, batch: int, train: dict[str, Any], budget: float) -> int:
    """Whole steps of a variant whose counted FLOPs come nearest ``budget`` (a stage plan's steps depend on
    its length: its mean step cost is taken over the fractions, then the count checked ±1 step)."""
    from toolkit.train.stages import parse

    shares = [s.fraction for s in parse(train["stages"])] if train.get("stages") else [1.0]
    probe = StepFlops(model_cfg, batch, train, 10**6)
    mean_step = sum(f * share for f, share in zip(probe.per_step, shares, strict=True))
    guess = max(1, round(budget / mean_step))
    return min(
        range(max(1, guess - 1), guess + 2),
        key=lambda n: abs(StepFlops(model_cfg, batch, train, n).at(n) - budget),
    )


def default_gamma_decay_epochs() -> int:
    """The trainer's γ decay epochs where its rule sets none (a run of one epoch)."""
    from toolkit.train.losses.fastclip.config import FastCLIPConfig

    return int(FastCLIPConfig.__dataclass_fields__["gamma_decay_epochs"].default)


def plan_variants(args: argparse.Namespace, num_train: int, model_cfg: dict) -> list[dict[str, Any]]:
    """Per variant: its top-level train keys, cell (steps, epochs) and ``StepFlops`` at equal FLOPs."""
    from toolkit.models.registry import config_image_size

    per_epoch = max(1, num_train // args.batch)  # the trainer's steps per epoch (no partial batch)
    full_steps = args.epochs * per_epoch
    budget = StepFlops(model_cfg, args.batch, {}, full_steps).at(full_steps)
    side = config_image_size(model_cfg) // 2
    full_decay = (
        round(args.epochs * GAMMA_DECAY_FRACTION) if args.epochs > 1 else default_gamma_decay_epochs()
    )
    out = []
    for name in args.variants:
        train = {
            k: v.replace("{SIDE}", str(side)) if isinstance(v, str) else v for k, v in VARIANTS[name].items()
        }
        steps = full_steps if not train else equal_flops_steps(model_cfg, args.batch, train, budget)
        epochs = args.epochs if not train else round(steps * args.batch / num_train, 3)
        cell = {
            "regime": "tokens",
            "batch": args.batch,
            "epochs": epochs,
            "steps_per_epoch": per_epoch,
            "steps": steps,
            "gamma_decay_epochs": max(1, round(full_decay * epochs / args.epochs)),
        }
        out.append(
            {
                "name": name,
                "train": train,
                "cell": cell,
                "flops": StepFlops(model_cfg, args.batch, train, steps),
            }
        )
    return out


def _config(args: argparse.Namespace, data: GlyphSet, plans: list[dict], method, runner, start) -> dict:
    return {
        **{k: v for k, v in data.counts.items() if k != "spec"},
        "model": args.model,
        "batch": args.batch,
        "full_epochs": args.epochs,
        "lr": args.lr,
        "weight_decay": 0.1,
        "warmup_fraction": WARMUP_FRACTION,
        "gamma_decay_fraction": GAMMA_DECAY_FRACTION,
        "seeds": args.seeds,
        "eval_points": args.eval_points,
        "min_fonts": args.min_fonts,
        "size": args.size,
        "limit": args.limit,
        "objective": [method.name, method.fields],
        "variants": {p["name"]: {"train": p["train"], **p["cell"]} for p in plans},
        "workers": args.workers,
        "quick": args.quick,
        "failed_runs": dict(runner.failed),
        "wall_s": round(time.monotonic() - start, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.monotonic()
    from toolkit.models.factory import resolve_spec

    data = GlyphSet(args)
    plans = plan_variants(args, data.counts["num_train_pairs"], resolve_spec(args.model).model_cfg)
    method = objective(args)
    runner = Runner(args, data)
    tasks = {
        p["name"]: [runner.task(p["cell"], method, {}, seed, train=p["train"]) for seed in range(args.seeds)]
        for p in plans
    }
    runner.run_all([t for ts in tasks.values() for t in ts])
    curves = {name: runner.curves(ts) for name, ts in tasks.items()}
    done = {p["name"]: (p, curves[p["name"]]) for p in plans if curves[p["name"]] is not None}
    results = tr.summarise(done, chance=1.0 / data.counts["num_held_pairs"]) if "full" in done else {}
    report = {
        "config": _config(args, data, plans, method, runner, start),
        "unfinished": sorted(set(tasks) - set(done)),
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    if results:
        tr.plot(results, out.with_suffix(".png"))
    out.with_suffix(".md").write_text(tr.markdown(report, out.stem))
    print(out.with_suffix(".md").read_text())
    return report


if __name__ == "__main__":
    main()
