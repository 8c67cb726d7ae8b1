"""Sigmoid (SigLIP) loss memory and time: open_clip's SigLipLoss vs cliptk's tiled ``siglip_loss``.

Each (method, B) case runs forward + backward of the loss (d = 512, unit-norm random features, t = 10 and
b = −10 with gradients, SigLIP's init) in a fresh subprocess, so its peak RSS (getrusage ru_maxrss) is its
own. "extra" = peak RSS − RSS once the inputs exist: what the loss costs, including the two [B, d] fp32
feature gradients every method must return ("grads" column, 2·B·d·4 bytes); "extra − grads" is the
loss's own working memory. Time: one forward + backward per subprocess; the methods alternate, round
after round, so a shared machine's load hits both alike, and ratios are taken within this run.

A case that cannot fit is not run: a method whose last measured extra, scaled by (B / B_prev)², exceeds
the budget is reported as "does not fit" with that prediction (open_clip materialises several B×B
matrices); each worker also runs under RLIMIT_AS (its start + the budget), so a wrong prediction ends in
a MemoryError, reported as such. On CUDA the triton backend is timed too (peak = max_memory_allocated).

    python -m benchmarks.loss.siglip_loss                        # the issue's sweep (~30 min on 2 cores)
    python -m benchmarks.loss.siglip_loss --sizes 1024 4096 --rounds 2
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

from benchmarks.loss.loss_memory import (  # the CLIP loss benchmark's harness helpers
    _get,
    _mem_available_bytes,
)

SIZES = (1024, 4096, 8192, 16384, 32768, 65536)
CPU_METHODS = ("open_clip", "torch")
GPU_METHODS = ("triton",)
SCALE, BIAS = 10.0, -10.0  # SigLIP's initialisation


def _statm(field: int) -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[field]) * os.sysconf("SC_PAGE_SIZE")


def _loss_fn(method: str):
    """(image [B, d], text [B, d], t 0-d, b 0-d) -> scalar loss."""
    if method == "open_clip":
        from open_clip.loss import SigLipLoss

        return SigLipLoss()
    from toolkit import kernels

    return lambda x, y, t, b: kernels.siglip_loss(x, y, t, b, backend=method)


def worker(method: str, b: int, d: int, budget_bytes: int) -> dict:
    """Runs in the fresh subprocess: one forward + backward, returns its measurements."""
    import torch

    resource.setrlimit(resource.RLIMIT_AS, (_statm(0) + budget_bytes, resource.RLIM_INFINITY))
    cuda = method in GPU_METHODS
    device = "cuda" if cuda else "cpu"
    fn = _loss_fn(method)
    gen = torch.Generator(device=device).manual_seed(b)
    x = torch.randn(b, d, generator=gen, device=device)
    y = torch.randn(b, d, generator=gen, device=device)
    x.div_(x.norm(dim=1, keepdim=True)).requires_grad_()  # in place: no second [B, d] before the baseline
    y.div_(y.norm(dim=1, keepdim=True)).requires_grad_()
    t = torch.tensor(SCALE, device=device, requires_grad=True)
    bias = torch.tensor(BIAS, device=device, requires_grad=True)
    warm = [v[:64].detach().clone().requires_grad_() for v in (x, y)]  # lazy library set-up out of the timing
    fn(*warm, t, bias).backward()
    t.grad = bias.grad = None
    del warm
    baseline = torch.cuda.memory_allocated() if cuda else _statm(1)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loss = fn(x, y, t, bias)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = (
        torch.cuda.max_memory_allocated()
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "status": "ok",
        "time_s": elapsed,
        "peak_bytes": peak,
        "extra_bytes": peak - baseline,
        "loss": loss.item(),
        "grad_t": t.grad.item(),
        "grad_b": bias.grad.item(),
        "threads": torch.get_num_threads(),
    }


def run_case(method: str, b: int, d: int, budget_bytes: int, timeout_s: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.loss.siglip_loss",
        "--worker",
        method,
        str(b),
        "--dim",
        str(d),
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


def rounds_for(b: int, rounds: int) -> int:
    return 1 if b >= 16384 else rounds  # big cases: memory is the point, and one run takes minutes


def _merge(runs: list[dict]) -> dict:
    """Rounds of one case -> median time, largest extra (any failed round makes the case fail)."""
    bad = next((r for r in runs if r["status"] != "ok"), None)
    if bad:
        return bad
    out = dict(runs[0])
    out |= {
        "time_s": statistics.median(r["time_s"] for r in runs),
        "times_s": [r["time_s"] for r in runs],
        "extra_bytes": max(r["extra_bytes"] for r in runs),
        "peak_bytes": max(r["peak_bytes"] for r in runs),
    }
    return out


def _predicted_too_big(prev: tuple[int, int] | None, b: int, budget: int) -> float | None:
    if prev is None:
        return None
    predicted = prev[1] * (b / prev[0]) ** 2
    return predicted if predicted > budget else None


def sweep(methods, sizes, d: int, rounds: int, budget: int, timeout_s: int) -> list[dict]:
    """Size-major; within a size the methods alternate round by round (module docstring)."""
    rows, prev = [], {}
    for b in sorted(sizes):
        runs = {m: [] for m in methods}
        skipped = {}
        for m in methods:
            too_big = None if m in ("torch", "triton") else _predicted_too_big(prev.get(m), b, budget)
            if too_big:
                skipped[m] = {
                    "status": f"does not fit: predicted {too_big / 2**30:.1f} GiB (from B={prev[m][0]}) "
                    f"> budget {budget / 2**30:.1f} GiB",
                    "predicted_extra_bytes": too_big,
                }
        for _ in range(rounds_for(b, rounds)):
            for m in methods:
                if m not in skipped and not (runs[m] and runs[m][-1]["status"] != "ok"):
                    print(f"[siglip_loss] {m} B={b} ...", file=sys.stderr, flush=True)
                    runs[m].append(run_case(m, b, d, budget, timeout_s))
        for m in methods:
            row = {"method": m, "B": b, "d": d, "grad_bytes": 2 * b * d * 4} | (
                skipped.get(m) or _merge(runs[m])
            )
            if row["status"] == "ok":
                prev[m] = (b, row["extra_bytes"])
            rows.append(row)
            print(f"[siglip_loss] {json.dumps(row)}", file=sys.stderr, flush=True)
    return rows


def targets(rows) -> list[str]:
    """The issue's targets as measured in this run (memory both with and without the feature gradients)."""
    out = []
    ours, ref = _get(rows, "torch", 16384), _get(rows, "open_clip", 16384)
    if ours and ref:
        whole = ours["extra_bytes"] / ref["extra_bytes"]
        own = (ours["extra_bytes"] - ours["grad_bytes"]) / (ref["extra_bytes"] - ref["grad_bytes"])
        out.append(
            f"B=16384: torch/open_clip extra memory {whole:.4f} with the feature gradients, {own:.4f} "
            f"without them (target <= 0.01): {'met' if own <= 0.01 else 'MISSED'} for the loss's own "
            f"memory, {'met' if whole <= 0.01 else 'missed'} counting the gradients"
        )
    ours, ref = _get(rows, "torch", 8192), _get(rows, "open_clip", 8192)
    if ours and ref:
        ratio = ours["time_s"] / ref["time_s"]
        out.append(
            f"B=8192: torch/open_clip forward+backward time {ratio:.2f} (target <= 1.2): "
            f"{'met' if ratio <= 1.2 else 'MISSED'}"
        )
    largest = max((r["B"] for r in rows if r["method"] == "open_clip" and r["status"] == "ok"), default=None)
    if largest:
        out.append(
            f"open_clip's SigLipLoss ran up to B={largest} here; cliptk's up to "
            f"B={max((r['B'] for r in rows if r['method'] == 'torch' and r['status'] == 'ok'), default='-')}"
        )
    return out


