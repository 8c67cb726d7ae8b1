"""``toolkit plan``: predicted per-device memory and per-rank traffic of a training configuration, and the
largest global batch and micro-batch that fit a device: ``run(PlanConfig) -> Plan``.

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

Traffic per rank per step comes from ``toolkit.train.plan.traffic`` (the ledger's own formula). The
predictions leave out the framework's own resident memory (the CUDA context, torch's libraries), which
the device must hold too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from toolkit.core.config import option
from toolkit.train.config import GradDtype, Precision
from toolkit.train.losses.config import MODES, Mode
from toolkit.train.optim import OptimizerName

OPTIMIZER_SLOTS = {"adamw": 2, "lamb": 2, "lion": 1, "sgd": 1}
GiB = 1024**3

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


@dataclass(frozen=True)
class PlanConfig:
    """``toolkit plan``'s one config (see the module docstring for the arithmetic)."""

    model: str = option("cliptk-tiny", doc="open_clip model name, config JSON or checkpoint directory.")
    batch_size: int = option(4096, ge=2, doc="GLOBAL batch over all ranks.")
    nodes: int = option(1, ge=1, doc="Nodes.")
    nproc_per_node: int = option(1, ge=1, doc="Training processes (devices) per node.")
    mode: Mode = option(
        "fastclip", doc="Distributed mode whose loss memory is tabled (traffic is shown for every mode)."
    )
    loss: str = option(
        "fastclip-v3",
        doc="Objective, a --loss name of `toolkit train` (openclip, fastclip-v0..v3, "
        "...; FastCLIP runs in the fastclip mode).",
    )
    micro_batch_size: int = option(
        0, ge=0, doc="Gradient-cache micro-batch per rank; 0: the whole local batch."
    )
    precision: Precision = option("fp32", doc="Autocast precision of the towers.")
    optimizer: OptimizerName = option("adamw", doc="Optimiser (its state per weight).")
    grad_dtype: GradDtype = option("fp32", doc="dtype of DDP's gradient all_reduce.")
    device: Literal["cpu", "cuda"] = option(
        "cuda",
        doc="Where training runs (cuda: batch offload counts 2 "
        "micro-batches on the device; cpu: FastCLIP tables count).",
    )
    num_samples: int = option(3_000_000, ge=1, doc="Dataset size N (FastCLIP's per-sample tables).")
    device_memory_gb: float = option(0.0, ge=0, doc="Device memory in GiB to fit (0: skip the fit).")
    measure: bool = option(False, doc="Measure the model's activations now instead of using MEASURED.")
    measure_sizes: list[int] = option(factory=lambda: [16, 64], doc="The two micro-batch sizes measured.")
    grad_checkpointing: bool = option(
        False,
        doc="Activations with `toolkit train --grad-checkpointing` (each "
        "transformer block recomputed in the backward).",
    )
    fsdp: bool = option(
        False,
        doc="Plan `toolkit train --fsdp`: parameters, gradients and optimizer state "
        "sharded over the ranks (FSDP2), beside DDP's total.",
    )
    fsdp_cpu_offload: bool = option(False, doc="With fsdp: the shards in host memory (`--fsdp-cpu-offload`).")
    fsdp_reshard_after_forward: bool = option(
        True,
        doc="With fsdp: blocks freed after their forward (`toolkit train`'s default); false: every unit "
        "gathered from its forward to its backward (`--no-fsdp-reshard-after-forward`).",
    )
    text_tokens: int = option(
        0,
        ge=0,
        doc="Tokens per caption the text tower runs on: the trainer cuts each "
        "batch after its longest caption, so give your data's longest caption (with "
        "--measure); 0: the model's full context, the worst case.",
    )
    storage: str = option(
        "pixels",
        doc="Storage mode of the training set (precompute --storage: pixels, jpeg, "
        "index) whose disk per sample and for num_samples is shown.",
    )
    patch_dropout: float = option(
        0.0,
        ge=0,
        doc="Activations with `toolkit train --patch-dropout P` (the image "
        "tower on a (1-P) share of its patches): measured with --measure, else the "
        "table's scaled to the kept tokens.",
    )
    stages: str = option(
        "",
        doc="A `toolkit train --stages` plan: tower FLOPs and memory per step of each stage "
        "(the full-size activations scaled to the stage's tokens), FLOPs over the run; the main "
        "memory table is the full-size stage's (the peak).",
    )
    steps: int = option(0, ge=0, doc="Steps of the run, for the FLOPs over a stage plan (0: per step only).")

    def __post_init__(self) -> None:
        from toolkit.data.trainset import storage
        from toolkit.train.losses import registry

        registry.spec_of_name(self.loss)  # an unknown name is refused, naming the registered ones
        storage.get(self.storage)  # so is an unknown storage mode

    @property
    def world(self) -> int:
        return self.nodes * self.nproc_per_node


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_params: int
    num_trainable: int
    embed_dim: int
    sample_bytes: int  # uint8 pixels + int64 tokens of one pair, as the loader hands them over
    units: object = None  # fsdp_memory.Units: FSDP's units (plan --fsdp)


