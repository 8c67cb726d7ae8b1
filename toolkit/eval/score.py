"""Zero-shot metrics of a model on one evaluation set, with clip-benchmark's own functions.

``zeroshot_classification.evaluate`` (top-1, top-5, mean per-class recall) and
``zeroshot_retrieval.evaluate`` (R@k both ways) on sets in its local ``wds/`` layout (see
:mod:`toolkit.eval.datasets`). Any module with ``encode_image``/``encode_text`` works with
:func:`evaluate_set`; :func:`evaluate_frozen` runs a frozen-tower model through its feature cache. Called
by the ``eval.zeroshot`` stage (:mod:`toolkit.eval.zeroshot`) and by the train stage's evaluation callback
(rank 0).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from toolkit.core.log import get_logger, progress
from toolkit.eval import report
from toolkit.eval.datasets import EvalSet, make_eval_loader


def evaluate_set(
    model: Any,
    tokenizer: Any,
    transform: Any,
    eval_set: EvalSet,
    *,
    batch_size: int = 64,
    num_workers: int = 0,
    device: str = "cpu",
    amp: bool = False,
    recall_k: list[int] | tuple[int, ...] = (1, 5, 10),
    loader: Any = None,
) -> dict[str, float | None]:
    """clip-benchmark metrics of ``model`` on one set (single process). Returns the metrics dict with
    undefined values (top-5 below 5 classes, R@k above the number of images) as None. ``loader`` replaces
    the set's image loader (cached tower features, a recording view); it must yield the set in order."""
    from clip_benchmark.metrics import zeroshot_classification, zeroshot_retrieval

    loader = loader if loader is not None else make_eval_loader(eval_set, transform, batch_size, num_workers)
    num_batches = -(-eval_set.num_samples // batch_size)
    batches = progress(loader, total=num_batches, desc=f"{eval_set.name}", unit="batch")
    wrapped = _LoaderView(batches, loader.dataset)
    if eval_set.kind == "classification":
        with _metric_warnings(eval_set), _no_tqdm_bars():
            metrics = zeroshot_classification.evaluate(
                model,
                wrapped,
                tokenizer,
                list(eval_set.classnames),
                list(eval_set.templates),
                device,
                amp=amp,
            )
        return report.clean_metrics(metrics)
    usable = [k for k in recall_k if k <= eval_set.num_samples]
    if len(usable) < len(recall_k):
        get_logger("eval").warning(
            "%s: R@k undefined for k > %d images: %s",
            eval_set.name,
            eval_set.num_samples,
            [k for k in recall_k if k not in usable],
        )
    with _metric_warnings(eval_set), _no_tqdm_bars():
        metrics = zeroshot_retrieval.evaluate(
            model, wrapped, tokenizer, device, amp=amp, recall_k_list=usable
        )
    for k in recall_k:
        metrics.setdefault(f"image_retrieval_recall@{k}", None)
        metrics.setdefault(f"text_retrieval_recall@{k}", None)
    return report.clean_metrics(metrics)


def evaluate_frozen(
    frozen: Any,
    eval_set: EvalSet,
    transform: Any,
    *,
    batch_size: int = 64,
    num_workers: int = 1,
    device: str = "cpu",
    recall_k: list[int] | tuple[int, ...] = (1, 5, 10),
    recorder_factory: Any = None,
) -> tuple[dict[str, float | None], bool, Any]:
    """Metrics of a frozen-tower model on one set through its feature cache (``frozen``:
    :class:`toolkit.eval.towercache.FrozenEval`): (metrics, cache hit?, recorder or None). Used by
    ``eval.zeroshot`` and by the train stage's evaluation callback (rank 0)."""

    def make(with_digest: bool = False) -> Any:
        return make_eval_loader(eval_set, transform, batch_size, num_workers, with_digest)

    model, loader, finish = frozen.inputs(eval_set, make, batch_size)
    recorder = recorder_factory(model) if recorder_factory else None
    if recorder is not None:
        model, loader = recorder, recorder.loader(loader)
    metrics = evaluate_set(
        model,
        frozen.texts.tokenizer,
        transform,
        eval_set,
        batch_size=batch_size,
        num_workers=num_workers,
        device=device,
        recall_k=recall_k,
        loader=loader,
    )
    return metrics, finish(), recorder


def _no_bar(iterable: Any, *args: Any, **kwargs: Any) -> Any:
    return iterable


@contextlib.contextmanager
def _no_tqdm_bars():
    """clip-benchmark wraps its loops in tqdm bars, which off a TTY wrote raw bar text into the training log
    at every in-training evaluation (`0%|  | 0/2 [00:00<?, ?it/s]...`); our progress (toolkit.core.log) is the
    one shown. TQDM_DISABLE cannot do it: tqdm reads it when first imported, which open_clip does before.
    So its modules' ``tqdm`` name passes the iterable through while they score."""
    from clip_benchmark.metrics import zeroshot_classification, zeroshot_retrieval

    modules = (zeroshot_classification, zeroshot_retrieval)
    saved = [m.tqdm for m in modules]
    for m in modules:
        m.tqdm = _no_bar
    try:
        yield
    finally:
        for m, bar in zip(modules, saved, strict=True):
            m.tqdm = bar


# sklearn's balanced_accuracy_score (clip-benchmark's mean per-class recall) warns when the model predicts a
# class that has no sample in the set: routine for sets that do not hold every class name they list.
_ABSENT_CLASS = "y_pred contains classes not in y_true"


@contextlib.contextmanager
def _metric_warnings(eval_set: EvalSet):
    """Python warnings raised by clip-benchmark and sklearn while ``eval_set`` is scored, as one toolkit log
    line each (named after the set) instead of raw ``file:line: UserWarning`` text on stderr that even
    ``--quiet`` printed. The known routine one is logged at info level (hidden by --quiet)."""
    log = get_logger("eval")
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", category=UserWarning)  # other categories keep the user's filters
        yield
    seen = set()
    for w in caught:
        text = str(w.message)
        if text in seen:
            continue
        seen.add(text)
        if _ABSENT_CLASS in text:
            log.info(
                "%s: the model predicted classes that have no sample in the set; mean per-class recall "
                "averages over the classes that do (sklearn: %s)",
                eval_set.name,
                text,
            )
        else:
            log.warning("%s: %s while scoring: %s", eval_set.name, w.category.__name__, text)


class InputCast:
    """Feeds images to ``model.encode_image`` in ``dtype``: models loaded with precision bf16/fp16
    (open_clip's meaning) hold low-precision conv weights, and clip-benchmark passes float32 images."""

    def __init__(self, model: Any, dtype: Any):
        self.model, self.dtype = model, dtype

    def encode_image(self, images: Any) -> Any:
        return self.model.encode_image(images.to(self.dtype))

    def encode_text(self, tokens: Any) -> Any:
        return self.model.encode_text(tokens)


class _LoaderView:
    """Iterates the progress-wrapped batches while exposing ``.dataset`` (clip-benchmark reads
    ``dataloader.dataset.classes``)."""

    def __init__(self, batches: Any, dataset: Any):
        self._batches, self.dataset = batches, dataset

    def __iter__(self):
        return iter(self._batches)
