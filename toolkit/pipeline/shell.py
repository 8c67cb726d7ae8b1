"""The ``shell`` stage: any command line as a pipeline stage, with the same manifest bookkeeping.

Values reach the command as data: the runner replaces each ``${...}`` in ``cmd`` by a quoted environment
variable (``"${CLIPTK_VAR_name}"``) whose value goes into ``env`` (:mod:`toolkit.pipeline.shellrefs`), so
``--set 'vars.name=x; touch F'`` passes the text ``x; touch F`` wherever the reference stands (``$(...)``,
backticks and here-documents included) and a ``run_dir`` with a space stays one word. ``quote_refs: false``
inserts the raw text for the shell to parse, for values you wrote yourself.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass

from toolkit.core.config import option
from toolkit.core.log import get_logger
from toolkit.core.procs import GroupReaper, child_preexec
from toolkit.core.stage import StageResult, stage_run

KIND = "shell"
# How much of a failed command's output goes into the error message and manifest.
ERROR_TAIL_CHARS = 2000
# After SIGTERM to the command's process group, how long its processes get before SIGKILL.
KILL_GRACE_S = 2.0


class ShellStageError(RuntimeError):
    """The command exited non-zero or timed out."""


@dataclass(frozen=True)
class ShellConfig:
    cmd: str = option(
        doc="Command line, run with `bash -c`; $STAGE_OUT holds the output directory. Each ${...} "
        "becomes a quoted environment variable holding its value as text, e.g. "
        '"${CLIPTK_VAR_name}" (see quote_refs).'
    )
    out: str = option(doc="Output directory; manifest.json, config.yaml and log.jsonl are written here.")
    inputs: list[str] = option(
        factory=list, is_input=True, doc="Paths the command reads; a change to any of them reruns the stage."
    )
    outputs: dict[str, str] = option(
        factory=dict, doc="Output name -> path, for later stages' ${stages.NAME.outputs.KEY}."
    )
    env: dict[str, str] = option(factory=dict, doc="Extra environment variables for the command.")
    cwd: str = option("", doc="Working directory (default: the current one).")
    timeout_s: float | None = option(
        None,
        gt=0,
        doc="Kill the command and every process it started after this many seconds (default: none).",
    )
    quote_refs: bool = option(
        True,
        doc="Pass each ${...} in cmd as an environment variable, so the shell sees "
        "its value as text; false inserts it raw, to be parsed as shell syntax "
        "(only for values you trust).",
    )


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the command's whole process group (``sleep 25 | cat`` included), SIGKILL after a grace."""
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _run_command(cfg: ShellConfig, env: dict[str, str]) -> tuple[int, str, str]:
    """Run ``cfg.cmd`` in its own process group: (exit code, stdout, stderr); a timeout or Ctrl-C kills
    the group, not only bash."""
    proc = subprocess.Popen(
        ["bash", "-c", cfg.cmd],
        cwd=cfg.cwd or None,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        preexec_fn=child_preexec(),
    )  # bash dies with the pipeline, even on SIGKILL
    reaper = GroupReaper(proc.pid)  # and so does what bash started (`sleep 1000`), which PDEATHSIG misses
    try:
        stdout, stderr = proc.communicate(timeout=cfg.timeout_s)
        reaper.release()  # a normal end: what the command left running on purpose stays
    except subprocess.TimeoutExpired as err:
        _kill_group(proc)
        proc.communicate()
        raise ShellStageError(
            f"command timed out after {cfg.timeout_s} s (its processes were killed): {cfg.cmd}"
        ) from err
    except BaseException:  # KeyboardInterrupt: the command must not outlive the pipeline
        _kill_group(proc)
        raise
    finally:
        if proc.poll() is None:
            _kill_group(proc)
        reaper.kill_now()  # a no-op after release()
    return proc.returncode, stdout, stderr


def run(cfg: ShellConfig) -> StageResult:
    """Run ``cfg.cmd``; raise :class:`ShellStageError` naming the exit code and the output tail on failure."""
    log = get_logger("shell")
    with stage_run(KIND, cfg, cfg.out) as rec:
        env = {**os.environ, **cfg.env, "STAGE_OUT": cfg.out}
        refs = {k: v for k, v in cfg.env.items() if k.startswith("CLIPTK_")}  # the ${...} values (shellrefs)
        log.info("$ %s%s", cfg.cmd, f"  [{', '.join(f'{k}={v!r}' for k, v in refs.items())}]" if refs else "")
        code, stdout, stderr = _run_command(cfg, env)
        for stream, text in (("stdout", stdout), ("stderr", stderr)):
            for line in text.splitlines():
                log.info("[%s] %s", stream, line)
        rec.counts["exit_code"] = code
        if code != 0:
            tail = (stderr or stdout)[-ERROR_TAIL_CHARS:].strip()
            raise ShellStageError(f"command exited with code {code}: {cfg.cmd}\n{tail}")
        rec.outputs.update({"out": cfg.out, **cfg.outputs})
    return rec.result()
