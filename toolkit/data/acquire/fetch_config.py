"""``toolkit data fetch``'s config: :class:`FetchConfig`, the stage's kind and its download limit.

Its own module so that the stage (:mod:`.fetch`), resume's checks (:mod:`.fetch_resume`) and the summary
(:mod:`.fetch_summary`) share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from toolkit.core.config import option

KIND = "data.fetch"

InputFormat = Literal[
    "auto",
    "txt",
    "csv",
    "tsv",
    "parquet",
    "jsonl",
    "json",
    "txt.gz",
    "csv.gz",
    "tsv.gz",
    "jsonl.gz",
    "json.gz",
]


ResizeMode = Literal["border", "center_crop", "keep_ratio", "keep_ratio_largest", "no"]


Distributor = Literal["multiprocessing", "pyspark", "ray"]


ExtraScheme = Literal["http", "https", "file", "ftp", "data"]


# 50 MiB: web images are rarely above 5 MB and camera JPEGs rarely above 25 MB, while one 1.5 GB URL
# otherwise costs 1.5 GB of memory. Downloads in flight hold up to this much each: img2dataset keeps up to
# 2 x threads samples per process, so the worst case is about 2 x processes x threads x max_bytes; lower
# --max-bytes or --threads on a small machine.
DEFAULT_MAX_BYTES = 50 * 2**20


# Name of the cleaned URL list (url, caption) that the worker hands img2dataset, under OUT/_tmp/.
ROWS_FILE = "urls.parquet"


@dataclass(frozen=True)
class FetchConfig:
    urls: str = option(
        doc="URL list (csv, tsv, parquet, jsonl, json or txt, optionally .gz; local or fsspec URL), "
        "or a folder of such files.",
        is_input=True,
    )
    out: str = option(doc="Output folder (local or fsspec URL) for the raw shards and the manifest.")
    input_format: InputFormat = option(
        "auto", doc="Format of the URL list; 'auto' reads it from the extension."
    )
    url_col: str = option("url", doc="Column holding the image URL (not used for txt lists: one URL a line).")
    caption_col: str = option("caption", doc="Column holding the caption; '' for none (txt lists have none).")
    image_size: int = option(256, ge=1, doc="Target image side in pixels (see resize_mode).")
    resize_mode: ResizeMode = option(
        "border",
        doc="img2dataset resize mode: border (fit, pad white), center_crop, "
        "keep_ratio (shorter side), keep_ratio_largest, no.",
    )
    resize_only_if_bigger: bool = option(False, doc="Only shrink images; never upscale smaller ones.")
    encode_quality: int = option(95, ge=1, le=100, doc="JPEG quality of the stored images.")
    min_image_size: int = option(
        0, ge=0, doc="Skip images whose shorter side is below this (reason image_too_small)."
    )
    max_image_area: float | None = option(
        None, gt=0, doc="Skip images with more pixels than this (default: no limit)."
    )
    max_aspect_ratio: float | None = option(
        None, ge=1, doc="Skip images whose long/short side ratio exceeds this."
    )
    strict_decode: bool = option(
        True,
        doc="Fully decode every image with Pillow first, rejecting truncated files "
        "and decompression bombs that OpenCV would accept or pad.",
    )
    samples_per_shard: int = option(10000, ge=1, doc="URLs per shard; a shard is the unit of resume.")
    num_processes: int = option(
        1, ge=1, affects_output=False, doc="Download processes (distributor workers)."
    )
    num_threads: int = option(32, ge=1, affects_output=False, doc="Download threads per process.")
    timeout_s: float = option(
        10.0,
        gt=0,
        affects_output=False,
        doc="Per-request socket timeout: a dead or stalled host fails the URL as 'timeout'.",
    )
    download_timeout_s: float = option(
        0.0,
        ge=0,
        affects_output=False,
        doc="Total seconds one download attempt may take, connection to last byte: "
        "a server that trickles bytes fails the URL as 'timeout'; 0: 10 x "
        "timeout_s.",
    )
    retries: int = option(0, ge=0, affects_output=False, doc="Extra attempts per failed URL.")
    max_shard_retry: int = option(1, ge=0, affects_output=False, doc="Extra attempts per shard that crashed.")
    distributor: Distributor = option(
        "multiprocessing",
        affects_output=False,
        doc="img2dataset distributor: multiprocessing, or pyspark / ray for clusters.",
    )
    subjob_size: int = option(1000, ge=1, affects_output=False, doc="Shards per pyspark job.")
    run_timeout_s: float | None = option(
        None,
        gt=0,
        affects_output=False,
        doc="Stop the whole run after this many seconds; finished shards stay and a "
        "rerun resumes (default: no limit).",
    )
    overwrite: bool = option(
        False, affects_output=False, doc="Delete the shards already in `out` first instead of resuming."
    )
    max_bytes: int = option(
        DEFAULT_MAX_BYTES,
        ge=1,
        doc="Abort a download once it exceeds this many bytes (announced or received); counted as too_large.",
    )
    allow_schemes: list[ExtraScheme] = option(
        factory=list,
        doc="URL schemes to download besides http and https, e.g. [file] for local test lists; "
        "URL lists come from the internet, so file, ftp and data URLs are refused unless "
        "named here (reason disallowed_scheme).",
    )
    keep_duplicates: bool = option(
        False,
        doc="Download every occurrence of a URL; by default only the first is "
        "kept and the others are counted as duplicate_url.",
    )
    retry_failed: bool = option(
        False,
        affects_output=False,
        doc="After fetching (or resuming), fetch again the URLs that failed for a transient "
        "reason (timeouts, HTTP 5xx/408/429, refused or broken connections; not 404s "
        "or bad images) into new shards of `out`; rerun to retry what fails again.",
    )
