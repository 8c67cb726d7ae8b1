"""``toolkit plan``'s one config (``PlanConfig``, shared by the CLI and YAML), the shapes of the model it
plans for (built on the meta device) and the ``Plan`` that ``planner.run`` returns; the per-sample tables
of the objective, which every part of the plan counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from toolkit.core.config import option
from toolkit.train.config import GradDtype, Precision
from toolkit.train.losses.config import Mode
from toolkit.train.optim import OptimizerName

GiB = 1024**3


@dataclass(frozen=True)
class PlanConfig:
    """``toolkit plan``'s one config (the arithmetic: ``toolkit.train.plan.memory``'s module docstring)."""

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


def objective(cfg: PlanConfig):
    """(ObjectiveSpec, LossConfig fields) of ``cfg.loss``, looked up in the registry now."""
    from toolkit.train.losses import registry

    return registry.spec_of_name(cfg.loss)


def table_bytes(cfg: PlanConfig) -> float:
    """Host bytes of the objective's per-sample float32 tables (its spec's ``table_columns``)."""
    spec, fields = objective(cfg)
    return 4.0 * cfg.num_samples * spec.table_columns(fields)
