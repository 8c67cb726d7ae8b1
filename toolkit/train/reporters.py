"""Metric sinks beyond metrics.jsonl and TensorBoard: Weights & Biases (``--report-to wandb``).

wandb is an optional dependency (``pip install 'cliptk[wandb]'``); asking for it without it installed is
an error naming the extra. Rank 0 opens one run in OUT/wandb. Its mode: ``WANDB_MODE`` when set (so
``WANDB_MODE=disabled`` turns it off and ``offline`` forces a local run); otherwise online when
credentials exist (``WANDB_API_KEY`` or a netrc entry for the wandb host, as ``wandb login`` writes) and
**offline** without them, so a run never stops to ask for a login: the offline run folder
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


def wandb_mode() -> str:
    """online, offline or disabled (module docstring)."""
    return os.environ.get("WANDB_MODE") or ("online" if has_credentials() else "offline")


class WandbSink:
    """One wandb run of a training run (rank 0). ``config``: the resolved training config (a dict)."""

    def __init__(self, run_dir: str, config: dict[str, Any], resume_step: int | None):
        try:
            import wandb
        except ImportError as err:
            raise RuntimeError("report_to wandb: wandb is not installed; pip install 'cliptk[wandb]' (or wandb), "
                               "or leave wandb out of report_to") from err
        folder = Path(run_dir) / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / RUN_ID
        if resume_step is None or not id_file.is_file():
            id_file.write_text(uuid.uuid4().hex[:12])  # wandb run ids: letters and digits
        self.mode = wandb_mode()
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "cliptk"), name=Path(run_dir).name,
                              id=id_file.read_text().strip(), resume="allow", dir=str(Path(run_dir)),
                              mode=self.mode, config=config)

    def write(self, record: dict[str, Any]) -> None:
        """Log the numbers of one metrics record at its step."""
        values = {k: v for k, v in record.items()
                  if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        self.run.log(values, step=int(record["step"]))

    def close(self) -> None:
        self.run.finish()


def open_sinks(report_to: list[str], run_dir: str, config: dict[str, Any], resume_step: int | None) -> list[Any]:
    """The extra sinks ``report_to`` names (jsonl and tensorboard are MetricsWriter's own)."""
    return [WandbSink(run_dir, config, resume_step)] if "wandb" in report_to else []
