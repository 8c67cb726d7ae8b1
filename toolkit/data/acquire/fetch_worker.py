"""Subprocess entry for ``toolkit data fetch``: drives img2dataset's reader, downloader and distributor.

Run as ``python -m toolkit.data.acquire.fetch_worker SPEC.json`` by :func:`toolkit.data.acquire.fetch.run`,
never imported by the CLI. Why a subprocess: img2dataset's multiprocessing distributor uses the 'spawn'
start method, which re-imports the caller's ``__main__``; ``python -m toolkit`` has no ``__main__``
guard, pytest's or a notebook's main module are not ours either. Here the guard is ours, and the
parent can kill the whole process group when a run exceeds its time limit.

Why not ``img2dataset.download()``: it decides which shards are done from every ``*.json`` in the
output folder (our ``manifest.json`` there would crash it), its ``overwrite`` mode is broken, and its
logger process only prints. The parent computes finished shards itself (tar + parquet + stats all
present) and passes them in; everything else is img2dataset's own code.

Protocol: lines on stdout starting with ``EVENT_PREFIX`` carry JSON events for the parent:
``{"plan": {"num_shards": N}}`` once the URL list is split, ``{"urls": n}`` while downloading (URLs done
since the last event), ``{"shard": id, "ok": bool, "urls": n}`` per shard (multiprocessing distributor
only), ``{"done": true}`` at the end. Everything else is img2dataset's
own output, which the parent logs at debug level.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from toolkit.data.acquire.download import DEFAULT_SCHEMES

EVENT_PREFIX = "@@cliptk-fetch "


# A download process reports URLs done at most this often (plus once per finished shard), so progress
# moves inside one big shard without a line per URL.
PROGRESS_EVENT_S = 0.5
_PROGRESS = {"pending": 0, "last": 0.0}
_PROGRESS_LOCK = threading.Lock()
_INSTALLED: dict[str, tuple] = {}


def emit(event: dict) -> None:
    """One event line in one ``write`` system call. img2dataset's pool processes and download threads
    share this stdout pipe, and ``print`` under PYTHONUNBUFFERED writes the text and its newline in two
    calls, so two events could land on one line (CI saw ``{"urls": 123}@@cliptk-fetch ...``). A single
    write of under PIPE_BUF (4096) bytes to a pipe is atomic."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (EVENT_PREFIX + json.dumps(event) + "\n").encode())


def _url_done() -> None:
    """Called by the download threads after every URL: an ``{"urls": n}`` event every PROGRESS_EVENT_S."""
    with _PROGRESS_LOCK:
        _PROGRESS["pending"] += 1
        now = time.monotonic()
        if now - _PROGRESS["last"] < PROGRESS_EVENT_S:
            return
        pending, _PROGRESS["pending"], _PROGRESS["last"] = _PROGRESS["pending"], 0, now
    emit({"urls": pending})


def _take_pending() -> int:
    with _PROGRESS_LOCK:
        pending, _PROGRESS["pending"] = _PROGRESS["pending"], 0
    return pending


def install_download(allowed_schemes: list[str], max_bytes: int, total_s: float = 0.0) -> None:
    """Put :func:`toolkit.data.acquire.download.make_download` in place of img2dataset's downloader, in
    this process (img2dataset's pool processes are spawned: each installs it on its first shard)."""
    import img2dataset.downloader

    from toolkit.data.acquire.download import make_download

    settings = (tuple(allowed_schemes), max_bytes, total_s)
    if _INSTALLED.get("settings") != settings:
        img2dataset.downloader.download_image_with_retry = make_download(
            allowed_schemes, max_bytes, _url_done, total_s
        )
        _INSTALLED["settings"] = settings


class ReportingDownloader:
    """Wraps img2dataset's ``Downloader``: checked downloads (scheme allow-list, size limit) and one
    event per finished shard (picklable: img2dataset's pool sends it to each download process)."""

    def __init__(self, downloader, allowed_schemes: list[str], max_bytes: int, total_s: float = 0.0):
        self.downloader = downloader
        self.allowed_schemes, self.max_bytes, self.total_s = list(allowed_schemes), max_bytes, total_s

    def __call__(self, row):
        install_download(self.allowed_schemes, self.max_bytes, self.total_s)
        ok, row = self.downloader(row)
        emit({"shard": int(row[0]), "ok": bool(ok), "urls": _take_pending()})
        return ok, row


