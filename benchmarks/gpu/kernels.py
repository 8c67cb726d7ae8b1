"""Section 2: the Triton LSE (CLIP) and sigmoid (SigLIP) kernels, forward and backward, against the chunked
torch backend, the naive full-matrix loss and inf-cl (when it imports), in fp32 and bf16.

Per (loss, dtype, B): every method's forward and backward wall time (median of ``REPEATS`` after one
warm-up that also compiles), its peak device memory above the inputs, and its parity with a float64
oracle: the chunked torch backend run on the same (already rounded) inputs upcast to float64, so the
errors are the method's accumulation error, not bf16's input rounding. A method that runs out of memory
at some B is not tried at larger B.
"""

from __future__ import annotations

import statistics

from benchmarks.gpu.common import Context, GiB, Section, progress, timed_ms

# Smallest first (compiles, parity), then the largest (the memory story: naive runs out, the tiles do not),
# then the middle, so a budget cut keeps the telling ends.
GPU_SIZES, GPU_DIM = (8192, 65536, 16384, 32768), 512
DRY_SIZES, DRY_DIM = (64, 67), 16  # odd 67: ragged tiles under the interpreter
DTYPES = ("bf16", "fp32")  # bf16 first: the training precision, so a budget cut keeps it
METHODS = {"clip": ("triton", "torch", "naive", "inf_cl"), "sigmoid": ("triton", "torch", "naive")}
REPEATS = 3
# Triton on IEEE fp32 features runs on the CUDA cores: 127 + 435 ms at B = 8,192 on one H200 against 10 + 11
# ms for the chunked torch backend, and `auto` never picks it; at B = 65,536 it alone overran the section's
# budget (2026-11-28). It is measured at the smallest B only.
FP32_TRITON_MAX_B = 8192
CLIP_SCALE = 14.3  # 1/0.07, CLIP's initial temperature
SIGLIP_SCALE, SIGLIP_BIAS = 10.0, -10.0  # SigLIP's initial t and b


def _inputs(kind: str, b: int, d: int, dtype, device: str):
    """Unit-norm features [b, d] in ``dtype`` and the loss's scalars (fp32), from a fixed seed."""
    import torch

    g = torch.Generator().manual_seed(b * 31 + d)
    x = torch.nn.functional.normalize(torch.randn(b, d, generator=g), dim=-1).to(device, dtype)
    y = torch.nn.functional.normalize(torch.randn(b, d, generator=g), dim=-1).to(device, dtype)
    scalars = [CLIP_SCALE] if kind == "clip" else [SIGLIP_SCALE, SIGLIP_BIAS]
    return x, y, [torch.tensor(v, device=device) for v in scalars]


def _loss(kind: str, method: str):
    """(x, y, scalars) -> 0-d loss of one method."""
    from toolkit import kernels

    if method == "inf_cl":
        from inf_cl import cal_inf_loss  # its scale's backward all_reduces: pass it detached (no d_scale)

        return lambda x, y, s: (
            0.5 * (cal_inf_loss(x, y, scale=s[0].detach()) + cal_inf_loss(y, x, scale=s[0].detach()))
        )
    if kind == "clip":
        return lambda x, y, s: kernels.clip_loss(x, y, s[0], backend=method)
    return lambda x, y, s: kernels.siglip_loss(x, y, s[0], s[1], backend=method)


def _forward_backward(fn, x, y, scalars):
    """Leaves, loss and gradients of one call (the scalars' gradients None where the method has none)."""
    xs, ys = x.detach().requires_grad_(), y.detach().requires_grad_()
    ss = [s.detach().requires_grad_() for s in scalars]
    loss = fn(xs, ys, ss)
    return (xs, ys, ss), loss


