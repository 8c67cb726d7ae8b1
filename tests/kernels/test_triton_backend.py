"""Triton backend vs the float64 naive oracle. Without CUDA the kernels run on CPU tensors under
TRITON_INTERPRET=1 (set in conftest.py before triton is imported); sizes stay small (the interpreter is
slow)."""

from __future__ import annotations

import pytest
import torch
from kernel_oracles import check_clip_loss, check_lse_case, rel_err, unit_rows

from toolkit import kernels as K

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (M, N, D, diag_offset, row scale kind, col scale kind, scale value, block_size)
LSE_CASES = [
    (1, 1, 72, None, "scalar", "scalar", 1.0, 16),  # batch 1 (tiles mostly masked)
    (3, 3, 96, 0, "scalar", "scalar", 100.0, 16),  # B=3, fully masked rows of the tile
    (37, 37, 72, 0, "per_row", "per_row", 100.0, 16),  # B % block != 0, individual temperatures
    (50, 23, 96, -5, "per_row", "scalar", 30.0, 16),  # rectangular, negative offset
    (23, 70, 72, 7, "scalar", "per_row", 1.0, 32),  # rectangular, ring-style offset
]


@pytest.mark.parametrize("case", LSE_CASES, ids=lambda c: "M{}N{}D{}k{}_{}_{}_a{}_bs{}".format(*c))
def test_lse_matches_float64_oracle(case, gen, poisoned):
    check_lse_case("triton", *case, dtype=torch.float32, tol=1e-4, gen=gen, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lse_low_precision_inputs(dtype, gen, poisoned):
    check_lse_case("triton", 45, 38, 72, 1, "per_row", "scalar", 100.0, 16, dtype, 2e-2, gen, DEVICE)


@pytest.mark.parametrize("b,d,value,block", [(1, 96, 1.0, 16), (70, 72, 100.0, 32), (200, 96, 1.0, None)])
def test_clip_loss_matches_oracle(b, d, value, block, gen, poisoned):
    check_clip_loss("triton", b, d, value, block, torch.float32, 1e-4, gen, DEVICE)


def test_clip_loss_bf16(gen, poisoned):
    check_clip_loss("triton", 48, 72, 100.0, 16, torch.bfloat16, 2e-2, gen, DEVICE)


def test_ieee_and_tf32_precision_options(gen):
    x, y = unit_rows(20, 72, gen), unit_rows(20, 72, gen)
    a = torch.tensor(100.0)
    ref = K.lse_forward(x.double(), y.double(), a.double(), a.double(), backend="naive")
    x, y, a = x.to(DEVICE), y.to(DEVICE), a.to(DEVICE)
    for precision in ("ieee", "tf32"):
        out = K.lse_forward(x, y, a, a, backend="triton", block_size=16, input_precision=precision)
        tol = 1e-4 if precision == "ieee" or DEVICE == "cpu" else 1e-2  # tf32 keeps 10 mantissa bits
        assert max(rel_err(o, r) for o, r in zip(out, ref, strict=True)) <= tol
    with pytest.raises(ValueError, match="input_precision"):
        K.lse_forward(x, y, a, a, backend="triton", input_precision="fp8")
    with pytest.raises(ValueError, match="power of two"):
        K.lse_forward(x, y, a, a, backend="triton", block_size=24)


def test_no_square_buffer(gen, monkeypatch):
    """Forward + backward allocate nothing of B×B size: the column partials are B×B/BLOCK_M."""
    b, d, block = 256, 8, 16
    sizes = []
    for name in ("empty", "zeros", "full"):
        real = getattr(torch, name)

        def spy(*args, _real=real, **kw):
            t = _real(*args, **kw)
            sizes.append(t.numel())
            return t

        monkeypatch.setattr(torch, name, spy)
    x, y = unit_rows(b, d, gen).to(DEVICE), unit_rows(b, d, gen).to(DEVICE)
    a, ones = torch.tensor(10.0, device=DEVICE), torch.ones(b, device=DEVICE)
    sizes.clear()  # count only what the kernels' wrappers allocate
    row, col = K.lse_forward(x, y, a, a, 0, backend="triton", block_size=block)
    K.lse_backward(x, y, a, a, row, col, ones, ones, 0, backend="triton", block_size=block)
    assert sizes and max(sizes) == max(b * b // block, b * d)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("d", [72, 512])
def test_autotuned_cuda_clip_loss(dtype, tol, d, gen):
    """Compiled (not interpreted) kernels with autotuned tiles at a realistic size (no block_size)."""
    check_clip_loss("triton", 3000, d, 100.0, None, dtype, tol, gen, "cuda")


COMPILE_SCRIPT = """
import inspect, itertools, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from toolkit.kernels import triton_lse as T
ptrs = {"RS": "*fp32", "CS": "*fp32", "ROW_LSE": "*fp32", "COL_PART": "*fp32", "COL_LSE": "*fp32",
        "GROW": "*fp32", "GCOL": "*fp32", "DX": "*fp32", "DRS": "*fp32"}
for dt, kernel in itertools.product(("fp32", "bf16"), (T._lse_fwd, T._lse_bwd)):
    consts = dict(HAS_DIAG=True, PRECISION="tf32", DOT_FP32=False, BLOCK_M=32, BLOCK_N=64, BLOCK_D=128)
    consts |= dict(COMPUTE_ROW=True, COMPUTE_COL=True, SHARED_SCALE=False) if kernel is T._lse_fwd else \\
        dict(HAS_GROW=True, HAS_GCOL=True)
    types = ptrs | {"X": "*" + dt, "Y": "*" + dt}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32")
           for n in inspect.signature(kernel.fn).parameters}
    triton.compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


def test_kernels_compile_for_cuda():
    """The interpreter accepts things the GPU compiler rejects (e.g. non-constexpr globals): compile both
    kernels to sm_90 cubin here (no GPU needed), in a subprocess without TRITON_INTERPRET."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
