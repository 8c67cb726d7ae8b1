"""Triton backend (``backend="triton"``): one forward sweep, one backward pass per gradient.

Kernels (3 QKᵀ passes for a full forward + backward, Inf-CL needs 6):
- ``_lse_fwd``: grid over row blocks; each program sweeps all column tiles once, keeps an online
  (max, sum) per row, and writes, per column tile, the column log-sum-exp *of its own row block* into a
  [num_row_blocks, N] fp32 buffer. ``torch.logsumexp`` over that buffer's first dim then gives the
  column LSE. The buffer is O(M·N / BLOCK_M) (for B = 65,536 and BLOCK_M = 64: 256 MiB), never B×B, and
  every entry is written exactly once, so the kernel is deterministic and autotuning reruns are safe.
- ``_lse_bwd``: grid over row blocks of one operand, recomputes the tiles and accumulates
  dx_i = Σ_j W_ij y_j and d_row_scale_i = Σ_j g_i P_ij s_ij. The same kernel gives dy / d_col_scale
  when launched on the transposed problem (x↔y, row↔col, diag_offset → −diag_offset), because
  W = g_r·a_r·P + g_c·a_c·Q is symmetric under that swap.

Inputs may be fp32, bf16 or fp16 with any D (the feature axis is padded to a power of two and masked);
dots accumulate in fp32 and scales multiply the fp32 dot, never the low-precision inputs. fp32 dots use
``input_precision`` ("ieee" exact, "tf32" tensor cores). fp64 inputs (oracles) are delegated to the
torch backend. No inline asm and no device asserts: under ``TRITON_INTERPRET=1`` (set before triton is
imported) the kernels run on CPU tensors, which is how CI tests them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from toolkit.kernels import tiled

NEG_INF = tl.constexpr(float("-inf"))  # globals inside @triton.jit must be constexpr


@triton.jit
def _lse_fwd(
    X,
    Y,
    RS,
    CS,
    ROW_LSE,
    COL_PART,
    M,
    N,
    D,
    stride_xm,
    stride_ym,
    diag_offset,
    HAS_DIAG: tl.constexpr,
    COMPUTE_ROW: tl.constexpr,
    COMPUTE_COL: tl.constexpr,
    SHARED_SCALE: tl.constexpr,
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
    rs = tl.load(RS + rows, mask=row_ok, other=0.0)
    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, N, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        y = tl.load(
            Y + cols[:, None] * stride_ym + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0
        )
        if DOT_FP32:
            y = y.to(tl.float32)
        s = tl.dot(x, tl.trans(y), input_precision=PRECISION)  # fp32 accumulation
        valid = row_ok[:, None] & col_ok[None, :]
        if HAS_DIAG:
            valid = valid & (cols[None, :] != rows[:, None] + diag_offset)
        zr = tl.where(valid, s * rs[:, None], NEG_INF)
        if COMPUTE_ROW:
            m_new = tl.maximum(m_i, tl.max(zr, 1))
            m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)  # all masked so far: avoid (-inf) - (-inf)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(zr - m_safe[:, None]), 1)
            m_i = m_new
        if COMPUTE_COL:
            if SHARED_SCALE:
                zc = zr
            else:
                cs = tl.load(CS + cols, mask=col_ok, other=0.0)
                zc = tl.where(valid, s * cs[None, :], NEG_INF)
            c_max = tl.max(zc, 0)
            c_safe = tl.where(c_max == NEG_INF, 0.0, c_max)
            part = c_safe + tl.log(tl.sum(tl.exp(zc - c_safe[None, :]), 0))  # log 0 = -inf when all masked
            tl.store(COL_PART + pid * N + cols, part, mask=col_ok)
    if COMPUTE_ROW:
        m_safe = tl.where(m_i == NEG_INF, 0.0, m_i)
        tl.store(ROW_LSE + rows, m_safe + tl.log(l_i), mask=row_ok)


@triton.jit
def _lse_bwd(
    X,
    Y,
    RS,
    CS,
    ROW_LSE,
    COL_LSE,
    GROW,
    GCOL,
    DX,
    DRS,
    M,
    N,
    D,
    stride_xm,
    stride_ym,
    stride_dxm,
    diag_offset,
    HAS_DIAG: tl.constexpr,
    HAS_GROW: tl.constexpr,
    HAS_GCOL: tl.constexpr,
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
    rs = tl.load(RS + rows, mask=row_ok, other=0.0)
    if HAS_GROW:
        r_lse = tl.load(ROW_LSE + rows, mask=row_ok, other=0.0)
        g_r = tl.load(GROW + rows, mask=row_ok, other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    d_rs = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, N, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        y = tl.load(
            Y + cols[:, None] * stride_ym + offs_d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0
        )
        w_dtype = y.dtype  # dL/ds is rounded to the input dtype for the second dot, as on tensor cores
        if DOT_FP32:
            y = y.to(tl.float32)
        s = tl.dot(x, tl.trans(y), input_precision=PRECISION)
        valid = row_ok[:, None] & col_ok[None, :]
        if HAS_DIAG:
            valid = valid & (cols[None, :] != rows[:, None] + diag_offset)
        w = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # dL/ds on this tile
        if HAS_GROW:
            gp = tl.where(valid, tl.exp(s * rs[:, None] - r_lse[:, None]), 0.0) * g_r[:, None]
            d_rs += tl.sum(gp * s, 1)
            w += gp * rs[:, None]
        if HAS_GCOL:
            cs = tl.load(CS + cols, mask=col_ok, other=0.0)
            c_lse = tl.load(COL_LSE + cols, mask=col_ok, other=0.0)
            g_c = tl.load(GCOL + cols, mask=col_ok, other=0.0)
            gq = tl.where(valid, tl.exp(s * cs[None, :] - c_lse[None, :]), 0.0) * g_c[None, :]
            w += gq * cs[None, :]
        w = w.to(w_dtype)
        if DOT_FP32:
            w = w.to(tl.float32)
        acc = tl.dot(w, y, acc, input_precision=PRECISION)
    tl.store(DX + rows[:, None] * stride_dxm + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(DRS + rows, d_rs, mask=row_ok)


def _gpu_configs(block_m: int | None) -> list:
    """Autotune space on GPU: tile sizes, two pipeline stages, 4 warps up to 64×64 tiles and 8 above
    (block_m fixed when the caller fixes it).

    Kept small on purpose: every config that survives ``_prune`` is compiled, once per dtype and flag
    combination, before the first call returns. The first H100 run of the wider space (4 × 4 tiles × 2 warps
    × 3 stages, re-tuned for every new M and N) was still compiling the CLIP and sigmoid kernels after
    6 minutes; compiling one D = 512 config for sm_90 takes 5–30 s on the 2-core CI machine. At D = 512 this
    space leaves 1 config per kernel in fp32 and 2–5 in bf16."""
    sizes_m = [block_m] if block_m else [32, 64, 128]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4 if bm * bn <= 64 * 64 else 8, num_stages=2)
        for bm in sizes_m
        for bn in (32, 64, 128)
    ]


def _smem_limit(device) -> int:
    try:
        return torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    except (AttributeError, RuntimeError, AssertionError):
        return 160 * 1024  # A100-class default when the property is unavailable


def _prune(configs, named_args, **kwargs):
    """Drop configs whose resident tiles (x block + y block per pipeline stage, full padded D) cannot
    fit in shared memory (fp32 at D = 512 only fits 32×32 tiles on H100; the estimate matches the
    compiler's for fp32 and over-counts bf16); keep the smallest if none fit."""
    x = named_args["X"]
    block_d = _block_d(named_args["D"])
    limit = _smem_limit(x.device)

    def need(c):
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        return (bm + bn * max(c.num_stages, 1)) * block_d * x.element_size() + bm * bn * 4

    fitting = [c for c in configs if need(c) <= limit]
    if not fitting:
        return [min(configs, key=need)]
    # Tiles much smaller than the largest that fits only add launch/loop overhead: skip them (shorter tuning).
    largest = max(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] for c in fitting)
    return [c for c in fitting if 4 * c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] >= largest]


