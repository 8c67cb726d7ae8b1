"""What one training step hands to the collectives, per rank, in each distributed mode: the analytic
twin of the communication ledger (``toolkit.core.dist``), checked against the ledger of real gloo runs
in tests/train/losses/test_modes.py and used by ``toolkit plan``.

``step_traffic`` returns {(op, category): (calls, bytes)} with the ledger's conventions (``bytes``: the
tensor handed to the op; ``calls`` None where DDP's bucketing decides); ``sent_bytes`` turns it into wire
bytes with ``toolkit.core.dist.wire_bytes``. Pure arithmetic: no process group needed.
"""

from __future__ import annotations

from toolkit.core.dist import wire_bytes

Traffic = dict[tuple[str, str], tuple[int | None, int]]

# One all_gather of 9 int64 per call: the shape check (check_equal_sizes pads shapes to 8 dims + ndim).
CHECK_BYTES = 9 * 8
F32, F64 = 4, 8


def fastclip_scalar_columns(version: str) -> int:
    """Per-sample float64 columns FastCLIP's objective all_gathers per step: ids, log u1, log u2, log g1,
    log g2 (v0, v1, v3); v2 adds τ, bound, m, v per side (fastclip/loss.py, fastclip/individual.py)."""
    return 13 if version == "v2" else 5


def step_traffic(mode: str, world: int, b: int, d: int, num_params: int, *, feature_bytes: int = 4,
                 grad_bytes: int = 4, objective: str = "openclip", version: str = "v3") -> Traffic:
    """(op, category) -> (calls, bytes) per rank for one step of ``objective`` in ``mode`` at world size
    ``world`` with local batch ``b``, feature dim ``d``, ``num_params`` gradients all-reduced (elements,
    ``grad_bytes`` each: 4 for fp32, 2 for bf16) and ``feature_bytes`` per feature element. The openclip
    objective's table is docs/distributed.md's; the fastclip objective runs in the fastclip mode; the siglip
    objective's modes are ``siglip_traffic``'s."""
    k, big_b = world, world * b
    table: Traffic = {("all_gather", "checks"): (1, CHECK_BYTES),
                      ("all_reduce", "param_grads"): (None, num_params * grad_bytes)}
    if objective == "fastclip":
        if mode != "fastclip":
            raise ValueError(f"the FastCLIP objectives run in the fastclip mode only, not {mode!r}")
        return table | {("all_gather", "features"): (1, 2 * b * d * feature_bytes),
                        ("all_gather", "scalars"): (1, b * fastclip_scalar_columns(version) * F64)}
    if objective == "siglip":
        return table | siglip_traffic(mode, world, b, d, feature_bytes)
    if mode == "gather":
        table |= {("all_gather", "features"): (2, 2 * b * d * feature_bytes),
                  ("reduce_scatter", "feature_grads"): (2, 2 * big_b * d * feature_bytes)}
    elif mode == "disco":
        table |= {("all_gather", "features"): (1, 2 * b * d * feature_bytes),
                  ("reduce_scatter", "feature_grads"): (1, 2 * big_b * d * feature_bytes)}
    elif mode == "fastclip":
        table |= {("all_gather", "features"): (1, 2 * b * d * feature_bytes),
                  ("all_gather", "scalars"): (1, 2 * b * F32)}
    elif mode == "ring":  # K−1 hops forward and backward, travelling accumulators
        for op in ("send", "recv"):
            table |= {(op, "features"): (2 * (k - 1), 2 * (k - 1) * b * d * feature_bytes),
                      (op, "scalars"): (3 * (k - 1), (k - 1) * (b * F32 + 2 * b * F32 + F32)),
                      (op, "feature_grads"): (k - 1, (k - 1) * b * d * F32)}
    else:
        raise ValueError(f"unknown distributed mode {mode!r}; choose gather, disco, ring or fastclip")
    return table


def siglip_traffic(mode: str, world: int, b: int, d: int, feature_bytes: int = 4) -> Traffic:
    """The sigmoid loss's feature traffic per rank (toolkit/train/losses/siglip/modes.py): gather moves the
    texts only (one all_gather, one reduce_scatter of [B, d]); ring K−1 text hops and K−1 hops of dy
    partials in the accumulation dtype (fp32; fp64 for fp64 features), all in the forward; fastclip one
    all_gather of the pairs and no gradient traffic (no normaliser to exchange either)."""
    k, acc_bytes = world, F64 if feature_bytes == F64 else F32
    if mode == "gather":
        return {("all_gather", "features"): (1, b * d * feature_bytes),
                ("reduce_scatter", "feature_grads"): (1, k * b * d * feature_bytes)}
    if mode == "ring":
        out: Traffic = {}
        for op in ("send", "recv"):
            out |= {(op, "features"): (k - 1, (k - 1) * b * d * feature_bytes),
                    (op, "feature_grads"): (k - 1, (k - 1) * b * d * acc_bytes)}
        return out
    if mode == "fastclip":
        return {("all_gather", "features"): (1, 2 * b * d * feature_bytes)}
    raise ValueError(f"the siglip objective runs in the gather, ring or fastclip mode, not {mode!r}")


def sent_bytes(table: Traffic, world: int) -> dict[str, float]:
    """Wire bytes per category and ``total`` (ring algorithms, ``wire_bytes``) of a ``step_traffic`` table."""
    out: dict[str, float] = {}
    for (op, cat), (_, nbytes) in table.items():
        out[cat] = out.get(cat, 0.0) + wire_bytes(op, nbytes, world)
    out["total"] = sum(out.values())
    return out
