"""Resume of an interrupted ``precompute``: raw shards already processed are reused by a rerun.

Processing a raw shard (decode, resize and tokenize, or a frozen tower's forward pass) is where
precompute spends its time; writing the training shards afterwards is a copy. So every raw shard's rows
go into a work folder that outlives a run killed, interrupted or failed, and each finished raw shard gets
a record ``<stem>.json`` (its skips and counts; keys and captions are in ``<stem>.keys.jsonl``) written after
its row files. A rerun into
the same output reuses each record whose raw shard (the tar and its parquet and stats, by size and
modification time) and processing options (model, image size, resize mode, towers and their weights
files, toolkit version) are unchanged, and processes the others again. Global ids are assigned after all
raw shards are processed, from every shard's keys, so a resumed run writes the same bytes as an
uninterrupted one. The folder is removed once the training shards and ``dataset.json`` are written.

Where it lives: ``OUT/_tmp/resume-precompute`` for a local OUT without ``tmp_dir``; otherwise
``resume-precompute-<hash of OUT>`` under ``tmp_dir`` (or the system temp folder for a remote OUT).
A rerun with a different ``tmp_dir`` starts afresh. The folder is locked
(:mod:`toolkit.core.outlock`) while a run uses it, so two runs never share it.
All functions run in the parent process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections import Counter

from toolkit import __version__
from toolkit.core import files
from toolkit.core.config import config_hash, input_paths
from toolkit.core.stage import fingerprint
from toolkit.data.raw.reader import sidecar
from toolkit.data.trainset.format import Field
from toolkit.data.trainset.precompute.worker import ShardResult, scratch_paths
from toolkit.data.trainset.reference import SCRATCH_EXT

# 2: keys and captions moved from the record into '<stem>.keys.jsonl'; 3: num_captions_cut
RECORD_VERSION = 3


def work_dir(cfg) -> str:
    """The local work folder of a precompute run into ``cfg.out`` (not created)."""
    if not cfg.tmp_dir and files.is_local(cfg.out):
        return os.path.join(files.local_path(cfg.out), "_tmp", "resume-precompute")
    tag = hashlib.sha256(cfg.out.rstrip("/").encode()).hexdigest()[:12]
    return os.path.join(cfg.tmp_dir or tempfile.gettempdir(), f"resume-precompute-{tag}")


def process_key(cfg) -> str:
    """Hash of everything that changes a raw shard's processed rows (not OUT, not the shard size). The
    reference model's content is not in it: each record names it, and :func:`load` refuses a changed one."""
    options = dataclasses.replace(cfg, input="", out="", samples_per_shard=1)
    weights = {k: fingerprint(p) for k, p in input_paths(cfg).items() if k != "input"}
    return config_hash(options, "precompute-rows", __version__, weights)


def stem(work: str, url: str) -> str:
    """Path prefix of one raw shard's files in ``work``: its row files and its record."""
    return os.path.join(work, hashlib.sha256(url.encode()).hexdigest()[:16])


def stem_of(res: ShardResult) -> str:
    """The path prefix of a result's scratch files (its row files are ``<stem>.image``/``.text``)."""
    return res.image_path[: -len(".image")]


def source_fingerprint(url: str) -> list[str]:
    """What identifies a raw shard's content: the tar and the sidecars that name its missing samples."""
    return [fingerprint(url), fingerprint(sidecar(url, ".parquet")), fingerprint(sidecar(url, "_stats.json"))]


def save(work: str, res: ShardResult, key: str, reference: dict | None = None) -> None:
    """Record ``res`` as finished (after its row files are complete): ``<stem>.json``, written atomically.
    ``reference``: the reference model's identity ({'weights_sha256', 'dim'}) its rows were made with."""
    record = {
        "version": RECORD_VERSION,
        "process_key": key,
        "url": res.url,
        "reference": reference,
        "source": source_fingerprint(res.url),
        "num_kept": res.num_kept,
        "num_read": res.num_read,
        "skips": [list(s) for s in res.skips],
        "converted": dict(res.converted),
        "tar_error": res.tar_error,
        "reference_s": res.reference_s,
        "num_captions_cut": res.num_captions_cut,
    }
    files.write_text_atomic(stem(work, res.url) + ".json", json.dumps(record, ensure_ascii=False))