def _autotune(block_m: int | None):
    # Keyed on D (and, implicitly, the tensors' dtypes) only: the best tile depends on the feature width and
    # dtype, not on the batch, and the gradient cache and distributed modes call with many M and N, each of
    # which would otherwise re-benchmark every config.
    return triton.autotune(_gpu_configs(block_m), key=["D"], prune_configs_by={"early_config_prune": _prune})


# Forward: BLOCK_M is chosen in Python (it sizes the column-partial buffer), BLOCK_N is tuned.
_FWD_TUNED = {bm: _autotune(bm)(_lse_fwd) for bm in (16, 32, 64, 128)}
_BWD_TUNED = _autotune(None)(_lse_bwd)

INTERPRETER_BLOCK = 32  # CPU interpreter: fixed tiles, no autotuning (each config would rerun the kernel)


def _use_autotune(x: Tensor, block_size: int | None) -> bool:
    return x.device.type == "cuda" and block_size is None


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _check_block(block_size: int | None) -> None:
    if block_size is not None and (block_size < 16 or block_size & (block_size - 1)):
        raise ValueError(f"triton block_size must be a power of two >= 16, got {block_size}")


def _precision(x: Tensor, input_precision: str | None) -> str:
    if input_precision is None:
        return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    if input_precision not in ("ieee", "tf32"):
        raise ValueError(f"input_precision must be 'ieee', 'tf32' or None, got {input_precision!r}")
    return input_precision


