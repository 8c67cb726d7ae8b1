"""Starting training processes: PyTorch's elastic launcher (torchrun) or the ranks SLURM started.

- ``torchrun_argv``: torchrun's arguments for a ``LaunchConfig``: one node -> ``--standalone`` (a c10d
  rendezvous on a free local port); N fixed nodes -> static rendezvous at master_addr:master_port with
  ``--node-rank``; MIN:MAX nodes or restarts across nodes -> c10d rendezvous at master_addr:master_port
  under ``rdzv_id``. ``--max-restarts`` restarts failed workers, which resume from the latest checkpoint.
- ``launch``: runs torchrun's own ``main`` in this process (it becomes the elastic agent, forwards
  signals to the workers and restarts them); each worker runs ``python -m ENTRY CONFIG.yaml``.
- ``apply_slurm_env``: under ``srun toolkit train ...`` every task is a rank; SLURM's variables become
  torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from types import FrameType

from toolkit.core.config import dump_yaml
from toolkit.core.log import get_logger
from toolkit.train.config import LaunchConfig, TrainConfig

# Signals the launcher passes to its workers instead of letting torchrun's agent handle them.
FORWARDED = tuple(s for s in (signal.SIGTERM, getattr(signal, "SIGUSR1", None)) if s is not None)
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # torchrun's default minus SIGTERM
AGENT_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # torchrun sets it from --signals-to-handle

WORKER_ENV = "CLIPTK_TRAIN_WORKER"  # set for workers a cliptk launcher started (it keeps the stage books)


def is_worker(env: Mapping[str, str] | None = None) -> bool:
    """True inside a process that torchrun, SLURM or a cliptk launcher made a rank of a job."""
    env = os.environ if env is None else env
    return "RANK" in env and "WORLD_SIZE" in env


def launched_by_cliptk() -> bool:
    return os.environ.get(WORKER_ENV) == "1"


def torchrun_argv(launch: LaunchConfig, entry: str, args: list[str]) -> list[str]:
    """torchrun's command-line arguments (module docstring) running ``python -m entry *args``."""
    lo, hi = launch.node_range()
    argv = [f"--nproc-per-node={launch.nproc_per_node}", f"--max-restarts={launch.max_restarts}",
            # SIGTERM is passed to the workers by the launcher (signals_forwarded_to_workers), not torchrun
            f"--signals-to-handle={AGENT_SIGNALS}"]
    endpoint = f"{launch.master_addr}:{launch.master_port}"
    if (lo, hi) == (1, 1):
        argv.append("--standalone")
    elif lo == hi and launch.max_restarts == 0:
        argv += [f"--nnodes={lo}", f"--node-rank={launch.node_rank}", f"--master-addr={launch.master_addr}",
                 f"--master-port={launch.master_port}"]
    else:
        argv += [f"--nnodes={lo}:{hi}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                 f"--rdzv-id={launch.rdzv_id}"]
    return [*argv, "--module", entry, *args]


def launch(cfg: TrainConfig, entry: str) -> None:
    """Run the job's processes on this node through torchrun (blocking). Raises RuntimeError naming the
    failed rank when the workers fail beyond ``max_restarts``."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    fd, path = tempfile.mkstemp(prefix="cliptk-train-", suffix=".yaml")
    with os.fdopen(fd, "w") as fh:
        fh.write(dump_yaml(cfg))
    argv = torchrun_argv(cfg.launch, entry, [path])
    get_logger("train").info("torchrun %s", " ".join(argv))
    saved = os.environ.get(WORKER_ENV)
    os.environ[WORKER_ENV] = "1"
    try:
        with signals_forwarded_to_workers():
            torchrun_main(argv)
    except ChildFailedError as err:
        raise RuntimeError(f"training workers failed: {_first_failure(err)}") from None
    except SignalException as err:  # torchrun passed the signal on: the ranks checkpoint and exit
        get_logger("train").warning("launcher received %s; the workers stopped after a checkpoint",
                                    getattr(err, "sigval", "a signal"))
    finally:
        os.unlink(path)
        if saved is None:
            os.environ.pop(WORKER_ENV, None)
        else:
            os.environ[WORKER_ENV] = saved


@contextmanager
def signals_forwarded_to_workers() -> Iterator[None]:
    """While torchrun runs in this process: SIGTERM and SIGUSR1 go on to the worker processes, which
    checkpoint and exit 0, and the agent ends normally. Left to torchrun, SIGTERM made the agent kill its
    workers and die, and the other nodes' agents then waited in the exit barrier for 300 s (measured: a
    two-node job hung past 180 s after SIGTERM to node 1's launcher); SIGUSR1's default action killed the
    launcher outright. Main thread only (elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: FrameType | None) -> None:
        get_logger("train").warning("launcher received %s: passing it to the workers", signal.Signals(signum).name)
        for pid in _child_pids(os.getpid()):
            with suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    saved = os.environ.get(AGENT_SIGNALS_ENV)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if saved is None:
            os.environ.pop(AGENT_SIGNALS_ENV, None)
        else:
            os.environ[AGENT_SIGNALS_ENV] = saved


def _child_pids(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (torchrun's workers), from /proc (Linux)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def _first_failure(err) -> str:
    failures = getattr(err, "failures", {}) or {}
    for rank, failure in sorted(failures.items()):
        return f"rank {rank} exited with code {failure.exitcode} ({failure.message or 'see its log above'})"
    return str(err)


def _slurm_hosts(nodelist: str) -> list[str]:
    """Hosts of a SLURM node list: ``scontrol show hostnames`` when available, else the simple forms
    ``a,b`` and ``prefix[1-3,7]``."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             check=True, timeout=30).stdout.split()
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    hosts = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            hosts += [f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return hosts


def apply_slurm_env(launch: LaunchConfig, env: dict[str, str] | None = None) -> bool:
    """Under ``srun`` with more than one task (and no RANK yet), set torchrun's variables from SLURM's.
    Returns True when it did. MASTER_ADDR defaults to the first node of the job."""
    env = os.environ if env is None else env
    if is_worker(env) or int(env.get("SLURM_NTASKS", "1")) <= 1 or "SLURM_PROCID" not in env:
        return False
    num_nodes = int(env.get("SLURM_NNODES", "1"))
    world = int(env["SLURM_NTASKS"])
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=str(world), LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
               LOCAL_WORLD_SIZE=str(world // max(num_nodes, 1)), GROUP_RANK=env.get("SLURM_NODEID", "0"))
    env.setdefault("MASTER_ADDR", (_slurm_hosts(env.get("SLURM_JOB_NODELIST", "")) or [launch.master_addr])[0])
    env.setdefault("MASTER_PORT", str(launch.master_port))
    return True
