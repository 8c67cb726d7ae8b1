"""One check of every CUDA path of cliptk, for the minutes a GPU is lent: prints a table per section and
writes JSON (after every section, so a run stopped early keeps what it measured).

    python -m benchmarks.gpu.check --out gpu_check.json          # on a CUDA machine, <= 9 min
    python -m benchmarks.gpu.check --dry-run --out /tmp/dry.json   # every section, tiny, on the CPU

Run from the repository root (``-m`` puts it on the import path; no PYTHONPATH needed).

Sections, in order, each stopped at its time budget (what it could not run is listed as skipped):
1. environment: the GPU, torch, CUDA, triton and the packages the sections use;
2. kernels: the Triton LSE (CLIP) and sigmoid kernels, forward + backward, against the chunked torch
   backend, the naive loss and inf-cl (when it imports), B = 8,192 .. 65,536, d = 512, fp32 and bf16:
   times, peak memory, errors against a float64 oracle;
3. trainer: `toolkit train` on ViT-B-32 in bf16 at global batch 512 and 4,096, with and without the
   gradient cache and --grad-checkpointing, FastCLIP-v3 and OpenCLIP: samples/s and peak memory beside
   `toolkit plan`'s prediction;
4. open_clip_train on the same model, data and batch;
5. JPEG decoding: libjpeg-turbo and PIL per CPU core, nvJPEG batched on the GPU, the loader's decoder;
6. nccl all_gather / all_reduce bytes and bandwidth, when the machine has two or more GPUs;
7. fsdp: a ViT-B-16 step with `--fsdp`'s wrapping (bf16 policy, with and without CPU offload) beside the
   unwrapped model: step time and peak memory.
No internet is needed (random-init models, synthetic data). The budgets below are estimates for one
H100 (80 GB) with 16 CPU cores; they sum to 515 s, inside the 9 minutes the check is sized for.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

# section name, module, seconds on one H100 (estimate: kernels ~64 cases of <= 1 s plus the float64 oracles;
# trainer: 4,096 synthetic samples made and precomputed in ~20 s, then ~12 runs of ~15 s start-up + steps)
BUDGETS_S = (
    ("environment", "env", 5),
    ("kernels", "kernels", 100),
    ("trainer", "trainer", 230),
    ("open_clip_train", "openclip_train", 70),
    ("jpeg decoding", "decode", 30),
    ("collectives", "collectives", 20),
    ("token budgets", "tokens", 60),  # 4 ViT-B-16 settings x 7 steps of batch 256 + builds
    ("fsdp", "fsdp", 60),
)
DRY_BUDGET_S = 240  # per section on a 2-core CPU: the dry run checks the code paths, not speed


class SectionOverran(Exception):
    """Raised by SIGALRM in the section that ran far past its budget."""


def _overran(signum, frame):
    raise SectionOverran()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="every section at tiny sizes on the CPU (Triton under TRITON_INTERPRET=1); what CI runs",
    )
    p.add_argument(
        "--out", type=Path, default=Path("gpu_check.json"), help="JSON results (default gpu_check.json)"
    )
    p.add_argument(
        "--work",
        type=Path,
        default=None,
        help="scratch folder for data and runs (default: a new temporary folder)",
    )
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        choices=[m for _, m, _ in BUDGETS_S],
        help="run only these sections (modules named as listed)",
    )
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's time budget")
    p.add_argument(
        "--open-clip-deps",
        default=None,
        help="folder holding webdataset<=0.2.86 for open_clip_train (put first on its PYTHONPATH only)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    import importlib

    import torch

    from benchmarks.gpu.common import Context, Section, print_section, write_json

    if not a.dry_run and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here; run with --dry-run for the CPU check of the code paths",
            file=sys.stderr,
        )
        return 2
    work = a.work or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    ctx = Context(
        work=work.resolve(),
        device="cpu" if a.dry_run else "cuda",
        dry_run=a.dry_run,
        open_clip_deps=a.open_clip_deps,
    )
    start, done = time.perf_counter(), []
    for name, module, budget in BUDGETS_S:
        if a.only and module not in a.only:
            continue
        sec = Section(name, (DRY_BUDGET_S if a.dry_run else budget) * a.budget_scale)
        # A hard stop at 1.25x the budget + 10 s: the cases check the budget between themselves, but one case
        # can hang or compile for minutes (the first H100 run lost the whole check in its kernels section that
        # way).
        signal.signal(signal.SIGALRM, _overran)
        signal.alarm(int(sec.budget_s * 1.25 + 10))
        try:
            importlib.import_module(f"benchmarks.gpu.{module}").run(ctx, sec)
        except SectionOverran:
            sec.error = (
                f"stopped at 1.25x its budget + 10 s ({sec.budget_s * 1.25 + 10:.0f} s); its rows so far "
                "are kept"
            )
        except Exception as err:  # one section's failure must not cost the others' minutes
            sec.error = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}"
        finally:
            signal.alarm(0)
        sec.wall_s = time.perf_counter() - sec.started
        done.append(sec)
        print_section(sec)
        write_json(
            a.out,
            {
                "dry_run": a.dry_run,
                "work": str(ctx.work),
                "wall_s": time.perf_counter() - start,
                "sections": [s.to_json() for s in done],
            },
        )
    total = time.perf_counter() - start
    print(f"\ngpu_check: {len(done)} sections in {total:.0f} s; JSON in {a.out}")
    return 1 if any(s.error for s in done) else 0


if __name__ == "__main__":
    sys.exit(main())
