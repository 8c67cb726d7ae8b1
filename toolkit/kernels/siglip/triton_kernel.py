"""Triton backend of the sigmoid loss (``backend="triton"``): one kernel, launched once per gradient side.

``_sig_rows``: grid over row blocks of x; each program sweeps every column tile once, recomputes
s = x yᵀ (fp32 accumulation), u = t·s + b, and accumulates per row
    loss_i = Σ_j softplus(−z_ij u_ij),   G_ij = σ(u_ij) − [z_ij = +1],
    dx_i = Σ_j G_ij y_j (un-scaled),  db_i = Σ_j G_ij,  dt_i = ⟨x_i, dx_i⟩ (= Σ_j G_ij s_ij).
Everything is written per row ([M] and [M, D]) and summed by torch: deterministic, no atomics. The y side
(dy) is the same kernel on the transposed problem (x↔y, pos_offset → −pos_offset), because u and z are
symmetric under that swap: a full forward + backward is 2 sweeps and 4 dots per tile pair (a fused
dy needs atomics on [N, D]). One exp per entry: softplus and σ both come from e = exp(−|u|).

Inputs fp32, bf16 or fp16 with any D (padded to a power of two and masked); fp64 (oracles) goes to the
torch backend. No inline asm: under ``TRITON_INTERPRET=1`` (set before triton is imported) the kernel
runs on CPU tensors, which is how CI tests it. Tile sizes are autotuned on CUDA (the LSE kernels'
configurations and shared-memory pruning).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from toolkit.kernels import triton_lse as L
from toolkit.kernels.siglip import tiled
from toolkit.kernels.siglip.common import SigmoidSums


@triton.jit
def _log1p(e):
    """log(1 + e) for e in [0, 1], accurate for tiny e (Goldberg: log(w)·e/(w − 1) with w = 1 + e)."""
    w = 1.0 + e
    exact = w == 1.0  # e below half an ulp of 1: log(1 + e) = e to fp32 precision
    return tl.where(exact, e, tl.log(w) * (e / tl.where(exact, 1.0, w - 1.0)))


@triton.jit
def _sig_rows(
    X,
    Y,
    T,
    B,
    LOSS,
    DX,
    DT,
    DB,
    M,
    N,
    D,
    stride_xm,
    stride_ym,
    stride_dxm,
    pos_offset,
    HAS_POS: tl.constexpr,
    COMPUTE_LOSS: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    d_ok = offs_d < D
    x = tl.load(
        X + rows[:, None] * stride_xm + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    if DOT_FP32:
        x = x.to(tl.float32)
    t = tl.load(T)
    b = tl.load(B)
    loss = tl.zeros([BLOCK_M], tl.float32)
    g_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, N, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        y = tl.load(
            Y + cols[:, None] * stride_ym + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0
        )
        w_dtype = y.dtype  # G is rounded to the input dtype for the second dot, as on tensor cores
        if DOT_FP32:
            y = y.to(tl.float32)
        u = tl.dot(x, tl.trans(y), input_precision=PRECISION) * t + b
        valid = row_ok[:, None] & col_ok[None, :]
        if HAS_POS:
            pos = cols[None, :] == rows[:, None] + pos_offset
        else:
            pos = cols[None, :] < 0  # no positives
        e = tl.exp(-tl.abs(u))
        if COMPUTE_LOSS:
            v = tl.where(pos, -u, u)  # the term is softplus(v) = max(v, 0) + log(1 + exp(−|v|))
            loss += tl.sum(tl.where(valid, tl.maximum(v, 0.0) + _log1p(e), 0.0), 1)
        if COMPUTE_GRAD:
            sig = tl.where(u >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
            g = tl.where(valid, sig - tl.where(pos, 1.0, 0.0), 0.0)
            g_sum += tl.sum(g, 1)
            g = g.to(w_dtype)
            if DOT_FP32:
                g = g.to(tl.float32)
            acc = tl.dot(g, y, acc, input_precision=PRECISION)
    if COMPUTE_LOSS:
        tl.store(LOSS + rows, loss, mask=row_ok)
    if COMPUTE_GRAD:
        tl.store(DX + rows[:, None] * stride_dxm + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(DT + rows, tl.sum(acc * x.to(tl.float32), 1), mask=row_ok)
        tl.store(DB + rows, g_sum, mask=row_ok)


_TUNED = L._autotune(None)(_sig_rows)


def _launch(
    x: Tensor,
    y: Tensor,
    t: Tensor,
    b: Tensor,
    pos_offset: int | None,
    compute_loss: bool,
    compute_grad: bool,
    block_size: int | None,
    precision: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One sweep over the rows of x: per-row loss [M], un-scaled dx [M, D], dt [M], db [M] (fp32; the ones
    not computed are left unwritten)."""
    m, n, d = x.shape[0], y.shape[0], x.shape[1]
    loss = torch.empty(m, dtype=torch.float32, device=x.device)
    dx = torch.empty((m, d) if compute_grad else (1, 1), dtype=torch.float32, device=x.device)
    dt, db = (torch.empty(m if compute_grad else 1, dtype=torch.float32, device=x.device) for _ in range(2))
    args = (x, y, t, b, loss, dx, dt, db, m, n, d, x.stride(0), y.stride(0), dx.stride(0), pos_offset or 0)
    flags = dict(
        HAS_POS=pos_offset is not None,
        COMPUTE_LOSS=compute_loss,
        COMPUTE_GRAD=compute_grad,
        PRECISION=precision,
        DOT_FP32=L._dot_fp32(x),
        BLOCK_D=L._block_d(d),
    )
    if L._use_autotune(x, block_size):
        _TUNED[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]),)](*args, **flags)
    else:
        bm = block_size or L.INTERPRETER_BLOCK
        _sig_rows[(triton.cdiv(m, bm),)](*args, **flags, BLOCK_M=bm, BLOCK_N=bm)
    return loss, dx, dt, db


def sigmoid_sums(
    x: Tensor,
    y: Tensor,
    scale: Tensor,
    bias: Tensor,
    pos_offset: int | None,
    compute_dx: bool,
    compute_dy: bool,
    block_size: int | None,
    input_precision: str | None,
    compute_loss: bool = True,
) -> SigmoidSums:
    """Loss sum and gradients (``toolkit.kernels.siglip.sigmoid_sums``); fp32 results."""
    L._check_block(block_size)
    m, n = x.shape[0], y.shape[0]
    if x.dtype == torch.float64 or m == 0 or n == 0:
        return tiled.sigmoid_sums(x, y, scale, bias, pos_offset, compute_dx, compute_dy, None, compute_loss)
    x, y = x.contiguous(), y.contiguous()
    t, b = scale.float().reshape(1).contiguous(), bias.float().reshape(1).contiguous()
    precision = L._precision(x, input_precision)
    loss = torch.zeros(1, dtype=torch.float32, device=x.device)
    if compute_loss or compute_dx:
        part, dx, dt, db = _launch(x, y, t, b, pos_offset, compute_loss, compute_dx, block_size, precision)
        loss = part if compute_loss else loss
    d_scale = d_bias = dy = None
    if compute_dx:
        d_scale, d_bias = dt.sum(), db.sum()
        dx = dx.mul_(t)
    else:
        dx = None
    if compute_dy:
        neg = None if pos_offset is None else -pos_offset
        _, dy, dt_y, db_y = _launch(y, x, t, b, neg, False, True, block_size, precision)
        dy = dy.mul_(t)
        if d_scale is None:
            d_scale, d_bias = dt_y.sum(), db_y.sum()
    return SigmoidSums(loss.sum(), dx, dy, d_scale, d_bias)
