"""The memory model of ``toolkit plan``: predicted bytes per device of a training configuration, and the
largest global batch and micro-batch that fit a device.

Every term is arithmetic on the model's shapes except the towers' activations, which are measured
(``toolkit.train.plan.memprobe``: activations(m) = fixed + per_sample·m, fitted from real allocator peaks;
``MEASURED`` holds the fits of the shipped small configs, ``measure=True`` measures any model; with patch
dropout, and for each stage of a stage plan, the full-size per-sample term is scaled to the tokens the
towers run on, ``estimate.activation_share``, unless measured). Bytes per
device, for a global batch B over K = nodes × processes ranks (local batch b = B/K), micro-batch m (b
without the gradient cache), embedding dim E, P parameters (T trainable):

| row | bytes |
|---|---|
| parameters | 4·P (fp32 weights; bf16/fp16 autocast keeps them fp32) |
| gradients | 4·T; K > 1 (DDP): the reducer's buckets, a flat copy of the gradients held through the step.
  The step frees the gradients (``set_to_none``) and the backward allocates them as it frees the
  activations, so at the peak (the backward's start) the buckets are there and the gradients not: one 4·T
  row (cliptk-small, batch 64, 2 ranks: planned 685.6 MiB, measured 685.3); with the gradient cache the
  gradients accumulate over the micro-batches beside the buckets: 2 × 4·T (not measured) |
| optimizer state | 4·T·slots (AdamW, LAMB: 2 moments; Lion, SGD with momentum: 1) |
| activations | fixed + per_sample·m (measured; precision-specific) |
| runtime buffers | CPU: what the model build and first pass leave resident beyond weights and gradients
  (measured) |
| batch inputs | b·(uint8 pixels + int64 tokens) per sample; 2·m of them on CUDA with the cache (offload) |
| cached features | gradient cache only: b rows of x and y and their gradients, 4·2·2·b·E |
| loss features | the global batch's features: gather/disco 2·B·E·4 + their gradients 2·B·E·4; fastclip
  2·B·E·4; ring 2·2·b·E·4 (the block in hand and the one arriving) |
| loss tiles | tiled.py's backward: 4 strips of rows × n columns fp32, rows = min(b, 2^21 / n), n = B (b for
  ring); plus LSE vectors 4·4·n |
| FastCLIP tables | per node, N samples × columns × 4 (2 columns; v2: 10), in host memory shared by the node's
  ranks |

With ``fsdp`` (``toolkit.train.plan.fsdp_memory``) the parameter, gradient and optimizer rows are sharded over
the ranks, beside the units FSDP gathers; the DDP total is printed next to it.

The predictions leave out the framework's own resident memory (the CUDA context, torch's libraries), which
the device must hold too.
"""

from __future__ import annotations

from toolkit.train.plan.config import GiB, ModelShape, PlanConfig, local_batch, model_shape, table_bytes

OPTIMIZER_SLOTS = {"adamw": 2, "lamb": 2, "lion": 1, "sgd": 1}


# Measured with `MALLOC_MMAP_THRESHOLD_=131072 toolkit plan --model M --precision P --device cpu --measure`
# on the 2-core CI-class CPU (fresh subprocess per size, 1 thread, micro-batches 16 and 64):
# (fixed bytes, bytes per sample, runtime buffers). Re-measure on your machine with --measure.
MEASURED: dict[tuple[str, str, str], tuple[float, float, float]] = {
    ("cliptk-tiny", "fp32", "cpu"): (10_716_501.0, 3_230_634.7, 32_580_000.0),
    ("cliptk-small", "fp32", "cpu"): (5_107_712.0, 9_967_616.0, 34_723_832.0),
}


# The same with --grad-checkpointing (open_clip's activation checkpointing of both towers' blocks), measured
# the same way with `--grad-checkpointing --measure` (benchmarks/grad_checkpointing.py prints both side by
# side).
MEASURED_CHECKPOINTED: dict[tuple[str, str, str], tuple[float, float, float]] = {
    ("cliptk-tiny", "fp32", "cpu"): (22_020_096.0, 517_888.0, 33_644_536.0),
    ("cliptk-small", "fp32", "cpu"): (43_814_912.0, 1_223_424.0, 36_401_144.0),
}


def loss_feature_bytes(mode: str, big_b: int, b: int, e: int, world: int) -> float:
    """The loss's copies of the features: the gathered global batch (and its gradients for gather/disco)."""
    if world == 1:
        return 0.0  # the loss works on the local features themselves
    if mode == "ring":
        return 2 * 2 * b * e * 4
    return 2 * big_b * e * 4 * (2 if mode in ("gather", "disco") else 1)