@dataclass(frozen=True)
class Plan:
    cfg: PlanConfig
    shape: ModelShape
    fixed_bytes: float
    per_sample_bytes: float
    rows: dict[str, float]  # per device, bytes
    table_bytes_per_node: float
    traffic: dict[str, dict[str, float]]  # mode -> category -> sent bytes per rank per step
    fit: dict[str, int | None] = field(default_factory=dict)
    source: str = ""  # where the activation constants came from
    disk_bytes_per_sample: float = 0.0  # the training set's, in cfg.storage (precompute's defaults)
    flops: dict[str, float] = field(default_factory=dict)  # counted tower FLOPs (tower_flops_rows)
    ddp_total: float = 0.0  # plan --fsdp: the same run's total per device with DDP
    stage_memory: dict[str, float] = field(default_factory=dict)  # total per device per stage (stage_totals)

    @property
    def total(self) -> float:
        return sum(self.rows.values())


def model_shape(model_spec: str) -> ModelShape:
    """Parameter counts and sizes of ``model_spec``, built on torch's meta device (no memory, no init)."""
    import torch

    from toolkit.models.factory import build_model, resolve_spec
    from toolkit.models.registry import config_context_length, config_image_size

    spec = resolve_spec(model_spec)
    with torch.device("meta"):
        clip = build_model(spec.model_cfg)
    from toolkit.train.plan.fsdp_memory import units_of

    n = sum(p.numel() for p in clip.parameters())
    size = config_image_size(spec.model_cfg)
    return ModelShape(
        spec.name,
        n,
        n,
        int(spec.model_cfg["embed_dim"]),
        size * size * 3 + 8 * config_context_length(spec.model_cfg),
        units_of(clip),
    )


def local_batch(cfg: PlanConfig, batch_size: int | None = None) -> int:
    big_b = cfg.batch_size if batch_size is None else batch_size
    if big_b % cfg.world:
        raise ValueError(f"global batch {big_b} does not divide by {cfg.world} ranks")
    return big_b // cfg.world


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
        param_bytes=_param_bytes(cfg),
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


def _param_bytes(cfg: PlanConfig) -> int:
    """Bytes of an all-gathered parameter under --fsdp: bf16 with precision bf16 (train/fsdp.py's policy)."""
    return 2 if cfg.precision == "bf16" else 4


def objective(cfg: PlanConfig):
    """(ObjectiveSpec, LossConfig fields) of ``cfg.loss``, looked up in the registry now."""
    from toolkit.train.losses import registry

    return registry.spec_of_name(cfg.loss)


def table_bytes(cfg: PlanConfig) -> float:
    """Host bytes of the objective's per-sample float32 tables (its spec's ``table_columns``)."""
    spec, fields = objective(cfg)
    return 4.0 * cfg.num_samples * spec.table_columns(fields)


