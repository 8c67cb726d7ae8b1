"""``TrainConfig``: the ``train`` stage's one config, composed of small parts each owned by its module.

Precedence when the CLI or a pipeline builds it: defaults < ``preset`` < YAML file < ``--set`` <
explicit options. ``batch_size`` is the *global* batch (all ranks together), as in the FastCLIP paper.
Torch-free: the CLI validates a config (and refuses a bad one) before any process starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from toolkit.core.config import ConfigError, option
from toolkit.core.launch import LaunchConfig
from toolkit.data.augment import AugmentConfig
from toolkit.train.losses.config import LossConfig
from toolkit.train.optim import OptimConfig

Precision = Literal["fp32", "bf16", "fp16"]
GradDtype = Literal["fp32", "bf16"]
REPORT_SINKS = ("jsonl", "tensorboard", "wandb")


@dataclass(frozen=True)
class LoaderConfig:
    """Reading the training shards (the order of global batches never depends on these)."""

    num_workers: int = option(
        2,
        ge=0,
        affects_output=False,
        doc="DataLoader worker processes per rank (0: read in the training process).",
    )
    shuffle_block: int = option(
        1,
        ge=1,
        doc="Samples per shuffled block: 1 shuffles samples; larger blocks "
        "read runs of consecutive samples (fewer, larger reads for object "
        "stores), shuffled as blocks.",
    )
    prefetch_batches: int = option(2, ge=1, affects_output=False, doc="Batches each worker reads ahead.")


@dataclass(frozen=True)
class CheckpointConfig:
    """Trainer checkpoints under OUT/checkpoints/step-NNNNNNNN/ (open_clip weights + trainer state)."""

    every_steps: int = option(
        0, ge=0, affects_output=False, doc="Checkpoint every this many steps (0: only at the end)."
    )
    dir: str = option(
        "",
        affects_output=False,
        doc="Where checkpoints go: a local folder or an fsspec URL "
        "(s3://..., gs://...); empty: OUT/checkpoints.",
    )
    keep: int = option(3, ge=1, affects_output=False, doc="Keep the newest this many checkpoints.")
    resume: str = option(
        "auto",
        affects_output=False,
        doc="auto: continue from the newest valid checkpoint in OUT if there is one; latest: "
        "the same but fail if there is none; none: start afresh (old checkpoints are "
        "removed); or a checkpoint directory.",
    )
    allow_other_data: bool = option(
        False,
        affects_output=False,
        doc="Resume a checkpoint even though it was trained on other data (its "
        "dataset.json differs: re-precomputed, or another folder); by default "
        "such a resume is refused, naming both.",
    )


@dataclass(frozen=True)
class EvalConfig:
    """Zero-shot evaluation during training, run on rank 0 by a callback the CLI or pipeline passes in."""

    every_steps: int = option(
        0, ge=0, affects_output=False, doc="Evaluate every this many steps and at the end (0: never)."
    )
    root: str = option(
        "", affects_output=False, doc="Folder holding the evaluation sets (clip-benchmark wds layout)."
    )
    datasets: list[str] = option(factory=list, affects_output=False, doc="Evaluation set names under root.")
    batch_size: int = option(64, ge=1, affects_output=False, doc="Images per evaluation batch.")
    feature_cache: str = option(
        "auto",
        affects_output=False,
        doc="Frozen-tower (LiT) models: folder caching the "
        "trunks' features of the sets, so every evaluation after the first runs only "
        "the heads; 'auto': $XDG_CACHE_HOME/cliptk/tower-features; 'off': none.",
    )


@dataclass(frozen=True)
class TrainConfig:
    """The ``train`` stage (docs/training.md)."""

    data: str = option(
        is_input=True, doc="Training shards: a `toolkit data precompute` output folder (local or fsspec URL)."
    )
    # not hashed: a checkpoint moved to another run directory resumes there
    out: str = option(
        affects_output=False,
        doc="Run directory: config, manifest, metrics, checkpoints/, model/, plots/, tensorboard/.",
    )
    model: str = option(
        "cliptk-tiny",
        doc="open_clip model name (RN50, ViT-B-32, cliptk-tiny, ...), config JSON "
        "or checkpoint directory (architecture; weights come from init).",
    )
    init: str = option(
        "",
        is_input=True,
        doc="Initial weights: an open_clip local-dir checkpoint or a "
        ".safetensors/.pt file (local only); empty: random init "
        "(the weights of a checkpoint directory given as model).",
    )
    preset: str = option(
        "",
        doc="Start from this published setting (`toolkit train presets`); every other "
        "key given overrides it.",
    )
    batch_size: int = option(
        64, ge=2, doc="Global batch: pairs per step over all ranks; must divide by the number of ranks."
    )
    epochs: int = option(1, ge=1, doc="Training epochs (ignored when steps is set).")
    steps: int = option(
        0,
        ge=0,
        doc="Total optimiser steps (global batches) when > 0; 0 (default): epochs x "
        "steps per epoch, which is train_num_samples (or the dataset's size) // "
        "batch_size.",
    )
    train_num_samples: int = option(
        0, ge=0, doc="Samples per (virtual) epoch; 0: the dataset's size. Epochs drive the γ and τ schedules."
    )
    seed: int = option(0, doc="Seed of the init, the data order and every rank's random streams.")
    precision: Precision = option(
        "fp32", doc="fp32; bf16 autocast (CPU and CUDA); fp16 autocast with a GradScaler (CUDA)."
    )
    device: str = option("auto", affects_output=False, doc="auto (cuda if available), cpu or cuda.")
    micro_batch_size: int | Literal["auto"] = option(
        0,
        ge=0,
        doc="Gradient cache: micro-batch per rank for the tower passes; 0: the whole local batch in one "
        "pass; auto: the largest that fits memory_budget_gb, chosen at start-up and logged.",
    )
    memory_budget_gb: float = option(
        0.0,
        ge=0,
        affects_output=False,
        doc="Memory per rank micro_batch_size auto may use, GiB; 0: CPU 90% of "
        "(available + this process's) host memory over the node's ranks, "
        "CUDA the device's memory.",
    )
    release_freed_memory: bool = option(
        False,
        affects_output=False,
        doc="CPU under glibc: fix malloc's mmap threshold at 64 KiB at start-up so "
        "freed activation memory leaves the resident set: less peak memory, "
        "slower steps (docs/training.md; ignored when MALLOC_MMAP_THRESHOLD_ "
        "is set).",
    )
    grad_dtype: GradDtype = option("fp32", doc="dtype of DDP's gradient all_reduce (bf16 halves the bytes).")
    max_nonfinite_steps: int = option(
        5,
        ge=1,
        affects_output=False,
        doc="Abort after this many steps in a row with a non-finite loss or gradient.",
    )
    watchdog_s: float = option(
        600.0,
        ge=0,
        affects_output=False,
        doc="Multi-process runs: stop the job, naming the rank, when no rank has finished "
        "a step for this many seconds (a stopped or hung rank would otherwise leave "
        "the others waiting for the 30-minute collective timeout); keep it above the "
        "longest evaluation or checkpoint write; 0: off.",
    )
    log_every: int = option(10, ge=1, affects_output=False, doc="Write metrics every this many steps.")
    tensorboard: bool = option(
        True, affects_output=False, doc="Write TensorBoard event files to OUT/tensorboard."
    )
    report_to: list[str] = option(
        factory=lambda: ["jsonl", "tensorboard"],
        affects_output=False,
        doc="Metric sinks, any of jsonl (OUT/metrics.jsonl), tensorboard (OUT/tensorboard;"
        " off when tensorboard is false) and wandb (optional extra; offline into "
        "OUT/wandb when no credentials are set).",
    )
    grad_checkpointing: bool = option(
        False,
        affects_output=False,
        doc="Recompute the towers' transformer blocks in the backward (open_clip's "
        "set_grad_checkpointing): less activation memory, one more forward.",
    )
    patch_dropout: float = option(
        0.0,
        absent_means=0.0,
        ge=0,
        doc="Patch dropout (FLIP): the fraction of each image's patch tokens dropped in "
        "training, in [0, 1) (the class token stays; none at evaluation); "
        "open_clip ViTs only. Masks follow from the step and the sample id.",
    )
    stages: str = option(
        "",
        absent_means="",
        doc="Resolution and text-length stages (CLIPA): 'SETTINGS:FRACTION;...', SETTINGS "
        "a comma list of <N>px and <K>tok (left out: the model's own), FRACTION the share "
        "of the steps; e.g. '112px,16tok:0.9;:0.1' (empty: no stages; docs/training.md).",
    )
    stage_lr: Literal["run", "stage"] = option(
        "run",
        absent_means="run",
        doc="With stages: one lr schedule over the whole run (run), or warmup and "
        "cosine restarted over each stage's steps (stage).",
    )
    stage_text: Literal["first", "random"] = option(
        "first",
        absent_means="first",
        doc="How a text stage shortens captions: the first K-1 tokens and the "
        "end-of-text token (CLIPA's truncation), or a random ordered subset "
        "between the start and end tokens (drawn per step and sample).",
    )
    compile: bool = option(
        False,
        affects_output=False,
        doc="torch.compile the towers (inductor; the first steps pay the compile time).",
    )
    fsdp: bool = option(
        False,
        affects_output=False,
        doc="Shard parameters, gradients and optimiser states over the ranks (FSDP2, per "
        "transformer block) instead of replicating them (DDP); checkpoints become sharded "
        "(docs/distributed.md).",
    )
    fsdp_cpu_offload: bool = option(
        False,
        affects_output=False,
        doc="With fsdp: keep the shards and the optimiser step in host memory "
        "(FSDP2's CPUOffloadPolicy): least device memory, slower steps.",
    )
    fsdp_reshard_after_forward: bool = option(
        True,
        affects_output=False,
        doc="With fsdp: free each block's gathered weights after its forward and gather them again "
        "for its backward (least memory); false keeps them whole until the backward (ZeRO-2: "
        "gradients and optimiser state still sharded; fewer all-gathers, more memory).",
    )
    lock_image: bool = option(
        False,
        absent_means=False,
        doc="Freeze the image tower (LiT) except its last lock_image_unlocked_groups "
        "layer groups (open_clip's lock_image_tower).",
    )
    lock_image_unlocked_groups: int = option(
        0,
        absent_means=0,
        ge=0,
        doc="Layer groups of a locked image tower left trainable, counted from the output.",
    )
    lock_text: bool = option(
        False,
        absent_means=False,
        doc="Freeze the text tower except its last lock_text_unlocked_layers layers "
        "(open_clip's lock_text_tower).",
    )
    lock_text_unlocked_layers: int = option(
        0, absent_means=0, ge=0, doc="Layers of a locked text tower left trainable, counted from the output."
    )
    ema_decay: float = option(
        0.0,
        absent_means=0.0,
        ge=0,
        le=1,
        doc="Keep an exponential moving average of the weights with this "
        "decay (0: none): checkpointed, evaluated beside the raw weights "
        "and saved as OUT/model-ema.",
    )
    audit_samples: bool = option(
        False,
        affects_output=False,
        doc="Record every step's sample ids per rank in "
        "OUT/samples/ (to check that no sample is seen "
        "twice or skipped across interruptions).",
    )
    nonfinite_test_steps: list[int] = option(
        factory=list,
        doc="Testing aid: poison the loss with NaN at these steps to exercise the non-finite handling.",
    )
    loss: LossConfig = option(factory=LossConfig, doc="The objective.")
    optim: OptimConfig = option(factory=OptimConfig, doc="Optimiser, lr schedule, gradient clipping.")
    loader: LoaderConfig = option(factory=LoaderConfig, doc="Reading the training shards.")
    augment: AugmentConfig = option(
        factory=AugmentConfig,
        doc="Random crops of pixel inputs (open_clip's train transform); none for frozen-tower features.",
    )
    launch: LaunchConfig = option(factory=LaunchConfig, doc="Processes and nodes.")
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig, doc="Checkpoints and resume.")
    eval: EvalConfig = option(factory=EvalConfig, doc="Zero-shot evaluation during training.")

    @staticmethod
    def layered_defaults(data: Mapping[str, Any], source: str) -> dict[str, Any]:
        """Defaults the rest of the config overrides (core.config.build): the named ``preset``'s settings;
        without a loss kind from the data or the preset, the default objective (``losses/choice.py``) with
        its γ decay over the planned epochs (a run planned by steps has no epoch count yet: the option's)."""
        from toolkit.train.losses.choice import layer_default_loss

        layers: dict[str, Any] = {}
        name = data.get("preset") or ""
        if name:
            from toolkit.train.presets import presets

            known = presets()
            if name not in known:
                raise ConfigError(
                    source, "preset", f"unknown preset {name!r}; known presets: {', '.join(known)}"
                )
            layers = known[name].train_overrides()

        def planned(key: str) -> Any:  # the data's value, else the preset's, else the field's default
            return data.get(key, layers.get(key, TrainConfig.__dataclass_fields__[key].default))

        epochs = None if planned("steps") else planned("epochs")  # None: a run planned by steps
        layer_default_loss(data, layers, epochs, source)
        return layers

    def data_plan(self) -> DataPlan:
        """The keys the data part reads (``batches.TrainData``, ``open_data``, ``step_counts``)."""
        return DataPlan(
            self.data,
            self.batch_size,
            self.seed,
            self.steps,
            self.epochs,
            self.train_num_samples,
            self.loader,
            self.augment,
        )

    def report_plan(self) -> ReportPlan:
        """The keys the reporting part reads (``report.Reporter``)."""
        return ReportPlan(
            self.out,
            self.batch_size,
            self.log_every,
            self.tensorboard,
            tuple(self.report_to),
            self.audit_samples,
        )

    def __post_init__(self) -> None:
        self.launch.node_range()  # refuses a malformed nodes value
        if self.eval.every_steps and not (self.eval.root and self.eval.datasets):
            raise ValueError("eval.every_steps is set: give eval.root and eval.datasets too")
        if self.stages:
            from toolkit.train.stages import parse

            parse(self.stages)  # a malformed plan is refused before any process starts
        if self.patch_dropout >= 1:
            raise ValueError(f"patch_dropout must be below 1 (0: none), got {self.patch_dropout}")
        if self.ema_decay >= 1:
            raise ValueError(f"ema_decay must be below 1 (0: no EMA), got {self.ema_decay}")
        unknown = sorted(set(self.report_to) - set(REPORT_SINKS))
        if unknown:
            raise ValueError(
                f"report_to: unknown sink(s) {', '.join(unknown)}; choose from {', '.join(REPORT_SINKS)}"
            )
        for count, key, needs in (
            (self.lock_image_unlocked_groups, "lock_image_unlocked_groups", "lock_image"),
            (self.lock_text_unlocked_layers, "lock_text_unlocked_layers", "lock_text"),
        ):
            if count and not getattr(self, needs):  # it only says what a lock leaves trainable
                raise ValueError(
                    f"{key} {count} does nothing without {needs}: set {needs} true "
                    f"(--{needs.replace('_', '-')}) or drop {key}"
                )
        if self.precision == "fp16" and self.device == "cpu":
            raise ValueError("fp16 needs CUDA (a GradScaler); use bf16 on the CPU")
        from toolkit.train.fsdp_rules import refusal

        if (why := refusal(self)) is not None:
            raise ValueError(why)


@dataclass(frozen=True)
class DataPlan:
    """What the data part reads of a ``TrainConfig`` (``TrainConfig.data_plan()``): the config keeps these
    keys at its top level (the CLI's and YAML's layout); the part takes only them."""

    data: str
    batch_size: int  # global
    seed: int
    steps: int
    epochs: int
    train_num_samples: int
    loader: LoaderConfig
    augment: AugmentConfig


@dataclass(frozen=True)
class ReportPlan:
    """What the reporting part reads of a ``TrainConfig`` (``TrainConfig.report_plan()``)."""

    out: str
    batch_size: int  # global: samples per step in the throughput figures
    log_every: int
    tensorboard: bool
    report_to: tuple[str, ...]
    audit_samples: bool
