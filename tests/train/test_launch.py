"""K processes train exactly like one: torchrun on one node, two launchers as two nodes, SLURM-started ranks.

Every run trains the same 6 global batches of 16 real pairs; the per-step global losses of the
multi-process runs must equal the single-process run's within 1e-5 (relative; only the order of float
reductions differs), and so must the final FastCLIP tables.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from _launch import free_port
from safetensors.torch import load_file
from trainkit import ROOT, env, metrics, run_cli, toolkit_cmd, train_cfg, two_node_job

from toolkit.core.launch import _slurm_hosts, apply_slurm_env, torchrun_argv
from toolkit.train.run import run

pytestmark = pytest.mark.dist
STEPS = 6
CASES = {
    "openclip-gather": ["--loss", "openclip", "--mode", "gather"],
    "fastclip-v3": ["--loss", "fastclip-v3", "--mode", "fastclip"],
    "openclip-ring": ["--loss", "openclip", "--mode", "ring"],
}


def _args(data, out, case: str) -> list[str]:
    return [
        "train",
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--batch-size",
        "16",
        "--workers",
        "0",
        "--log-every",
        "1",
        "--set",
        "tensorboard=false",
        *CASES[case],
    ]


def _single(data, out, case: str) -> list[float]:
    loss = {
        "openclip-gather": {"kind": "openclip", "mode": "gather"},
        "fastclip-v3": {},
        "openclip-ring": {"kind": "openclip", "mode": "ring"},
    }[case]
    run(train_cfg(data, out, steps=STEPS, batch_size=16, loss=loss))
    return [r["loss"] for r in metrics(out)]


def _assert_same_run(out, reference_out, reference_losses) -> None:
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == pytest.approx(reference_losses, rel=1e-5)
    state = out / "checkpoints" / f"step-{STEPS:08d}" / "loss_state.safetensors"
    if state.is_file():
        want, got = load_file(str(reference_out / state.relative_to(out))), load_file(str(state))
        for key in want:  # log u: an absolute 1e-5 in log u is a relative 1e-5 in u
            assert got[key].allclose(want[key], rtol=0, atol=1e-5), key


# One launch per path by default (each ~14 s on 2 cores): torchrun --nproc-per-node with FastCLIP-v3, two
# launchers with OpenCLIP's gather. The other cases are slow: their launch path is one of those two, and the
# mode's K-rank equality is proven by tests/train/losses/test_modes.py::test_every_mode_matches_k1_after_ddp
# (every mode after DDP at K = 2 and 4, spawned gloo jobs) and through the trainer by test_fsdp.py (fastclip
# and ring at 2 and 4 ranks, gather at 2).
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "case",
    ["fastclip-v3", pytest.param("openclip-gather", marks=SLOW), pytest.param("openclip-ring", marks=SLOW)],
)
def test_nproc_per_node_2_equals_one_process(demo_train, tmp_path, case):
    reference = _single(demo_train, tmp_path / "one", case)
    # the default case also runs --quiet: no torchrun banner, no INFO line of any process on stderr (what
    # test_train_messages.py's own launch checks, marked slow there: this launch proves it by default)
    quiet = ["--quiet"] if case == "fastclip-v3" else []
    result = run_cli([*quiet, *_args(demo_train, tmp_path / "two", case), "--nproc-per-node", "2"])
    assert result.returncode == 0, result.stderr[-4000:]
    _assert_same_run(tmp_path / "two", tmp_path / "one", reference)
    assert "on 2 rank(s)" in result.stdout
    if quiet:
        assert result.stderr == "", result.stderr[-3000:]


@pytest.mark.parametrize("case", [pytest.param("fastclip-v3", marks=SLOW), "openclip-gather"])
def test_two_launchers_as_two_nodes_equal_one_process(demo_train, tmp_path, case):
    reference = _single(demo_train, tmp_path / "one", case)
    node0, node1 = two_node_job(_args(demo_train, tmp_path / "nodes", case))
    assert node0.returncode == 0 and node1.returncode == 0, (node0.stdout[-3000:], node1.stdout[-3000:])
    _assert_same_run(tmp_path / "nodes", tmp_path / "one", reference)


def test_ranks_started_by_slurm(demo_train, tmp_path):
    """Two tasks with SLURM's variables (what `srun --ntasks 2 toolkit train ...` sets) form one job."""
    reference = _single(demo_train, tmp_path / "one", "fastclip-v3")
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        slurm = {
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NNODES": "1",
            "SLURM_NODEID": "0",
            "SLURM_JOB_NODELIST": "localhost",
            "MASTER_PORT": port,
        }
        procs.append(
            subprocess.Popen(
                toolkit_cmd(*_args(demo_train, tmp_path / "slurm", "fastclip-v3")),
                cwd=ROOT,
                env={**env(), **slurm},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    _assert_same_run(tmp_path / "slurm", tmp_path / "one", reference)


def test_bad_config_is_refused_before_any_process_starts(demo_train, tmp_path):
    result = run_cli(
        [*_args(demo_train, tmp_path / "bad", "fastclip-v3"), "--nproc-per-node", "2", "--mode", "gather"]
    )
    assert result.returncode == 2 and "fastclip mode only" in result.stderr
    assert "torchrun" not in result.stderr and not (tmp_path / "bad").exists()


def test_torchrun_arguments_and_slurm_environment():
    from toolkit.core.config import build
    from toolkit.train.config import LaunchConfig

    one = torchrun_argv(build(LaunchConfig, {"nproc_per_node": 4}), "m", ["c.yaml"])
    assert "--standalone" in one and "--nproc-per-node=4" in one and one[-3:] == ["--module", "m", "c.yaml"]
    static = torchrun_argv(build(LaunchConfig, {"nodes": "8", "node_rank": 3, "master_addr": "h0"}), "m", [])
    assert {"--nnodes=8", "--node-rank=3", "--master-addr=h0", "--master-port=29500"} <= set(static)
    elastic = torchrun_argv(build(LaunchConfig, {"nodes": "2:4", "max_restarts": 3}), "m", [])
    assert {"--nnodes=2:4", "--rdzv-backend=c10d", "--max-restarts=3"} <= set(elastic)
    assert _slurm_hosts("gpu[01-03,07],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]
    environ = {
        "SLURM_NTASKS": "16",
        "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "n[1-2]",
    }
    assert apply_slurm_env(build(LaunchConfig, {}), environ)
    assert (
        environ["RANK"],
        environ["WORLD_SIZE"],
        environ["LOCAL_RANK"],
        environ["LOCAL_WORLD_SIZE"],
        environ["GROUP_RANK"],
        environ["MASTER_ADDR"],
    ) == ("9", "16", "1", "8", "1", "n1")
    assert not apply_slurm_env(build(LaunchConfig, {}), {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"})
    assert os.environ.get("RANK") is None


PROBE = '''
import json
import os


def make(eval_cfg):
    """The evaluation callback of a launched rank, built from the config's eval section by name."""
    def evaluate(clip, model_cfg, preprocess_cfg, step):
        return {f"eval/{eval_cfg.datasets[0]}/rank": float(os.environ["RANK"]),
                f"eval/{eval_cfg.datasets[0]}/params": float(sum(p.numel() for p in clip.parameters()))}
    return evaluate
'''


def test_launched_ranks_build_their_evaluation_callback_from_the_named_factory(
    demo_train, tmp_path, monkeypatch
):
    """Ranks start from the trainer's own entry (toolkit.train.worker) and build the callback the launching
    process names (``eval_factory``, "module:function" of the config's eval section), as toolkit.trainval
    does."""
    (tmp_path / "probe_eval.py").write_text(PROBE)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = train_cfg(
        demo_train,
        tmp_path / "run",
        steps=2,
        launch={"nproc_per_node": 2},
        eval={"every_steps": 2, "root": str(tmp_path), "datasets": ["probe"]},
    )
    result = run(cfg, eval_factory="probe_eval:make")
    assert result.counts["world_size"] == 2
    evaluated = [m for m in metrics(tmp_path / "run") if "eval/probe/rank" in m]
    assert evaluated and {m["eval/probe/rank"] for m in evaluated} == {0.0}  # rank 0 evaluates
    assert all(m["eval/probe/params"] > 0 for m in evaluated)
    argv = torchrun_argv(cfg.launch, "toolkit.train.worker", ["c.yaml", "--eval-factory", "probe_eval:make"])
    assert argv[-5:] == ["--module", "toolkit.train.worker", "c.yaml", "--eval-factory", "probe_eval:make"]
