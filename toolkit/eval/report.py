"""Evaluation results: clip-benchmark's JSON records, the average over sets, a markdown table, a bar chart.

One record per (dataset, task), exactly clip-benchmark's result schema::

    {"dataset": "wds/NAME", "model": ..., "pretrained": ..., "task": "zeroshot_classification",
     "metrics": {"acc1": .., "acc5": .., "mean_per_class_recall": ..}, "language": "en"}

``results.json`` wraps them: ``{"model", "pretrained", "results": [records], "average": {...}}``. Metrics
that are undefined (top-5 with fewer than 5 classes, R@k with fewer than k images) are ``null``, never NaN.
The primary metric of a set is top-1 accuracy (classification) or the mean of both R@1 (retrieval);
``average.primary`` is their mean over sets.
"""

from __future__ import annotations

import io
import math
from typing import Any

from toolkit.core import files

RECORD_KEYS = ("dataset", "model", "pretrained", "task", "metrics", "language")
CLASSIFICATION_COLUMNS = (
    ("acc1", "top-1"),
    ("acc5", "top-5"),
    ("mean_per_class_recall", "mean per-class recall"),
)


def retrieval_columns(recall_k: list[int] | tuple[int, ...]) -> list[tuple[str, str]]:
    """(metric key, header): clip-benchmark's 'text_retrieval' is image->text, 'image_retrieval'
    text->image."""
    return [(f"text_retrieval_recall@{k}", f"I→T R@{k}") for k in recall_k] + [
        (f"image_retrieval_recall@{k}", f"T→I R@{k}") for k in recall_k
    ]


def clean_metrics(metrics: dict[str, Any]) -> dict[str, float | None]:
    """Floats, with NaN/inf (clip-benchmark's 'undefined') turned into None so the JSON stays valid."""
    out: dict[str, float | None] = {}
    for key, value in metrics.items():
        v = None if value is None else float(value)
        out[key] = None if v is None or not math.isfinite(v) else v
    return out


def make_record(
    dataset: str, model: str, pretrained: str | None, task: str, metrics: dict[str, Any], language: str = "en"
) -> dict[str, Any]:
    return {
        "dataset": f"wds/{dataset}",
        "model": model,
        "pretrained": pretrained,
        "task": task,
        "metrics": clean_metrics(metrics),
        "language": language,
    }


def primary_metric(record: dict[str, Any]) -> float | None:
    m = record["metrics"]
    if record["task"] == "zeroshot_classification":
        return m.get("acc1")
    r1 = [m.get("image_retrieval_recall@1"), m.get("text_retrieval_recall@1")]
    return None if None in r1 else sum(r1) / 2


def average(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean of every metric over the sets of each task, and of the primary metric over all sets."""
    out: dict[str, Any] = {}
    for task in sorted({r["task"] for r in records}):
        values: dict[str, list[float]] = {}
        for r in (r for r in records if r["task"] == task):
            for key, v in r["metrics"].items():
                if v is not None:
                    values.setdefault(key, []).append(v)
        out[task] = {k: sum(v) / len(v) for k, v in values.items()}
    prim = [p for p in (primary_metric(r) for r in records) if p is not None]
    out["primary"] = sum(prim) / len(prim) if prim else None
    out["num_datasets"] = len(records)
    return out


def validate_record(record: Any, where: str) -> dict[str, Any]:
    """Check one record against clip-benchmark's schema; ValueError names the key."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object, got {type(record).__name__}")
    missing = [k for k in RECORD_KEYS if k not in record]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
    if not isinstance(record["metrics"], dict) or not all(
        v is None or isinstance(v, (int, float)) for v in record["metrics"].values()
    ):
        raise ValueError(f"{where}: 'metrics' must map names to numbers or null")
    return record


def write_results(path: str, model: str, pretrained: str | None, records: list[dict[str, Any]]) -> dict:
    data = {"model": model, "pretrained": pretrained, "results": records, "average": average(records)}
    files.write_json_atomic(path, data)
    return data


def read_results(path: str) -> dict[str, Any]:
    """Load and validate a ``results.json`` written by :func:`write_results`."""
    data = files.read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise ValueError(f"{path}: expected an object with a 'results' list")
    for i, record in enumerate(data["results"]):
        validate_record(record, f"{path}: results[{i}]")
    return data


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.2f}"


def chance_level(kind: str, num_samples: int, num_classes: int) -> float:
    """The primary metric of a model that guesses: top-1 = 1/classes; R@1 = 1/samples (one caption per
    image, as the sets built by `eval build-set` from the demo hold)."""
    return 1.0 / max(num_classes if kind == "classification" else num_samples, 1)


