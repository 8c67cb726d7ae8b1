"""``eval.zeroshot``: zero-shot classification and image<->text retrieval with clip-benchmark's metrics.

The stage: validate every set, load the model once with :func:`toolkit.models.load_model`, score each set
(:mod:`toolkit.eval.score`: clip-benchmark's metrics, a frozen-tower model through its feature cache),
write results.json, report.md, the charts and the galleries.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from toolkit.core import files
from toolkit.core.config import option
from toolkit.core.log import get_logger
from toolkit.core.stage import StageResult, stage_run
from toolkit.eval import report
from toolkit.eval.datasets import SPLIT, DatasetError, EvalSet, make_eval_loader, open_eval_set
from toolkit.eval.score import InputCast, evaluate_frozen, evaluate_set

KIND = "eval.zeroshot"


@dataclass(frozen=True)
class ZeroShotConfig:
    model: str = option(
        is_input=True,
        doc="Checkpoint directory (open_clip_config.json + weights), open_clip "
        "model name (e.g. cliptk-tiny, ViT-B-32) or model config JSON.",
    )
    datasets: list[str] = option(doc="Names of evaluation sets under `root` (clip-benchmark wds layout).")
    root: str = option(is_input=True, doc="Directory holding one folder per evaluation set.")
    out: str = option(doc="Output directory: results.json, report.md, results.png, per_dataset/*.json.")
    weights: str = option(
        "",
        is_input=True,
        doc="Local weights file (.safetensors/.pt/.pth/.bin) for a model "
        "name or config JSON; empty: random init (or the checkpoint's).",
    )
    batch_size: int = option(
        64,
        ge=1,
        affects_output=False,
        doc="Images per batch (a frozen convolutional "
        "trunk runs them 8 at a time, its fastest "
        "size on a CPU).",
    )
    num_workers: int = option(
        1,
        ge=0,
        affects_output=False,
        doc="DataLoader worker processes decoding images "
        "while the model runs (at most one per shard "
        "is used); 0: decode in this process.",
    )
    feature_cache: str = option(
        "auto",
        affects_output=False,
        doc="Folder keeping frozen-tower (LiT) models' "
        "trunk features per eval set, so a re-evaluation runs only the heads; 'auto': "
        "$XDG_CACHE_HOME/cliptk/tower-features (~/.cache/...); 'off': no cache.",
    )
    training_run: str = option(
        "",
        is_input=True,
        doc="Training run directory (its metrics.jsonl): its loss, "
        "temperature, learning-rate and eval curves are drawn in "
        "training_curves.png beside the report; empty: none.",
    )
    gallery_queries: int = option(
        5,
        ge=0,
        doc="Captions of each retrieval set drawn in gallery_<set>.png with "
        "their top-5 images (linked from report.md); 0: no gallery.",
    )
    device: str = option(
        "auto", affects_output=False, doc="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1'."
    )
    amp: bool = option(False, doc="Autocast the forward passes (fp16 on CUDA, bf16 on CPU).")
    precision: Literal["fp32", "bf16", "fp16", "pure_bf16", "pure_fp16"] = option(
        "fp32", doc="Model weight precision (open_clip's meanings)."
    )
    recall_k: list[int] = option(factory=lambda: [1, 5, 10], doc="k values for retrieval recall@k.")
    seed: int = option(0, doc="Seed of the random init when no weights are given.")
    language: str = option("en", doc="Language recorded in the results (clip-benchmark's schema).")
    skip_missing: bool = option(
        False,
        doc="Sets of `datasets` with no folder under `root` are reported as "
        "not evaluated instead of failing (optional sets, e.g. Fashion-MNIST).",
    )

    def __post_init__(self) -> None:
        if not self.datasets:
            raise ValueError("datasets: give at least one evaluation set name")
        bad = [
            n for n in self.datasets if n in ("", ".", "..") or any(c in n for c in "/\\\0") or n != n.strip()
        ]
        if bad:  # names become folder and file names under root and out: '../../x' wrote outside out
            raise ValueError(
                f"datasets: {bad[0][:80]!r} is not a set name; give the folder name of a set under "
                "root (no '/', '\\', '..'), and point root at the folder that holds it"
            )
        if len(set(self.datasets)) != len(self.datasets):
            raise ValueError(f"datasets: duplicate names in {self.datasets}")
        if not self.recall_k or any(k < 1 for k in self.recall_k):
            raise ValueError(f"recall_k: expected positive integers, got {self.recall_k}")


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' if available else 'cpu'; 'cuda:N' selects GPU N and returns 'cuda'."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} requested but CUDA is not available")
        if ":" in device:
            torch.cuda.set_device(int(device.split(":", 1)[1]))
        return "cuda"  # clip-benchmark passes the device to torch.autocast, which wants the type only
    if device != "cpu":
        raise ValueError(f"unknown device {device!r}; expected auto, cpu, cuda or cuda:N")
    return device


def run(cfg: ZeroShotConfig) -> StageResult:
    """Validate every set, load the model once, evaluate each set, write JSON + markdown + PNG."""
    from toolkit.models import load_model

    with stage_run(KIND, cfg, cfg.out) as rec:
        missing = _missing_sets(cfg)
        # open every set before loading the model, so a bad one fails at once
        sets = [open_eval_set(cfg.root, name) for name in cfg.datasets if name not in missing]
        device = resolve_device(cfg.device)
        loaded = load_model(
            cfg.model, weights=cfg.weights or None, device=device, precision=cfg.precision, seed=cfg.seed
        )
        model, title = loaded.model, model_title(cfg.model, loaded.name)
        if cfg.precision != "fp32":
            import open_clip

            model = InputCast(model, open_clip.get_input_dtype(cfg.precision))
        frozen = _frozen_context(cfg, loaded, model, device, rec)
        records, galleries = _evaluate_sets(cfg, loaded, title, model, sets, device, frozen, rec)
        _write_report(cfg, rec, title, loaded.weights, sets, records, galleries, missing)
        rec.details["device"] = device
    return rec.result()


def _missing_sets(cfg: ZeroShotConfig) -> list[str]:
    """The sets of ``cfg.datasets`` with no folder under ``root``, when ``skip_missing`` allows that (each
    logged); DatasetError when none of them is there."""
    # a set is there when its split folder is (build-set --missing-ok leaves only its manifest)
    missing = [
        n for n in cfg.datasets if cfg.skip_missing and not files.exists(files.join(cfg.root, n, SPLIT))
    ]
    for name in missing:
        get_logger("eval").warning(
            "%s: no evaluation set in %s: not evaluated (skip_missing)", name, cfg.root
        )
    if len(missing) == len(cfg.datasets):
        raise DatasetError(f"{cfg.root}: none of the sets {cfg.datasets} exists")
    return missing


def _evaluate_sets(
    cfg: ZeroShotConfig,
    loaded: Any,
    title: str,
    model: Any,
    sets: list[EvalSet],
    device: str,
    frozen: Any,
    rec: Any,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Score each set, writing OUT/per_dataset/<set>_<task>.json as it goes: (records, gallery records)."""
    log = get_logger("eval")
    per_dataset = files.join(cfg.out, "per_dataset")
    files.makedirs(per_dataset)
    records, galleries = [], []
    for eval_set in sets:
        start = time.monotonic()
        metrics, gallery = _evaluate_one(cfg, loaded, title, model, eval_set, device, frozen, rec)
        galleries += [gallery] if gallery else []
        record = report.make_record(
            eval_set.name, title, loaded.weights, eval_set.task, metrics, cfg.language
        )
        records.append(record)
        files.write_json_atomic(files.join(per_dataset, f"{eval_set.name}_{eval_set.task}.json"), record)
        rec.details.setdefault("duration_s", {})[eval_set.name] = round(time.monotonic() - start, 3)
        log.info(
            "%s (%s, %d samples): %s",
            eval_set.name,
            eval_set.task,
            eval_set.num_samples,
            ", ".join(f"{k}={'n/a' if v is None else f'{v:.4f}'}" for k, v in metrics.items()),
            extra={"data": record},
        )
    return records, galleries


