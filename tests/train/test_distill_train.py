"""``toolkit train --loss distill`` end to end on real training shards (the demo emoji pairs) extended with a
reference model's embeddings (reference_set.py), and its refusal of a set without them."""

from __future__ import annotations

import pytest
from reference_set import add_reference
from trainkit import metrics, run_cli, train_cfg, weights

from toolkit.train.batches import open_data
from toolkit.train.run import run

SGD = {"optim": {"name": "sgd", "lr": 0.1}}  # linear in the gradient: equal gradients give equal weights


@pytest.fixture(scope="module")
def reference_train(demo_train, tmp_path_factory):
    return add_reference(demo_train, tmp_path_factory.mktemp("reference_train") / "train")


def _rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12)).item() for k in want)


def test_toolkit_train_loss_distill(reference_train, tmp_path):
    out = tmp_path / "run"
    done = run_cli(
        [
            "train",
            "--data",
            str(reference_train),
            "--out",
            str(out),
            "--loss",
            "distill",
            "--batch-size",
            "16",
            "--steps",
            "3",
            "--log-every",
            "1",
            "--workers",
            "0",
            "--set",
            "tensorboard=false",
            "--set",
            "loss.distill.weight=0.8",
            "--set",
            "optim.name=sgd",
            "--set",
            "optim.lr=0.1",
        ]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [m for m in metrics(out) if "loss" in m]
    assert len(steps) == 3 and all(0 < m["loss"] < 100 for m in steps)
    # the reference rows reach the objective: weight 0 is exactly the CLIP loss, weight 0.8 trains otherwise
    run(train_cfg(reference_train, tmp_path / "clip", steps=3, loss={"kind": "openclip"}, **SGD))
    run(
        train_cfg(
            reference_train,
            tmp_path / "w0",
            steps=3,
            loss={"kind": "distill", "distill": {"weight": 0.0}},
            **SGD,
        )
    )
    assert _rel(weights(tmp_path / "w0"), weights(tmp_path / "clip")) <= 1e-5
    assert _rel(weights(out), weights(tmp_path / "clip")) > 1e-3


def test_a_set_without_reference_embeddings_is_refused_naming_it(demo_train, tmp_path):
    done = run_cli(
        [
            "train",
            "--data",
            str(demo_train),
            "--out",
            str(tmp_path / "run"),
            "--loss",
            "distill",
            "--batch-size",
            "16",
            "--steps",
            "1",
            "--workers",
            "0",
            "--set",
            "tensorboard=false",
        ]
    )
    assert done.returncode != 0
    said = " ".join((done.stdout + done.stderr).split())
    assert str(demo_train) in said and "--reference-model" in said and "ref_image" in said
    # refused by the preflight, before the stage books, the model or any checkpoint: the run folder is not
    # made
    assert not (tmp_path / "run").exists()


def test_drrho_without_reference_embeddings_is_refused_by_the_preflight_and_by_every_rank(
    demo_train, tmp_path
):
    """``run(cfg)`` refuses in its preflight (nothing written); a rank that had no preflight (the user's own
    torchrun or srun) refuses in ``open_data``, before its model is built."""
    cfg = train_cfg(demo_train, tmp_path / "run", steps=1, loss={"kind": "drrho"})
    with pytest.raises(
        ValueError,
        match=r"the drrho objective needs a reference model's embeddings per sample "
        r"\(fields ref_image, ref_text\)",
    ) as err:
        run(cfg)
    assert str(demo_train) in str(err.value) and not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="ref_image, ref_text") as err:
        open_data(cfg.data_plan(), cfg.loss, 2)
    assert str(demo_train) in str(err.value)
    openclip = train_cfg(demo_train, tmp_path / "run", loss={"kind": "openclip"})
    assert open_data(openclip.data_plan(), openclip.loss, 2).num_samples == 160


def test_toolkit_train_loss_drrho_reads_the_reference_and_the_gradient_cache_passes_it(
    reference_train, tmp_path
):
    done = run_cli(
        [
            "train",
            "--data",
            str(reference_train),
            "--out",
            str(tmp_path / "run"),
            "--loss",
            "drrho",
            "--batch-size",
            "16",
            "--steps",
            "2",
            "--log-every",
            "1",
            "--workers",
            "0",
            "--set",
            "tensorboard=false",
        ]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert all(0 < m["loss"] < 100 for m in metrics(tmp_path / "run") if "loss" in m)

    def drrho(name: str, ref_weight: float, **over) -> dict:
        run(
            train_cfg(
                reference_train,
                tmp_path / name,
                steps=3,
                loss={"kind": "drrho", "drrho": {"ref_weight": ref_weight}},
                **SGD,
                **over,
            )
        )
        return weights(tmp_path / name)

    full = drrho("full", 1.0)
    assert (
        _rel(drrho("cached", 1.0, micro_batch_size=5), full) <= 1e-5
    )  # the cache's micro-batches get their rows
    assert _rel(drrho("no_reference", 0.0), full) > 1e-3  # the reference rows change what is trained
