"""The distillation objective over the global batch, tiled: no B×B matrix, O(B·(d + d_ref)) memory.

Notation: student rows x (image), y (text) [b, d] on this rank, X, Y [B, d] the global batch; teacher rows
u, v [b, e] (e = d_ref) and U, V [B, e]; s_ij = x_i·y_j, t_ij = u_i·v_j; a the student's logit scale,
a_t = 1/τ_t the teacher's. Row softmaxes P^s_ij = exp(a s_ij − R^s_i), P^t_ij = exp(a_t t_ij − R^t_i) with the
row LSEs R^s, R^t; column softmaxes Q^s, Q^t with the column LSEs C^s, C^t. Per row (image→text)

    KL_i = Σ_j P^t_ij (log P^t_ij − log P^s_ij) = a_t Σ_j P^t_ij t_ij − R^t_i − a Σ_j P^t_ij s_ij + R^s_i

and per column likewise; the value is (1 − λ)·CLIP + λ·½(mean_i KL_i + mean_j KL'_j) (MobileCLIP), and
∂KL_i/∂s_ij = a (P^s_ij − P^t_ij), ∂KL_i/∂a = Σ_j (P^s_ij − P^t_ij) s_ij.

Everything runs on ``toolkit.kernels``' LSE primitives (torch, triton or naive backend): the LSEs come
from ``lse_forward``; the teacher-weighted sums Σ_j P^t_ij y_j (and Σ_i Q^t_ij x_i) come from
``lse_backward`` on *augmented* features, image side [u, 0, x] and text side [v, y, 0] ([n, e + 2d]): their
dot products are t_ij exactly (the zero blocks add exact zeros), so the kernel's softmax weights are the
teacher's, and its gradient matrix G·[V, Y, 0] (Gᵀ·[U, 0, X]) carries G·Y (Gᵀ·X) in its middle (last)
block. The price: those passes multiply over e + 2d columns instead of e.

Two distributed modes (every rank calls them with equal local batches, checked by the caller):
- ``gather_distill`` (OpenCLIP's gather_with_grad): the student features are gathered with autograd (the
  backward reduce-scatters their gradients), the teacher's without; rank r's rows and columns against the
  global batch; each rank's own upstream gradient.
- ``anchor_distill`` (the fastclip mode; also the one-process path): everything gathered without autograd,
  then the anchors' four LSEs [b, 4] gathered; each rank forms its own feature gradients from its anchor
  terms and its role as a negative of every gathered anchor, no feature-gradient communication (the
  other ranks' upstream gradient is taken equal to this rank's, as ``modes/anchors.py``).
Both return rank r's share loss_r (mean over ranks = the global value) with the K× gradient convention
of ``modes/contrastive.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from toolkit import kernels as K
from toolkit.core import dist as D
from toolkit.train.losses.modes.anchors import anchor_grads, anchor_lses
from toolkit.train.losses.modes.common import add_positive_grads, clip_value, gather_pairs, positive_logits


def _image_side(teacher: Tensor, student: Tensor) -> Tensor:
    """[t, 0, s] [n, e + 2d]: dotted with a ``_text_side`` row gives the teacher similarity only."""
    return torch.cat([teacher, torch.zeros_like(student), student], 1)


def _text_side(teacher: Tensor, student: Tensor) -> Tensor:
    """[t, s, 0] [n, e + 2d] (see ``_image_side``)."""
    return torch.cat([teacher, student, torch.zeros_like(student)], 1)


def _teacher_row_sums(
    x: Tensor, u: Tensor, ys: Tensor, vs: Tensor, at: Tensor, rt: Tensor, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    """For rows x [m, d] / u [m, e] against ys [n, d] / vs [n, e], given the teacher's row LSEs rt [m]:
    (Σ_j P^t_ij t_ij [m], Σ_j P^t_ij y_j [m, d], Σ_j P^t_ij s_ij [m]), in the accumulation dtype."""
    e, d = u.shape[1], x.shape[1]
    ones = torch.ones_like(rt)
    w = (
        K.lse_backward(
            _image_side(u, x),
            _text_side(vs, ys),
            at,
            at,
            rt,
            None,
            ones,
            None,
            backend=backend,
            compute_dy=False,
        )[0]
        / at
    )
    pty = w[:, e : e + d]
    return (u.to(w.dtype) * w[:, :e]).sum(1), pty, (x.to(w.dtype) * pty).sum(1)


class _RowKL(torch.autograd.Function):
    """Rows x [m, d] (teacher u [m, e]) against the rows of ys [n, d] (vs [n, e]): (KL_i [m], R^s_i [m]),
    differentiable in x, ys and a (the teacher is data). The column side is the same call transposed."""

    @staticmethod
    def forward(ctx, x, ys, a, u, vs, at, backend):
        rs, _ = K.lse_forward(x, ys, a, a, compute_col=False, backend=backend)
        rt, _ = K.lse_forward(u, vs, at, at, compute_col=False, backend=backend)
        teacher_mean, pty, cross = _teacher_row_sums(x, u, ys, vs, at, rt, backend)
        kl = at * teacher_mean - rt - a.to(rs.dtype) * cross + rs
        ctx.save_for_backward(x, ys, a, u, vs, at, rs, rt, pty, cross)
        ctx.backend = backend
        return kl, rs

    @staticmethod
    def backward(ctx, g_kl, g_rs):
        x, ys, a, u, vs, at, rs, rt, pty, cross = ctx.saved_tensors
        e, d, acc = u.shape[1], x.shape[1], rs.dtype
        g_kl, g_rs = g_kl.to(acc), g_rs.to(acc)
        scale = a.detach().to(acc)
        dx, dys, d_rs, _ = K.lse_backward(x, ys, a, a, rs, None, g_kl + g_rs, None, backend=ctx.backend)
        dx = dx - scale * g_kl[:, None] * pty  # − a Σ_j g_i P^t_ij y_j
        dya = K.lse_backward(
            _image_side(u, x),
            _text_side(vs, ys),
            at,
            at,
            rt,
            None,
            g_kl,
            None,
            backend=ctx.backend,
            compute_dx=False,
        )[1]
        dys = dys - (scale / at) * dya[:, e + d :]  # − a Σ_i g_i P^t_ij x_i
        da = d_rs.sum() - (g_kl * cross).sum()
        return dx.to(x.dtype), dys.to(ys.dtype), da.to(a.dtype), None, None, None, None


def gather_distill(
    x: Tensor,
    y: Tensor,
    a: Tensor,
    u: Tensor,
    v: Tensor,
    at: Tensor,
    weight: float,
    group=None,
    backend: str = "auto",
    ledger=None,
) -> Tensor:
    """The gather mode (module docstring): this rank's share (0-d). x, y [b, d] (autograd), u, v [b, e]
    teacher rows in x's dtype, a 0-d, at 0-d in the accumulation dtype. Called by all ranks of ``group``."""
    xs = D.all_gather_with_grad(x, group, check_sizes=False, ledger=ledger)
    ys = D.all_gather_with_grad(y, group, check_sizes=False, ledger=ledger)
    us, vs = gather_pairs(u, v, group, ledger=ledger)
    kl_row, r_row = _RowKL.apply(x, ys, a, u, vs, at, backend)
    kl_col, r_col = _RowKL.apply(y, xs, a, v, us, at, backend)
    acc = r_row.dtype
    pos = (x.to(acc) * y.to(acc)).sum(1)  # local positives, differentiated here (as modes.gather_loss)
    return (1 - weight) * clip_value(r_row, r_col, a, pos) + weight * 0.5 * (kl_row.mean() + kl_col.mean())


