"""Section 4: open_clip_train on the same model, data (the raw JPEG shards) and batch as the trainer
section, for samples/s side by side: ``python -m open_clip_train.main`` with ``--log-every-n-steps 1``.

open_clip_torch 3.3.0's trainer needs webdataset <= 0.2.86 (0.2.87+ ends every shard with an EOF marker
its ``group_by_keys_nothrow`` cannot read); ``--open-clip-deps DIR`` puts a folder holding it first on
open_clip's PYTHONPATH only. Without one, and with a newer webdataset installed, it is pip-installed into
the work folder (the package registry must be reachable) or the section is skipped."""

from __future__ import annotations

import re
import statistics
import subprocess
from importlib.metadata import version

from gpucheck import data
from gpucheck.common import PY, REPO, Context, Section, env_with_repo, run_cmd, tail
from gpucheck.trainer import DRY_DATA, GPU_DATA, steps_for

WEBDATASET_MAX = (0, 2, 86)
STEP = re.compile(r"Train Epoch: \d+ \[\s*\d+/\d+ .*?Batch \(t\): ([0-9.]+), ([0-9.]+)/s, ([0-9.]+)/s/gpu")
GPU_RUNS = [(512, False), (4096, True)]  # batch, --grad-checkpointing (4,096 without it does not fit 80 GB)
DRY_RUNS = [(16, False)]

_MAIN = ("import sys, open_clip; cfg = sys.argv[1]\n"
         "cfg and open_clip.add_model_config(cfg)\n"
         "from open_clip_train.main import main; sys.exit(main(sys.argv[2:]) or 0)")


def deps_folder(ctx: Context, sec: Section) -> str | None:
    """A PYTHONPATH entry with a webdataset open_clip_train can use; '' when the installed one does."""
    if ctx.open_clip_deps:
        return ctx.open_clip_deps
    if tuple(int(x) for x in version("webdataset").split(".")[:3]) <= WEBDATASET_MAX:
        return ""
    target = ctx.work / "open_clip_deps"
    proc = subprocess.run([PY, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                           "webdataset==" + ".".join(map(str, WEBDATASET_MAX))], capture_output=True, text=True)
    if proc.returncode != 0:
        sec.error = f"webdataset<=0.2.86 for open_clip_train could not be installed: {proc.stderr.strip()[-200:]}"
        return None
    return str(target)


def _args(ctx: Context, batch: int, gc: bool, name: str) -> list[str]:
    raw = ctx.shared["raw"]
    names = sorted(p.stem for p in raw.glob("*.tar"))
    # resampled shards and as many samples as the trainer section's run of this batch: the same steps
    args = ["--train-data", str(raw / f"{{{names[0]}..{names[-1]}}}.tar"), "--train-num-samples",
            str(batch * steps_for(batch)), "--dataset-resampled", "--dataset-type", "webdataset",
            "--model", ctx.shared["model"],
            "--batch-size", str(batch), "--precision", "fp32" if ctx.dry_run else "amp_bf16",
            "--workers", "2" if ctx.dry_run else "8", "--epochs", "1", "--lr", "1e-4", "--warmup", "1",
            "--log-every-n-steps", "1", "--save-frequency", "0", "--logs", str(ctx.work / "open_clip_logs"),
            "--name", name, "--report-to", "", "--seed", "0", "--device", ctx.device]
    return args + (["--grad-checkpointing"] if gc else [])


def run(ctx: Context, sec: Section) -> None:
    if "raw" not in ctx.shared:
        num_samples, raw_px, model, _ = DRY_DATA if ctx.dry_run else GPU_DATA
        if not data.prepare(ctx, sec, num_samples, raw_px, model):
            return
    deps = deps_folder(ctx, sec)
    if deps is None:
        return
    config = REPO / "toolkit" / "models" / "configs" / f"{ctx.shared['model']}.json"
    for batch, gc in DRY_RUNS if ctx.dry_run else GPU_RUNS:
        case = f"open_clip_train B={batch} gc={gc}"
        if sec.left_s() < 30:
            sec.skip(case, f"{sec.left_s():.0f} s left of the section's budget")
            continue
        name = f"b{batch}_gc{int(gc)}"
        log = ctx.work / f"open_clip_{name}.log"
        cmd = [PY, "-c", _MAIN, str(config) if config.exists() else "", *_args(ctx, batch, gc, name)]
        code, wall = run_cmd(cmd, sec.left_s(), log, env_with_repo(deps or None))
        steps = [(float(t), float(s)) for t, s, _ in STEP.findall(log.read_text(errors="replace"))]
        row = {"trainer": "open_clip_train", "B": batch, "grad_ckpt": gc, "model": ctx.shared["model"],
               "steps": len(steps), "wall_s": wall}
        if code != 0 or not steps:
            sec.rows.append(row | {"status": f"failed ({code}): {tail(log, 2)}"})
            continue
        steady = steps[1:] or steps
        sec.rows.append(row | {"samples_per_s": batch * len(steady) / sum(t for t, _ in steady),
                               "median_step_s": statistics.median(t for t, _ in steady), "status": "ok"})
