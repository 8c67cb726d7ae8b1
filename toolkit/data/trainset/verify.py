"""``toolkit data verify DIR``: read every sample of a training-shard folder and list what is damaged.

Each storage mode checks its own parts (``StorageMode.verify_part``, :mod:`.storage`). jpeg and index sets
(:mod:`.storage.tablemode`): each part's table matches dataset.json, and every record's image bytes
exist, match their xxh3-64 and decode, and its token ids lie inside the vocabulary. Pixels sets: checks,
per shard of ``dataset.json``: the tar exists and is long enough; its checksum sidecar matches
dataset.json (:mod:`.integrity`); every sample's first member is named after its id, its xxh3-64 matches
the sidecar, and its token ids lie inside the vocabulary; the tar ends with its end-of-archive marker
(:mod:`.storage.pixels`).
Unlike the loader, which stops at the first damaged sample, verify reads on and lists every one (up to
``max_listed`` per shard; all are counted). Read-only: it writes nothing into the folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.core import files
from toolkit.core.config import option
from toolkit.core.log import counter, get_logger
from toolkit.data.trainset import integrity, storage
from toolkit.data.trainset.format import TrainDataset


@dataclass(frozen=True)
class VerifyConfig:
    input: str = option(is_input=True, doc="Training-shard folder (precompute output), local or fsspec URL.")
    max_listed: int = option(20, ge=1, doc="Damaged samples listed per shard (every one is counted).")


@dataclass
class VerifyResult:
    """What verify found: ``problems`` are one-line messages naming the shard (and sample)."""

    root: str
    num_shards: int
    num_samples: int
    checksums: bool
    vocab_size: int | None
    reference: dict | None = None  # dataset.json's extra.reference (precompute --reference-model), if any
    reference_bytes: int = 0  # bytes per sample its embeddings take (reference.bytes_per_sample)
    num_damaged_samples: int = 0
    damaged_shards: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def run(cfg: VerifyConfig) -> VerifyResult:
    """Verify ``cfg.input``; FileNotFoundError/ValueError if dataset.json itself is missing or malformed, or
    says the set holds no sample (there is nothing intact to report, nor to train on)."""
    ds = TrainDataset.open(cfg.input)
    if ds.num_samples == 0:
        raise ValueError(
            f"{files.join(cfg.input, 'dataset.json')}: num_samples is 0: the set holds no sample to "
            "verify or train on; precompute it again from raw shards that hold samples"
        )
    mode = storage.of(ds)
    checksums = all(s.sums for s in ds.shards)
    from toolkit.data.trainset.reference import bytes_per_sample

    result = VerifyResult(
        cfg.input,
        len(ds.shards),
        ds.num_samples,
        checksums,
        integrity.vocab_size(ds),
        ds.extra.get("reference"),
        bytes_per_sample(ds),
    )
    if not checksums:
        get_logger("data").warning(
            "%s: no checksums recorded (precomputed before the toolkit wrote them): "
            "checking the layout and token ids only",
            cfg.input,
        )
    notes: dict = {}  # what the mode gathers across parts for its set-wide lines (verify_lines)
    with counter(ds.num_samples, desc="verify", unit="samples") as count:
        for index, shard in enumerate(ds.shards):
            found = mode.verify_part(ds, index, result.vocab_size, count, notes)
            if found:
                result.damaged_shards.append(shard.name)
                result.num_damaged_samples += sum(1 for _, sample in found if sample)
                result.problems += [msg for msg, _ in found[: cfg.max_listed]]
                if len(found) > cfg.max_listed:
                    result.problems.append(
                        f"{ds.url(shard)}: {len(found) - cfg.max_listed} more damaged samples not listed"
                    )
    result.problems[:0] = mode.verify_lines(ds, notes)
    return result
