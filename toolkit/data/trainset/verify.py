"""``toolkit data verify DIR``: read every sample of a training-shard folder and list what is damaged.

jpeg and index sets (:mod:`.refs`): each part's table matches dataset.json, and every record's image bytes
exist, match their xxh3-64 and decode, and its token ids lie inside the vocabulary. Pixels sets: checks,
per shard of ``dataset.json``: the tar exists and is long enough; its checksum sidecar matches
dataset.json (:mod:`.integrity`); every sample's first member is named after its id, its xxh3-64 matches
the sidecar, and its token ids lie inside the vocabulary; the tar ends with its end-of-archive marker.
Unlike the loader, which stops at the first damaged sample, verify reads on and lists every one (up to
``max_listed`` per shard; all are counted). Read-only: it writes nothing into the folder.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from toolkit.core import files
from toolkit.core.config import option
from toolkit.core.log import counter, get_logger
from toolkit.data.trainset import integrity
from toolkit.data.trainset.format import BLOCK, TrainDataset, decode_rows, id_key

# Samples per read call: 256 x a 224 px sample (~150 kB) keeps one read under 40 MB.
VERIFY_CHUNK = 256


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
    """Verify ``cfg.input``; FileNotFoundError/ValueError if dataset.json itself is missing or malformed."""
    ds = TrainDataset.open(cfg.input)
    checksums = all(s.sums for s in ds.shards)
    from toolkit.data.trainset.reference import bytes_per_sample

    result = VerifyResult(cfg.input, len(ds.shards), ds.num_samples, checksums, integrity.vocab_size(ds),
                          ds.extra.get("reference"), bytes_per_sample(ds))
    if not checksums:
        get_logger("data").warning("%s: no checksums recorded (precomputed before the toolkit wrote them): "
                                   "checking the layout and token ids only", cfg.input)
    tally: dict[int, list[int]] = {}  # jpeg/index: data file -> [records checked, checksum mismatches]
    with counter(ds.num_samples, desc="verify", unit="samples") as count:
        check = _verify_shard if ds.storage == "pixels" else functools.partial(_verify_part, tally=tally)
        for index, shard in enumerate(ds.shards):
            found = check(ds, index, result.vocab_size, count)
            if found:
                result.damaged_shards.append(shard.name)
                result.num_damaged_samples += sum(1 for _, sample in found if sample)
                result.problems += [msg for msg, _ in found[:cfg.max_listed]]
                if len(found) > cfg.max_listed:
                    result.problems.append(f"{ds.url(shard)}: {len(found) - cfg.max_listed} more damaged "
                                           "samples not listed")
    other = _other_files_line(ds, tally)
    if other:
        result.problems.insert(0, other)
    return result


def _other_files_line(ds: TrainDataset, tally: dict[int, list[int]]) -> str | None:
    """One line when data files match none of the checksums the index recorded for their samples: they are
    other files than were indexed (an index copied beside another raw folder with the same file names
    read as every sample "damaged: checksum does not match", never saying why)."""
    other = sorted(f for f, (checked, wrong) in tally.items() if checked and wrong == checked)
    if not other:
        return None
    from toolkit.data.trainset import refs

    names = ", ".join(ds.data_files[f] for f in other[:3])
    names += f" and {len(other) - 3} more" if len(other) > 3 else ""
    where = refs.resolve_data_root(ds.root, ds.data_root)
    return (f"{where}: {len(other)} of the {len(ds.data_files)} data files ({names}) match none of the "
            "checksums recorded for their samples: they are not the files this set indexed (same names, "
            "other contents; was the set copied beside another raw folder?); point data_root in "
            f"{ds.root}/dataset.json at the indexed files or precompute again")


def _verify_shard(ds: TrainDataset, index: int, vocab: int | None, count) -> list[tuple[str, bool]]:
    """(message, is a sample problem) for every problem of one shard."""
    shard, size = ds.shards[index], ds.sample_bytes
    url = ds.url(shard)
    try:
        sums = integrity.load_sums(ds, index) if shard.sums else None
        fh = files.open_file(url, "rb")
    except (OSError, ValueError) as err:
        count.advance(shard.num_samples)
        return [(f"{url}: {err}" if url not in str(err) else str(err), False)]
    found: list[tuple[str, bool]] = []
    with fh:
        fh.seek(0, 2)
        length = fh.tell()
        readable = min(shard.num_samples, length // size)
        for start in range(0, readable, VERIFY_CHUNK):
            n = min(VERIFY_CHUNK, readable - start)
            fh.seek(start * size)  # not read_rows: it stops at the first misnamed sample, verify lists them all
            rows = np.frombuffer(fh.read(n * size), np.uint8).reshape(n, size)
            found += _check_rows(ds, index, start, rows, sums, vocab)
            count.advance(n)
        if readable < shard.num_samples:
            found.append((f"{url}: ends inside sample {readable} ({length} bytes; dataset.json says "
                          f"{shard.num_samples} samples of {size} bytes)", False))
            count.advance(shard.num_samples - readable)
        else:
            fh.seek(shard.num_samples * size)
            if fh.read(2 * BLOCK) != bytes(2 * BLOCK):
                found.append((f"{url}: no end-of-archive marker after sample {shard.num_samples - 1}: data was "
                              "appended or the tail is damaged", False))
    return found


def _verify_part(ds: TrainDataset, index: int, vocab: int | None, count,
                 tally: dict[int, list[int]] | None = None) -> list[tuple[str, bool]]:
    """(message, is a sample problem) for every problem of one jpeg/index part: its table against
    dataset.json, then every record's image bytes (length, xxh3-64, decodable) and token ids. ``tally``
    counts, per data file, the records checked and those whose checksum did not match."""
    from toolkit.data.trainset import refs

    reader = refs.RefReader(ds, vocab)
    shard, found = ds.shards[index], []
    try:
        table = reader.table(index)
    except (OSError, ValueError) as err:
        count.advance(shard.num_samples)
        return [(str(err), False)]
    try:
        for position, rec in enumerate(table):
            seen = (tally if tally is not None else {}).setdefault(int(rec["file"]), [0, 0])
            seen[0] += 1
            try:
                data = reader.image_bytes(index, position, rec)
                refs.decode_image(data, reader.side, reader.resize_mode)
                integrity.check_tokens(ds, index, position, rec["tokens"][None], vocab)
            except integrity.DataIntegrityError as err:
                seen[1] += refs.CHECKSUM_MISMATCH in str(err)
                found.append((str(err).split("; run `toolkit data verify")[0], True))
            except ValueError as err:  # ImageError: the bytes match the index but no longer decode
                found.append((f"{reader.data_url(int(rec['file']))}: sample {position} of {shard.name} (id "
                              f"{shard.first_id + position}) does not decode: {err}", True))
            count.advance(1)
    finally:
        reader.close()
    return found


def _check_rows(ds: TrainDataset, index: int, start: int, rows, sums, vocab: int | None) -> list[tuple[str, bool]]:
    """Every damaged sample of ``rows`` ([n, sample_bytes], samples start.. of shard ``index``)."""
    shard, name_ext = ds.shards[index], ds.fields[0].ext
    tokens = decode_rows(ds, rows).get("tokens")
    found = []
    for k in range(rows.shape[0]):
        position = start + k
        name = f"{id_key(shard.first_id + position)}.{name_ext}".encode() + b"\0"
        try:
            if bytes(rows[k, :len(name)]) != name:
                raise integrity.damaged(ds, index, position, f"its first member is not named {name[:-1].decode()}")
            integrity.check_sums(ds, index, position, rows[k:k + 1], sums)
            if tokens is not None:
                integrity.check_tokens(ds, index, position, tokens[k:k + 1], vocab)
        except integrity.DataIntegrityError as err:
            found.append((str(err).split("; run `toolkit data verify")[0], True))
    return found