def _write_report(
    cfg: ZeroShotConfig,
    rec: Any,
    title: str,
    weights: str | None,
    sets: list[EvalSet],
    records: list[dict[str, Any]],
    galleries: list[dict[str, Any]],
    missing: list[str],
) -> None:
    """results.json, report.md (with the galleries and training curves) and results.png; their paths,
    the counts, the chance levels and the average in the manifest."""
    counts = {s.name: s.num_samples for s in sets}
    data = report.write_results(files.join(cfg.out, "results.json"), title, weights, records)
    chance = {s.name: report.chance_level(s.kind, s.num_samples, len(s.classnames)) for s in sets}
    table = report.markdown_table(data, counts, cfg.recall_k, chance)
    if missing:
        table += f"\nNot evaluated (no set under {cfg.root}): {', '.join(missing)}\n"
    table += report.gallery_section(galleries)
    if cfg.training_run:
        table += _curves(cfg, rec)
    files.write_text_atomic(files.join(cfg.out, "report.md"), table)
    report.bar_chart(data, files.join(cfg.out, "results.png"))
    rec.outputs.update(
        results=files.join(cfg.out, "results.json"),
        report=files.join(cfg.out, "report.md"),
        chart=files.join(cfg.out, "results.png"),
        per_dataset=files.join(cfg.out, "per_dataset"),
        **{f"gallery_{g['set']}": g["path"] for g in galleries},
    )
    rec.counts.update(num_datasets=len(sets), num_samples=counts)
    rec.details.update(
        not_evaluated=missing, chance=chance, average=data["average"], model=title, weights=weights
    )