def traffic(cfg: PlanConfig, shape: ModelShape) -> dict[str, dict[str, float]]:
    """Wire bytes per rank per step for every mode of the openclip objective, and for ``cfg.loss`` in its mode
    when it is another objective (``NAME/MODE``)."""
    from toolkit.train.plan.traffic import sent_bytes, step_traffic

    b, feat = local_batch(cfg), 2 if cfg.precision != "fp32" else 4
    grad = 2 if cfg.grad_dtype == "bf16" else 4
    if cfg.world == 1:
        return {}
    out = {
        f"openclip/{mode}": sent_bytes(
            step_traffic(
                mode, cfg.world, b, shape.embed_dim, shape.num_trainable, feature_bytes=feat, grad_bytes=grad
            ),
            cfg.world,
        )
        for mode in MODES
    }
    if cfg.fsdp:  # the parameter traffic FSDP adds (its gradient reduce-scatter replaces DDP's all_reduce)
        from toolkit.train.plan.fsdp_memory import traffic as fsdp_traffic

        m = cfg.micro_batch_size
        out["fsdp (parameters)"] = fsdp_traffic(
            num_params=shape.num_params,
            num_trainable=shape.num_trainable,
            units=shape.units,
            world=cfg.world,
            param_bytes=_param_bytes(cfg),
            num_micro=-(-b // m) if 0 < m < b else 0,
            reshard=cfg.fsdp_reshard_after_forward,
        )
    spec, fields = objective(cfg)
    if spec.kind != "openclip":
        variant = {k: v for k, v in fields.items() if k != "kind"}
        mode = cfg.mode if cfg.mode in spec.modes else spec.modes[0]
        table = step_traffic(
            mode,
            cfg.world,
            b,
            shape.embed_dim,
            shape.num_trainable,
            feature_bytes=feat,
            grad_bytes=grad,
            objective=spec.kind,
            **variant,
        )
        out[f"{cfg.loss}/{mode}"] = sent_bytes(table, cfg.world)
    return out


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
            f"no measured activations for {key} in toolkit.train.plan.planner.{table_name} "
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


def run(cfg: PlanConfig) -> Plan:
    """The plan for ``cfg`` (module docstring); builds the model on the meta device, measures if asked."""
    spec, _ = objective(cfg)
    if cfg.mode not in spec.modes:  # e.g. FastCLIP runs in the fastclip mode only: plan the mode it runs in
        cfg = replace(cfg, mode=spec.modes[0])
    shape = model_shape(cfg.model)
    fixed, per_sample, overhead, source = activation_constants(cfg)
    rows = memory_rows(cfg, shape, fixed, per_sample, overhead)
    if cfg.device == "cpu":
        rows["FastCLIP tables (host, per node)"] = table_bytes(cfg)
    fit = largest_fit(cfg, shape, fixed, per_sample, overhead) if cfg.device_memory_gb else {}
    ddp = (
        sum(memory_rows(replace(cfg, fsdp=False), shape, fixed, per_sample, overhead).values())
        if cfg.fsdp
        else 0.0
    )
    if cfg.fsdp and cfg.device == "cpu":
        ddp += rows["FastCLIP tables (host, per node)"]
    return Plan(
        cfg,
        shape,
        fixed,
        per_sample,
        rows,
        table_bytes(cfg),
        traffic(cfg, shape),
        fit,
        source,
        disk_bytes(cfg),
        tower_flops_rows(cfg),
        ddp,
        stage_totals(cfg, shape, fixed, per_sample, overhead) if cfg.stages else {},
    )


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


def disk_bytes(cfg: PlanConfig) -> float:
    """Bytes a training sample takes on disk in ``cfg.storage`` (its storage mode's figure), at the side
    precompute stores for the model by default (the crop margin of ``crop_scale_min`` 0.9) and its context."""
    from toolkit.data.images import stored_side
    from toolkit.data.trainset import storage
    from toolkit.models.factory import resolve_spec
    from toolkit.models.registry import config_context_length, config_image_size

    model_cfg = resolve_spec(cfg.model).model_cfg
    side = stored_side(config_image_size(model_cfg), 0.9)
    return float(storage.get(cfg.storage).disk_bytes_per_sample(side, config_context_length(model_cfg)))


def tower_flops_rows(cfg: PlanConfig) -> dict[str, float]:
    """Counted tower FLOPs (models/flops.py) of one training step at cfg's patch dropout and caption length:
    per sample forward, per rank and per global step (forward + backward, the cache's extra forward); {} for
    towers it does not count (ResNets, timm, Hugging Face text)."""
    from toolkit.models.factory import resolve_spec
    from toolkit.models.flops import step_flops, tower_flops

    try:
        per = tower_flops(
            resolve_spec(cfg.model).model_cfg,
            text_tokens=cfg.text_tokens or None,
            patch_dropout=cfg.patch_dropout,
        )
    except ValueError:
        return {}
    b = local_batch(cfg)
    cached = 0 < cfg.micro_batch_size < b
    rows = {
        "image forward per sample": per.image,
        "text forward per sample": per.text,
        "towers per rank per step": step_flops(per, b, cached),
        "towers per global step": step_flops(per, cfg.batch_size, cached),
    }
    return rows | (stage_flops_rows(cfg, cached) if cfg.stages else {})


def stage_flops_rows(cfg: PlanConfig, cached: bool) -> dict[str, float]:
    """Per global step of each stage of ``cfg.stages`` and, given ``cfg.steps``, summed over the run and as a
    share of the same run at full size."""
    from toolkit.models.factory import resolve_spec
    from toolkit.models.flops import step_flops, tower_flops
    from toolkit.train.stages import parse, schedule

    model_cfg = resolve_spec(cfg.model).model_cfg
    rows, total = {}, 0.0
    stages = schedule(parse(cfg.stages), cfg.steps or 1000)
    for i, s in enumerate(stages, 1):
        per = tower_flops(
            model_cfg,
            image_size=s.image_px or None,
            text_tokens=s.text_tokens or cfg.text_tokens or None,
            patch_dropout=cfg.patch_dropout,
        )
        step = step_flops(per, cfg.batch_size, cached)
        rows[f"stage {i} ({s.image_px or 'full'} px, {s.text_tokens or 'full'} tok) per step"] = step
        total += step * (s.stop - s.start)
    if cfg.steps:
        full = step_flops(tower_flops(model_cfg, text_tokens=cfg.text_tokens or None), cfg.batch_size, cached)
        rows[f"run of {cfg.steps} steps ({total / (full * cfg.steps):.2f} x full size)"] = total
    return rows


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
