"""The text tables ``toolkit plan`` prints (``format_plan``)."""

from __future__ import annotations

from toolkit.train.plan.config import GiB, Plan, local_batch
from toolkit.train.plan.memory import OPTIMIZER_SLOTS


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def format_plan(plan: Plan) -> str:
    """The plan as the text tables ``toolkit plan`` prints."""
    c, s = plan.cfg, plan.shape
    b = local_batch(c)
    lines = [
        f"{s.name}: {s.num_params / 1e6:.2f}M parameters, embed dim {s.embed_dim}; global batch "
        f"{c.batch_size} "
        f"= {c.nodes} node(s) x {c.nproc_per_node} process(es) x {b}; {c.loss}, mode {c.mode}, "
        f"{c.precision}, "
        f"{c.optimizer}, micro-batch {c.micro_batch_size or 'off'}, {c.device}"
        + (", grad checkpointing" if c.grad_checkpointing else ""),
        f"activations: {_size(plan.fixed_bytes)} + {_size(plan.per_sample_bytes)} per sample"
        + (f" ({plan.source})" if plan.source else ""),
        "",
        f"{'memory per device':<36}{'bytes':>14}",
    ]
    lines += [f"{name:<36}{_size(v):>14}" for name, v in plan.rows.items()]
    lines.append(f"{'total':<36}{_size(plan.total):>14}")
    if c.fsdp:
        lines.append(f"{'total with DDP (for comparison)':<36}{_size(plan.ddp_total):>14}")
        if c.fsdp_cpu_offload and c.device == "cuda":
            from toolkit.train.plan.fsdp_memory import host_rows

            for name, v in host_rows(
                num_params=s.num_params,
                num_trainable=s.num_trainable,
                slots=OPTIMIZER_SLOTS[c.optimizer],
                world=c.world,
            ).items():
                lines.append(f"{name:<36}{_size(v):>14}")
    if plan.table_bytes_per_node and c.device != "cpu":
        lines.append(f"{'FastCLIP tables (host, per node)':<36}{_size(plan.table_bytes_per_node):>14}")
    if plan.disk_bytes_per_sample:
        lines.append(
            f"{'training set on disk (' + c.storage + ')':<36}{_size(plan.disk_bytes_per_sample):>14} "
            f"per sample, {_size(plan.disk_bytes_per_sample * c.num_samples)} for {c.num_samples:,} "
            "(meta lines not counted)"
        )
    if plan.traffic:
        cats = ("features", "feature_grads", "scalars", "param_grads", "total") + (
            ("params",) if c.fsdp else ()
        )
        lines += ["", f"{'sent per rank per step':<24}" + "".join(f"{k:>15}" for k in cats)]
        for name, row in plan.traffic.items():
            lines.append(f"{name:<24}" + "".join(f"{_size(row.get(k, 0.0)):>15}" for k in cats))
    if plan.stage_memory:
        lines += ["", f"{'memory per device per stage':<36}{'bytes':>14}"]
        lines += [f"{name:<36}{_size(v):>14}" for name, v in plan.stage_memory.items()]
    if plan.flops:
        lines += ["", f"{'tower FLOPs (counted)':<36}{'GFLOP':>14}"]
        lines += [f"{name:<36}{v / 1e9:>14.3f}" for name, v in plan.flops.items()]
    if plan.fit:
        f = plan.fit
        lines += [
            "",
            f"fits in {c.device_memory_gb:g} GiB per device:",
            f"  largest micro-batch at global batch {c.batch_size}: {f['micro_batch'] or 'none fits'}",
            f"  largest global batch without the gradient cache: {f['global_batch_no_cache'] or 'none fits'}",
            f"  largest global batch with micro-batch {f['cache_micro_batch']}: "
            f"{f['global_batch_with_cache'] or 'none fits'}",
        ]
    return "\n".join(lines)
