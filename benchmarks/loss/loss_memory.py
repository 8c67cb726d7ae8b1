"""Contrastive-loss memory and time: naive vs open_clip ClipLoss vs cliptk's tiled backends.

Each (method, B) case runs forward + backward of the symmetric CLIP loss (d = 512, unit-norm random
features, logit scale 14.3 with grad) in a fresh subprocess, so its peak RSS (getrusage ru_maxrss) is
its own. "extra" = peak RSS − RSS once the inputs exist, i.e. what the loss itself costs (including the
O(B·d) feature gradients every method must produce). Time = median wall time of the repeats.

Cases that cannot fit are not run: sizes go up in order and a method whose previous measured extra,
scaled by (B / B_prev)², exceeds the memory budget is reported as "does not fit" with that
prediction. As a second guard each worker runs under RLIMIT_AS (its address space at start + the
budget), so a wrong prediction ends in a MemoryError, reported as such, instead of swapping the machine.

On a CUDA machine the script also times backend="triton" and, when importable, inf-cl's cal_inf_loss
(peak = torch.cuda.max_memory_allocated).

``--methods distill_torch distill_naive`` (not in the default sweep) measure the distill objective
(``--loss distill``: CLIP loss + KL from a teacher's similarities, λ = 0.5) on one process: the teacher's
unit-norm features [B, d] exist before the baseline, like the student's.

    python -m benchmarks.loss.loss_memory                      # the issue's sweep (slow: ~15 min)
    python -m benchmarks.loss.loss_memory --sizes 1024 8192 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = (1024, 4096, 8192, 16384, 65536)
CPU_METHODS = ("naive", "open_clip", "torch")
GPU_METHODS = ("triton", "inf_cl")
LOGIT_SCALE = 14.3  # 1 / 0.07, CLIP's initial temperature


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable missing from /proc/meminfo")


def _loss_fn(method: str, b: int = 0, d: int = 0, device: str = "cpu"):
    """(image [B, d], text [B, d], logit_scale 0-d) -> scalar loss, for one method (distill_*: with a
    teacher's [b, d] features made here)."""
    from toolkit import kernels

    if method.startswith("distill_"):
        import torch

        from toolkit.train.losses import LossConfig, build_loss

        loss = build_loss(LossConfig(kind="distill", backend=method.removeprefix("distill_")))
        gen = torch.Generator(device=device).manual_seed(b + 1)
        u, v = (torch.randn(b, d, generator=gen, device=device) for _ in range(2))
        u.div_(u.norm(dim=1, keepdim=True))
        v.div_(v.norm(dim=1, keepdim=True))
        return lambda x, y, a: loss(x, y, a, reference=(u, v))

    if method == "naive":
        return lambda x, y, a: kernels.clip_loss(x, y, a, backend="naive")
    if method in ("torch", "triton"):
        return lambda x, y, a: kernels.clip_loss(x, y, a, backend=method)
    if method == "open_clip":
        from open_clip.loss import ClipLoss

        return ClipLoss()
    if method == "inf_cl":
        # pip inf-cl 1.2.1: cal_inf_loss(q, k, scale=...) is the mean one-sided CE with diagonal labels,
        # so the symmetric loss takes two calls (6 QKᵀ passes). Its scale goes through a Function whose
        # backward all_reduces unconditionally, which fails without a process group: pass it detached.
        from inf_cl import cal_inf_loss

        return lambda x, y, a: (
            0.5 * (cal_inf_loss(x, y, scale=a.detach()) + cal_inf_loss(y, x, scale=a.detach()))
        )
    raise ValueError(f"unknown method {method!r}")


def worker(method: str, b: int, d: int, repeats: int, budget_bytes: int) -> dict:
    """Runs in the fresh subprocess: one case, returns its measurements."""
    import torch

    resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + budget_bytes, resource.RLIM_INFINITY))
    cuda = method in GPU_METHODS
    device = "cuda" if cuda else "cpu"
    fn = _loss_fn(method, b, d, device)
    gen = torch.Generator(device=device).manual_seed(b)
    # Normalised in place: no second [B, d] copy before the baseline is taken.
    x = torch.randn(b, d, generator=gen, device=device)
    y = torch.randn(b, d, generator=gen, device=device)
    x.div_(x.norm(dim=1, keepdim=True)).requires_grad_()
    y.div_(y.norm(dim=1, keepdim=True)).requires_grad_()
    a = torch.tensor(LOGIT_SCALE, device=device, requires_grad=True)
    baseline = torch.cuda.memory_allocated() if cuda else _rss_bytes()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        x.grad = y.grad = a.grad = None
        start = time.perf_counter()
        loss = fn(x, y, a)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (
        torch.cuda.max_memory_allocated()
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "status": "ok",
        "time_s": statistics.median(times),
        "times_s": times,
        "peak_bytes": peak,
        "extra_bytes": peak - baseline,
        "loss": loss.item(),
        "threads": torch.get_num_threads(),
    }


