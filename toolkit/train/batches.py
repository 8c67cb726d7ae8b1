"""The training data as the loop sees it:
``TrainData(plan, rt, open_data(plan, cfg.loss, rt.world_size), micro)`` (``plan``: ``cfg.data_plan()``, the
keys this part reads).

Owns the opened dataset (``toolkit data precompute`` output), the number of steps (per epoch and in
all), this rank's batches from any step on (``batches``), and their move to the device
(``to_device``; kept on the host when the gradient cache offloads them), the random crop's resize there
when it runs on the device (``augment.crop_on``), and a reference model's embeddings of the batch
(``reference_to_device``) for the objectives that read them (``check_reference`` refuses a training set
without them). Every rank builds one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from toolkit.data.augment import pixel_transform, resize_crops
from toolkit.data.trainset import storage
from toolkit.data.trainset.format import REF_ROLES, TrainDataset
from toolkit.data.trainset.integrity import check_claims
from toolkit.data.trainset.loader import make_loader
from toolkit.data.trainset.order import BatchOrder
from toolkit.train.config import DataPlan
from toolkit.train.losses import LossConfig, objective_class
from toolkit.train.runtime import Runtime


def has_reference(dataset: TrainDataset) -> bool:
    """Whether the training set holds a reference model's image and text embeddings per sample."""
    return all(dataset.field(role) is not None for role in REF_ROLES)


def check_reference(dataset: TrainDataset, loss: LossConfig) -> None:
    """Refuse, naming the training set, an objective that reads reference embeddings (``reads_reference``)
    on a set precomputed without them (``open_data``: before the model or the objective is built)."""
    if objective_class(loss.kind).reads_reference and not has_reference(dataset):
        raise ValueError(
            f"{dataset.root or 'the training set'}: the {loss.name} objective needs a reference "
            f"model's embeddings per sample (fields {', '.join(REF_ROLES)}), and this training "
            "set has none; precompute it with `toolkit data precompute --reference-model MODEL`"
        )


def steps_per_epoch(cfg: DataPlan, num_samples: int) -> int:
    """Global batches per (virtual) epoch: train_num_samples (or the dataset) // batch_size, at least 1."""
    return max(1, (cfg.train_num_samples or num_samples) // cfg.batch_size)


class StepCounts(NamedTuple):
    """The run's length in global batches."""

    per_epoch: int  # steps_per_epoch
    total: int  # cfg.steps, or epochs × per_epoch


def open_data(cfg: DataPlan, loss: LossConfig, world_size: int | None) -> TrainDataset:
    """The training set, refusing a global batch larger than the data or not divisible by ``world_size`` ranks
    (None: not known yet, an elastic job's launcher), and a set without the reference embeddings the objective
    reads (``check_reference``), before anything else is built. Called by the launching process's preflight
    and by every rank that did not get the preflight's set (an elastic job learns its world size only at
    rendezvous; the ranks of the user's own torchrun or srun had no preflight)."""
    dataset = TrainDataset.open(cfg.data)
    check_claims(
        dataset, storage.of(dataset).sample_bytes(dataset)
    )  # before per-sample tables are sized by what dataset.json claims
    order = BatchOrder(
        dataset.num_samples, cfg.batch_size, cfg.seed, cfg.loader.shuffle_block
    )  # batch <= data
    if world_size is not None:
        order.batch_ids(0, 0, world_size)  # a global batch the ranks divide
    check_reference(dataset, loss)
    return dataset


def step_counts(cfg: DataPlan, num_samples: int) -> StepCounts:
    per_epoch = steps_per_epoch(cfg, num_samples)
    return StepCounts(per_epoch, cfg.steps or cfg.epochs * per_epoch)


def crop_on_device(crop_on: str, device: torch.device, offloaded: bool) -> bool:
    """Whether the random crop's resize runs on the training device (``augment.crop_on``): 'auto' on CUDA,
    where one batched resize costs next to nothing and the loader's CPU then only reads, while on the CPU the
    loader workers' per-sample uint8 resize is the cheaper one and runs in parallel with the step. An
    offloaded batch (micro-batches moved one by one) is cropped by the loader whatever the setting."""
    if offloaded:
        return False
    return crop_on == "device" or (crop_on == "auto" and device.type == "cuda")


class TrainData:
    """This rank's view of the training set (module docstring), from ``open_data``. ``micro_batch_size``:
    the gradient cache's (0: the whole local batch); smaller than the local batch, the batch stays on the
    host and the cache moves each micro-batch itself (``offloaded``)."""

    def __init__(self, cfg: DataPlan, rt: Runtime, dataset: TrainDataset, micro_batch_size: int = 0):
        self.cfg, self.rank, self.world_size, self.device = cfg, rt.rank, rt.world_size, rt.device
        self.dataset = dataset
        self.num_samples = self.dataset.num_samples
        self.steps = step_counts(cfg, self.num_samples)
        self.steps_per_epoch, self.total_steps = self.steps
        self.local_batch_size = cfg.batch_size // rt.world_size
        self.offloaded = 0 < micro_batch_size < self.local_batch_size
        image = self.dataset.field("image")  # random crops (or the crop margin's resize): loader or device
        self.crop_on_device = crop_on_device(cfg.augment.crop_on, self.device, self.offloaded)
        self.image_transform = pixel_transform(
            cfg.augment,
            image and image.shape,
            self.dataset.extra.get("image_size") or (image and image.shape[0]),
            cfg.seed,
            on_device=self.crop_on_device,
        )

    def batches(self, start_step: int) -> Iterator[dict]:
        """This rank's slices of global batches start_step .. total_steps-1 (each dict has its ``step``)."""
        if start_step >= self.total_steps:
            return iter(())
        lc = self.cfg.loader
        return iter(
            make_loader(
                self.dataset,
                batch_size=self.cfg.batch_size,
                rank=self.rank,
                world_size=self.world_size,
                seed=self.cfg.seed,
                block=lc.shuffle_block,
                start_step=start_step,
                num_steps=self.total_steps - start_step,
                num_workers=lc.num_workers,
                prefetch_factor=lc.prefetch_batches,
                pin_memory=self.device.type == "cuda",
                image_transform=self.image_transform,
            )
        )

    def to_device(
        self, batch: dict, trim_tokens: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(image, text, index) of one batch: index on the device; image and text too unless offloaded
        (the gradient cache then moves each micro-batch itself, non-blocking from pinned memory on CUDA).
        ``trim_tokens``: cuts host token ids [b, L] to the columns the model reads
        (``TrainModel.trim_tokens``), before they move."""
        image = batch["image"] if "image" in batch else batch["image_features"]
        text = trim_tokens(batch["tokens"]) if "tokens" in batch else batch["text_features"]
        if not self.offloaded:
            image, text = image.to(self.device, non_blocking=True), text.to(self.device, non_blocking=True)
        if (
            "crop_box" in batch
        ):  # DeviceCrop: the stored pixels arrive; one batched resize here (never offloaded)
            image = resize_crops(image, batch["crop_box"], self.image_transform.size)
        return image, text, batch["index"].to(self.device, non_blocking=True)

    def reference_to_device(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(ref_image, ref_text) [b, d_ref] of one batch as float32 on the device (float16 on disk), same rows
        as ``to_device``'s; always moved, offloaded or not: the loss reads them for the whole local batch.
        A set without them was refused before step 1 (:func:`check_reference`). Moved as float16, then
        widened on the device: a copy that also converts would convert into an unpinned host buffer first."""
        ref_image, ref_text = (batch[k].to(self.device, non_blocking=True).float() for k in REF_ROLES)
        return ref_image, ref_text
