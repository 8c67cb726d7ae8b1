"""The objective ``toolkit train`` uses when none is named: the winner of the convergence evidence at the
run's global batch size (torch-free: config building calls it).

``BY_BATCH`` holds (largest global batch, the ``LossConfig`` fields of the objective to use up to it);
the last row applies to every larger batch. The evidence is ``benchmarks/objectives/results/convergence.md``
(``benchmarks/objectives/convergence/``: held-out retrieval of LiT heads on emoji drawings, every method's
knobs tuned on a validation split, 5 paired seeds); docs/objectives.md explains the choice. An explicit
``--loss`` / ``loss.kind`` or a ``--preset`` always wins.
"""

from __future__ import annotations

# benchmarks/objectives/results/convergence.md (LiT heads on 3 training artists' 4,882 pairs, all ~1,900 concepts, scored on
# a 4th artist, knobs tuned on validation, 5 paired seeds): after 6 epochs FastCLIP-v3 with drift-corrected
# estimators (u_drift: batch) is the best cliptk objective by validation at batch 32 and 256 and ahead of the
# best-tuned OpenCLIP at 32, 64 and 256 (+0.94, +0.67, +0.64 R@1), while plain v3 trails OpenCLIP at every
# batch (-0.78, -1.19, -3.42). (NeuCLIP wins batch 64, +1.78, but costs ~5 v3 steps of CPU per LiT step and
# trails after 30 epochs.) After 30 epochs OpenCLIP with a tuned fixed tau is ahead of every cliptk objective
# at 32 and 64 (docs/objectives.md says so). The table keeps its batch rows so new evidence can split it.
BY_BATCH: tuple[tuple[int | None, dict[str, str]], ...] = (
    (None, {"kind": "fastclip", "version": "v3", "u_drift": "batch"}),
)


def default_loss(batch_size: int) -> dict[str, str]:
    """LossConfig fields of the objective the evidence picks at global batch ``batch_size``."""
    for largest, fields in BY_BATCH:
        if largest is None or batch_size <= largest:
            return dict(fields)
    raise AssertionError("BY_BATCH must end with a row for every larger batch")


def describe() -> str:
    """'fastclip-v3 (u_drift: batch) at every batch', or 'X up to batch N, Y above' (for --help and docs)."""
    parts = []
    for largest, fields in BY_BATCH:
        name = fields["kind"] + (f"-{fields['version']}" if "version" in fields else "")
        name += "".join(f" ({k}: {v})" for k, v in fields.items() if k not in ("kind", "version"))
        parts.append(f"{name} up to batch {largest}" if largest is not None else f"{name} above")
    if len(parts) == 1:
        return parts[0].removesuffix(" above") + " at every batch"
    return ", ".join(parts)
