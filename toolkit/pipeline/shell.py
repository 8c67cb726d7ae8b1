"""The ``shell`` stage: any command line as a pipeline stage, with the same manifest bookkeeping."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from toolkit.core.config import option
from toolkit.core.log import get_logger
from toolkit.core.stage import StageResult, stage_run

KIND = "shell"
# How much of a failed command's output goes into the error message and manifest.
ERROR_TAIL_CHARS = 2000


class ShellStageError(RuntimeError):
    """The command exited non-zero or timed out."""


@dataclass(frozen=True)
class ShellConfig:
    cmd: str = option(doc="Command line, run with `bash -c`; $STAGE_OUT holds the output directory.")
    out: str = option(doc="Output directory; manifest.json, config.yaml and log.jsonl are written here.")
    inputs: list[str] = option(factory=list, is_input=True,
                               doc="Paths the command reads; a change to any of them reruns the stage.")
    outputs: dict[str, str] = option(factory=dict,
                                     doc="Output name -> path, for later stages' ${stages.NAME.outputs.KEY}.")
    env: dict[str, str] = option(factory=dict, doc="Extra environment variables for the command.")
    cwd: str = option("", doc="Working directory (default: the current one).")
    timeout_s: float | None = option(None, gt=0, doc="Kill the command after this many seconds (default: none).")


def run(cfg: ShellConfig) -> StageResult:
    """Run ``cfg.cmd``; raise :class:`ShellStageError` naming the exit code and the output tail on failure."""
    log = get_logger("shell")
    with stage_run(KIND, cfg, cfg.out) as rec:
        env = {**os.environ, **cfg.env, "STAGE_OUT": cfg.out}
        log.info("$ %s", cfg.cmd)
        try:
            proc = subprocess.run(["bash", "-c", cfg.cmd], cwd=cfg.cwd or None, env=env, capture_output=True,
                                  text=True, timeout=cfg.timeout_s, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as err:
            raise ShellStageError(f"command timed out after {cfg.timeout_s} s: {cfg.cmd}") from err
        for stream, text in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            for line in text.splitlines():
                log.info("[%s] %s", stream, line)
        rec.counts["exit_code"] = proc.returncode
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout)[-ERROR_TAIL_CHARS:].strip()
            raise ShellStageError(f"command exited with code {proc.returncode}: {cfg.cmd}\n{tail}")
        rec.outputs.update({"out": cfg.out, **cfg.outputs})
    return rec.result()
