"""Starting a job's processes: PyTorch's elastic launcher (torchrun) or the ranks SLURM started.

Shared by ``toolkit train`` (toolkit.train.launch) and ``toolkit data precompute`` (its ranks): a stage
with a ``LaunchConfig`` calls :func:`launch_job` with its config and the module its ranks run.

- ``torchrun_argv``: torchrun's arguments for a ``LaunchConfig``: one node without a port -> ``--standalone``
  (a c10d rendezvous on a free local port); one node with ``master_port`` -> a c10d rendezvous on that port;
  N fixed nodes -> static rendezvous at master_addr:port with ``--node-rank``; MIN:MAX nodes or restarts
  across nodes -> c10d rendezvous at master_addr:port under ``rdzv_id``. ``--max-restarts`` restarts failed
  workers (a trainer's resume from the latest checkpoint).
- ``launch``: checks the rendezvous port (``check_port``), then runs torchrun's agent in a child process
  (``toolkit.core.agent``) and supervises it (``supervise.Supervisor``: signals, rendezvous deadline);
  each worker runs ``python -m ENTRY CONFIG.yaml``.
- ``apply_slurm_env``: under ``srun toolkit train ...`` every task is a rank; SLURM's variables become
  torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from toolkit.core.config import dump_yaml, option
from toolkit.core.log import QUIET_ENV, get_logger, is_quiet
from toolkit.core.procs import child_preexec
from toolkit.core.stage import StageInterrupted
from toolkit.core.supervise import POLL_S, LauncherSignals, Supervisor, stop_tree
from toolkit.core.watchdog import Watch

Backend = Literal["auto", "gloo", "nccl"]
DEFAULT_MASTER_PORT = 29500  # torchrun's

AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # torchrun's default minus SIGTERM (the launcher handles signals)
WORKER_ENV = "CLIPTK_TRAIN_WORKER"  # set for workers a cliptk launcher started (it keeps the stage books)
# A probe of a busy rendezvous port: a TCPStore client against a server that is not one never returns
# (measured with torch 2.14: a 3 s store timeout still waiting after 20 s), so it runs in a child process
# that SIGALRM's default action ends STORE_ANSWER_S after torch's import; the import itself takes 2-10 s on
# a loaded 2-core machine, hence the longer bound on the whole probe.
STORE_ANSWER_S = 5
PROBE_TIMEOUT_S = 60.0
_PROBE = (
    "import datetime, signal, sys; from torch.distributed import TCPStore; signal.alarm(int(sys.argv[3])); "
    "TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, wait_for_workers=False, "
    "timeout=datetime.timedelta(seconds=int(sys.argv[3]))); print('store')"
)


class RendezvousError(RuntimeError):
    """The rendezvous cannot happen as configured (its port is taken); the message names the port."""


@dataclass(frozen=True)
class LaunchConfig:
    """How many processes and where (torchrun under the hood; SLURM's variables are read when set)."""

    nproc_per_node: int = option(
        1, ge=1, affects_output=False, doc="Training processes on this node (one per GPU on CUDA)."
    )
    nodes: str = option(
        "1",
        affects_output=False,
        doc="Number of nodes N, or MIN:MAX for an elastic job (torchrun's c10d rendezvous).",
    )
    node_rank: int = option(
        0,
        ge=0,
        affects_output=False,
        doc="This node's rank, 0..N-1 (fixed N only; elastic jobs are ranked by the rendezvous).",
    )
    master_addr: str = option(
        "127.0.0.1", affects_output=False, doc="Address of node 0 (the rendezvous host)."
    )
    master_port: int = option(
        0,
        ge=0,
        le=65535,
        affects_output=False,
        doc="Rendezvous port on master_addr; 0: any free port on a single node, 29500 "
        "across nodes (a port given on a single node is used, and refused if busy).",
    )
    max_restarts: int = option(
        0,
        ge=0,
        affects_output=False,
        doc="Times torchrun restarts the workers after a failure; they resume from the latest checkpoint.",
    )
    rdzv_id: str = option(
        "cliptk", affects_output=False, doc="Job id shared by every node of an elastic job."
    )
    backend: Backend = option(
        "auto",
        affects_output=False,
        doc="Process-group backend: auto (nccl on CUDA, else gloo), gloo or nccl.",
    )
    timeout_s: float = option(1800.0, gt=0, affects_output=False, doc="Collective timeout in seconds.")
    rendezvous_timeout_s: float = option(
        300.0,
        gt=0,
        affects_output=False,
        doc="Seconds the launcher waits for every node to join before it stops "
        "with an error naming what it waited for.",
    )

    def node_range(self) -> tuple[int, int]:
        """(min, max) nodes from ``nodes`` ('2' -> (2, 2), '1:4' -> (1, 4))."""
        parts = self.nodes.split(":")
        try:
            lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
        except ValueError:
            lo = hi = 0
        if lo < 1 or hi < lo:
            raise ValueError(f"nodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {self.nodes!r}")
        return lo, hi

    @property
    def port(self) -> int:
        """The rendezvous port in use: master_port, or torchrun's 29500 when it is 0 (standalone: unused)."""
        return self.master_port or DEFAULT_MASTER_PORT

    @property
    def is_multiprocess(self) -> bool:
        return self.nproc_per_node > 1 or self.node_range() != (1, 1) or self.max_restarts > 0


def is_worker(env: Mapping[str, str] | None = None) -> bool:
    """True inside a process that torchrun, SLURM or a cliptk launcher made a rank of a job."""
    env = os.environ if env is None else env
    return "RANK" in env and "WORLD_SIZE" in env


def launched_by_cliptk() -> bool:
    return os.environ.get(WORKER_ENV) == "1"


def rendezvous_kind(launch: LaunchConfig) -> str:
    """standalone (one node, any free port), static (fixed nodes, no restarts) or c10d."""
    lo, hi = launch.node_range()
    if (lo, hi) == (1, 1) and not launch.master_port:
        return "standalone"
    if lo == hi > 1 and launch.max_restarts == 0:
        return "static"
    return "c10d"


def torchrun_argv(launch: LaunchConfig, entry: str, args: list[str]) -> list[str]:
    """torchrun's command-line arguments (module docstring) running ``python -m entry *args``."""
    lo, hi = launch.node_range()
    argv = [
        f"--nproc-per-node={launch.nproc_per_node}",
        f"--max-restarts={launch.max_restarts}",
        f"--signals-to-handle={AGENT_SIGNALS}",
    ]
    kind = rendezvous_kind(launch)
    if kind == "standalone":
        argv.append("--standalone")
    elif kind == "static":
        argv += [
            f"--nnodes={lo}",
            f"--node-rank={launch.node_rank}",
            f"--master-addr={launch.master_addr}",
            f"--master-port={launch.port}",
        ]
    else:
        argv += [
            f"--nnodes={lo}:{hi}" if lo != hi else f"--nnodes={lo}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={launch.master_addr}:{launch.port}",
            f"--rdzv-id={launch.rdzv_id}",
            f"--rdzv-conf=join_timeout={max(1, round(launch.rendezvous_timeout_s))}",
        ]
    return [*argv, "--module", entry, *args]


def warn_unused_port(launch: LaunchConfig) -> None:
    """A master_port given to a single process has nothing to rendezvous: say so instead of ignoring it."""
    if launch.master_port and not launch.is_multiprocess:
        get_logger("launch").warning(
            "--master-port %d is unused: one process needs no rendezvous (it is used "
            "with --nproc-per-node > 1 or --nodes)",
            launch.master_port,
        )


def describe_wait(launch: LaunchConfig) -> str:
    """What the launcher waits for until its workers start, in words (timeouts and interruptions say it)."""
    lo, hi = launch.node_range()
    where = f"{launch.master_addr}:{launch.port}"
    kind = rendezvous_kind(launch)
    if kind == "standalone":
        return f"torchrun to start {launch.nproc_per_node} worker(s) on this node"
    if kind == "static" and launch.node_rank == 0:
        return (
            f"the other {lo - 1} node(s) of {lo} to join this node's rendezvous at {where} (each started "
            f"with --nodes {lo} --node-rank 1..{lo - 1} --master-addr {launch.master_addr} "
            f"--master-port {launch.port})"
        )
    if kind == "static":
        return f"node 0's rendezvous at {where} (node {launch.node_rank} of {lo}; is node 0 started?)"
    count = f"{lo}" if lo == hi else f"{lo} to {hi}"
    return f"{count} node(s) at the c10d rendezvous {where} (rdzv_id {launch.rdzv_id})"


def check_port(launch: LaunchConfig, signals: LauncherSignals) -> None:
    """Refuse a rendezvous port that another program holds, before torchrun waits on it forever. A node
    that hosts the rendezvous (static node 0, a single node) must be able to bind it; elsewhere a busy
    local port must answer as a torch TCPStore (another node's launcher on this host). Remote addresses
    are not checked (their wait ends at launch.rendezvous_timeout_s)."""
    kind = rendezvous_kind(launch)
    if kind == "standalone":
        return
    addr, port = launch.master_addr, launch.port
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's server does
            s.bind((addr, port))
        return
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            return  # not a local address (or unresolvable): torchrun reports what it finds
    hosts = (kind == "static" and launch.node_rank == 0) or launch.node_range() == (1, 1)
    if hosts:
        raise RendezvousError(
            f"--master-port {port}: port {port} on {addr} is already in use (another program "
            "or another job); this node hosts the rendezvous there: choose a free port"
        )
    if not _answers_as_store(addr, port, signals):
        raise RendezvousError(
            f"--master-port {port}: {addr}:{port} is held by a program that is not a torch "
            f"rendezvous (it did not answer as a TCPStore within {STORE_ANSWER_S} s); choose "
            "a free port for every node of the job"
        )


def _answers_as_store(addr: str, port: int, signals: LauncherSignals) -> bool:
    """True when a TCPStore client connects to addr:port (probe in a child process, see PROBE_TIMEOUT_S)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _PROBE, addr, str(port), str(STORE_ANSWER_S)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            signals.check(f"an answer from {addr}:{port} (is it a rendezvous?)")
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            stop_tree(proc)
    return proc.returncode == 0 and "store" in (proc.stdout.read() if proc.stdout else "")


def _agent_env() -> dict[str, str]:
    """The agent's (and so the workers') environment: marked as launched by cliptk, with this process's
    log level; --quiet silences torchrun's banner and INFO lines and the workers' INFO lines."""
    env = dict(os.environ, **{WORKER_ENV: "1"})
    if is_quiet():
        env.update({"CLIPTK_LOG_LEVEL": "WARNING", QUIET_ENV: "1"})
        env.setdefault("LOGLEVEL", "ERROR")  # torch.distributed.elastic's loggers read it at import
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    else:
        env["CLIPTK_LOG_LEVEL"] = logging.getLevelName(get_logger().getEffectiveLevel())
    return env


def launch_job(
    launch: LaunchConfig, cfg: Any, entry: str, what: str = "training", args: tuple[str, ...] = ()
) -> None:
    """Run the job's processes on this node through torchrun (blocking); each runs ``python -m entry
    CONFIG.yaml *args`` with ``cfg`` dumped to a temporary YAML. Raises RendezvousError (busy port),
    supervise.RendezvousTimeout, StageInterrupted (a signal before the workers started, or a second one),
    or RuntimeError naming the failed rank when the workers fail beyond ``max_restarts``. ``what`` names
    the job in errors."""
    log = get_logger("launch")
    with LauncherSignals() as signals:
        check_port(launch, signals)
        fd, path = tempfile.mkstemp(prefix="cliptk-job-", suffix=".yaml")
        with os.fdopen(fd, "w") as fh:
            fh.write(dump_yaml(cfg))
        result = path[: -len(".yaml")] + ".result.json"
        argv = torchrun_argv(launch, entry, [path, *args])
        log.info("torchrun %s", " ".join(argv))
        # before any rank beats: clears an earlier run's heartbeats; a stage without a watchdog_s is not
        # watched
        watch = Watch(cfg.out, getattr(cfg, "watchdog_s", 0.0))
        try:
            # a terminal's Ctrl-C reaches the launcher only; a SIGKILLed launcher takes the agent with it (and
            # the agent its ranks, toolkit.core.agent), so no orphan trains on into this run folder
            proc = subprocess.Popen(
                [sys.executable, "-m", "toolkit.core.agent", result, *argv],
                env=_agent_env(),
                start_new_session=True,
                preexec_fn=child_preexec(),
            )
            supervisor = Supervisor(proc, signals, describe_wait(launch), launch.rendezvous_timeout_s)
            supervisor.watch, supervisor.what = watch, what
            code = supervisor.wait()
            outcome = _read_outcome(result)
        finally:
            for leftover in (path, result):
                if os.path.exists(leftover):
                    os.unlink(leftover)
    _report(outcome, code, supervisor, what)


def _read_outcome(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def _report(outcome: dict, code: int, supervisor: Supervisor, what: str) -> None:
    resume = "resume from the newest checkpoint" if what == "training" else "resume (finished work is kept)"
    if "failed" in outcome and supervisor.forwarded is not None:  # e.g. a worker signalled while starting up
        raise StageInterrupted(
            f"interrupted by {signal.Signals(supervisor.forwarded).name}: the workers stopped "
            f"({outcome['failed']}); rerun the same command to {resume}",
            None if what == "training" else supervisor.forwarded,
        )  # train's launcher: exit 1
    if "failed" in outcome:
        raise RuntimeError(f"{what} workers failed: {outcome['failed']}")
    if "error" in outcome and not supervisor.workers_started:
        raise RendezvousError(
            f"the rendezvous failed while waiting for {supervisor.waiting_for}: {outcome['error']}"
        )
    if "error" in outcome:
        raise RuntimeError(f"torchrun's agent failed: {outcome['error']}")
    if "signal" in outcome:  # the agent itself got SIGINT/SIGHUP/SIGQUIT and stopped the workers
        get_logger("launch").warning(
            "torchrun's agent received %s; the workers stopped%s",
            outcome["signal"],
            " after a checkpoint" if what == "training" else "; rerun to " + resume,
        )
    elif code != 0:
        raise RuntimeError(f"torchrun's agent exited with code {code} (see its log above)")


def _slurm_hosts(nodelist: str) -> list[str]:
    """Hosts of a SLURM node list: ``scontrol show hostnames`` when available, else the simple forms
    ``a,b`` and ``prefix[1-3,7]``."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.split()
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
    env.update(
        RANK=env["SLURM_PROCID"],
        WORLD_SIZE=str(world),
        LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
        LOCAL_WORLD_SIZE=str(world // max(num_nodes, 1)),
        GROUP_RANK=env.get("SLURM_NODEID", "0"),
    )
    env.setdefault(
        "MASTER_ADDR", (_slurm_hosts(env.get("SLURM_JOB_NODELIST", "")) or [launch.master_addr])[0]
    )
    env.setdefault("MASTER_PORT", str(launch.port))
    return True
