"""Statistics, tables and the plot of the token-budget benchmark (``tokens``; curves as ``runs`` has them).

R@1 is the mean of image→text and text→image. A variant's curve is the mean over its seeds at each of its
evaluations (the seeds of a variant evaluate at the same steps); its x-axes are samples seen, counted tower
FLOPs up to the evaluation (``tokens.StepFlops``) and training seconds (seed mean). Interpolation is linear
between evaluations and starts at (0, chance): no run is evaluated before its first step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.objectives.convergence.report import mean_r1, stats

# issue 41's targets: reach the full run's final held-out R@1 with at most these shares of its FLOPs and
# training time; at equal training time, at least this R@1 gain with Δ above 2 paired std
REACH_FLOPS_MAX, REACH_TIME_MAX, EQUAL_TIME_GAIN_MIN = 0.5, 0.6, 0.01


def first_reach(xs: list[float], ys: list[float], target: float, chance: float) -> float | None:
    """The first x at which the curve (0, chance), (xs, ys) reaches ``target``; None if it never does. The
    start never counts as reaching: a target at or below chance is reached at the first evaluation."""
    px, py = [0.0, *xs], [chance, *ys]
    for i in range(1, len(px)):
        if py[i] >= target:
            if py[i - 1] >= target:
                return px[i]
            return px[i - 1] + (target - py[i - 1]) * (px[i] - px[i - 1]) / (py[i] - py[i - 1])
    return None


def value_at(xs: list[float], ys: list[float], x: float, chance: float) -> tuple[float, bool]:
    """(the curve's value at ``x``, whether the run ended before ``x``: then its last value)."""
    return float(np.interp(x, [0.0, *xs], [chance, *ys])), x > xs[-1]


def _paired(values: list[float], ref: list[float]) -> dict[str, Any]:
    diffs = [v - r for v, r in zip(values, ref, strict=True)]
    d = stats(diffs)
    return {**d, "per_seed": diffs, "ahead_by_2_std": len(diffs) > 1 and d["mean"] > 2 * d["std"]}


def _curves(plan: dict, runs: list[dict]) -> dict[str, list[float]]:
    return {
        "samples": runs[0]["samples_seen"],
        "flops": [plan["flops"].at(s) for s in runs[0]["step"]],
        "train_s": np.mean([r["train_s"] for r in runs], 0).tolist(),
        "heldout": np.mean([[mean_r1(p) for p in r["heldout"]] for r in runs], 0).tolist(),
        "val": np.mean([[mean_r1(p) for p in r["val"]] for r in runs], 0).tolist(),
    }


def _row(plan: dict, runs: list[dict], full: dict[str, Any], chance: float) -> dict[str, Any]:
    c = _curves(plan, runs)
    final = [mean_r1(r["heldout"][-1]) for r in runs]
    steps = plan["cell"]["steps"]
    at_time = [  # per seed: R@1 at the same seed's full run's final training time
        value_at(r["train_s"], [mean_r1(p) for p in r["heldout"]], t, chance)
        for r, t in zip(runs, full["train_s_per_seed"], strict=True)
    ]
    reach_flops = first_reach(c["flops"], c["heldout"], full["target"], chance)
    reach_s = first_reach(c["train_s"], c["heldout"], full["target"], chance)
    return {
        "train": plan["train"],
        "steps": steps,
        "epochs": plan["cell"]["epochs"],
        "samples": steps * plan["cell"]["batch"],
        "flops": plan["flops"].at(steps),
        "num_seeds": len(runs),
        "heldout_r1": stats(final),
        "val_r1": stats([mean_r1(r["val"][-1]) for r in runs]),
        "distinct_r1": stats([mean_r1(r["heldout_distinct"][-1]) for r in runs]),
        "heldout_r10": stats([mean_r1(r["heldout_r10"]) for r in runs]),
        "delta_vs_full": _paired(final, full["final_per_seed"]),
        "reach_flops_ratio": None if reach_flops is None else reach_flops / full["flops"],
        "reach_time_ratio": None if reach_s is None else reach_s / full["train_s"],
        "r1_at_full_time": stats([v for v, _ in at_time]),
        "delta_at_full_time": _paired([v for v, _ in at_time], full["final_per_seed"]),
        "ended_before_full_time": any(ended for _, ended in at_time),
        "train_s_per_run": float(np.mean([r["train_s"][-1] for r in runs])),
        "wall_s_per_run": float(np.mean([r["wall_s"] for r in runs])),
        "curve": c,
    }


def targets(row: dict[str, Any]) -> dict[str, bool]:
    """The issue's two targets for one variant (module constants)."""
    f, t, d = row["reach_flops_ratio"], row["reach_time_ratio"], row["delta_at_full_time"]
    return {
        "reach": f is not None and t is not None and f <= REACH_FLOPS_MAX and t <= REACH_TIME_MAX,
        "equal_time": d["mean"] >= EQUAL_TIME_GAIN_MIN and d["ahead_by_2_std"],
    }


def summarise(done: dict[str, tuple[dict, list[dict]]], chance: float) -> dict[str, Any]:
    """Rows per variant (``done``: name -> (plan, curves per seed); it holds ``full``) and the targets."""
    plan, runs = done["full"]
    final = [mean_r1(r["heldout"][-1]) for r in runs]
    full = {
        "final_per_seed": final,
        "target": float(np.mean(final)),
        "flops": plan["flops"].at(plan["cell"]["steps"]),
        "train_s": float(np.mean([r["train_s"][-1] for r in runs])),
        "train_s_per_seed": [r["train_s"][-1] for r in runs],
    }
    rows = {name: _row(p, rs, full, chance) for name, (p, rs) in done.items()}
    met = {name: targets(r) for name, r in rows.items() if name != "full"}
    return {
        "chance": chance,
        "full_final_r1": full["target"],
        "rows": rows,
        "targets": {
            "per_variant": met,
            "reach": any(m["reach"] for m in met.values()),
            "equal_time": any(m["equal_time"] for m in met.values()),
        },
    }


def _pm(s: dict[str, float], digits: int = 2) -> str:
    return f"{100 * s['mean']:.{digits}f} ± {100 * s['std']:.{digits}f}"


def _ratio(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.2f}x"


def table(results: dict[str, Any]) -> str:
    lines = [
        "| variant | steps (epochs) | FLOPs (x full) | seeds | held-out R@1 | Δ vs full | val R@1 | "
        "FLOPs to full's R@1 | time to full's R@1 | R@1 at full's time | Δ at full's time | "
        "train s per run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    full_flops = results["rows"]["full"]["flops"]
    for name, r in results["rows"].items():
        ref = name == "full"
        d, dt = r["delta_vs_full"], r["delta_at_full_time"]
        ended = " (run ended first)" if r["ended_before_full_time"] else ""
        lines.append(
            f"| {name} | {r['steps']} ({r['epochs']:g}) | {r['flops'] / full_flops:.3f} | {r['num_seeds']} | "
            f"{_pm(r['heldout_r1'])} | {'—' if ref else _pm(d)} | {_pm(r['val_r1'])} | "
            f"{_ratio(r['reach_flops_ratio'])} | {_ratio(r['reach_time_ratio'])} | "
            f"{_pm(r['r1_at_full_time'])}{ended} | {'—' if ref else _pm(dt)} | {r['train_s_per_run']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def targets_table(results: dict[str, Any]) -> str:
    lines = [
        f"| variant | reach full's R@1 with ≤ {REACH_FLOPS_MAX}x FLOPs and ≤ {REACH_TIME_MAX}x time | "
        f"≥ +{100 * EQUAL_TIME_GAIN_MIN:g} R@1 at equal time with Δ > 2 std |",
        "|---|---|---|",
    ]
    for name, m in results["targets"]["per_variant"].items():
        r = results["rows"][name]
        dt = r["delta_at_full_time"]
        lines.append(
            f"| {name} | {'met' if m['reach'] else 'missed'} ({_ratio(r['reach_flops_ratio'])} FLOPs, "
            f"{_ratio(r['reach_time_ratio'])} time) | {'met' if m['equal_time'] else 'missed'} "
            f"({100 * dt['mean']:+.2f} ± {100 * dt['std']:.2f}) |"
        )
    t = results["targets"]
    verdict = {k: "met" if t[k] else "missed" for k in ("reach", "equal_time")}
    if t["per_variant"]:  # nothing to judge until a variant besides full tokens has finished
        lines.append(f"| **any variant** | {verdict['reach']} | {verdict['equal_time']} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """Held-out R@1 (seed mean) against samples seen, counted tower FLOPs and training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15.0, 4.4))
    xs = (("samples", "samples seen"), ("flops", "tower FLOPs (counted)"), ("train_s", "training time (s)"))
    for ax, (key, label) in zip(axes, xs, strict=True):
        for name, r in results["rows"].items():
            c = r["curve"]
            ax.plot(
                [0.0, *c[key]],
                [100 * results["chance"], *(100 * np.asarray(c["heldout"]))],
                marker=".",
                lw=2.0 if name == "full" else 1.3,
                label=name,
            )
        ax.axhline(100 * results["full_final_r1"], color="grey", ls=":", lw=1)
        ax.set(xlabel=label, ylabel="held-out R@1 (%)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(report: dict[str, Any], stem: str) -> str:
    c = report["config"]
    parts = [
        "# Quality per compute on Unicode glyphs: fewer tokens per sample at equal tower FLOPs",
        "",
        f"{c['model']} from random init on {len(c['train_styles'])} font styles "
        f"({c['num_train_pairs']} pairs of {c['num_characters']} characters), scored on "
        f"{c['heldout_style']} ({c['num_held_pairs']} drawings), never trained on. "
        f"Global batch {c['batch']}; the full-token run trains "
        f"{c['full_epochs']} epochs and every other variant the same counted tower FLOPs (forward + "
        f"backward). Objective in every variant: {c['objective'][0]} (what `toolkit train` picks for "
        "the full run unless another was asked for). "
        f"AdamW lr {c['lr']:g} (wd 0.1, 10% warmup, cosine over each run); {c['seeds']} paired seeds. R@1 in "
        "%, the mean of image→text and text→image, mean ± std over seeds; Δ: paired difference vs full "
        '(± std of the per-seed differences). "to full\'s R@1": where the seed-mean curve first reaches the '
        "full run's final R@1, as a share of the full run's FLOPs and training time (one thread, "
        f"{c['workers']} run(s) at a time). Wall time {c['wall_s'] / 60:.0f} min.",
        "",
    ]
    if report["unfinished"]:
        parts += ["Variants not (or not yet) finished: " + ", ".join(report["unfinished"]), ""]
    if c.get("failed_runs"):
        parts += ["Failed runs: " + "; ".join(f"{k}: {v[:120]}" for k, v in c["failed_runs"].items()), ""]
    if report["results"]:
        parts += [table(report["results"]), "Targets (issue 41):", "", targets_table(report["results"])]
        parts += [f"![curves]({stem}.png)", ""]
    return "\n".join(parts)
