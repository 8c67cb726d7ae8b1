"""clip-benchmark metrics through our reader: tied features score 100%, shuffled ones do not."""

from __future__ import annotations

import pytest
from evalkit import TiedModel, tied_tokenizer, to_tensor

from toolkit.eval.datasets import open_eval_set
from toolkit.eval.score import evaluate_set

DERANGE7 = [1, 2, 3, 4, 5, 6, 0]


@pytest.mark.parametrize("batch_size", [1, 4, 64])
def test_tied_classification_scores_100(sets_root, batch_size):
    eval_set = open_eval_set(sets_root, "cls7")
    assert (eval_set.kind, eval_set.num_samples, len(eval_set.classnames)) == ("classification", 14, 7)
    metrics = evaluate_set(TiedModel(7), tied_tokenizer, to_tensor, eval_set, batch_size=batch_size)
    assert metrics == {"acc1": 1.0, "acc5": 1.0, "mean_per_class_recall": 1.0}


def test_shuffled_classification_fails(sets_root):
    eval_set = open_eval_set(sets_root, "cls7")
    metrics = evaluate_set(TiedModel(7, DERANGE7), tied_tokenizer, to_tensor, eval_set, batch_size=5)
    assert metrics["acc1"] == 0.0
    assert metrics["mean_per_class_recall"] == 0.0
    assert metrics["acc5"] < 1.0


@pytest.mark.parametrize("batch_size", [1, 7])
def test_tied_retrieval_scores_100(sets_root, batch_size):
    eval_set = open_eval_set(sets_root, "ret9")
    assert (eval_set.kind, eval_set.num_samples) == ("retrieval", 9)
    metrics = evaluate_set(TiedModel(9), tied_tokenizer, to_tensor, eval_set, batch_size=batch_size)
    assert set(metrics) == {f"{d}_retrieval_recall@{k}" for d in ("image", "text") for k in (1, 5, 10)}
    # R@10 with 9 images is undefined: reported as None, not computed on too few candidates.
    assert (
        metrics.pop("image_retrieval_recall@10") is None and metrics.pop("text_retrieval_recall@10") is None
    )
    assert all(v == 1.0 for v in metrics.values()), metrics


def test_shuffled_retrieval_fails(sets_root):
    eval_set = open_eval_set(sets_root, "ret9")
    perm = [(k + 4) % 9 for k in range(9)]
    metrics = evaluate_set(TiedModel(9, perm), tied_tokenizer, to_tensor, eval_set, batch_size=4)
    assert metrics["image_retrieval_recall@1"] == 0.0 and metrics["text_retrieval_recall@1"] == 0.0


def test_recall_k_above_set_size_is_none(sets_root):
    eval_set = open_eval_set(sets_root, "ret3")
    metrics = evaluate_set(TiedModel(3), tied_tokenizer, to_tensor, eval_set, recall_k=(1, 2, 5))
    assert metrics["image_retrieval_recall@1"] == 1.0 and metrics["text_retrieval_recall@2"] == 1.0
    assert metrics["image_retrieval_recall@5"] is None and metrics["text_retrieval_recall@5"] is None


def test_run_with_bf16_model_weights(sets_root, tmp_path):
    """precision=bf16 casts matmul weights; images must be fed in bf16 (clip-benchmark sends float32)."""
    from toolkit.core.config import build
    from toolkit.eval.zeroshot import ZeroShotConfig, run

    cfg = build(
        ZeroShotConfig,
        {
            "model": "cliptk-tiny",
            "datasets": ["cls7", "ret3"],
            "root": str(sets_root),
            "out": str(tmp_path),
            "precision": "bf16",
            "device": "cpu",
            "batch_size": 5,
        },
    )
    result = run(cfg)
    assert result.counts == {"num_datasets": 2, "num_samples": {"cls7": 14, "ret3": 3}}
    avg = result.details["average"]
    assert 0 <= avg["zeroshot_classification"]["acc1"] <= 1
    # 3 images: R@5 and R@10 are undefined, so only R@1 enters the retrieval average.
    assert set(avg["zeroshot_retrieval"]) == {"image_retrieval_recall@1", "text_retrieval_recall@1"}
    assert avg["num_datasets"] == 2 and avg["primary"] is not None


def test_optional_sets_missing_are_reported_not_fatal(sets_root, tmp_path):
    """build-set --missing-ok without its input builds nothing; zeroshot --skip-missing evaluates the rest
    and names the missing set in report.md; without the flags both fail naming the path or set."""
    from toolkit.core.config import build
    from toolkit.eval.build import BuildSetConfig
    from toolkit.eval.build import run as build_set
    from toolkit.eval.datasets import DatasetError
    from toolkit.eval.zeroshot import ZeroShotConfig, run

    absent = str(tmp_path / "no-fashion-mnist")
    spec = {"source": "fashion-mnist", "input": absent, "out": str(tmp_path / "sets" / "fashion_mnist")}
    built = build_set(build(BuildSetConfig, {**spec, "missing_ok": True}))
    assert built.counts["missing_input"] == 1 and not (tmp_path / "sets" / "fashion_mnist" / "test").exists()
    with pytest.raises(DatasetError, match="no-fashion-mnist"):
        build_set(build(BuildSetConfig, {**spec, "out": str(tmp_path / "other")}))
    (tmp_path / "sets" / "cls7").symlink_to(sets_root / "cls7")
    cfg = {
        "model": "cliptk-tiny",
        "datasets": ["cls7", "fashion_mnist"],
        "root": str(tmp_path / "sets"),
        "out": str(tmp_path / "zs"),
        "device": "cpu",
    }
    result = run(build(ZeroShotConfig, {**cfg, "skip_missing": True}))
    assert result.counts["num_samples"] == {"cls7": 14} and result.details["not_evaluated"] == [
        "fashion_mnist"
    ]
    report_md = (tmp_path / "zs" / "report.md").read_text()
    assert (
        "Not evaluated" in report_md and "fashion_mnist" in report_md and "| cls7 | 14 | 14.29 |" in report_md
    )
    with pytest.raises(DatasetError, match="fashion_mnist"):
        run(build(ZeroShotConfig, {**cfg, "out": str(tmp_path / "zs2")}))