def _fwd_block_m(d: int) -> int:
    """Row-block height on GPU: the x tile [BLOCK_M, BLOCK_D] stays resident, so shrink it for large D."""
    bd = _block_d(d)
    return 128 if bd <= 64 else 64 if bd <= 256 else 32 if bd <= 512 else 16


def _dot_fp32(x: Tensor) -> bool:
    """The CPU interpreter's tl.dot mis-multiplies bf16 (numpy has no bf16): upcast tiles before the dot
    there. bf16 products are exact in fp32 and the GPU accumulates in fp32, so results are the same."""
    return x.dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


def _per_row(scale: Tensor, n: int) -> Tensor:
    return scale.float().expand(n).contiguous() if scale.dim() == 0 else scale.float().contiguous()


def lse_forward(
    x: Tensor,
    y: Tensor,
    row_scale: Tensor,
    col_scale: Tensor,
    diag_offset: int | None,
    compute_row: bool,
    compute_col: bool,
    block_size: int | None,
    input_precision: str | None,
) -> tuple[Tensor | None, Tensor | None]:
    """Row LSE [M], column LSE [N] (fp32) in one sweep; scales already 0-d/1-d of the acc dtype."""
    _check_block(block_size)
    m, n, d = x.shape[0], y.shape[0], x.shape[1]
    if x.dtype == torch.float64 or m == 0 or n == 0:
        return tiled.lse_forward(x, y, row_scale, col_scale, diag_offset, compute_row, compute_col, None)
    x, y = x.contiguous(), y.contiguous()
    shared = tiled._same_scale(row_scale, col_scale)
    rs, cs = _per_row(row_scale, m), _per_row(col_scale, n)
    tuned = _use_autotune(x, block_size)
    block_m = _fwd_block_m(d) if tuned else (block_size or INTERPRETER_BLOCK)
    num_row_blocks = triton.cdiv(m, block_m)
    row = torch.empty(m, dtype=torch.float32, device=x.device)
    part = torch.empty((num_row_blocks, n) if compute_col else (1, 1), dtype=torch.float32, device=x.device)
    args = (x, y, rs, cs, row, part, m, n, d, x.stride(0), y.stride(0), diag_offset or 0)
    flags = dict(
        HAS_DIAG=diag_offset is not None,
        COMPUTE_ROW=compute_row,
        COMPUTE_COL=compute_col,
        SHARED_SCALE=shared,
        PRECISION=_precision(x, input_precision),
        DOT_FP32=_dot_fp32(x),
        BLOCK_D=_block_d(d),
    )
    if tuned:
        _FWD_TUNED[block_m][(num_row_blocks,)](*args, **flags)
    else:
        _lse_fwd[(num_row_blocks,)](*args, **flags, BLOCK_M=block_m, BLOCK_N=block_m)
    col = torch.logsumexp(part, dim=0) if compute_col else None
    return (row if compute_row else None), col


