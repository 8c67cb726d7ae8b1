"""Elastic training: restarted workers, resumes at another world size, signals to one node, fsspec
checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from _launch import free_port
from trainkit import ROOT, env, metrics, run_cli, toolkit_cmd, train_cfg, weights

from toolkit.train.metrics import read_audit
from toolkit.train.run import run

STEPS = 24
ARGS = [
    "--batch-size",
    "16",
    "--loss",
    "fastclip-v3",
    "--workers",
    "0",
    "--log-every",
    "1",
    "--checkpoint-every",
    "4",
    "--set",
    "tensorboard=false",
    "--set",
    "audit_samples=true",
    "--set",
    "optim.warmup_steps=4",
]


def _args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--steps", str(STEPS), *ARGS, *extra]


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _wait(predicate, proc, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"ended early (code {proc.returncode}): {proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _rel(got: dict, want: dict) -> float:
    """Relative difference of the whole parameter vectors."""
    num = sum(((got[k] - want[k]).double() ** 2).sum() for k in want) ** 0.5
    return float(num / sum((want[k].double() ** 2).sum() for k in want) ** 0.5)


@pytest.fixture(scope="module")
def two_proc_reference(demo_train, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("elastic_ref") / "run"
    result = run_cli([*_args(demo_train, out), "--nproc-per-node", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.dist
def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(
    demo_train, two_proc_reference, tmp_path
):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        toolkit_cmd(*_args(demo_train, out), "--nproc-per-node", "2", "--max-restarts", "1"),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _wait(lambda: (out / "checkpoints" / "step-00000008" / "checkpoint.json").is_file(), proc)
    agents = _children(proc.pid)  # the launcher's one child is torchrun's agent; its children are the workers
    assert len(agents) == 1, agents
    workers = _children(agents[0])
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-4000:]
    assert "resumed from" in output
    want, got = weights(two_proc_reference), weights(out)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6
    assert [r["step"] for r in metrics(out)] == list(range(1, STEPS + 1))
    assert read_audit(str(out)) == read_audit(str(two_proc_reference))  # every batch once, in order


@pytest.mark.dist
@pytest.mark.parametrize("first,second", [(1, 2), (2, 1)])
def test_resume_at_another_world_size_reads_the_same_batches(
    demo_train, two_proc_reference, tmp_path, first, second
):
    source = two_proc_reference if first == 2 else tmp_path / "one"
    if first == 1:
        assert run_cli(_args(demo_train, source)).returncode == 0
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "step-00000016", out / "checkpoints" / "step-00000016")
    extra = ["--nproc-per-node", str(second)] if second > 1 else []
    result = run_cli([*_args(demo_train, out), "--resume", "latest", *extra])
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"on {second} rank(s)" in result.stdout
    before, after = read_audit(str(source)), read_audit(str(out))
    assert sorted(after) == list(range(17, STEPS + 1))
    assert all(after[s] == before[s] for s in after)  # the same global batches, ids compared
    assert _rel(weights(out), weights(source)) <= 1e-5


@pytest.mark.dist
def test_sigterm_to_one_node_stops_every_rank_after_one_checkpoint(demo_train, tmp_path):
    out = tmp_path / "run"
    port, procs = str(free_port()), []
    for node in (0, 1):
        procs.append(
            subprocess.Popen(
                toolkit_cmd(
                    *_args(demo_train, out),
                    "--steps",
                    "400",
                    "--nodes",
                    "2",
                    "--node-rank",
                    str(node),
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    port,
                ),
                cwd=ROOT,
                env=env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    _wait(lambda: (out / "metrics.jsonl").is_file() and len(metrics(out)) >= 3, procs[0])
    procs[1].send_signal(signal.SIGTERM)
    logs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    last = max(r["step"] for r in metrics(out))
    assert last < 400 and (out / "checkpoints" / f"step-{last:08d}" / "checkpoint.json").is_file()
    assert not (out / "model").exists()
    manifest = json.loads((out / "manifest.json").read_text())  # node 0's launcher learned the outcome
    assert manifest["status"] == "preempted" and manifest["counts"]["step"] == last, manifest
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".train")) == []  # no side file


def test_checkpoints_on_an_fsspec_url_resume_exactly(demo_train, tmp_path):
    import fsspec

    url = "memory://cliptk-ckpt-test/run"
    cfg = {"steps": 6, "checkpoint": {"every_steps": 3, "dir": url}}
    run(train_cfg(demo_train, tmp_path / "a", **cfg))
    fs = fsspec.filesystem("memory")
    assert fs.isfile("/cliptk-ckpt-test/run/step-00000006/checkpoint.json")
    reference = weights(tmp_path / "a")
    fs.rm("/cliptk-ckpt-test/run/step-00000006/checkpoint.json")  # the last write never completed
    run(
        train_cfg(
            demo_train, tmp_path / "a", steps=6, checkpoint={"every_steps": 3, "dir": url, "resume": "latest"}
        )
    )
    for key, value in weights(tmp_path / "a").items():
        assert torch.equal(value, reference[key]), key
    fs.rm("/cliptk-ckpt-test", recursive=True)


@pytest.mark.dist
def test_sigusr1_to_a_launcher_reaches_its_workers(demo_train, tmp_path):
    """SLURM's --signal=USR1 aimed at a torchrun launcher: passed on to the workers, which checkpoint and
    exit 0 (the signal's default action used to kill the launcher and orphan them)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        toolkit_cmd(*_args(demo_train, out), "--steps", "400", "--nproc-per-node", "2"),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _wait(lambda: (out / "metrics.jsonl").is_file() and len(metrics(out)) >= 3, proc)
    proc.send_signal(signal.SIGUSR1)
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, output[-3000:]
    last = max(r["step"] for r in metrics(out))
    assert last < 400 and (out / "checkpoints" / f"step-{last:08d}" / "checkpoint.json").is_file()


# adagrad_eps 1e-4: AdaGrad's first steps after a (re)start are ±lr·sign(g) for every coordinate, so fp32
# summation-order noise (1e-7) flips the sign of near-zero gradients and moves those coordinates by 2·lr
# (measured: 5e-4 relative on the network with eps 1e-10, while the weights agree to 1e-5); a larger ε
# makes those updates proportional to g. float64 exactness at any world size: losses/test_neuclip_dist.py.
NEUCLIP = [
    "--loss",
    "neuclip",
    "--set",
    "loss.neuclip.num_prototypes=48",
    "--set",
    "loss.neuclip.restart_every_steps=6",
    "--set",
    "loss.neuclip.adagrad_eps=1e-4",
]


@pytest.mark.dist
def test_neuclip_resumes_exactly_at_another_world_size(demo_train, tmp_path):
    """Its network (prototypes and AdaGrad sums) travels in the loss state: a 2-process run resumed on one
    process from step 16 ends like the uninterrupted one (weights, network, losses), restarts included."""
    from safetensors.torch import load_file

    source, out = tmp_path / "two", tmp_path / "resumed"
    assert (
        run_cli([*_args(demo_train, source), *NEUCLIP, "--nproc-per-node", "2"], timeout_s=600).returncode
        == 0
    )
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "step-00000016", out / "checkpoints" / "step-00000016")
    result = run_cli([*_args(demo_train, out), *NEUCLIP, "--resume", "latest"], timeout_s=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "on 1 rank(s)" in result.stdout
    assert _rel(weights(out), weights(source)) <= 1e-5
    final = Path("checkpoints") / f"step-{STEPS:08d}" / "loss_state.safetensors"
    net_got, net_want = load_file(str(out / final)), load_file(str(source / final))
    assert set(net_want) == {"network.initialised", "network.filled", "network.weight", "network.sumsq"}
    assert _rel(net_got, net_want) <= 1e-5
    losses = {r["step"]: r["loss"] for r in metrics(out)}
    assert [losses[s] for s in range(17, STEPS + 1)] == pytest.approx(
        [r["loss"] for r in metrics(source) if r["step"] > 16], rel=1e-5
    )