class _AnchorDistill(torch.autograd.Function):
    """The fastclip mode (module docstring); K = 1 is the one-process loss."""

    @staticmethod
    def forward(ctx, x, y, a, u, v, at, weight, group, backend, ledger):
        off = D.get_rank(group) * x.shape[0]
        xs, ys = gather_pairs(x, y, group, ledger=ledger)
        us, vs = gather_pairs(u, v, group, ledger=ledger)
        rs, cs = anchor_lses(x, y, xs, ys, a, off, False, backend)
        rt, ct = anchor_lses(u, v, us, vs, at, off, False, backend)
        lses = D.all_gather_nograd(
            torch.stack([rs, cs, rt, ct], 1), group, D.SCALARS, check_sizes=False, ledger=ledger
        )
        mean_row, _, cross_row = _teacher_row_sums(x, u, ys, vs, at, rt, backend)
        mean_col, _, cross_col = _teacher_row_sums(y, v, xs, us, at, ct, backend)  # columns: transposed
        scale = a.to(rs.dtype)
        kl_row = at * mean_row - rt - scale * cross_row + rs
        kl_col = at * mean_col - ct - scale * cross_col + cs
        pos = positive_logits(x, y)
        ctx.save_for_backward(x, y, a, u, v, at, xs, ys, us, vs, lses, pos, cross_row.sum() + cross_col.sum())
        ctx.weight, ctx.backend, ctx.off = weight, backend, off
        return (1 - weight) * clip_value(rs, cs, a, pos) + weight * 0.5 * (kl_row.mean() + kl_col.mean())

    @staticmethod
    def backward(ctx, g):
        x, y, a, u, v, at, xs, ys, us, vs, lses, pos, cross = ctx.saved_tensors
        lam, e, d = ctx.weight, u.shape[1], x.shape[1]
        g = g.to(lses.dtype)
        w = g / (2 * x.shape[0])  # every anchor term's upstream weight
        # the student LSEs: CLIP's (1 − λ) and the KL's λ add up to weight w
        dx, dy, da = anchor_grads(x, y, xs, ys, a, lses[:, 0], lses[:, 1], w, ctx.off, False, ctx.backend)
        dx, dy = add_positive_grads(dx, dy, x, y, a, (1 - lam) * g)
        # − λ a Σ_j P^t_ij s_ij (rows and columns): teacher weights on the student's features
        xa, ya = _image_side(u, x), _text_side(v, y)
        one = xs.shape[0] == x.shape[0]  # one process: anchor_grads reads only the local rows
        xsa, ysa = (xa, ya) if one else (_image_side(us, xs), _text_side(vs, ys))
        dxa, dya, _ = anchor_grads(
            xa, ya, xsa, ysa, at, lses[:, 2], lses[:, 3], w, ctx.off, False, ctx.backend
        )
        coef = lam * a.detach().to(g.dtype) / at
        dx = dx - coef * dxa[:, e : e + d]
        dy = dy - coef * dya[:, e + d :]
        da = da - (1 - lam) * g * pos.mean() - lam * w * cross
        return dx.to(x.dtype), dy.to(y.dtype), da.to(a.dtype), None, None, None, None, None, None, None


def anchor_distill(
    x: Tensor,
    y: Tensor,
    a: Tensor,
    u: Tensor,
    v: Tensor,
    at: Tensor,
    weight: float,
    group=None,
    backend: str = "auto",
    ledger=None,
) -> Tensor:
    """The fastclip mode and the one-process loss (module docstring): this rank's share (0-d); arguments as
    ``gather_distill``. Called by all ranks of ``group``."""
    return _AnchorDistill.apply(x, y, a, u, v, at, weight, group, backend, ledger)


MODE_FNS = {"gather": gather_distill, "fastclip": anchor_distill}
