"""core.stage input fingerprints: measured once per pipeline stage, afresh after the recorder has them."""

from __future__ import annotations

import os

import pytest

from toolkit.core import stage
from toolkit.pipeline.shell import ShellConfig


def test_fingerprints_once_serves_the_recorder_then_measures_afresh(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"a")
    cfg = ShellConfig(cmd="true", out=str(tmp_path / "out"), inputs=[str(folder)])
    outside = stage.fingerprint(str(folder))
    with stage.fingerprints_once():
        before = stage.fingerprint(str(folder))
        (folder / "b.png").write_bytes(b"bb")
        assert before == outside and stage.fingerprint(str(folder)) == before  # not walked again
        with stage.stage_run("shell", cfg, cfg.out) as rec:
            assert rec.manifest["inputs"]["inputs[0]"]["fingerprint"] == before
            assert stage.fingerprint(str(folder)) != before  # the body sees the folder as it is now
    assert stage.fingerprint(str(folder)) != outside


HOLDER = """
import sys, time
from pathlib import Path
import os

import pytest

from toolkit.core import stage
from toolkit.pipeline.shell import ShellConfig

cfg = ShellConfig(cmd="hold", out=sys.argv[1])
with stage.stage_run("shell", cfg, cfg.out):
    Path(sys.argv[2]).write_text("holding")
    time.sleep(600)
"""


def _start_holder(tmp_path, out):
    import subprocess
    import sys
    import time

    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out), str(ready)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (
            proc.stdout.read() if proc.poll() else "slow"
        )
        time.sleep(0.05)
    return proc


@pytest.mark.timeout(120)
def test_second_run_into_a_locked_folder_fails_at_once_naming_the_holder(tmp_path):
    import signal
    import socket

    from toolkit.core.outlock import OutputLocked

    out = tmp_path / "out"
    holder = _start_holder(tmp_path, out)
    try:
        manifest = (out / "manifest.json").read_text()
        cfg = ShellConfig(cmd="second", out=str(out))
        with pytest.raises(OutputLocked) as err, stage.stage_run("shell", cfg, cfg.out):
            raise AssertionError("the body of a second run must not start")
        message = str(err.value)
        assert (
            f"{out} is in use by another run (pid {holder.pid} on {socket.gethostname()}, since " in message
        )
        assert "running: " in message and "hold" in message and "\n" not in message
        assert (out / "manifest.json").read_text() == manifest  # nothing of the holder's was touched
        assert "cmd: hold" in (out / "config.yaml").read_text()
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up at all: the OS releases the flock
        holder.wait(30)
    with stage.stage_run("shell", cfg, cfg.out) as rec:
        assert rec.lock_fd is not None
        assert f'"pid": {os.getpid()}, ' in (out / ".lock").read_text()
    assert (out / ".lock").read_text() == ""  # released: names nobody
    assert stage.read_manifest(str(out))["status"] == "done"


@pytest.mark.parametrize(
    ("error", "words", "status"),
    [
        (KeyboardInterrupt(), "interrupted (Ctrl-C or SIGINT)", "interrupted"),
        (
            stage.StageInterrupted("interrupted by SIGTERM while waiting"),
            "interrupted by SIGTERM",
            "interrupted",
        ),
        (RuntimeError(""), "RuntimeError (no message)", "failed"),
        (ValueError("bad row 3"), "bad row 3", "failed"),
    ],
)
def test_failure_message_is_never_empty(tmp_path, caplog, error, words, status):
    """Issue 15 item 9: Ctrl-C logged 'data.fetch failed: ' and recorded 'KeyboardInterrupt: '. A signal is
    recorded as interrupted, not failed (issue 25 item 2)."""
    cfg = ShellConfig(cmd="x", out=str(tmp_path / "out"))
    with pytest.raises(type(error)), stage.stage_run("shell", cfg, cfg.out):
        raise error
    verb = "failed" if status == "failed" else "stopped"
    assert f"shell {verb}: {words}" in caplog.text
    manifest = stage.read_manifest(cfg.out)
    assert manifest["status"] == status and manifest["error"].startswith(f"{type(error).__name__}: {words}")


def test_cli_ctrl_c_is_one_line_and_exit_130(capsys):
    import typer

    from toolkit.cli.common import run_stage

    def interrupted(cfg):
        raise KeyboardInterrupt

    with pytest.raises(typer.Exit) as exit_info:
        run_stage(interrupted, None)
    assert exit_info.value.exit_code == 130
    assert capsys.readouterr().err.strip() == (
        "error: interrupted (Ctrl-C); finished work is kept, rerun the same command to resume"
    )


def test_a_launchers_failure_goes_in_front_of_the_symptom_a_rank_recorded(tmp_path):
    """A rank killed with SIGKILL records nothing; rank 0 may record gloo's "connection closed by peer" before
    torchrun stops it: the manifest then names the launcher's first failure first, and keeps the rank's."""
    import json

    (tmp_path / "manifest.json").write_text(
        json.dumps({"status": "failed", "error": "RuntimeError: Connection closed by peer"})
    )
    err = RuntimeError("rank 1 exited with code -9 (SIGKILL)")
    stage.settle_manifest(str(tmp_path), err)
    stage.settle_manifest(str(tmp_path), err)  # twice: once in front
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["status"] == "failed"
    assert m["error"] == (
        "RuntimeError: rank 1 exited with code -9 (SIGKILL); "
        "a rank recorded: RuntimeError: Connection closed by peer"
    )
