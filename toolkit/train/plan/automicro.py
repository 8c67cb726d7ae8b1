"""``--micro-batch-size auto``: the largest gradient-cache micro-batch that fits, chosen once at start-up.

- CPU: ``toolkit plan``'s prediction (``toolkit.train.plan.memory.memory_rows``) with the model's measured
  activation constants (``memory.MEASURED``, else measured now in subprocesses, ``memprobe``) against a
  stated budget: ``memory_budget_gb``, or by default 90% of (the host's MemAvailable + this process's
  resident set) divided among the node's ranks.
- CUDA: try a forward + backward of the towers on the real model at the local batch b, then b/2, b/4, ...
  until one fits (backing off on out-of-memory) and the plan's rows not yet allocated (optimiser state,
  cached features, the loss's) fit beside its peak in ``memory_budget_gb`` (default: the device's memory).

Returns 0 (no gradient cache) when the whole local batch fits. Every rank calls ``choose`` (CPU: each
rank decides alike from the same numbers; CUDA: each rank probes its own device).
"""

from __future__ import annotations

from typing import Any

import torch

from toolkit.core.log import get_logger

GiB = 1024**3


def plan_config(cfg: Any, group_size: int, local_world: int, device: str, num_samples: int):
    """The ``PlanConfig`` describing this training run."""
    from toolkit.core.config import build
    from toolkit.train.plan.config import PlanConfig

    return build(
        PlanConfig,
        {
            "model": cfg.model,
            "batch_size": cfg.batch_size,
            "nodes": group_size // local_world,
            "nproc_per_node": local_world,
            "mode": cfg.loss.mode,
            "loss": cfg.loss.name,
            "precision": cfg.precision,
            "optimizer": cfg.optim.name,
            "grad_dtype": cfg.grad_dtype,
            "device": device,
            "num_samples": num_samples,
            "grad_checkpointing": cfg.grad_checkpointing,
            "fsdp": cfg.fsdp,
            "patch_dropout": cfg.patch_dropout,
            "fsdp_cpu_offload": cfg.fsdp_cpu_offload,
            "fsdp_reshard_after_forward": cfg.fsdp_reshard_after_forward,
        },
    )


def host_budget_bytes(local_world: int) -> float:
    """90% of (MemAvailable + this process's RSS) / local ranks (the default CPU budget)."""
    from toolkit.train.plan.memprobe import rss_bytes

    with open("/proc/meminfo") as fh:
        avail = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    return 0.9 * (avail + rss_bytes()) / local_world


def _cpu(pcfg: Any, local: int, budget: float) -> tuple[int, str]:
    from toolkit.train.plan import memory
    from toolkit.train.plan.config import model_shape, table_bytes

    key = (pcfg.model, pcfg.precision, "cpu")
    table = memory.MEASURED_CHECKPOINTED if pcfg.grad_checkpointing else memory.MEASURED
    if key in table and not pcfg.patch_dropout:  # the table holds full-sequence activations
        fixed, per_sample, overhead = table[key]
    else:
        from toolkit.train.plan.memprobe import measure_activations

        fit = measure_activations(
            pcfg.model,
            (16, 64),
            pcfg.precision,
            "cpu",
            threads=torch.get_num_threads(),
            grad_checkpointing=pcfg.grad_checkpointing,
            patch_dropout=pcfg.patch_dropout,
        )
        fixed, per_sample, overhead = fit.fixed_bytes, fit.per_sample_bytes, fit.overhead_bytes
    shape = model_shape(pcfg.model)
    tables = table_bytes(pcfg)

    def total(m: int) -> float:
        return sum(memory.memory_rows(pcfg, shape, fixed, per_sample, overhead, micro=m).values()) + tables

    best = max((m for m in range(1, local + 1) if total(m) <= budget), default=1)
    return best, (
        f"predicted {total(best) / GiB:.2f} GiB of a {budget / GiB:.2f} GiB budget "
        f"({per_sample / 2**20:.2f} MiB of activations per sample)"
    )


def _cuda(model: Any, dev: torch.device, pcfg: Any, local: int, budget: float) -> tuple[int, str]:
    from toolkit.train.plan.config import model_shape
    from toolkit.train.plan.memory import memory_rows
    from toolkit.train.plan.memprobe import tower_pass
    from toolkit.train.runtime import autocast

    shape = model_shape(pcfg.model)
    m = local
    while True:
        rows = memory_rows(pcfg, shape, 0.0, 0.0, micro=m)
        later = sum(v for k, v in rows.items() if k.startswith(("optimizer", "cached", "loss")))
        try:
            torch.cuda.reset_peak_memory_stats(dev)
            tower_pass(model, m, autocast(pcfg.precision, "cuda"), dev)
            peak = torch.cuda.max_memory_allocated(dev)
            ok = peak + later <= budget
        except torch.cuda.OutOfMemoryError:
            ok, peak = False, float("nan")
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        if ok or m == 1:
            return (
                m,
                f"probe peak {peak / GiB:.2f} GiB + {later / GiB:.2f} GiB later of {budget / GiB:.2f} GiB",
            )
        m = max(1, m // 2)


def choose(cfg: Any, model: Any, rt: Any, num_samples: int) -> int:
    """The micro-batch for training ``model`` (the ``TrainModel``, on ``rt.device``) per ``cfg`` on a
    dataset of ``num_samples``: 0 when the local batch fits whole. ``rt``: this rank's ``Runtime``."""
    log = get_logger("train")
    local = cfg.batch_size // rt.world_size
    if model.image_role != "image" or model.text_role != "tokens":
        log.info(
            "micro-batch auto: frozen-tower features, the heads keep O(D) floats per sample: whole local "
            "batch of %d",
            local,
        )
        return 0
    cuda = rt.device.type == "cuda"
    pcfg = plan_config(cfg, rt.world_size, rt.local_world_size, "cuda" if cuda else "cpu", num_samples)
    if cuda:
        budget = cfg.memory_budget_gb * GiB or torch.cuda.get_device_properties(rt.device).total_memory
        m, why = _cuda(model, rt.device, pcfg, local, budget)
    else:
        budget = cfg.memory_budget_gb * GiB or host_budget_bytes(rt.local_world_size)
        m, why = _cpu(pcfg, local, budget)
    log.info("micro-batch auto: %d of the local batch %d (%s)", m, local, why)
    return 0 if m >= local else m
