"""Convergence runs that read a reference model's embeddings: ``RefBench`` (the convergence ``Bench`` with the
reference's rows in every batch) and ``RefRunner`` (its worker pool and run cache).

Every batch carries ``ref_image`` / ``ref_text`` [b, d_ref] (float32, the rows of the batch's training pairs),
as the trainer's loader yields them for a training set precomputed with ``--reference-model``. An objective
that ``reads_reference`` gets them as ``reference=``: through the trainer's own step when this checkout's
``StepInputs`` carries a reference (the trainer plumbing), else through ``FeedReference``, which hands the
current batch's rows to the loss (the same call the trainer makes; no other change to the step).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import multiprocessing
from pathlib import Path

from benchmarks.objectives.convergence import runs
from benchmarks.objectives.convergence.runs import Bench, Runner
from benchmarks.objectives.reference.teacher import Reference


def trainer_feeds_reference() -> bool:
    """Whether this checkout's trainer step passes ``reference=`` itself (``StepInputs.reference``)."""
    from toolkit.train.step import StepInputs

    return any(f.name == "reference" for f in dataclasses.fields(StepInputs))


def feed_reference_class():
    """``FeedReference`` (built on first use: torch is imported lazily)."""
    from torch import nn

    class FeedReference(nn.Module):
        """The loss as the trainer step calls it, plus ``reference=`` (the batch's reference rows, set by
        ``RefBench`` before each step) for an objective that ``reads_reference``."""

        reads_reference = False  # the step must not pass it again where it can

        def __init__(self, loss: nn.Module):
            super().__init__()
            self.loss, self.reference = loss, None

        def forward(self, image_features, text_features, logit_scale, index, logit_bias=None):
            return self.loss(
                image_features,
                text_features,
                logit_scale,
                index,
                logit_bias=logit_bias,
                reference=self.reference,
            )

        def global_value(self):
            return self.loss.global_value()

    return FeedReference


class RefBench(Bench):
    """A convergence ``Bench`` whose batches carry ``reference``'s embeddings of their training rows."""

    def __init__(self, args: argparse.Namespace, scratch: bool, reference: Reference):
        import torch

        super().__init__(args, scratch)
        if len(reference.image) != len(self.data.pairs["train"]):
            raise SystemExit(
                f"reference {args.reference_file}: {len(reference.image)} rows, the training set has "
                f"{len(self.data.pairs['train'])} pairs (made for other data: delete it to retrain)"
            )
        self.reference = (torch.from_numpy(reference.image), torch.from_numpy(reference.text))
        self.feed = None

    def batch_extras(self, ids) -> dict:
        extras = {"ref_image": self.reference[0][ids].float(), "ref_text": self.reference[1][ids].float()}
        if self.feed is not None:
            self.feed.reference = (extras["ref_image"], extras["ref_text"])
        return extras

    def parts(self, mode: str, loss_cfg, batch: int, steps: int, seed: int):
        parts = super().parts(mode, loss_cfg, batch, steps, seed)
        self.feed = None
        if getattr(parts.loss_fn, "reads_reference", False) and not trainer_feeds_reference():
            self.feed = feed_reference_class()(parts.loss_fn)
            parts = dataclasses.replace(parts, loss_fn=self.feed)
        return parts


def _init_ref_worker(args: argparse.Namespace, scratch: bool, reference_file: str) -> None:
    runs._BENCH = RefBench(args, scratch, Reference.load(Path(reference_file)))


class RefRunner(Runner):
    """The convergence ``Runner`` on ``RefBench`` workers. A run of an objective that reads the reference
    (``reads``: its kinds) has the reference's signature in its cache key; other runs keep the convergence
    benchmark's keys, so its finished runs in CACHE/runs.jsonl are reused."""

    def __init__(self, args: argparse.Namespace, data, reference: Reference, scratch: bool, reads: set[str]):
        super().__init__(args, data, scratch)
        self.reference, self.reads = reference, reads

    def task(self, cell: dict, method, knobs: dict, seed: int) -> dict:
        task = super().task(cell, method, knobs, seed)
        if method.kind in self.reads:
            task["key"] = hashlib.sha1((task["key"] + self.reference.signature).encode()).hexdigest()[:20]
        return task

    def run_all(self, tasks: list[dict]) -> None:
        if self.args.workers <= 1:
            if not isinstance(runs._BENCH, RefBench) or (
                self.scratch and "scratch" not in runs._BENCH.tensors
            ):
                _init_ref_worker(self.args, self.scratch, self.args.reference_file)
        elif (
            self.pool is None and any(t["key"] not in self.done for t in tasks) and not self.args.cached_only
        ):
            ctx = multiprocessing.get_context("spawn")
            self.pool = ctx.Pool(
                self.args.workers,
                initializer=_init_ref_worker,
                initargs=(self.args, self.scratch, self.args.reference_file),
            )
        super().run_all(tasks)