def markdown(rows) -> str:
    lines = [
        "| method | B | median time (s) | peak RSS (MiB) | extra (MiB) | grads (MiB) | extra − grads (MiB) "
        "| status |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = r["status"] == "ok"
        mib = (lambda v: f"{v / 2**20:.0f}") if ok else (lambda v: "-")
        lines.append(
            "| {} | {} | {} | {} | {} | {} | {} | {} |".format(
                r["method"],
                r["B"],
                f"{r['time_s']:.3f}" if ok else "-",
                mib(r.get("peak_bytes", 0)),
                mib(r.get("extra_bytes", 0)),
                f"{r['grad_bytes'] / 2**20:.0f}",
                mib(r.get("extra_bytes", 0) - r["grad_bytes"]),
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
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per size (1 at B >= 16384)")
    parser.add_argument(
        "--methods", nargs="+", default=None, help="default: open_clip torch (+ triton on CUDA)"
    )
    parser.add_argument(
        "--budget-bytes",
        type=int,
        default=None,
        help="memory a case may use; default 70%% of MemAvailable at start",
    )
    parser.add_argument("--timeout-s", type=int, default=3600, help="wall limit per case")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/loss/results/siglip_loss"),
        help="writes OUT.json and OUT.md",
    )
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "B"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    budget = args.budget_bytes or int(0.7 * _mem_available_bytes())
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.dim, budget)))
        return
    import torch

    methods = args.methods or list(CPU_METHODS) + (list(GPU_METHODS) if torch.cuda.is_available() else [])
    rows = sweep(methods, args.sizes, args.dim, args.rounds, budget, args.timeout_s)
    table = markdown(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "budget_bytes": budget,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "d": args.dim,
        "load_avg_at_end": os.getloadavg(),
    }
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
