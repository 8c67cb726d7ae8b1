"""Helpers of the trainer tests: a real training set (demo emoji pairs), configs, launchers, result readers.

Imported by bare name (tests/train is on sys.path, see tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _launch import free_port

ROOT = Path(__file__).resolve().parents[2]
MODEL = "cliptk-tiny"


def build_demo_trainset(base: Path, num_concepts: int = 160, samples_per_shard: int = 50) -> Path:
    """Real pairs: Twemoji images with their Unicode names (toolkit data demo) -> raw shards (data shard) ->
    training shards for cliptk-tiny (data precompute). Returns the training folder."""
    from toolkit.core.config import build
    from toolkit.data.acquire import demo, shard
    from toolkit.data.trainset.precompute import stage as precompute

    result = demo.run(build(demo.DemoConfig, {"out": str(base / "demo"), "limit": num_concepts}))
    shard.run(
        build(
            shard.ShardConfig,
            {
                "source": result.outputs["train_csv"],
                "out": str(base / "raw"),
                "image_size": 64,
                "samples_per_shard": samples_per_shard,
            },
        )
    )
    precompute.run(
        build(
            precompute.PrecomputeConfig,
            {
                "input": str(base / "raw"),
                "out": str(base / "train"),
                "model": MODEL,
                "samples_per_shard": samples_per_shard,
                "num_workers": 1,
            },
        )
    )
    return base / "train"


def train_cfg(data: Path, out: Path, **over):
    """A TrainConfig for tests: small batch, no worker processes, no TensorBoard; ``over`` as nested dicts."""
    from toolkit.core.config import build, deep_merge
    from toolkit.train.config import TrainConfig

    # FastCLIP-v3 named: these tests exercise its per-sample tables (the default at batch 16 is another)
    base = {
        "data": str(data),
        "out": str(out),
        "model": MODEL,
        "batch_size": 16,
        "steps": 6,
        "log_every": 1,
        "tensorboard": False,
        "loader": {"num_workers": 0},
        "loss": {"kind": "fastclip", "fastclip": {"version": "v3"}},
    }
    if isinstance(over.get("loss"), dict):
        over = {**over, "loss": fastclip_section(over["loss"])}
    return build(TrainConfig, deep_merge(base, over))


def run_one_thread(cfg):
    """Train ``cfg`` in this process at one thread, as the `toolkit` commands of these tests run (``env()``
    sets OMP_NUM_THREADS=1): the same summation order as the command, without its ~4 s of start-up."""
    import torch

    from toolkit.train.run import run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(cfg)
    finally:
        torch.set_num_threads(threads)


def fastclip_section(loss: dict) -> dict:
    """A test's loss keys with FastCLIP's knobs (``version``, ``gamma_min``, ...) given by name beside the
    shared ones put into their ``fastclip`` section, where LossConfig reads them (the tests' shorthand)."""
    import dataclasses

    from toolkit.train.losses.fastclip.config import FastCLIPConfig

    own = {f.name for f in dataclasses.fields(FastCLIPConfig)}
    section = {k: v for k, v in loss.items() if k in own}
    if not section:
        return loss
    rest = {k: v for k, v in loss.items() if k not in own}
    return {**rest, "fastclip": {**rest.get("fastclip", {}), **section}}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def weights(run_dir: Path, sub: str = "model") -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / sub / "open_clip_model.safetensors"))


def toolkit_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "toolkit", *args]


def env() -> dict[str, str]:
    """The environment of a CLI subprocess: this checkout first on the path, one thread per process."""
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )


def run_cli(args: list[str], timeout_s: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        toolkit_cmd(*args), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout_s, **kw
    )


def two_node_job(args: list[str], timeout_s: float = 300) -> list[subprocess.CompletedProcess]:
    """The same `toolkit train` on two launchers as nodes 0 and 1 of one job on 127.0.0.1."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            toolkit_cmd(
                *args,
                "--nodes",
                "2",
                "--node-rank",
                str(r),
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
        for r in (0, 1)
    ]
    out = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout_s)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out