def loss_tile_bytes(mode: str, big_b: int, b: int) -> float:
    """toolkit/kernels/tiled.py's backward: 4 strip buffers [rows, n] fp32 + a few LSE vectors [n]."""
    from toolkit.kernels.tiled import strip_rows

    n = b if mode == "ring" else big_b
    return 4 * strip_rows(b, n, None) * n * 4 + 4 * 4 * n


def memory_rows(
    cfg: PlanConfig,
    shape: ModelShape,
    fixed: float,
    per_sample: float,
    overhead: float = 0.0,
    batch_size: int | None = None,
    micro: int | None = None,
) -> dict[str, float]:
    """Per-device bytes of every row of the module docstring's table (global batch and micro-batch
    overridable for the fit)."""
    big_b = cfg.batch_size if batch_size is None else batch_size
    b = local_batch(cfg, big_b)
    m = cfg.micro_batch_size if micro is None else micro
    cached = 0 < m < b
    m = m if cached else b
    e, t = shape.embed_dim, shape.num_trainable
    on_device_inputs = 2 * m if cached and cfg.device == "cuda" else b
    rows = {
        "parameters": 4.0 * shape.num_params,
        **_gradient_rows(cfg.world > 1 and not cfg.fsdp, cached, t),
        f"optimizer state ({cfg.optimizer})": 4.0 * t * OPTIMIZER_SLOTS[cfg.optimizer],
        f"activations (micro-batch {m})": fixed + per_sample * m,
        "runtime buffers (measured)": overhead,
        "batch inputs": float(on_device_inputs * shape.sample_bytes),
        "cached features + grads": float(4 * 2 * 2 * b * e) if cached else 0.0,
        "loss features": loss_feature_bytes(cfg.mode, big_b, b, e, cfg.world),
        "loss tiles + LSE vectors": loss_tile_bytes(cfg.mode, big_b, b),
    }
    if not cfg.fsdp:
        return rows
    from toolkit.train.plan.fsdp_memory import sharded_rows

    return sharded_rows(
        rows,
        num_params=shape.num_params,
        num_trainable=t,
        slots=OPTIMIZER_SLOTS[cfg.optimizer],
        world=cfg.world,
        units=shape.units,
        param_bytes=param_bytes(cfg),
        cached=cached,
        offload=cfg.fsdp_cpu_offload and cfg.device == "cuda",
        reshard=cfg.fsdp_reshard_after_forward,
    )


def _gradient_rows(ddp: bool, cached: bool, num_trainable: int) -> dict[str, float]:
    """The gradients, and DDP's buckets (K > 1): a flat copy of every gradient held through the step. The step
    frees the gradients (set_to_none) and the backward allocates them as it frees the activations, so
    without the gradient cache the peak holds the buckets, not both (measured:
    benchmarks/trainer/fsdp_memory.py); with it the gradients accumulate over the micro-batches beside
    them (not measured)."""
    grads = 4.0 * num_trainable
    if not ddp:
        return {"gradients": grads}
    return (
        {"gradients": grads, "gradient buckets (DDP)": grads}
        if cached
        else {"gradients (DDP buckets)": grads}
    )


def param_bytes(cfg: PlanConfig) -> int:
    """Bytes of an all-gathered parameter under --fsdp: bf16 with precision bf16 (train/fsdp.py's policy)."""
    return 2 if cfg.precision == "bf16" else 4


