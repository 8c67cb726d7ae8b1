"""``TrainState``: the run's position (steps, samples, skipped steps), which the loop advances, the reporter
logs and every checkpoint carries; a module of its own so that neither part imports the other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """What a checkpoint carries besides weights, optimiser and loss state."""

    step: int = 0  # global batches consumed (= the next batch's index t)
    samples_seen: int = 0
    skipped_steps: int = 0
    nonfinite_in_row: int = 0
