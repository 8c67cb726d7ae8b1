"""``--fsdp`` (train/fsdp.py): FSDP2-sharded training equals one process, and composes with the trainer's parts.

The oracle is the issue's: K = 2 and 4 gloo ranks with --fsdp train the same weights as one plain process on the
same global batches (SGD, whole-vector relative difference <= 1e-6 after 4 steps), with and without the gradient
cache, in the fastclip and ring modes. The per-tensor worst case is larger (1.6e-6 on a LayerNorm bias of norm
~1e-2) and is the same for DDP at K = 2 (measured: FSDP and DDP weights at K = 2 agree bit for bit), so the
whole vector is the measure, as in test_elastic.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import run_rank_script
from trainkit import metrics, train_cfg, weights

from toolkit.train.run import run

SGD = {"optim": {"name": "sgd", "lr": 0.1}}  # linear in the gradient: summation-order noise stays small
MODES = {"fastclip": {"kind": "fastclip", "fastclip": {"version": "v3"}, "mode": "fastclip"},
         "ring": {"kind": "openclip", "mode": "ring"}}


def rel(got: dict, want: dict) -> float:
    """Relative L2 difference of the whole parameter vectors (module docstring)."""
    assert got.keys() == want.keys()
    num = sum(((got[k] - want[k]).double() ** 2).sum() for k in want) ** 0.5
    return float(num / sum((want[k].double() ** 2).sum() for k in want) ** 0.5)


@pytest.fixture(scope="module")
def references(demo_train, tmp_path_factory) -> dict:
    """One plain process per (mode, micro-batch): the runs every sharded job must equal."""
    base, out = tmp_path_factory.mktemp("fsdp_ref"), {}
    for mode, loss in MODES.items():
        for micro in (0, 2):
            run(train_cfg(demo_train, base / f"{mode}-{micro}", steps=4, loss=loss, micro_batch_size=micro, **SGD))
            out[mode, micro] = base / f"{mode}-{micro}"
    return out


def sharded_runs(data, base, world: int, runs: dict) -> dict:
    """Train ``runs`` ({name: overrides}) with --fsdp in one ``world``-rank gloo job (fsdp_jobs.py); returns
    {name: run folder}."""
    import json

    base.mkdir(parents=True, exist_ok=True)
    runs = {name: {**over, "fsdp": True} for name, over in runs.items()}
    (base / "jobs.json").write_text(json.dumps({"data": str(data), "runs": runs}))
    run_rank_script(str(Path(__file__).with_name("fsdp_jobs.py")), world, base, timeout_s=600)
    return {name: base / name for name in runs}


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_at_2_and_4_ranks_trains_the_weights_of_one_process(demo_train, references, tmp_path, world):
    runs = {f"{mode}-{micro}": {"steps": 4, "loss": loss, "micro_batch_size": micro, **SGD}
            for mode, loss in MODES.items() for micro in (0, 2)}  # 2: the gradient cache
    got = sharded_runs(demo_train, tmp_path, world, runs)
    for (mode, micro), want in references.items():
        out = got[f"{mode}-{micro}"]
        assert rel(weights(out), weights(want)) <= 1e-6, (mode, world, micro)
        assert [m["loss"] for m in metrics(out)] == pytest.approx([m["loss"] for m in metrics(want)], rel=1e-5)
        sharded = out / "checkpoints" / "step-00000004"
        assert sorted(p.name for p in sharded.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(world)]


@pytest.mark.parametrize(("over", "words"), [
    ({"fsdp_cpu_offload": True}, "set fsdp too"),
    ({"fsdp": True, "grad_dtype": "bf16"}, "grad_dtype sets DDP's all_reduce"),
    ({"fsdp": True, "checkpoint": {"dir": "s3://bucket/ckpt"}}, "a folder all ranks share"),
])
def test_combinations_that_cannot_work_are_refused_in_one_line(demo_train, tmp_path, over, words):
    with pytest.raises(ValueError, match=words) as err:
        train_cfg(demo_train, tmp_path, **over)
    assert "\n" not in str(err.value)
