"""Is a finished raw shard whole? ``fetch`` checks every finished shard before it resumes.

A shard counts as finished when its tar, parquet and stats file exist, but existing is not being whole:
a run killed while writing, two runs writing into one folder, or a disk that filled up leave tars cut
short and sidecars that disagree with them. :func:`check_shard` compares the three:

- the stats file is readable and its ``count`` / ``successes`` match the parquet's rows / success rows;
- the tar ends with its end-of-archive marker and no member runs past the end of the file;
- the tar holds exactly the parquet's success keys, each with an image member.

For remote folders only the stats/parquet agreement and the tar's last bytes (the end-of-archive marker)
are checked: walking a tar's headers on an object store costs one request per member.
"""

from __future__ import annotations

import json
import tarfile
from collections import Counter

import fsspec

from toolkit.data.images import IMAGE_EXTS
from toolkit.data.raw.layout import shard_stem
from toolkit.data.raw.reader import EndAwareTarInfo, end_problem, split_member_name

END_MARKER_BYTES = 1024  # two zero blocks close every tar


def check_shard(out: str, shard_id: int, deep: bool = True) -> str | None:
    """None when shard ``shard_id`` of ``out`` is whole, else why not (one line)."""
    fs, path = fsspec.core.url_to_fs(out)
    stem = f"{path.rstrip('/')}/{shard_stem(shard_id)}"
    try:
        with fs.open(stem + "_stats.json", "r") as fh:
            stats = json.load(fh)
        count, successes = int(stats["count"]), int(stats["successes"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable stats file: {type(err).__name__}: {err}"
    try:
        import pyarrow.parquet as pq

        with fs.open(stem + ".parquet", "rb") as fh:
            table = pq.read_table(fh, columns=["key", "status"]).to_pydict()
    except (OSError, ValueError, KeyError) as err:
        return f"unreadable parquet: {type(err).__name__}: {err}"
    keys = [str(k) for k, s in zip(table["key"], table["status"], strict=True) if s == "success"]
    if len(table["key"]) != count or len(keys) != successes:
        return (
            f"parquet has {len(table['key'])} rows ({len(keys)} successes), stats file says {count} "
            f"({successes} successes)"
        )
    if not deep:
        return _check_tail(fs, stem + ".tar")
    return _check_members(fs, stem + ".tar", keys)


def _check_tail(fs, tar_path: str) -> str | None:
    size = fs.size(tar_path)
    if size < END_MARKER_BYTES:
        return f"tar has {size} bytes: too short to be whole"
    with fs.open(tar_path, "rb") as fh:
        fh.seek(size - END_MARKER_BYTES)
        if fh.read(END_MARKER_BYTES).strip(b"\0"):
            return "tar does not end with its end-of-archive marker (cut short)"
    return None


def _check_members(fs, tar_path: str, keys: list[str]) -> str | None:
    images: dict[str, bool] = {}
    try:
        with (
            fs.open(tar_path, "rb") as fh,
            tarfile.open(fileobj=fh, mode="r:", tarinfo=EndAwareTarInfo) as tar,
        ):
            for info in tar:  # seeks from header to header: the image data is not read
                split = split_member_name(info.name) if info.isreg() else None
                if split is not None:
                    images[split[0]] = images.get(split[0], False) or split[1] in IMAGE_EXTS
                tar.members = []
            problem = end_problem(tar)
    except (tarfile.TarError, OSError, EOFError) as err:
        return f"tar is damaged: {err}"
    if problem is not None:
        return f"tar is damaged: {problem}"
    missing = [k for k in keys if not images.get(k)]
    extra = sorted(set(images) - set(keys))
    if missing or extra:
        what = [
            f"{len(missing)} success(es) without an image member, e.g. {missing[0]}" if missing else "",
            f"{len(extra)} member key(s) the parquet does not list as successes, e.g. {extra[0]}"
            if extra
            else "",
        ]
        return "tar disagrees with the parquet: " + "; ".join(w for w in what if w)
    return None


def check_shard_urls(out: str, shard_id: int, urls: list[str]) -> str | None:
    """None when shard ``shard_id``'s parquet lists exactly ``urls`` (in any order), else why not (one line).

    For shards found without a manifest (img2dataset run by hand, a copied folder): a shard is its rows'
    position in the list, so one from another list or shard size would stand for URLs it never fetched."""
    import pyarrow.parquet as pq

    fs, path = fsspec.core.url_to_fs(out)
    try:
        with fs.open(f"{path.rstrip('/')}/{shard_stem(shard_id)}.parquet", "rb") as fh:
            got = [str(u) for u in pq.read_table(fh, columns=["url"]).column("url").to_pylist()]
    except (OSError, ValueError, KeyError) as err:
        return f"unreadable parquet: {type(err).__name__}: {err}"
    if len(got) != len(urls):
        return f"holds {len(got)} rows where this list and shard size put {len(urls)}"
    # img2dataset writes a shard's rows in the order their downloads finish: compare them as multisets
    extra = Counter(u.strip() for u in got) - Counter(u.strip() for u in urls)
    return (
        None
        if not extra
        else (
            f"holds {next(iter(extra))[:200]!r}, which is not among the {len(urls)} URLs "
            "this list puts in that shard"
        )
    )