def markdown_table(
    data: dict[str, Any], counts: dict[str, int], recall_k: list[int], chance: dict[str, float] | None = None
) -> str:
    """Two tables (classification, retrieval) in percent, each with an average row; ``chance`` (set name
    -> chance level of the primary metric) adds a column beside the numbers."""
    chance = chance or {}
    lines = [
        f"# Zero-shot evaluation: {data['model']}",
        "",
        f"weights: `{data['pretrained'] or 'random init'}`",
        "",
    ]
    for task, columns in (
        ("zeroshot_classification", CLASSIFICATION_COLUMNS),
        ("zeroshot_retrieval", retrieval_columns(recall_k)),
    ):
        rows = [r for r in data["results"] if r["task"] == task]
        if not rows:
            continue
        lines += [
            f"## {task.replace('_', ' ')} (%)",
            "",
            "| dataset | samples | chance | " + " | ".join(h for _, h in columns) + " |",
            "|---|---:|---:|" + "---:|" * len(columns),
        ]
        for r in rows:
            name = r["dataset"].removeprefix("wds/")
            cells = [_pct(r["metrics"].get(k)) for k, _ in columns]
            lines.append(
                f"| {name} | {counts.get(name, '')} | {_pct(chance.get(name))} | " + " | ".join(cells) + " |"
            )
        avg = data["average"][task]
        lines.append("| **average** | | | " + " | ".join(_pct(avg.get(k)) for k, _ in columns) + " |")
        lines.append("")
    lines.append(
        f"Average primary metric over {data['average']['num_datasets']} set(s) (top-1 for "
        f"classification, mean R@1 for retrieval): **{_pct(data['average']['primary'])}%**"
    )
    return "\n".join(lines) + "\n"


def bar_chart(data: dict[str, Any], path: str) -> None:
    """Horizontal bars of each set's primary metric and the average (%), as a PNG drawn by matplotlib
    (as the training curves are); a set whose metric is undefined gets no bar and a dash."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [
        (
            r["dataset"].removeprefix("wds/") + (" (ret)" if r["task"] == "zeroshot_retrieval" else ""),
            primary_metric(r),
        )
        for r in data["results"]
    ]
    bars.append(("average", data["average"]["primary"]))
    labels = [label[:34] for label, _ in bars]
    values = [0.0 if value is None else 100 * max(0.0, min(1.0, value)) for _, value in bars]
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.32 * len(bars)), dpi=100)
    rows = list(range(len(bars)))[::-1]  # the first set on top, the average last
    ax.barh(rows, values, color=["#d6604d" if label == "average" else "#4393c3" for label, _ in bars])
    for row, value, (_, raw) in zip(rows, values, bars, strict=True):
        ax.text(value + 1, row, _pct(raw), va="center", fontsize=8)
    ax.set(yticks=rows, yticklabels=labels, xlim=(0, 112), xlabel="%")
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title(f"zero-shot primary metric (%): {data['model']}"[:90], fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    files.write_bytes_atomic(path, buf.getvalue())


def gallery_section(galleries: list[dict[str, Any]]) -> str:
    """Markdown linking each retrieval gallery PNG (same folder as report.md) with its queries' ranks."""
    lines = []
    for g in galleries:
        name = g["path"].rsplit("/", 1)[-1]
        lines += [
            "",
            f"## Retrieval gallery: {g['set']}",
            "",
            "Captions of the set (spread evenly over it), the 5 images the model ranks first, the right "
            "one framed in green (shown at the end of the row when it is not among them):",
            "",
            f"![{g['set']} retrieval gallery]({name})",
            "",
            "| caption | rank of the right image |",
            "|---|---:|",
        ]
        lines += [f"| {q['caption']} | {q['rank']} |" for q in g["queries"]]
    return "\n".join(lines) + ("\n" if lines else "")


# Metrics of a training run's metrics.jsonl drawn by training_curves, in this order, when present.
CURVES = (("loss", "training loss"), ("tau", "temperature τ"), ("lr", "learning rate"))


def _eval_curve_label(key: str) -> str | None:
    """'eval/SET/text_retrieval_recall@1' -> 'SET I→T R@1' (top-1 and R@1 only; None for other metrics)."""
    parts = key.split("/")
    names = {"text_retrieval_recall@1": "I→T R@1", "image_retrieval_recall@1": "T→I R@1", "acc1": "top-1"}
    return f"{parts[1]} {names[parts[2]]}" if len(parts) == 3 and parts[2] in names else None


def training_curves(metrics_jsonl: str, path: str, title: str = "") -> list[str]:
    """One PNG with a panel per logged curve (loss, τ, learning rate) and one panel with every in-training
    evaluation's R@1 / top-1 (%), from a training run's ``metrics.jsonl`` (one JSON object per logged step,
    with ``step``); returns the metrics drawn."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with files.open_file(metrics_jsonl, "rt", encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    keys = [(k, label) for k, label in CURVES if any(isinstance(r.get(k), (int, float)) for r in records)]
    evals = sorted(
        (k, _eval_curve_label(k)) for k in {k for r in records for k in r if k.startswith("eval/")}
    )
    evals = [(k, label) for k, label in evals if label]
    if not keys and not evals:
        raise ValueError(f"{metrics_jsonl}: no loss, tau, lr or eval/ values to plot")
    panels = [[(k, label)] for k, label in keys] + ([evals] if evals else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), dpi=100, squeeze=False)
    for ax, lines in zip(axes[0], panels, strict=True):
        for key, label in lines:
            scale = 100 if key.startswith("eval/") else 1
            points = [(r["step"], scale * r[key]) for r in records if isinstance(r.get(key), (int, float))]
            ax.plot(
                *zip(*points, strict=True),
                marker="o" if len(points) < 30 else None,
                markersize=3,
                label=label,
            )
        ax.set(
            xlabel="step", title="held-out evaluation (%)" if lines is panels[-1] and evals else lines[0][1]
        )
        if len(lines) > 1 or lines[0][0].startswith("eval/"):
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    files.write_bytes_atomic(path, buf.getvalue())
    return [k for k, _ in keys] + [k for k, _ in evals]
