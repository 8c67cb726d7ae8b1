"""Statistics, tables and the plot of the from-scratch benchmark (curves as ``runs`` describes them).

Per cell, ``summarise`` compares each method's tuned setting over the paired seeds with the best OpenCLIP
(the OpenCLIP variant with the better validation score): held-out R@1 (mean of image→text and text→image)
mean ± std, the paired difference Δ per seed and its std, whether Δ > 2 std and whether Δ is within 1 std
of zero or better (the default objective's rule), R@10 and median rank, and the same R@1 and Δ on the
held-out set without look-alikes.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.objectives.convergence.report import mean_r1, stats, val_score


def _delta(values: list[float], ref: list[float]) -> dict[str, Any]:
    diffs = [v - r for v, r in zip(values, ref, strict=True)]
    d = stats(diffs)
    return {
        **d,
        "per_seed": diffs,
        "ahead_by_2_std": len(diffs) > 1 and d["mean"] > 2 * d["std"],
        "not_behind_by_1_std": d["mean"] >= -d["std"],
    }


def _mean_curve(runs: list[dict], key: str) -> list[float]:
    return np.mean([[mean_r1(p) for p in r[key]] for r in runs], axis=0).tolist()


def _row(runs: list[dict], ref: dict[str, list[float]]) -> dict[str, Any]:
    final = {k: [mean_r1(r[k][-1]) for r in runs] for k in ("heldout", "heldout_distinct")}
    return {
        "val_r1": val_score(runs),
        "heldout_r1": stats(final["heldout"]),
        "heldout_i2t_r1": stats([r["heldout"][-1][0] for r in runs]),
        "heldout_t2i_r1": stats([r["heldout"][-1][1] for r in runs]),
        "heldout_r10": stats([mean_r1(r["heldout_r10"]) for r in runs]),
        "heldout_median_rank": stats([mean_r1(r["median_rank"]["heldout"]) for r in runs]),
        "distinct_r1": stats(final["heldout_distinct"]),
        "distinct_r10": stats([mean_r1(r["heldout_distinct_r10"]) for r in runs]),
        "distinct_median_rank": stats([mean_r1(r["median_rank"]["heldout_distinct"]) for r in runs]),
        "delta_vs_best_openclip": _delta(final["heldout"], ref["heldout"]),
        "distinct_delta_vs_best_openclip": _delta(final["heldout_distinct"], ref["heldout_distinct"]),
        "final_tau": stats([r["tau"] for r in runs if r.get("tau") is not None] or [float("nan")]),
        "curve_samples": runs[0]["samples_seen"],
        "curve_train_s": np.mean([r["train_s"] for r in runs], 0).tolist(),
        "curve_heldout": _mean_curve(runs, "heldout"),
        "curve_val": _mean_curve(runs, "val"),
        "num_seeds": len(runs),
        "wall_s_per_run": statistics.fmean(r["wall_s"] for r in runs),
    }


def summarise(
    cell: dict, runs: dict[str, list[dict]], searches: dict[str, dict], openclip: list[str]
) -> dict:
    """One cell: ``runs`` {method: final runs in seed order}, ``searches`` {method: tuning report}."""
    best_open = max(openclip, key=lambda m: val_score(runs[m]))
    ref = {k: [mean_r1(r[k][-1]) for r in runs[best_open]] for k in ("heldout", "heldout_distinct")}
    rows = {m: {**_row(rs, ref), "tuning": searches[m]} for m, rs in runs.items()}
    others = [m for m in runs if m not in openclip and m != "trainer default"]
    best_other = max(others, key=lambda m: rows[m]["val_r1"]) if others else None
    return {**cell, "best_openclip": best_open, "best_cliptk": best_other, "rows": rows}


def _pm(s: dict[str, float], scale: float = 100.0, digits: int = 2) -> str:
    return f"{scale * s['mean']:.{digits}f} ± {scale * s['std']:.{digits}f}"


def table(cells: list[dict]) -> str:
    lines = [
        "| budget | batch | epochs (steps) | method | tuned on validation | seeds | val R@1 | "
        "held-out R@1 | Δ vs best OpenCLIP | R@10 | median rank | R@1 w/o look-alikes | "
        "Δ w/o look-alikes | min per run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        for name, r in cell["rows"].items():
            best = name == cell["best_openclip"]
            d, dd = r["delta_vs_best_openclip"], r["distinct_delta_vs_best_openclip"]
            delta = "—" if best else f"{100 * d['mean']:+.2f} ± {100 * d['std']:.2f}"
            ddelta = "—" if best else f"{100 * dd['mean']:+.2f} ± {100 * dd['std']:.2f}"
            tuned = (
                ", ".join(
                    f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in r["tuning"]["chosen"].items()
                )
                or "—"
            )
            if r["tuning"].get("adopted_from"):
                tuned += f" ({r['tuning']['adopted_from'].split(' (')[0]})"
            if r["tuning"]["ends_at_best"]:
                tuned += " (grid end: " + ", ".join(r["tuning"]["ends_at_best"]) + ")"
            lines.append(
                f"| {cell['regime']} | {cell['batch']} | {cell['epochs']} ({cell['steps']}) | {name}"
                f"{' **(best OpenCLIP)**' if best else ''} | {tuned} | {r['num_seeds']} | "
                f"{100 * r['val_r1']:.2f} | {_pm(r['heldout_r1'])} | {delta} | {_pm(r['heldout_r10'])} | "
                f"{_pm(r['heldout_median_rank'], 1, 0)} | {_pm(r['distinct_r1'])} | {ddelta} | "
                f"{r['wall_s_per_run'] / 60:.1f} |"
            )
    return "\n".join(lines) + "\n"


def plot(cells: list[dict], path: Path) -> None:
    """Held-out R@1 (seed mean) against samples seen (top) and training seconds (bottom), a column a cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(cells), figsize=(5.0 * len(cells), 7.6), squeeze=False)
    for col, cell in enumerate(cells):
        for name, r in cell["rows"].items():
            width = 2.0 if name == cell["best_openclip"] else 1.3
            y = 100 * np.asarray(r["curve_heldout"])
            axes[0][col].plot(r["curve_samples"], y, label=name, lw=width, marker=".")
            axes[1][col].plot(r["curve_train_s"], y, label=name, lw=width, marker=".")
        axes[0][col].set(
            title=f"{cell['regime']}: batch {cell['batch']}, {cell['epochs']} epochs",
            xlabel="samples seen",
            ylabel="held-out R@1 (%)",
        )
        axes[1][col].set(xlabel="training time (s, one thread)", ylabel="held-out R@1 (%)")
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(report: dict, stem: str) -> str:
    c = report["config"]
    timing = (
        "Reported from the run cache (--cached-only): each run's own minutes are in the last column."
        if c.get("cached_only")
        else f"Wall time {c['wall_s'] / 60:.0f} min with {c['workers']} run(s) at a time."
    )
    parts = [
        "# From scratch on Unicode glyphs: which objective trains the towers best",
        "",
        f"{c['model']} from random init on {len(c['train_styles'])} font styles ({c['num_train_pairs']} "
        f"pairs of {c['num_characters']} characters); tuned on {c['val_style']} ({c['num_val_pairs']} "
        f"drawings); scored on {c['heldout_style']} ({c['num_held_pairs']} drawings; "
        f"{c['num_held_distinct_pairs']} without "
        f"look-alikes), never trained or tuned on. AdamW lr {c['lr']:g} (wd 0.1, 10% warmup, cosine); "
        f"{c['seeds']} paired seeds per tuned setting (tuning: {c['tune_seeds']} seed per grid point). "
        "R@1 and R@10 in %, the mean of image→text and text→image, mean ± std over seeds; Δ: paired "
        "difference vs the best OpenCLIP (± std of the per-seed differences); median rank of the true pair "
        "(1 = first). " + timing,
        "",
    ]
    missing = [x for x in c["cells_planned"] if x not in c["cells_done"]]
    if missing:
        parts += ["Cells not (or not yet) run: " + ", ".join(missing), ""]
    if c.get("failed_runs"):
        parts += ["Failed runs: " + "; ".join(f"{k}: {v[:120]}" for k, v in c["failed_runs"].items()), ""]
    unfinished = [
        f"{x['regime']} b{x['batch']}: {', '.join(x['unfinished'])}"
        for x in report["results"]
        if x.get("unfinished")
    ]
    if unfinished:
        parts += ["Methods left out of a cell (runs unfinished): " + "; ".join(unfinished), ""]
    if report["results"]:
        parts += [table(report["results"]), f"![curves]({stem}.png)", ""]
    return "\n".join(parts)
