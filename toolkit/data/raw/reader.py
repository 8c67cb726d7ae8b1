"""Reading raw shards (img2dataset's webdataset layout) robustly, from local paths or fsspec URLs.

A raw shard is ``NNNNN.tar`` holding ``<key>.jpg|png|webp|...``, ``<key>.txt`` and ``<key>.json``
members, with ``NNNNN_stats.json`` and ``NNNNN.parquet`` beside it (both optional here). Members are
grouped into samples by key the way webdataset does (key = path up to the first dot of the file name).

Damaged tars are read as far as they go: :class:`RawShardReader` yields every sample before the
damage and then records what was lost (``truncated_tar``: the sample cut in half, plus the keys the
shard's parquet or stats file says should have followed) or that nothing was readable
(``unreadable_tar``). A tar counts as whole only when it ends with its end-of-archive marker: tarfile
itself takes a tar cut at a member boundary or inside a header for a complete one.
"""

from __future__ import annotations

import posixpath
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field

import fsspec

from toolkit.core import files
from toolkit.core.log import get_logger
from toolkit.data.images import IMAGE_EXTS

log = get_logger("data.raw")

# Shard-like files list_shards does not read (it names them in a warning instead of skipping them silently).
COMPRESSED_TAR_EXTS = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")
# webdataset's grouping: a member's key is its path up to the first dot of the file name, the rest its
# extension.
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")


def split_member_name(name: str) -> tuple[str, str] | None:
    """(key, lower-case extension) of a tar member name the way webdataset groups members into samples
    (``'a/b.c.jpg'`` -> ``('a/b', 'c.jpg')``); None without an extension. Eval sets are read the same way."""
    match = _KEY_EXT.match(name)
    return (match.group(1), match.group(2).lower()) if match else None


@dataclass
class RawSample:
    """One sample of a raw shard: its key and member bytes by lower-case extension."""

    key: str
    files: dict[str, bytes] = field(default_factory=dict)
    # (byte offset of the member's data in the tar, its length) by extension: what an index points at
    offsets: dict[str, tuple[int, int]] = field(default_factory=dict)

    def image(self) -> tuple[str, bytes] | None:
        """(extension, bytes) of the first image member, or None."""
        for ext in IMAGE_EXTS:
            if ext in self.files:
                return ext, self.files[ext]
        return None


def list_shards(source: str) -> list[str]:
    """Raw shard URLs of ``source`` in sorted order: a folder of ``*.tar``, one ``.tar``, a glob or a
    brace pattern (``dir/{00000..00009}.tar``), local or any fsspec URL. Raises FileNotFoundError.
    Compressed tars in a folder (``.tar.gz``, ...) and a glob's matches that are not tars (``raw/*`` also
    matches img2dataset's ``_stats.json`` and ``.parquet``) are not read; a warning names them."""
    if "{" in source:
        import braceexpand

        urls = sorted(braceexpand.braceexpand(source))
        missing = [u for u in urls if not files.exists(u)]
        if missing:
            raise FileNotFoundError(f"{source}: {len(missing)} shard(s) do not exist, e.g. {missing[0]}")
        return urls
    fs, path = fsspec.core.url_to_fs(source)
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    prefix = "" if files.is_local(source) else f"{protocol}://"
    compressed: list[str] = []
    folders: list[str] = []  # a folder's sub-folders are not searched: a glob names their shards
    others: list[str] = []  # a glob's matches that are not tars: img2dataset's sidecars, mostly
    if any(ch in path for ch in "*?["):
        matches = fs.glob(path, detail=True)  # {name: info}: no isdir call per match (a request on http)
        tar_exts = (
            ".tar",
            *COMPRESSED_TAR_EXTS,
        )  # a pattern naming compressed tars reads them (tarfile decompresses)
        found = [p for p in matches if p.endswith(tar_exts)]
        others = sorted(
            p.rsplit("/", 1)[-1]
            for p, info in matches.items()
            if not p.endswith(tar_exts) and info.get("type") != "directory"
        )
    elif fs.isdir(path):
        entries = fs.ls(path, detail=True)
        names = [e["name"] for e in entries]
        found = [p for p in names if p.endswith(".tar")]
        compressed = sorted(p.rsplit("/", 1)[-1] for p in names if p.endswith(COMPRESSED_TAR_EXTS))
        folders = sorted(
            e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"
        )
    elif fs.exists(path):
        found = [path]
    else:
        raise FileNotFoundError(f"{source}: no such file or folder")
    notes = []
    if compressed:
        notes.append(
            f"{len(compressed)} compressed tar(s) ignored ({_some(compressed)}): only plain .tar shards "
            "are read; decompress them"
        )
    if others:  # `raw/*` also matches 00000_stats.json and 00000.parquet, which are no shards
        notes.append(f"{len(others)} matched file(s) that are not .tar ignored ({_some(others)})")
    note = "; ".join(notes)
    urls = sorted(prefix + p if prefix and "://" not in p else p for p in found)
    if not urls:
        if folders:  # dataset/part-0/00000.tar, dataset/part-1/...: one level down
            note = "; ".join(
                [
                    *notes,
                    f"its sub-folders ({_some(folders)}) are not searched: give a glob such as "
                    f"{source.rstrip('/')}/*/*.tar",
                ]
            )
        raise FileNotFoundError(f"{source}: no .tar shards found" + (f"; {note}" if note else ""))
    if note:
        log.warning("%s: %s", source, note)
    return urls


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def shard_basename(url: str) -> str:
    """File name of a shard URL, ``'d/00001.tar'`` -> ``'00001.tar'`` (used in manifests and skip lists)."""
    return url.rstrip("/").rsplit("/", 1)[-1]


