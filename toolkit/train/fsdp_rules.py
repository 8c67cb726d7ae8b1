"""Which settings ``--fsdp`` runs with: ``refusal(cfg)`` says, in one line, why a combination cannot work.

Torch-free: ``TrainConfig`` calls it when built, so the CLI, a pipeline and a YAML file are refused before any
rank starts. What composes (tests/train/test_fsdp*.py): every objective and loss mode, the gradient cache,
``grad_checkpointing``, locked towers, EMA, bf16, a resume at another world size.
"""

from __future__ import annotations

from typing import Any


def refusal(cfg: Any) -> str | None:
    """Why ``cfg`` (a ``TrainConfig``) cannot train as asked with its fsdp keys; None when it can."""
    if cfg.fsdp_cpu_offload and not cfg.fsdp:
        return "fsdp_cpu_offload offloads FSDP's shards: set fsdp too (--fsdp --fsdp-cpu-offload)"
    if not cfg.fsdp_reshard_after_forward and not cfg.fsdp:
        return "fsdp_reshard_after_forward sets how FSDP reshards: set fsdp too (--fsdp)"
    if not cfg.fsdp:
        return None
    if cfg.precision == "fp16":
        return (
            "fsdp with precision fp16: the fp16 GradScaler does not know FSDP's shards; use --precision "
            "bf16 (bf16 all-gathers, fp32 gradient reductions and master weights)"
        )
    if cfg.grad_dtype != "fp32":
        return (
            "fsdp with grad_dtype bf16: grad_dtype sets DDP's all_reduce; FSDP reduce-scatters gradients "
            "in fp32 (precision bf16 all-gathers bf16 parameters)"
        )
    if cfg.checkpoint.dir and "://" in cfg.checkpoint.dir and not cfg.checkpoint.dir.startswith("file://"):
        return (
            f"fsdp with checkpoint.dir {cfg.checkpoint.dir}: every rank writes its own shard files, which "
            "needs a folder all ranks share (a local or network filesystem), not an object-store URL"
        )
    return None
