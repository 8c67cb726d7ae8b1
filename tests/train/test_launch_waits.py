"""The launcher never hangs (issue 25 items 2 and 5): a busy rendezvous port is refused naming it, a peer that
never comes ends at launch.rendezvous_timeout_s naming what was awaited, and SIGTERM/SIGINT sent to the
launcher's process group while it waits end it and its agent within seconds, the manifest saying
"interrupted". Real launchers (`toolkit train` subprocesses), real sockets, real signals.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from _launch import free_port
from trainkit import ROOT, env, run_cli, toolkit_cmd

pytestmark = pytest.mark.dist


def _args(data, out, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        "2",
        "--batch-size",
        "16",
        "--workers",
        "0",
        "--nproc-per-node",
        "2",
        *extra,
    ]


class _SilentServer:
    """Another program on the port: accepts connections and never answers (what made torchrun hang)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.fixture
def silent_server():
    server = _SilentServer()
    yield server
    server.close()


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_a_port_held_by_another_program_is_refused_naming_it(demo_train, tmp_path, silent_server):
    """The issue's case: an elastic job whose rendezvous port a silent server holds (it waited > 10 min)."""
    out = tmp_path / "run"
    port = str(silent_server.port)
    result = run_cli(
        _args(demo_train, out, "--nodes", "1:2", "--master-addr", "127.0.0.1", "--master-port", port),
        timeout_s=240,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert (
        f"--master-port {port}: 127.0.0.1:{port} is held by a program that is not a torch rendezvous"
        in result.stderr
    ), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    m = _manifest(out)
    assert m["status"] == "failed" and f"--master-port {port}" in m["error"]


@pytest.mark.parametrize(
    "over", [{"nodes": "2", "node_rank": 0}, {"nproc_per_node": 2}], ids=["static-node0", "one-node"]
)
def test_a_node_that_hosts_the_rendezvous_refuses_a_busy_port(silent_server, over):
    """Node 0 of a static job, and one node given --master-port (which used to be ignored: standalone), host
    the rendezvous themselves: a port in use is refused at once, without a probe."""
    from toolkit.core.config import build
    from toolkit.core.launch import RendezvousError, check_port, torchrun_argv
    from toolkit.core.supervise import LauncherSignals
    from toolkit.train.config import LaunchConfig

    launch = build(LaunchConfig, {**over, "master_port": silent_server.port})
    argv = " ".join(torchrun_argv(launch, "m", []))
    assert f"127.0.0.1:{silent_server.port}" in argv or f"--master-port={silent_server.port}" in argv
    with pytest.raises(
        RendezvousError,
        match=f"--master-port {silent_server.port}: port {silent_server.port} on 127.0.0.1 is already in use",
    ):
        check_port(launch, LauncherSignals())
    check_port(build(LaunchConfig, {**over, "master_port": free_port()}), LauncherSignals())  # free: accepted
    assert "--standalone" in torchrun_argv(build(LaunchConfig, {"nproc_per_node": 2}), "m", [])


def test_a_peer_that_never_comes_ends_at_the_rendezvous_timeout_naming_it(demo_train, tmp_path):
    out = tmp_path / "run"
    port = str(free_port())
    result = run_cli(
        _args(
            demo_train,
            out,
            "--nodes",
            "2",
            "--node-rank",
            "0",
            "--master-port",
            port,
            "--set",
            "launch.rendezvous_timeout_s=3",
        ),
        timeout_s=240,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "no rendezvous within 3 s" in result.stderr, result.stderr[-3000:]
    assert f"the other 1 node(s) of 2 to join this node's rendezvous at 127.0.0.1:{port}" in result.stderr
    assert _manifest(out)["status"] == "failed"


def _launch_config(lines: list[str]) -> str:
    """The config file the launcher handed torchrun (unique to the run: a test's own processes only, not
    those of another test running beside it)."""
    line = next(line for line in lines if "torchrun --nproc" in line)
    return next(token for token in line.split() if token.endswith(".yaml"))


def _agent_pids(yaml_path: str) -> list[int]:
    """Live processes whose command line names this launch's config file (its agent and workers)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if (
                yaml_path.encode() in cmdline.read_bytes()
                and Path(cmdline.parent, "stat").read_text().split()[2] != "Z"
            ):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_waiting_for_a_peer_ends_launcher_and_agent(demo_train, tmp_path, sig):
    """A static node 0 whose peer never comes (the rendezvous deadline far away): the signal, sent to the
    launcher's process group as a terminal's Ctrl-C is, ends it within seconds and kills its agent."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        toolkit_cmd(
            *_args(demo_train, out, "--nodes", "2", "--node-rank", "0", "--master-port", str(free_port()))
        ),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 180
    while not any("torchrun --nproc" in line for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
        time.sleep(0.2)
    yaml_path = _launch_config(lines)
    time.sleep(2)  # the agent is in its rendezvous now
    assert _agent_pids(yaml_path), "the agent should be waiting"
    sent = time.monotonic()
    os.killpg(proc.pid, sig)
    proc.wait(timeout=60)
    reader.join(timeout=10)
    output = "".join(lines)
    assert time.monotonic() - sent < 30, output[-3000:]  # interpreter shutdown takes a few seconds here
    assert proc.returncode == 1, output[-3000:]
    assert f"interrupted by {sig.name} while waiting for the other 1 node(s) of 2" in output, output[-3000:]
    m = _manifest(out)
    assert m["status"] == "interrupted" and sig.name in m["error"]
    assert not _agent_pids(yaml_path)


def test_a_second_signal_stops_running_workers_at_once(demo_train, tmp_path):
    """The first SIGTERM asks the workers for a checkpoint; a second one, sent before they finished
    (serialising a 92 MiB checkpoint takes seconds), kills the agent and the workers now."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        toolkit_cmd(*_args(demo_train, out, "--steps", "400", "--log-every", "1")),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
        time.sleep(0.1)
    yaml_path = _launch_config(lines)
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    reader.join(timeout=10)
    output = "".join(lines)
    assert proc.returncode == 1, output[-3000:]
    assert "interrupted by a second signal (SIGTERM): the workers were stopped at once" in output, output[
        -3000:
    ]
    assert _manifest(out)["status"] == "interrupted"
    assert not _agent_pids(yaml_path)
