"""``toolkit data fetch``'s resume bookkeeping: which shards already in ``out`` may be kept.

Rerunning resumes: finished shards are never downloaded again, but only when they came from the same
URL list and settings (:func:`check_resumable`), and only those whose tar, parquet and stats agree
(:func:`verified_shards`).
"""

from __future__ import annotations

from toolkit.core import files
from toolkit.core.config import config_hash, to_dict
from toolkit.core.log import get_logger
from toolkit.core.stage import fingerprint, read_manifest
from toolkit.data.acquire import urllist
from toolkit.data.acquire.fetch_config import KIND, FetchConfig
from toolkit.data.acquire.urlrows import read_rows
from toolkit.data.raw import layout

log = get_logger("data.fetch")


def _changed_fields(previous: dict, cfg: FetchConfig) -> list[str]:
    import dataclasses

    now = to_dict(cfg)
    return [
        f.name
        for f in dataclasses.fields(cfg)
        if f.metadata.get("affects_output", True) and previous.get("config", {}).get(f.name) != now[f.name]
    ]


def check_resumable(cfg: FetchConfig, out: str, fmt: str, caption_col: str | None) -> str:
    """Refuse to mix shards of another config or URL list into ``out`` (unless ``overwrite``); shards without
    a manifest are resumed only if they hold this list's rows (:func:`check_foreign_shards`).

    Returns the URL list's sha256 (reused from the last manifest when the file is untouched): a shard is
    identified by its rows' position in the list, so finished shards are only valid for the same bytes.
    """
    previous = read_manifest(out) or {}
    same_file = ((previous.get("inputs") or {}).get("urls") or {}).get("fingerprint") == fingerprint(cfg.urls)
    recorded = (previous.get("details") or {}).get("urls_sha256")
    digest = recorded if same_file and recorded else urllist.list_digest(cfg.urls)
    if cfg.overwrite:
        layout.check_owned(out, (KIND, "data.shard"))  # --overwrite deletes only shards cliptk wrote
        return digest
    if not layout.shard_files(out):
        return digest
    if not previous:  # before the stage's manifest exists: once written, a rerun would trust these shards
        check_foreign_shards(cfg, fmt, caption_col, out)
        log.warning(
            "%s holds shards but no manifest; they hold the rows of %s, so they are resumed", out, cfg.urls
        )
        return digest
    if previous.get("kind") != KIND:
        raise ValueError(
            f"{out} holds the output of a {previous.get('kind')!r} stage; choose another --out "
            "or pass --overwrite to delete its shards"
        )
    if previous.get("config_hash") != config_hash(cfg, KIND):
        changed = ", ".join(_changed_fields(previous, cfg)) or "config"
        raise ValueError(
            f"{out} holds shards fetched with different settings ({changed} changed); pass "
            "--overwrite to delete them and fetch again, or choose another --out"
        )
    if recorded and recorded != digest:
        raise ValueError(
            f"{cfg.urls} changed since {out} was fetched from it (its rows decide which shard "
            "holds which URL); pass --overwrite to fetch again, or choose another --out"
        )
    return digest


def check_foreign_shards(cfg: FetchConfig, fmt: str, caption_col: str | None, out: str) -> None:
    """Shards in ``out`` that no cliptk stage wrote are resumed only if each finished one holds exactly the
    rows this list and ``samples_per_shard`` put there; otherwise ValueError naming the shard (their URLs
    were counted as fetched and the list's other URLs in those shards silently never requested)."""
    from toolkit.data.raw.verify import check_shard_urls

    urls = (
        read_rows(cfg.urls, fmt, cfg.url_col, caption_col, cfg.keep_duplicates)
        .table.column("url")
        .to_pylist()
    )
    size = cfg.samples_per_shard
    for shard_id in sorted(layout.finished_shards(out)):
        why = check_shard_urls(out, shard_id, urls[shard_id * size : (shard_id + 1) * size])
        if why is not None:
            raise ValueError(
                f"{out}/{layout.shard_stem(shard_id)}.parquet: {why}: {out} holds shards (no manifest) "
                f"that did not come from {cfg.urls} with samples_per_shard {size}; choose another "
                "--out, or move those shards away"
            )


def verified_shards(rec, out: str) -> set[int]:
    """Finished shards whose tar, parquet and stats agree; the others are deleted to be fetched again.

    Each redone shard and why is logged and recorded (``details.shards_redone``,
    ``counts.num_shards_redone``): a shard left half-written by an interrupted run, or damaged by a second run
    or a full disk.
    """
    from toolkit.data.raw.verify import check_shard

    present = layout.shard_files(out)
    redo = {
        i: f"unfinished: only {', '.join(sorted(kinds))} written"
        for i, kinds in present.items()
        if not {".tar", ".parquet", "_stats.json"} <= kinds
    }
    for shard_id in sorted(set(present) - set(redo)):
        why = check_shard(out, shard_id, deep=files.is_local(out))
        if why is not None:
            redo[shard_id] = why
    for shard_id, why in sorted(redo.items()):
        log.warning("fetch: shard %s is fetched again: %s", layout.shard_stem(shard_id), why)
        layout.remove_shard(out, shard_id)
    rec.details["shards_redone"] = {layout.shard_stem(i): why for i, why in sorted(redo.items())}
    rec.counts["num_shards_redone"] = len(redo)
    return set(present) - set(redo)