def model_title(model: str, name: str) -> str:
    """The model's name in results, reports and galleries: a training run's model (RUN/model, RUN/model-ema,
    RUN/checkpoints/step-N) by the run's folder name, which open_clip's name of the folder ("model") did not
    say; any other model by its own ``name``."""
    if not files.is_local(model):
        return name
    path = Path(files.local_path(model)).absolute()
    places = {
        path.parent: {"model": "", "model-ema": " (EMA weights)"}.get(path.name),
        path.parent.parent: f" step {path.name.removeprefix('step-').lstrip('0') or 0}"
        if path.parent.name == "checkpoints" and path.name.startswith("step-")
        else None,
    }
    for run, suffix in places.items():
        if suffix is not None and _is_training_run(run):
            return run.name + suffix
    return name


def _is_training_run(folder: Path) -> bool:
    try:
        return json.loads((folder / "manifest.json").read_text()).get("kind") == "train"
    except (OSError, ValueError, AttributeError):
        return False


def _frozen_context(cfg: ZeroShotConfig, loaded: Any, model: Any, device: str, rec: Any) -> Any:
    """Make the model fast for CPU inference; for a frozen-tower model on fp32 CPU, its feature cache
    (:class:`toolkit.eval.towercache.FrozenEval`), else None."""
    from toolkit.eval import towercache
    from toolkit.models.inference import optimize_clip

    opened = None
    if device == "cpu" and cfg.precision == "fp32" and not cfg.amp:
        opened = towercache.open_frozen(
            loaded.model,
            loaded.tokenizer,
            loaded.preprocess_cfg,
            files.local_path(cfg.feature_cache)
            if cfg.feature_cache not in ("auto", "off")
            else cfg.feature_cache,
            copy_trunk=False,
        )
    if device == "cpu" and cfg.precision == "fp32":
        rec.details["inference"] = optimize_clip(
            loaded.model
        )  # after the fingerprint: folding changes weights
    if opened is None:
        return None
    frozen, fingerprint, root = opened
    rec.details.update(tower_fingerprint=fingerprint, feature_cache=root, cache_hits=[])
    return frozen


def _evaluate_one(
    cfg: ZeroShotConfig,
    loaded: Any,
    title: str,
    model: Any,
    eval_set: EvalSet,
    device: str,
    frozen: Any,
    rec: Any,
) -> tuple[dict[str, float | None], dict[str, Any] | None]:
    """Metrics of one set (through the feature cache for a frozen-tower model) and its gallery record."""
    from toolkit.eval import gallery

    factory = gallery.Recorder if eval_set.kind == "retrieval" and cfg.gallery_queries else None
    if frozen is not None:
        metrics, hit, recorder = evaluate_frozen(
            frozen,
            eval_set,
            loaded.preprocess,
            batch_size=cfg.batch_size,
            num_workers=cfg.num_workers,
            device=device,
            recall_k=cfg.recall_k,
            recorder_factory=factory,
        )
        if hit:
            rec.details["cache_hits"].append(eval_set.name)
    else:
        metrics, recorder = _evaluate_live(cfg, loaded, model, eval_set, device, factory)
    if recorder is None:
        return metrics, None
    path = files.join(cfg.out, f"gallery_{eval_set.name}.png")
    drawn = gallery.write_gallery(
        recorder,
        eval_set,
        path,
        cfg.gallery_queries,
        title=f"{eval_set.name}: {title}, text -> image top 5 (right image in green)",
    )
    return metrics, {"set": eval_set.name, "path": path, **drawn}


def _evaluate_live(
    cfg: ZeroShotConfig, loaded: Any, model: Any, eval_set: EvalSet, device: str, factory: Any
) -> tuple[dict[str, float | None], Any]:
    """Metrics of one set by running the whole model on its images: (metrics, the gallery's recorder or
    None)."""
    recorder = factory(model) if factory else None
    loader = (
        recorder.loader(
            make_eval_loader(eval_set, loaded.preprocess, cfg.batch_size, cfg.num_workers, with_digest=True)
        )
        if recorder
        else None
    )
    metrics = evaluate_set(
        recorder or model,
        loaded.tokenizer,
        loaded.preprocess,
        eval_set,
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        device=device,
        amp=cfg.amp,
        recall_k=cfg.recall_k,
        loader=loader,
    )
    return metrics, recorder


def _curves(cfg: ZeroShotConfig, rec: Any) -> str:
    """Draw the training run's curves into OUT/training_curves.png; the report's markdown for them."""
    metrics = files.join(cfg.training_run, "metrics.jsonl")
    if not files.exists(metrics):
        raise DatasetError(f"training_run: {metrics} not found (give the run directory of `toolkit train`)")
    path = files.join(cfg.out, "training_curves.png")
    drawn = report.training_curves(metrics, path, title=f"training: {cfg.training_run}")
    rec.outputs["training_curves"] = path
    return (
        f"\n## Training curves\n\n{', '.join(drawn)} against the optimizer step, from "
        f"`{metrics}`:\n\n![training curves](training_curves.png)\n"
    )
