"""Metric sinks beyond metrics.jsonl and TensorBoard: Weights & Biases (``--report-to wandb``).

wandb is an optional dependency (``pip install 'cliptk[wandb]'``); asking for it without it installed is
an error naming the extra. Rank 0 opens one run in OUT/wandb. Its mode: ``WANDB_MODE`` when set (so
``WANDB_MODE=disabled`` turns it off and ``offline`` forces a local run); otherwise online when
credentials exist (``WANDB_API_KEY`` or a netrc entry for the wandb host, as ``wandb login`` writes) and
**offline** without them, so a run never stops to ask for a login; with credentials but a server that does
not accept a connection within a few seconds, offline too, with one warning line: the offline run folder
(OUT/wandb/offline-run-*/) holds every metric and can be uploaded later with ``wandb sync``. A resumed
run continues the same wandb run (its id is kept in OUT/wandb/run_id) from the checkpoint's step.
"""

from __future__ import annotations

import math
import netrc
import os
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from toolkit.core.log import get_logger

RUN_ID = "run_id"


def has_credentials() -> bool:
    """True when wandb could log in without asking: an API key in the environment or the netrc file."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


# How long the server check of an online run waits for a TCP connection: wandb itself retried for ~110 s
# and then printed 161 lines with two tracebacks when the server was unreachable (issue 43 item 14).
SERVER_CHECK_TIMEOUT_S = 5.0


def wandb_mode() -> str:
    """online, offline or disabled (module docstring)."""
    return os.environ.get("WANDB_MODE") or ("online" if has_credentials() else "offline")


def server_problem(timeout_s: float = SERVER_CHECK_TIMEOUT_S) -> str | None:
    """Why the wandb server (``WANDB_BASE_URL``) cannot be reached, or None when a TCP connection opens
    (also None behind an HTTP(S) proxy, which this check cannot see through: wandb's own timeout decides)."""
    import socket

    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")):
        return None
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname or "api.wandb.ai", port), timeout=timeout_s).close()
    except OSError as err:
        return f"cannot reach {url.scheme}://{url.hostname}:{port} ({err.strerror or type(err).__name__})"
    return None


class WandbSink:
    """One wandb run of a training run (rank 0). ``config``: the resolved training config (a dict)."""

    def __init__(self, run_dir: str, config: dict[str, Any], resume_step: int | None):
        try:
            import wandb
        except ImportError as err:
            raise RuntimeError(
                "report_to wandb: wandb is not installed; pip install 'cliptk[wandb]' (or wandb), "
                "or leave wandb out of report_to"
            ) from err
        folder = Path(run_dir) / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / RUN_ID
        if resume_step is None or not id_file.is_file():
            id_file.write_text(uuid.uuid4().hex[:12])  # wandb run ids: letters and digits
        self.mode = wandb_mode()
        problem = server_problem() if self.mode == "online" else None
        if problem is not None:  # one line, then a local run that `wandb sync` uploads later
            self.mode = "offline"
            get_logger("train").warning(
                "wandb: %s within %g s: logging offline into %s instead; upload it "
                "later with `wandb sync %s/offline-run-*`",
                problem,
                SERVER_CHECK_TIMEOUT_S,
                folder,
                folder,
            )
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "cliptk"),
            name=Path(run_dir).name,
            id=id_file.read_text().strip(),
            resume="allow",
            dir=str(Path(run_dir)),
            mode=self.mode,
            config=config,
        )

    def write(self, record: dict[str, Any]) -> None:
        """Log the numbers of one metrics record at its step."""
        values = {
            k: v
            for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)
        }
        self.run.log(values, step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


def open_sinks(
    report_to: list[str], run_dir: str, config: dict[str, Any], resume_step: int | None
) -> list[Any]:
    """The extra sinks ``report_to`` names (jsonl and tensorboard are MetricsWriter's own)."""
    return [WandbSink(run_dir, config, resume_step)] if "wandb" in report_to else []
