"""What one training step hands to the collectives, per rank, in each distributed mode: the analytic
twin of the communication ledger (``toolkit.core.dist``), checked against the ledger of real gloo runs
in tests/train/losses/test_modes.py and used by ``toolkit plan``.

``step_traffic`` returns {(op, category): (calls, bytes)} with the ledger's conventions (``bytes``: the
tensor handed to the op; ``calls`` None where DDP's bucketing decides); ``sent_bytes`` turns it into wire
bytes with ``toolkit.core.dist.wire_bytes``. Pure arithmetic: no process group needed.
"""

from __future__ import annotations

from typing import Any

from toolkit.core.dist import wire_bytes
from toolkit.train.losses import registry
from toolkit.train.losses.spec import F32, Traffic

# One all_gather of 9 int64 per call: the shape check (check_equal_sizes pads shapes to 8 dims + ndim).
CHECK_BYTES = 9 * 8


def step_traffic(
    mode: str,
    world: int,
    b: int,
    d: int,
    num_params: int,
    *,
    feature_bytes: int = 4,
    grad_bytes: int = 4,
    objective: str = "openclip",
    **fields: Any,
) -> Traffic:
    """(op, category) -> (calls, bytes) per rank for one step of ``objective`` in ``mode`` at world size
    ``world`` with local batch ``b``, feature dim ``d``, ``num_params`` gradients all-reduced (elements,
    ``grad_bytes`` each: 4 for fp32, 2 for bf16) and ``feature_bytes`` per feature element. ``objective``
    is a registered kind and ``fields`` its LossConfig variant (FastCLIP's ``fastclip={"version": "v2"}``):
    an objective
    whose spec has ``traffic`` (fastclip, siglip) brings its own features and scalars, in the modes it runs
    in; the others use the CLIP loss's table below (docs/distributed.md)."""
    k, big_b = world, world * b
    table: Traffic = {
        ("all_gather", "checks"): (1, CHECK_BYTES),
        ("all_reduce", "param_grads"): (None, num_params * grad_bytes),
    }
    spec = registry.spec(objective)
    spec.check_mode(mode)
    if spec.traffic is not None:
        return table | spec.traffic(mode, world, b, d, feature_bytes, fields)
    if mode == "gather":
        table |= {
            ("all_gather", "features"): (2, 2 * b * d * feature_bytes),
            ("reduce_scatter", "feature_grads"): (2, 2 * big_b * d * feature_bytes),
        }
    elif mode == "disco":
        table |= {
            ("all_gather", "features"): (1, 2 * b * d * feature_bytes),
            ("reduce_scatter", "feature_grads"): (1, 2 * big_b * d * feature_bytes),
        }
    elif mode == "fastclip":
        table |= {
            ("all_gather", "features"): (1, 2 * b * d * feature_bytes),
            ("all_gather", "scalars"): (1, 2 * b * F32),
        }
    elif mode == "ring":  # K−1 hops forward and backward, travelling accumulators
        for op in ("send", "recv"):
            table |= {
                (op, "features"): (2 * (k - 1), 2 * (k - 1) * b * d * feature_bytes),
                (op, "scalars"): (3 * (k - 1), (k - 1) * (b * F32 + 2 * b * F32 + F32)),
                (op, "feature_grads"): (k - 1, (k - 1) * b * d * F32),
            }
    else:
        from toolkit.train.losses.config import MODES

        raise ValueError(f"unknown distributed mode {mode!r}; choose {', '.join(MODES)}")
    return table


def sent_bytes(table: Traffic, world: int) -> dict[str, float]:
    """Wire bytes per category and ``total`` (ring algorithms, ``wire_bytes``) of a ``step_traffic`` table."""
    out: dict[str, float] = {}
    for (op, cat), (_, nbytes) in table.items():
        out[cat] = out.get(cat, 0.0) + wire_bytes(op, nbytes, world)
    out["total"] = sum(out.values())
    return out