def shard_names(urls: list[str]) -> dict[str, str]:
    """URL -> the name skip lists, manifests and meta lines give that shard: its file name, or, when two
    shards share one (``raw/a/00000.tar``, ``raw/b/00000.tar``), its path below the shards' common folder."""
    names = {url: shard_basename(url) for url in urls}
    if len(set(names.values())) == len(names):
        return names
    return dict(zip(urls, split_common_dir(urls)[1], strict=True))


def split_common_dir(urls: list[str]) -> tuple[str, list[str]]:
    """(the folder, local path or URL, that holds every one of ``urls``; each url's name relative to it)."""
    scheme, sep, _ = urls[0].rpartition("://")
    paths = [u.rpartition("://")[2] if sep else u for u in urls]
    common = posixpath.commonpath([posixpath.dirname(p) or "." for p in paths]) or "."
    names = [posixpath.relpath(p, common) if sep or common != "." else posixpath.normpath(p) for p in paths]
    return (f"{scheme}{sep}{common}" if sep else common), names


def sidecar(url: str, suffix: str) -> str:
    """The file img2dataset writes beside shard ``url``: ``sidecar('d/00001.tar', '_stats.json')``."""
    return url[: -len(".tar")] + suffix if url.endswith(".tar") else url + suffix


def expected_keys(url: str) -> tuple[list[str] | None, int | None]:
    """Keys img2dataset wrote into this shard (parquet rows with status success), or when the parquet
    is missing or unreadable its success count (``_stats.json``); (None, None) when neither is usable.

    Called once per raw shard by precompute: only the ``key`` and ``status`` columns are read, and the
    stats file only when the parquet gives no keys."""
    parquet = sidecar(url, ".parquet")
    try:
        if files.exists(parquet):
            import pyarrow.parquet as pq

            with files.open_file(parquet, "rb") as fh:
                pf = pq.ParquetFile(fh)
                columns = [c for c in ("key", "status") if c in pf.schema_arrow.names]
                table = pf.read(columns=columns).to_pydict()
            statuses = table.get("status") or ["success"] * len(table.get("key", []))
            return [
                str(k) for k, s in zip(table.get("key", []), statuses, strict=True) if s == "success"
            ], None
    except (OSError, ValueError, ImportError):
        pass
    stats = sidecar(url, "_stats.json")
    try:
        if files.exists(stats):
            return None, int(files.read_json(stats).get("successes"))
    except (OSError, ValueError, TypeError):
        pass
    return None, None


