"""Child process of test_plan.py: the peak resident memory a real training run adds, measured.

``python plan_jobs.py DATA OUT BATCH MICRO`` trains cliptk-tiny (fastclip-v3, AdamW, fp32, CPU, no loader
workers) for 3 steps and prints JSON {"measured": bytes}: the peak RSS during steps 2..3 (from step 2
on the optimiser state exists, as in a long run) minus the RSS before the trainer built anything (every
module already imported). The peak mark is reset (5 > /proc/self/clear_refs) after step 1, so the
model build's and step 1's transients do not count.
"""

from __future__ import annotations

import json
import sys

import open_clip  # noqa: F401  (imported before the baseline: its import is no training memory)
import torch
from trainkit import train_cfg

import toolkit.train.loop as loop
from toolkit.train.plan.memprobe import peak_rss_bytes, reset_peak_rss, rss_bytes


def main(data: str, out: str, batch: int, micro: int) -> None:
    torch.set_num_threads(1)
    cfg = train_cfg(
        data,
        out,
        batch_size=batch,
        steps=3,
        micro_batch_size=micro,
        loss={"kind": "fastclip", "version": "v3", "mode": "fastclip"},
        checkpoint={"resume": "none"},
    )
    before = rss_bytes()
    parts = loop.build_parts(cfg)
    state = loop.TrainState()
    for batch_dict in parts.data.batches(0):
        loop.train_step(parts, state, batch_dict)
        if state.step == 1:
            reset_peak_rss()
    peak = peak_rss_bytes()
    parts.io.close()
    print(json.dumps({"measured": peak - before, "before": before, "peak": peak}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
