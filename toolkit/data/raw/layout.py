"""The raw shard layout shared by ``fetch`` and ``shard`` (img2dataset's webdataset output).

A raw shard folder holds, per shard ``NNNNN`` (:data:`SHARD_DIGITS` digits, img2dataset's
``oom_shard_count``):
- ``NNNNN.tar``: ``<key>.jpg``, ``<key>.txt`` (caption) and ``<key>.json`` (metadata) per good sample;
- ``NNNNN.parquet``: one metadata row per input row, failures included (``status``, ``error_message``);
- ``NNNNN_stats.json``: ``count``, ``successes``, ``failed_to_download``, ``failed_to_resize``,
  ``duration``, ``start_time``, ``end_time`` and ``status_dict`` (message -> count).
A shard is finished when all three exist; img2dataset writes the stats file last.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter

import fsspec

from toolkit.core import files
from toolkit.data.raw.reasons import SUCCESS

SHARD_DIGITS = 5  # img2dataset's oom_shard_count: shard names 00000..99999
# At least SHARD_DIGITS digits: '2023.parquet' or '1.tar' beside the shards are someone else's files.
_SHARD_FILE = re.compile(rf"^(\d{{{SHARD_DIGITS},}})(\.tar|\.parquet|_stats\.json)$")


def shard_stem(shard_id: int) -> str:
    """The name shard ``shard_id``'s files share before their suffix: ``shard_stem(1) == '00001'``."""
    return f"{shard_id:0{SHARD_DIGITS}d}"


def img2dataset_key(index: int, shard_id: int, samples_per_shard: int) -> str:
    """img2dataset's key for sample ``index`` of shard ``shard_id`` (e.g. '000010002')."""
    digits = math.ceil(math.log10(samples_per_shard))
    return f"{(10**digits) * shard_id + index:0{digits + SHARD_DIGITS}d}"


def absolute(path: str) -> str:
    """img2dataset resolves local paths against the cwd: an absolute local path, or the URL without a
    trailing '/' (shard names are appended with '/')."""
    return os.path.abspath(files.local_path(path)) if files.is_local(path) else path.rstrip("/")


def _fs(out: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(out)
    return fs, path.rstrip("/")


def shard_files(out: str) -> dict[int, set[str]]:
    """Shard id -> which of '.tar', '.parquet', '_stats.json' exist in ``out``."""
    fs, path = _fs(out)
    found: dict[int, set[str]] = {}
    if not fs.exists(path):
        return found
    for entry in fs.ls(path, detail=False):
        match = _SHARD_FILE.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if match:
            found.setdefault(int(match.group(1)), set()).add(match.group(2))
    return found


def finished_shards(out: str) -> set[int]:
    """Ids of shards whose tar, parquet and stats file all exist (the stats file is written last)."""
    return {i for i, kinds in shard_files(out).items() if {".tar", ".parquet", "_stats.json"} <= kinds}


def check_owned(out: str, kinds: tuple[str, ...]) -> None:
    """Raise ValueError if ``out`` holds files named like shards that no run of ``kinds`` wrote (its
    manifest says so): deleting or replacing shards must never touch a user's own ``00000.tar``."""
    from toolkit.core.stage import read_manifest

    found = shard_files(out)
    if not found:
        return
    kind = (read_manifest(out) or {}).get("kind")
    if kind in kinds:
        return
    example = f"{shard_stem(min(found))}{sorted(found[min(found)])[0]}"
    who = f"the output of a {kind!r} stage" if kind else "no manifest"
    raise ValueError(
        f"{out} holds {sum(map(len, found.values()))} file(s) named like shards (e.g. {example}) "
        f"and {who}: they were not written by {' or '.join(kinds)}, so they are not replaced; "
        "choose an empty output folder or move them away"
    )


def remove_shards(out: str) -> int:
    """Delete every shard file and img2dataset's ``_tmp/`` in ``out`` (nothing else); returns files
    removed."""
    fs, path = _fs(out)
    removed = 0
    for shard_id, kinds in shard_files(out).items():
        for suffix in kinds:
            fs.rm(f"{path}/{shard_stem(shard_id)}{suffix}")
            removed += 1
    remove_tmp(out)
    return removed


def remove_shard(out: str, shard_id: int) -> int:
    """Delete shard ``shard_id``'s tar, parquet and stats file (those that exist); returns files removed."""
    fs, path = _fs(out)
    kinds = shard_files(out).get(shard_id, set())
    for suffix in kinds:
        fs.rm(f"{path}/{shard_stem(shard_id)}{suffix}")
    return len(kinds)


def remove_tmp(out: str) -> bool:
    """Delete img2dataset's ``_tmp/`` (feather splits of the URL list) in ``out``; True if it existed."""
    fs, path = _fs(out)
    if not fs.exists(f"{path}/_tmp"):
        return False
    fs.rm(f"{path}/_tmp", recursive=True)
    return True


def read_stats(out: str, shard_ids: set[int] | None = None) -> dict[int, dict]:
    """Shard id -> parsed ``NNNNN_stats.json`` for finished shards (or just ``shard_ids``)."""
    fs, path = _fs(out)
    ids = sorted(finished_shards(out) if shard_ids is None else shard_ids)
    stats = {}
    for shard_id in ids:
        name = f"{path}/{shard_stem(shard_id)}_stats.json"
        with fs.open(name, "r") as fh:
            try:
                stats[shard_id] = json.load(fh)
            except ValueError as err:
                raise ValueError(
                    f"{name}: unreadable stats file ({err}); delete it to refetch the shard"
                ) from err
    return stats


def write_stats(
    out: str,
    shard_id: int,
    status: Counter[str],
    start_time: float,
    end_time: float,
    num_download_failed: int = 0,
) -> None:
    """Write ``NNNNN_stats.json`` in img2dataset's format (used by ``shard``, which downloads nothing)."""
    fs, path = _fs(out)
    count = sum(status.values())
    stats = {
        "count": count,
        "successes": status.get(SUCCESS, 0),
        "failed_to_download": num_download_failed,
        "failed_to_resize": count - status.get(SUCCESS, 0) - num_download_failed,
        "duration": end_time - start_time,
        "start_time": start_time,
        "end_time": end_time,
        "status_dict": dict(status),
    }
    with fs.open(f"{path}/{shard_stem(shard_id)}_stats.json", "w") as fh:
        json.dump(stats, fh, indent=4)
