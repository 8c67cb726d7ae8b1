"""How the towers run (train/towers.py): activation checkpointing, locked towers, torch.compile."""

from __future__ import annotations

import pytest
import torch
from trainkit import MODEL, metrics, train_cfg, weights

from toolkit.train.run import run

SGD = {"optim": {"name": "sgd", "lr": 0.1}}  # linear in the gradient: summation-order noise stays small


def _rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12)).item() for k in want)


@pytest.mark.parametrize("micro", [0, 5])  # 5: the gradient cache's second pass is checkpointed
def test_grad_checkpointing_trains_the_same_weights(demo_train, tmp_path, micro):
    run(train_cfg(demo_train, tmp_path / "plain", steps=3, micro_batch_size=micro, **SGD))
    run(
        train_cfg(
            demo_train, tmp_path / "ckpt", steps=3, micro_batch_size=micro, grad_checkpointing=True, **SGD
        )
    )
    assert _rel(weights(tmp_path / "ckpt"), weights(tmp_path / "plain")) <= 1e-6


def test_the_trainers_config_turns_checkpointing_on_in_both_towers(demo_train, tmp_path):
    from toolkit.train.plan.memprobe import build_tower_model
    from toolkit.train.towers import prepare

    model = build_tower_model(MODEL)
    prepare(model, train_cfg(demo_train, tmp_path, grad_checkpointing=True))
    assert model.clip.visual.transformer.grad_checkpointing and model.clip.transformer.grad_checkpointing
    plain = build_tower_model(MODEL)
    prepare(plain, train_cfg(demo_train, tmp_path))
    assert (
        not plain.clip.visual.transformer.grad_checkpointing and not plain.clip.transformer.grad_checkpointing
    )


def test_plan_predicts_the_checkpointed_activations():
    from toolkit.core.config import build
    from toolkit.train.plan.config import PlanConfig
    from toolkit.train.plan.memory import MEASURED, MEASURED_CHECKPOINTED
    from toolkit.train.plan.planner import run

    def activations(ckpt: bool) -> float:
        plan = run(
            build(
                PlanConfig,
                {
                    "model": MODEL,
                    "batch_size": 256,
                    "micro_batch_size": 64,
                    "device": "cpu",
                    "grad_checkpointing": ckpt,
                },
            )
        )
        return plan.rows["activations (micro-batch 64)"]

    fixed, per_sample, _ = MEASURED_CHECKPOINTED[(MODEL, "fp32", "cpu")]
    assert activations(True) == fixed + 64 * per_sample
    fixed, per_sample, _ = MEASURED[(MODEL, "fp32", "cpu")]
    assert activations(False) == fixed + 64 * per_sample
    assert activations(False) >= 2 * activations(True)  # benchmarks/grad_checkpointing.py's measured saving


# torch.compile (inductor) takes minutes per process on 2 shared CPU cores (forward and backward graphs, the
# cache's graph-free pass, recompiles for new caption lengths): these two are `slow` for that reason alone,
# and get a longer timeout than pytest's 600 s.
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_compiled_towers_train_resume_and_cache_like_eager(demo_train, tmp_path):
    over = {"steps": 4, "micro_batch_size": 8, "checkpoint": {"every_steps": 2}, **SGD}
    run(train_cfg(demo_train, tmp_path / "eager", **over))
    run(train_cfg(demo_train, tmp_path / "compiled", compile=True, **over))
    eager, compiled = metrics(tmp_path / "eager"), metrics(tmp_path / "compiled")
    assert [m["loss"] for m in compiled] == pytest.approx([m["loss"] for m in eager], rel=1e-5)
    assert _rel(weights(tmp_path / "compiled"), weights(tmp_path / "eager")) <= 1e-5
    step2 = tmp_path / "compiled" / "checkpoints" / "step-00000002"
    run(
        train_cfg(
            demo_train, tmp_path / "resumed", compile=True, **{**over, "checkpoint": {"resume": str(step2)}}
        )
    )
    assert _rel(weights(tmp_path / "resumed"), weights(tmp_path / "compiled")) <= 1e-6
    assert [m["loss"] for m in metrics(tmp_path / "resumed")] == pytest.approx(
        [m["loss"] for m in compiled[2:]], rel=1e-6
    )


# under --fsdp, FSDP2 wraps the blocks that regional compile compiled (towers.prepare runs before fsdp.shard,
# torchtitan's order): the all-gathers run between compiled blocks, not inside their graphs
@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp"])
def test_compiled_towers_at_2_ranks_match_one_process(demo_train, tmp_path, fsdp):
    over = {"steps": 2, **SGD}
    run(train_cfg(demo_train, tmp_path / "one", **over))
    two = train_cfg(
        demo_train, tmp_path / "two", compile=True, fsdp=fsdp, launch={"nproc_per_node": 2}, **over
    )
    run(two)
    assert [m["loss"] for m in metrics(tmp_path / "two")] == pytest.approx(
        [m["loss"] for m in metrics(tmp_path / "one")], rel=1e-5
    )
    assert _rel(weights(tmp_path / "two"), weights(tmp_path / "one")) <= 1e-5


