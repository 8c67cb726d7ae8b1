"""The ``train`` stage as the CLI and pipelines run it: the trainer plus zero-shot evaluation.

``toolkit.train`` never imports ``toolkit.eval``; this module (the pipeline layer sits above both)
builds the evaluation callback from ``cfg.eval`` and hands it to the trainer. It is also the module
launched ranks run (``python -m toolkit.pipeline.train_stage CONFIG.yaml``), so evaluation works the
same with one process or many.
"""

from __future__ import annotations

from typing import Any

from toolkit.core.stage import StageResult
from toolkit.train.config import TrainConfig
from toolkit.train.loop import EvalFn


def make_eval_fn(cfg: TrainConfig) -> EvalFn | None:
    """The zero-shot callback for ``cfg.eval`` (None when evaluation is off); opens the sets at once so a
    missing one fails before training starts."""
    if not cfg.eval.every_steps:
        return None
    from toolkit.eval.datasets import open_eval_set

    sets = [open_eval_set(cfg.eval.root, name) for name in cfg.eval.datasets]

    def evaluate(clip: Any, model_cfg: dict, preprocess_cfg: dict, step: int) -> dict[str, float]:
        from toolkit.eval.zeroshot import evaluate_set
        from toolkit.models.factory import eval_transform
        from toolkit.models.registry import tokenizer

        device = next(clip.parameters()).device.type
        tok, transform = tokenizer(model_cfg), eval_transform(preprocess_cfg)
        out: dict[str, float] = {}
        for eval_set in sets:
            metrics = evaluate_set(clip, tok, transform, eval_set, batch_size=cfg.eval.batch_size, device=device)
            out.update({f"eval/{eval_set.name}/{k}": v for k, v in metrics.items() if v is not None})
        return out

    return evaluate


def run(cfg: TrainConfig) -> StageResult:
    """Train per ``cfg`` with its evaluation callback (the pipeline kind ``train`` and ``toolkit train``)."""
    from toolkit.train.run import run as train_run

    return train_run(cfg, make_eval_fn(cfg), entry=__name__)


if __name__ == "__main__":
    from toolkit.train.run import worker_main

    worker_main(make_eval_fn)