def run_case(method: str, b: int, d: int, repeats: int, budget_bytes: int, timeout_s: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.loss.loss_memory",
        "--worker",
        method,
        str(b),
        "--dim",
        str(d),
        "--repeats",
        str(repeats),
        "--budget-bytes",
        str(budget_bytes),
    ]
    root = str(Path(__file__).resolve().parents[2])  # the worker imports toolkit, benchmarks from here
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {timeout_s} s"}
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        oom = "MemoryError" in proc.stderr or "can't allocate memory" in proc.stderr.lower()
        return {"status": ("did not fit under the RLIMIT_AS budget: " if oom else "failed: ") + tail[0]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def repeats_for(b: int, repeats: int) -> int:
    return 1 if b >= 16384 else repeats  # big cases: memory is the point, and one run takes minutes


def sweep(methods, sizes, d: int, repeats: int, budget_bytes: int, timeout_s: int) -> list[dict]:
    """Size-major, so the methods compared at one B run back to back (the CPU may be shared)."""
    rows, prev = [], {}  # prev[method] = (B, extra bytes) of its last measured size
    for b in sorted(sizes):
        for method in methods:
            row = {"method": method, "B": b, "d": d}
            last = prev.get(method)
            predicted = last[1] * (b / last[0]) ** 2 if last else None
            if method not in ("torch", "triton") and predicted and predicted > budget_bytes:
                row |= {
                    "status": f"does not fit: predicted {predicted / 2**30:.1f} GiB "
                    f"(from B={last[0]}) > budget {budget_bytes / 2**30:.1f} GiB",
                    "predicted_extra_bytes": predicted,
                }
            else:
                print(f"[loss_memory] {method} B={b} ...", file=sys.stderr, flush=True)
                row |= run_case(method, b, d, repeats_for(b, repeats), budget_bytes, timeout_s)
                if row["status"] == "ok":
                    prev[method] = (b, row["extra_bytes"])
            rows.append(row)
            print(f"[loss_memory] {json.dumps(row)}", file=sys.stderr, flush=True)
    return rows


def _get(rows, method, b):
    return next((r for r in rows if r["method"] == method and r["B"] == b and r["status"] == "ok"), None)


def targets(rows) -> list[str]:
    """The issue's three targets, as measured in this run."""
    out = []
    ours = _get(rows, "torch", 65536)
    if ours:
        out.append(
            f"B=65536: torch extra {ours['extra_bytes'] / 2**30:.2f} GiB (target < 1 GiB): "
            f"{'met' if ours['extra_bytes'] < 2**30 else 'MISSED'}"
        )
    ours, naive = _get(rows, "torch", 16384), _get(rows, "naive", 16384)
    if ours and naive:
        ratio = ours["extra_bytes"] / naive["extra_bytes"]
        out.append(
            f"B=16384: torch/naive extra memory {ratio:.4f} (target <= 0.05): "
            f"{'met' if ratio <= 0.05 else 'MISSED'}"
        )
    ours, naive = _get(rows, "torch", 8192), _get(rows, "naive", 8192)
    if ours and naive:
        ratio = ours["time_s"] / naive["time_s"]
        out.append(
            f"B=8192: torch/naive time {ratio:.2f} (target <= 1.4): {'met' if ratio <= 1.4 else 'MISSED'}"
        )
    return out


def markdown(rows) -> str:
    lines = [
        "| method | B | median time (s) | peak RSS (MiB) | extra (MiB) | status |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = r["status"] == "ok"
        lines.append(
            "| {} | {} | {} | {} | {} | {} |".format(
                r["method"],
                r["B"],
                f"{r['time_s']:.3f}" if ok else "-",
                f"{r['peak_bytes'] / 2**20:.0f}" if ok else "-",
                f"{r['extra_bytes'] / 2**20:.0f}" if ok else "-",
                r["status"],
            )
        )
    return "\n".join(lines + [""] + [f"- {t}" for t in targets(rows)])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="batch sizes B")
    parser.add_argument("--dim", type=int, default=512, help="feature dim d")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per case (1 at B >= 16384)")
    parser.add_argument(
        "--methods", nargs="+", default=None, help="default: naive open_clip torch (+ GPU ones)"
    )
    parser.add_argument(
        "--budget-bytes",
        type=int,
        default=None,
        help="memory a case may use; default 70%% of MemAvailable at start",
    )
    parser.add_argument("--timeout-s", type=int, default=1800, help="wall limit per case")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/loss/results/loss_memory"),
        help="writes OUT.json and OUT.md",
    )
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "B"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    budget = args.budget_bytes or int(0.7 * _mem_available_bytes())
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.dim, args.repeats, budget)))
        return
    import torch

    methods = args.methods or list(CPU_METHODS) + (list(GPU_METHODS) if torch.cuda.is_available() else [])
    rows = sweep(methods, args.sizes, args.dim, args.repeats, budget, args.timeout_s)
    table = markdown(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"budget_bytes": budget, "cpu_count": os.cpu_count(), "torch": torch.__version__, "d": args.dim}
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