def _measure(fn, x, y, scalars, device: str, repeats: int) -> dict:
    import torch

    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    (xs, ys, ss), loss = _forward_backward(fn, x, y, scalars)  # warm-up (compiles), kept for parity
    loss.backward()
    peak = (torch.cuda.max_memory_allocated() - base) / GiB if cuda else None
    fwd, bwd = [], []
    for _ in range(repeats):
        holder = {}
        fwd.append(timed_ms(lambda h=holder: h.update(r=_forward_backward(fn, x, y, scalars)), device))
        bwd.append(timed_ms(lambda h=holder: h["r"][1].backward(), device))
    grads = [xs.grad, ys.grad] + [s.grad for s in ss]
    return {
        "fwd_ms": statistics.median(fwd),
        "bwd_ms": statistics.median(bwd),
        "peak_gib": peak,
        "loss": float(loss.detach()),
        "grads": grads,
    }


def _rel(a, b) -> float | None:
    if a is None or b is None:
        return None
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _oracle(kind: str, x, y, scalars) -> dict:
    """The float64 oracle: the torch backend on the inputs upcast to float64 (tiled, so it fits at 65,536)."""
    import torch

    (xs, ys, ss), loss = _forward_backward(
        _loss(kind, "torch"), x.to(torch.float64), y.to(torch.float64), [s.to(torch.float64) for s in scalars]
    )
    loss.backward()
    return {"loss": float(loss.detach()), "grads": [xs.grad, ys.grad] + [s.grad for s in ss]}


def _parity(got: dict, ref: dict) -> dict:
    feats = [_rel(g, r) for g, r in zip(got["grads"][:2], ref["grads"][:2], strict=True)]
    scal = [_rel(g, r) for g, r in zip(got["grads"][2:], ref["grads"][2:], strict=True) if g is not None]
    return {
        "loss_abs_err": abs(got["loss"] - ref["loss"]),
        "grad_rel_err": max(feats),
        "scale_grad_rel_err": max(scal) if scal else None,
    }


def _case(kind, method, b, d, dtype_name, ctx, ref, dead: set) -> dict:
    import torch

    row = {"loss": kind, "dtype": dtype_name, "B": b, "d": d, "method": method}
    if method in dead:
        return row | {"status": f"skipped: {dead_reason(method)}"}
    try:
        fn = _loss(kind, method)
    except ImportError as err:
        dead.add(method)
        return row | {"status": f"not installed ({err.name})"}
    x, y, scalars = ref["inputs"]
    try:
        got = _measure(fn, x, y, scalars, ctx.device, 1 if ctx.dry_run else REPEATS)
    except torch.cuda.OutOfMemoryError:
        dead.add(method)
        torch.cuda.empty_cache()
        return row | {"status": "out of memory"}
    except Exception as err:  # a peer's failure is a result to report, not the end of the check
        return row | {"status": f"error: {type(err).__name__}: {str(err)[:160]}"}
    return row | {k: got[k] for k in ("fwd_ms", "bwd_ms", "peak_gib")} | _parity(got, ref) | {"status": "ok"}


def dead_reason(method: str) -> str:
    return f"{method} failed at a smaller B (out of memory or not installed)"


def run(ctx: Context, sec: Section) -> None:
    import torch

    sizes, d = (DRY_SIZES, DRY_DIM) if ctx.dry_run else (GPU_SIZES, GPU_DIM)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    dead: dict[str, set] = {}
    for b in sizes:
        for kind in ("clip", "sigmoid"):
            for name in DTYPES:
                if sec.left_s() < 0:
                    sec.skip(f"{kind} {name} B={b}", "the section's budget is spent")
                    continue
                x, y, scalars = _inputs(kind, b, d, dtypes[name], ctx.device)
                ref = _oracle(kind, x, y, scalars) | {"inputs": (x, y, scalars)}
                for method in METHODS[kind]:
                    if method == "triton" and name == "fp32" and b > FP32_TRITON_MAX_B and not ctx.dry_run:
                        sec.skip(
                            f"{kind} fp32 B={b} triton",
                            f"fp32 Triton is measured at B <= {FP32_TRITON_MAX_B} only",
                        )
                        continue
                    row = _case(kind, method, b, d, name, ctx, ref, dead.setdefault(kind + name, set()))
                    sec.rows.append(row)
                    progress(sec.name, row)
                del ref, x, y
    if not ctx.dry_run:
        sec.notes.append(
            "peak_gib: device memory above the inputs during forward+backward; errors against a "
            "float64 oracle (torch backend on the upcast inputs)"
        )