def load(
    work: str,
    urls: list[str],
    key: str,
    fields: list[Field],
    prune: bool = True,
    reference: dict | None = None,
) -> dict[int, ShardResult]:
    """Finished results of this run's raw shards (task index -> result); deletes every other file.

    A record counts when its process key, URL and source fingerprint match and its row and key files have
    exactly ``num_kept`` rows; anything else (a record of other options or of a changed shard, row files a
    killed worker left half written, shards no longer in the input) is removed. ``prune`` False
    deletes nothing: the other ranks of a distributed run, which must not remove a shard in progress.
    A record made with other reference weights or width than ``reference`` under the same options (a model
    folder overwritten in place) is refused: ValueError naming the folder and both references.
    """
    found: dict[int, ShardResult] = {}
    for index, url in enumerate(urls):
        res = _read(stem(work, url), index, url, key, fields, reference)
        if res is not None:
            found[index] = res
    if not prune:
        return found
    kept = {os.path.basename(stem(work, res.url)) for res in found.values()}
    for name in os.listdir(work):
        if name != ".lock" and name.split(".")[0] not in kept:  # <stem>.image/.text/.json (/.jpg, /.ref)
            path = os.path.join(work, name)
            if os.path.isfile(path) and not os.path.islink(path):
                os.unlink(path)
    return found


def _check_reference(base: str, url: str, found: dict | None, reference: dict | None) -> None:
    if found != reference:

        def describe(ref: dict | None) -> str:
            return (
                f"d_ref {ref['dim']}, weights sha256 {ref['weights_sha256'][:12]}" if ref else "no reference"
            )

        raise ValueError(
            f"{os.path.dirname(base)}: {url} was processed by an interrupted run with a reference "
            f"model of {describe(found)}; this run's reference, under the same options, has "
            f"{describe(reference)} (the model folder changed?): the rows cannot be mixed. Restore that "
            "reference to resume, or delete the folder to start afresh"
        )


def _read(
    base: str, index: int, url: str, key: str, fields: list[Field], reference: dict | None
) -> ShardResult | None:
    try:
        with open(base + ".json", encoding="utf-8") as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    if (
        not isinstance(record, dict)
        or record.get("version") != RECORD_VERSION
        or record.get("process_key") != key
        or record.get("url") != url
        or record.get("source") != source_fingerprint(url)
    ):
        return None
    _check_reference(base, url, record.get("reference"), reference)
    res = ShardResult(
        index,
        url,
        int(record["num_kept"]),
        base + ".image",
        base + ".text",
        int(record["num_read"]),
        [tuple(s) for s in record["skips"]],
        Counter(record["converted"]),
        record["tar_error"],
        float(record.get("reference_s", 0)),
        int(record["num_captions_cut"]),
    )
    paths = (res.image_path, res.text_path, base + SCRATCH_EXT)[: len(fields)]
    for path, field in zip(paths, fields, strict=True):
        try:
            if os.path.getsize(path) != res.num_kept * field.nbytes:
                return None
        except OSError:
            return None
    paths = scratch_paths(base)
    for name, width in (("order", 4), ("khash", 8)):
        if not os.path.isfile(paths[name]) or os.path.getsize(paths[name]) != res.num_kept * width:
            return None
    if not os.path.isfile(paths["keys"]):
        return None
    return res


def remove_stale_scratch(cfg, log) -> None:
    """Delete the ``precompute-*`` scratch folders of killed runs (OUT/_tmp's all: we hold OUT's lock)."""
    if cfg.tmp_dir:
        parent: str | None = cfg.tmp_dir
    elif files.is_local(cfg.out):
        parent = os.path.join(files.local_path(cfg.out), "_tmp")
    else:
        parent = tempfile.gettempdir()
    whole = not cfg.tmp_dir and files.is_local(cfg.out)
    for name in files.remove_stale_temp_dirs(parent, "precompute-", whole):
        log.info("precompute: removed %s left by a run that was killed", name)


def remove_empty_dir(path: str) -> None:
    try:
        os.rmdir(path)  # only succeeds when empty: a concurrent run's scratch stays
    except OSError:
        pass