def activation_constants(cfg: PlanConfig) -> tuple[float, float, float, str]:
    """(fixed, per-sample, runtime buffers, where from): measured now, or MEASURED's entry for the model."""
    key = (cfg.model, cfg.precision, cfg.device)
    table, table_name = (
        (MEASURED_CHECKPOINTED, "MEASURED_CHECKPOINTED") if cfg.grad_checkpointing else (MEASURED, "MEASURED")
    )
    if not cfg.measure and cfg.device == "cuda" and (cfg.text_tokens or key not in table):
        # planning a GPU job happens on a laptop: an estimate from the H100 run, labelled (plan/estimate.py)
        from toolkit.train.plan import estimate as E

        h100 = PlanConfig(
            model=E.H100_MODEL,
            batch_size=E.H100_BATCH,
            loss=E.H100_LOSS,
            mode="gather",
            precision=E.H100_PRECISION,
            device="cuda",
        )
        others = sum(memory_rows(h100, model_shape(E.H100_MODEL), 0.0, 0.0).values())
        return E.estimated_constants(
            cfg.model, cfg.precision, cfg.text_tokens, cfg.grad_checkpointing, others, cfg.patch_dropout
        )
    if cfg.text_tokens and not cfg.measure:
        raise ValueError(
            f"text_tokens={cfg.text_tokens}: MEASURED holds full-context activations only; pass "
            "--measure to measure them at that caption length"
        )
    if not cfg.measure and key in table:
        fixed, per_sample, overhead = table[key]
        if not cfg.patch_dropout:
            return fixed, per_sample, overhead, "table"
        # the table's full sequence scaled to the kept tokens (estimate.activation_share: layers x tokens x
        # width); measured against --measure on cliptk-tiny (docs/training.md, "toolkit plan")
        from toolkit.models.factory import resolve_spec
        from toolkit.train.plan.estimate import activation_share

        share = activation_share(resolve_spec(cfg.model).model_cfg, patch_dropout=cfg.patch_dropout)
        return fixed, per_sample * share, overhead, f"table, per sample x {share:.3f} for the kept patches"
    if not cfg.measure:
        raise ValueError(
            f"no measured activations for {key} in toolkit.train.plan.memory.{table_name} "
            f"(known: {sorted(table)}); pass --measure to measure them now"
        )
    from toolkit.train.plan.memprobe import measure_activations

    if cfg.device == "cuda" and not _cuda_available():
        raise ValueError(
            "--measure with device cuda measures on this machine's GPU, and it has none: "
            "drop --measure (the plan then uses an estimate from the H100 run, labelled as "
            "such) or run it on the GPU machine"
        )
    fit = measure_activations(
        cfg.model,
        tuple(cfg.measure_sizes),
        cfg.precision,
        cfg.device,
        threads=1,
        text_tokens=cfg.text_tokens,
        grad_checkpointing=cfg.grad_checkpointing,
        patch_dropout=cfg.patch_dropout,
    )
    return fit.fixed_bytes, fit.per_sample_bytes, fit.overhead_bytes, f"measured {list(fit.points)}"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def largest_fit(
    cfg: PlanConfig, shape: ModelShape, fixed: float, per_sample: float, overhead: float
) -> dict[str, int | None]:
    """The largest micro-batch at cfg's global batch, and the largest global batches without the gradient
    cache and with it (at cfg's micro-batch, or the largest that fits at cfg's batch), that fit
    ``device_memory_gb`` (tables included on the CPU)."""
    budget = cfg.device_memory_gb * GiB - (table_bytes(cfg) if cfg.device == "cpu" else 0.0)

    def fits(big_b: int, micro: int) -> bool:
        return sum(memory_rows(cfg, shape, fixed, per_sample, overhead, big_b, micro).values()) <= budget

    b = local_batch(cfg)
    best_micro = max((m for m in _candidates(b) if fits(cfg.batch_size, m)), default=None)
    micro = cfg.micro_batch_size or best_micro or 1
    return {
        "micro_batch": best_micro,
        "global_batch_no_cache": _largest_batch(cfg.world, lambda n: fits(n, 0)),
        "global_batch_with_cache": _largest_batch(cfg.world, lambda n: fits(n, min(micro, n // cfg.world))),
        "cache_micro_batch": micro,
    }


def _candidates(b: int) -> list[int]:
    return list(range(1, b + 1)) if b <= 4096 else sorted({*range(1, 4097), b})


def _largest_batch(world: int, fits) -> int | None:
    """Largest multiple n of ``world`` (n >= 2, per-rank batch >= 1) with fits(n), by doubling + bisection."""
    lo = world if world >= 2 else 2
    if not fits(lo):
        return None
    hi = lo
    while fits(hi * 2) and hi < 1 << 40:
        hi *= 2
    lo_k, hi_k = hi // world, 2 * hi // world  # in units of ranks' local batches
    while hi_k - lo_k > 1:
        mid = (lo_k + hi_k) // 2
        lo_k, hi_k = (mid, hi_k) if fits(mid * world) else (lo_k, mid)
    return lo_k * world


def stage_totals(cfg: PlanConfig, shape: ModelShape, fixed: float, per_sample: float, overhead: float):
    """Memory per device in each stage of ``cfg.stages``: the plan's rows with the per-sample activations
    (measured or tabled at full size) scaled to the stage's image side and caption length
    (``estimate.activation_share``); {} for towers the share is not modelled for."""
    from toolkit.models.factory import resolve_spec
    from toolkit.train.plan.estimate import activation_share
    from toolkit.train.stages import parse

    model_cfg = resolve_spec(cfg.model).model_cfg
    out = {}
    for i, s in enumerate(parse(cfg.stages), 1):
        try:
            share = activation_share(
                model_cfg,
                text_tokens=s.text_tokens,
                image_px=s.image_px,
                patch_dropout=cfg.patch_dropout,
                base_text_tokens=cfg.text_tokens,
            ) / activation_share(model_cfg, patch_dropout=cfg.patch_dropout, base_text_tokens=cfg.text_tokens)
        except ValueError:
            return {}
        rows = memory_rows(cfg, shape, fixed, per_sample * share, overhead)
        extra = table_bytes(cfg) if cfg.device == "cpu" else 0.0
        out[f"stage {i} ({s.image_px or 'full'} px, {s.text_tokens or 'full'} tok) per step"] = (
            sum(rows.values()) + extra
        )
    return out