def build_downloader(spec: dict, column_list: list[str]):
    """img2dataset's Downloader for ``spec`` (see toolkit.data.acquire.fetch.worker_spec for the keys)."""
    from img2dataset.downloader import Downloader
    from img2dataset.resizer import Resizer
    from img2dataset.writer import WebDatasetSampleWriter

    from toolkit.data.acquire.resizer import CheckedResizer
    from toolkit.data.raw.layout import SHARD_DIGITS

    resizer = Resizer(
        image_size=spec["image_size"],
        resize_mode=spec["resize_mode"],
        resize_only_if_bigger=spec["resize_only_if_bigger"],
        encode_quality=spec["encode_quality"],
        encode_format="jpg",
        min_image_size=spec["min_image_size"],
        max_image_area=spec["max_image_area"] or float("inf"),
        max_aspect_ratio=spec["max_aspect_ratio"] or float("inf"),
    )
    return Downloader(
        sample_writer_class=WebDatasetSampleWriter,
        resizer=CheckedResizer(resizer, spec["strict_decode"]),
        thread_count=spec["num_threads"],
        save_caption=spec["caption_col"] is not None,
        extract_exif=True,
        output_folder=spec["output_folder"],
        column_list=column_list,
        timeout=spec["timeout_s"],
        number_sample_per_shard=spec["samples_per_shard"],
        oom_shard_count=SHARD_DIGITS,
        compute_hash="sha256",
        verify_hash_type=None,
        encode_format="jpg",
        retries=spec["retries"],
        user_agent_token=None,
        disallowed_header_directives=["noai", "noimageai", "noindex", "noimageindex"],
    )


def run_inline(downloader, shards: list, max_shard_retry: int) -> None:
    """The multiprocessing distributor's loop without a pool: one spawned process only adds start-up."""
    failed = [row for row in shards if not downloader(row)[0]]
    for _ in range(max_shard_retry):
        if not failed:
            break
        failed = [row for row in failed if not downloader(row)[0]]


def distribute(spec: dict, downloader, shards: list) -> None:
    from img2dataset import distributor

    name, processes = spec["distributor"], spec["num_processes"]
    if name == "multiprocessing" and processes == 1:
        run_inline(downloader, shards, spec["max_shard_retry"])
    elif name == "multiprocessing":
        distributor.multiprocessing_distributor(processes, downloader, shards, None, spec["max_shard_retry"])
    elif name == "pyspark":
        import pyspark  # noqa: F401  (a clear ImportError instead of img2dataset's)

        distributor.pyspark_distributor(
            processes, downloader, shards, spec["subjob_size"], spec["max_shard_retry"]
        )
    elif name == "ray":
        import ray  # noqa: F401  (img2dataset's ray_distributor silently does nothing without ray)

        distributor.ray_distributor(processes, downloader, shards, None, spec["max_shard_retry"])
    else:
        raise ValueError(f"unknown distributor {name!r}")


def main(spec_path: str) -> None:
    with open(spec_path) as fh:
        spec = json.load(fh)
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    import fsspec
    from img2dataset.reader import Reader

    fs, tmp = fsspec.core.url_to_fs(spec["tmp_path"])
    fs.makedirs(tmp, exist_ok=True)
    reader = Reader(
        spec["url_list"],
        spec["input_format"],
        spec["url_col"],
        spec["caption_col"],
        None,
        None,
        None,
        spec["samples_per_shard"],
        set(spec["done_shards"]),
        spec["tmp_path"],
        spec.get("start_shard_id", 0),
    )
    shards = list(reader)  # splits the list into feather files under _tmp/, skipping finished shards
    emit({"plan": {"num_shards": len(shards)}})
    downloader = build_downloader(spec, reader.column_list)
    allowed = [*DEFAULT_SCHEMES, *spec["allow_schemes"]]
    distribute(
        spec,
        ReportingDownloader(downloader, allowed, spec["max_bytes"], spec.get("download_timeout_s", 0.0)),
        shards,
    )
    if fs.exists(tmp):
        fs.rm(tmp, recursive=True)
    emit({"done": True})


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m toolkit.data.acquire.fetch_worker SPEC.json")
    main(sys.argv[1])