def _bwd_launch(
    x, y, rs, cs, lse_r, lse_c, g_r, g_c, diag_offset, block_size, precision
) -> tuple[Tensor, Tensor]:
    """One pass: gradient of the rows of x ([M, D]) and of their scales ([M])."""
    m, n, d = x.shape[0], y.shape[0], x.shape[1]
    dx = torch.empty(m, d, dtype=torch.float32, device=x.device)
    d_rs = torch.empty(m, dtype=torch.float32, device=x.device)
    dummy = rs  # never read when the matching HAS_* flag is off
    args = (
        x,
        y,
        rs,
        cs,
        dummy if lse_r is None else lse_r,
        dummy if lse_c is None else lse_c,
        dummy if g_r is None else g_r,
        dummy if g_c is None else g_c,
        dx,
        d_rs,
        m,
        n,
        d,
        x.stride(0),
        y.stride(0),
        dx.stride(0),
        diag_offset or 0,
    )
    flags = dict(
        HAS_DIAG=diag_offset is not None,
        HAS_GROW=g_r is not None,
        HAS_GCOL=g_c is not None,
        PRECISION=precision,
        DOT_FP32=_dot_fp32(x),
        BLOCK_D=_block_d(d),
    )
    if _use_autotune(x, block_size):
        _BWD_TUNED[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]),)](*args, **flags)
    else:
        bm = block_size or INTERPRETER_BLOCK
        _lse_bwd[(triton.cdiv(m, bm),)](*args, **flags, BLOCK_M=bm, BLOCK_N=bm)
    return dx, d_rs


def lse_backward(
    x: Tensor,
    y: Tensor,
    row_scale: Tensor,
    col_scale: Tensor,
    row_lse: Tensor | None,
    col_lse: Tensor | None,
    grad_row: Tensor | None,
    grad_col: Tensor | None,
    diag_offset: int | None,
    block_size: int | None,
    input_precision: str | None,
    compute_dx: bool = True,
    compute_dy: bool = True,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """(dx, dy, d_row_scale, d_col_scale) in fp32: one kernel pass for x's side (dx, d_row_scale), one for
    y's side (dy, d_col_scale); a side not asked for is None and its pass is skipped."""
    _check_block(block_size)
    m, n = x.shape[0], y.shape[0]
    if x.dtype == torch.float64 or m == 0 or n == 0 or (grad_row is None and grad_col is None):
        return tiled.lse_backward(
            x,
            y,
            row_scale,
            col_scale,
            row_lse,
            col_lse,
            grad_row,
            grad_col,
            diag_offset,
            None,
            compute_dx,
            compute_dy,
        )
    x, y = x.contiguous(), y.contiguous()
    rs, cs = _per_row(row_scale, m), _per_row(col_scale, n)
    vec = [None if t is None else t.float().contiguous() for t in (row_lse, col_lse, grad_row, grad_col)]
    lse_r, lse_c, g_r, g_c = vec
    precision = _precision(x, input_precision)
    dx = dy = d_rs = d_cs = None
    if compute_dx:
        dx, d_rs = _bwd_launch(x, y, rs, cs, lse_r, lse_c, g_r, g_c, diag_offset, block_size, precision)
    if compute_dy:
        neg = None if diag_offset is None else -diag_offset
        dy, d_cs = _bwd_launch(y, x, cs, rs, lse_c, lse_r, g_c, g_r, neg, block_size, precision)
    return dx, dy, d_rs, d_cs
