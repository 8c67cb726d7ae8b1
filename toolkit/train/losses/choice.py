"""The objective ``toolkit train`` uses when none is named: the winner of the convergence evidence at the
run's global batch size (torch-free: config building calls it).

``BY_BATCH`` holds (largest global batch, the ``LossConfig`` fields of the objective to use up to it);
the last row applies to every larger batch. The evidence is ``benchmarks/results/convergence.md``
(``benchmarks/convergence.py``: held-out retrieval of LiT heads on emoji drawings, every method's
knobs tuned on a validation split, 5 paired seeds); docs/objectives.md explains the choice. An explicit
``--loss`` / ``loss.kind`` or a ``--preset`` always wins.
"""

from __future__ import annotations

# At global batch 32 and 64 the best-tuned OpenCLIP is ahead of FastCLIP-v1 and v3 in the short regime
# (6 epochs) and level in the long one (30 epochs): per-sample estimators refreshed once an epoch lag
# the model when dataset/batch is large. At 256 FastCLIP-v3 is ahead. 128 was not measured: it goes
# with the nearer small batch (64 is a factor 2 away, 256 a factor 2 too; the lag grows as n/B, so the
# smaller side is the safer guess).
BY_BATCH: tuple[tuple[int | None, dict[str, str]], ...] = (
    (128, {"kind": "openclip"}),
    (None, {"kind": "fastclip", "version": "v3"}),
)


def default_loss(batch_size: int) -> dict[str, str]:
    """LossConfig fields of the objective the evidence picks at global batch ``batch_size``."""
    for largest, fields in BY_BATCH:
        if largest is None or batch_size <= largest:
            return dict(fields)
    raise AssertionError("BY_BATCH must end with a row for every larger batch")


def describe() -> str:
    """'openclip up to batch 128, fastclip-v3 above' (for --help and docs)."""
    parts = []
    for largest, fields in BY_BATCH:
        name = fields["kind"] + (f"-{fields['version']}" if "version" in fields else "")
        parts.append(f"{name} up to batch {largest}" if largest is not None else f"{name} above")
    return ", ".join(parts)
