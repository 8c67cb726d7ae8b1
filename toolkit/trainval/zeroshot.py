"""Training with zero-shot evaluation: ``run(cfg)``, as ``toolkit train`` and the pipeline kind ``train``
call it.

``toolkit.train`` never imports ``toolkit.eval``; this module (above both) builds the evaluation callback
from ``cfg.eval`` and hands it to the trainer, by value here and by name (``EVAL_FACTORY``) to the ranks the
trainer launches, which start from the trainer's own entry (``python -m toolkit.train.worker CONFIG.yaml
--eval-factory toolkit.trainval.zeroshot:make_eval_fn``), so evaluation works the same with one process or
many.
"""

from __future__ import annotations

from typing import Any

from toolkit.core.stage import StageResult
from toolkit.train.config import EvalConfig, TrainConfig
from toolkit.train.loop import EvalFn


def make_eval_fn(cfg: EvalConfig) -> EvalFn | None:
    """The zero-shot callback for ``cfg`` (a TrainConfig's ``eval``; None when evaluation is off); opens the
    sets at once so a missing one fails before training starts."""
    if not cfg.every_steps:
        return None
    from toolkit.eval.datasets import open_eval_set

    sets = [open_eval_set(cfg.root, name) for name in cfg.datasets]
    frozen: dict[str, Any] = {}  # the frozen trunks' cache, opened at the first evaluation

    def evaluate(clip: Any, model_cfg: dict, preprocess_cfg: dict, step: int) -> dict[str, float]:
        from toolkit.eval.score import evaluate_frozen, evaluate_set
        from toolkit.models.factory import eval_transform
        from toolkit.models.registry import tokenizer

        device = next(clip.parameters()).device.type
        tok, transform = tokenizer(model_cfg), eval_transform(preprocess_cfg)
        if device == "cpu" and "eval" not in frozen:
            frozen["eval"] = _open_frozen(clip, tok, preprocess_cfg, cfg.feature_cache)
        out: dict[str, float] = {}
        for eval_set in sets:
            if frozen.get("eval") is not None:  # only the heads run once the trunks' features are cached
                metrics = evaluate_frozen(frozen["eval"], eval_set, transform, batch_size=cfg.batch_size)[0]
            else:
                metrics = evaluate_set(
                    clip, tok, transform, eval_set, batch_size=cfg.batch_size, device=device
                )
            out.update({f"eval/{eval_set.name}/{k}": v for k, v in metrics.items() if v is not None})
        return out

    return evaluate


def _open_frozen(clip: Any, tok: Any, preprocess_cfg: dict, feature_cache: str) -> Any:
    """The feature cache of a model whose trunks are frozen (no trainable trunk parameter), else None.
    The training model is left untouched: cold passes run on a folded copy of its image trunk."""
    from toolkit.eval.towercache import open_frozen

    trunks = [
        getattr(getattr(clip, "visual", None), "trunk", None),
        getattr(getattr(clip, "text", None), "transformer", None),
    ]
    if any(t is None or any(p.requires_grad for p in t.parameters()) for t in trunks):
        return None
    opened = open_frozen(clip, tok, preprocess_cfg, feature_cache, copy_trunk=True)
    return opened[0] if opened else None


EVAL_FACTORY = f"{__name__}:make_eval_fn"  # what launched ranks call to build their own callback


def run(cfg: TrainConfig) -> StageResult:
    """Train per ``cfg`` with its evaluation callback (the pipeline kind ``train`` and ``toolkit train``)."""
    from toolkit.train.run import run as train_run

    return train_run(cfg, make_eval_fn(cfg.eval), eval_factory=EVAL_FACTORY)