def test_locked_towers_train_only_their_unlocked_groups_and_layers(demo_train, tmp_path):
    out = tmp_path / "locked"
    run(
        train_cfg(
            demo_train,
            out,
            steps=2,
            checkpoint={"every_steps": 1},
            lock_image=True,
            lock_image_unlocked_groups=2,
            lock_text=True,
            lock_text_unlocked_layers=1,
        )
    )
    before, after = weights(out, "checkpoints/step-00000001"), weights(out)
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    last = max(int(k.split(".")[3]) for k in after if k.startswith("visual.transformer.resblocks."))
    # open_clip's groups, counted from the output: image 2 = [proj] and [last block + ln_post]; text 1 =
    # [projection]
    trainable = {
        k
        for k in after
        if k.startswith(
            (
                f"visual.transformer.resblocks.{last}.",
                "visual.ln_post.",
                "visual.proj",
                "text_projection",
                "logit_scale",
            )
        )
    }
    assert moved == trainable
    assert any(k.startswith("visual.transformer.resblocks.0.") for k in after)  # a frozen block exists


def test_ema_is_checkpointed_resumed_exactly_evaluated_and_saved(demo_train, tmp_path):
    from open_clip.factory import create_model_and_transforms

    def eval_fn(clip, model_cfg, preprocess_cfg, step):  # a real metric of the model under evaluation
        with torch.no_grad():
            feats = clip.encode_text(torch.arange(1, 9).view(2, 4).repeat(1, 8)[:, :32], normalize=True)
        return {"eval/probe/cosine": float(feats[0] @ feats[1])}

    over = {
        "steps": 4,
        "ema_decay": 0.5,
        "checkpoint": {"every_steps": 2},
        "eval": {"every_steps": 2, "root": str(tmp_path), "datasets": ["probe"]},
    }
    run(train_cfg(demo_train, tmp_path / "whole", **over), eval_fn=eval_fn)
    step2 = tmp_path / "whole" / "checkpoints" / "step-00000002"
    assert (step2 / "ema.safetensors").is_file()
    run(
        train_cfg(demo_train, tmp_path / "resumed", **{**over, "checkpoint": {"resume": str(step2)}}),
        eval_fn=eval_fn,
    )
    ema, raw = weights(tmp_path / "whole", "model-ema"), weights(tmp_path / "whole")
    assert _rel(weights(tmp_path / "resumed", "model-ema"), ema) <= 1e-6
    assert _rel(ema, raw) > 1e-4  # an average, not a copy of the last weights
    last = [m for m in metrics(tmp_path / "whole") if "eval_ema/probe/cosine" in m][-1]
    assert last["eval/probe/cosine"] != last["eval_ema/probe/cosine"]
    model, _, _ = create_model_and_transforms(f"local-dir:{tmp_path / 'whole' / 'model-ema'}")
    assert eval_fn(model.eval(), None, None, 4)["eval/probe/cosine"] == pytest.approx(
        last["eval_ema/probe/cosine"], abs=1e-6
    )


def test_an_unlocked_count_that_locks_nothing_is_refused(demo_train, tmp_path):
    """Before: --lock-image-unlocked-groups 99 / --lock-text-unlocked-layers 99 trained the whole tower
    without a word (issue 43 item 11)."""
    from toolkit.train.plan.memprobe import build_tower_model
    from toolkit.train.towers import prepare

    for over, want in (
        (
            {"lock_image": True, "lock_image_unlocked_groups": 99},
            r"lock_image_unlocked_groups 99: "
            r"the image tower has (\d+) layer groups .*nothing is locked; use at most \d+",
        ),
        (
            {"lock_text": True, "lock_text_unlocked_layers": 99},
            r"lock_text_unlocked_layers 99: "
            r"the text tower has (\d+) layer groups .*nothing is locked; use at most \d+",
        ),
    ):
        with pytest.raises(ValueError, match=want) as err:
            prepare(build_tower_model(MODEL), train_cfg(demo_train, tmp_path, **over))
        most = int(str(err.value).rsplit("at most ", 1)[1].split()[0])
        key = next(k for k in over if "unlocked" in k)
        model = build_tower_model(MODEL)  # the largest count allowed still locks something
        prepare(model, train_cfg(demo_train, tmp_path, **{**over, key: most}))
        assert any(not p.requires_grad for p in model.clip.parameters())


@pytest.mark.parametrize("key", ["lock_image_unlocked_groups", "lock_text_unlocked_layers"])
def test_an_unlocked_count_without_its_lock_is_refused(demo_train, tmp_path, key):
    with pytest.raises(ValueError, match=f"{key} 2 does nothing without lock_"):
        train_cfg(demo_train, tmp_path, **{key: 2})