def promised_samples(urls: list[str]) -> int | None:
    """Samples the shards' ``_stats.json`` files count as successes, for progress totals; None when a
    shard has no readable stats file (a hand-made tar) or a remote listing would cost one request each."""
    total = 0
    for url in urls:
        if not files.is_local(url):
            return None
        try:
            total += int(files.read_json(sidecar(url, "_stats.json"))["successes"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    return total


class EndAwareTarInfo(tarfile.TarInfo):
    """A TarInfo that records on its TarFile (``end_error``) which header problem ended the iteration.

    tarfile stops iterating without any error at a zero block (the proper end-of-archive marker), but
    equally at end of file (a tar cut at a member boundary), at a partial header block (cut inside a
    header) and at a header with a bad checksum past the first member. :func:`end_problem` tells them apart.
    """

    @classmethod
    def fromtarfile(cls, tarfile_):  # tarfile's own signature
        try:
            return super().fromtarfile(tarfile_)
        except tarfile.HeaderError as err:
            tarfile_.end_error = err
            raise


def end_problem(tar: tarfile.TarFile) -> str | None:
    """None if an iterated ``tar`` (opened with ``tarinfo=EndAwareTarInfo``) ended at its end-of-archive
    marker, else what was wrong where it stopped."""
    err = getattr(tar, "end_error", None)
    if err is None or isinstance(err, tarfile.EOFHeaderError):
        return None
    if isinstance(err, tarfile.EmptyHeaderError):
        return f"no end-of-archive marker after byte {tar.offset} (cut at a member boundary)"
    if isinstance(err, tarfile.TruncatedHeaderError):
        return f"cut inside the member header at byte {tar.offset}"
    return f"damaged member header at byte {tar.offset} ({err})"


class RawShardReader:
    """Iterate the samples of one raw shard; after iteration, ``error`` says why reading stopped early
    (None if the tar was read to its end-of-archive marker), ``error_kind`` is 'truncated_tar' or
    'unreadable_tar', and ``cut_key`` names the sample that was cut in half (if any). Damage is logged
    as a warning (terminal and the stage's log.jsonl). ``caption_ext``: the member that completes a sample
    besides its image (precompute's ``caption_ext`` member, ``json`` for ``json:FIELD``)."""

    def __init__(self, url: str, caption_ext: str = "txt"):
        self.url = url
        self.caption_ext = caption_ext.partition(":")[0]  # json:FIELD -> the json member
        self.error: str | None = None
        self.error_kind: str | None = None
        self.cut_key: str | None = None
        self.num_members = 0

    def samples(self) -> Iterator[RawSample]:
        current: RawSample | None = None
        try:
            with files.open_file(self.url, "rb") as fh:
                try:
                    stream = tarfile.open(fileobj=fh, mode="r|*", tarinfo=EndAwareTarInfo)
                except (tarfile.TarError, EOFError, OSError) as err:
                    self._damaged("unreadable_tar", f"not a readable tar file: {err}")
                    return
                for info in stream:
                    if not info.isreg():
                        continue
                    split = split_member_name(info.name)
                    if split is None:  # no extension: not part of any sample
                        continue
                    key, ext = split
                    if current is not None and (current.key != key or ext in current.files):
                        yield current  # a repeated extension starts a second sample with the same key
                        current = None
                    if current is None:
                        current = RawSample(key)
                    extracted = stream.extractfile(info)
                    current.files[ext] = extracted.read() if extracted is not None else b""
                    current.offsets[ext] = (info.offset_data, info.size)
                    self.num_members += 1
                    stream.members = []  # stream mode keeps every TarInfo otherwise
                problem = end_problem(stream)
                if problem is not None:
                    raise tarfile.ReadError(problem)
        except (tarfile.TarError, EOFError, OSError, ValueError) as err:
            kind = "unreadable_tar" if self.num_members == 0 and current is None else "truncated_tar"
            self._damaged(kind, f"tar file ends early or is damaged: {err}")
            if current is not None and not (current.image() and self.caption_ext in current.files):
                self.cut_key, current = current.key, None  # incomplete sample: lost to the damage
        if current is not None:
            yield current

    def _damaged(self, kind: str, message: str) -> None:
        self.error_kind, self.error = kind, message
        log.warning("%s: %s (%s)", self.url, message, kind)
