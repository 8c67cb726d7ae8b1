"""Why a raw sample failed: img2dataset's free-text error messages (and ours) as a small set of reasons.

Summaries read ``http_404: 2, timeout: 1`` instead of one line per memory address. ``fetch`` and
``shard`` count reasons from the status messages in each shard's ``NNNNN_stats.json``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

SUCCESS = "success"
_HEX_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# Raw messages kept verbatim in the manifest details (most frequent first).
MAX_RAW_MESSAGES = 20

# (pattern, reason) tried in order against img2dataset's error messages and ours; our own messages
# (anchored at the start) go first so that bytes quoted in them cannot match a later pattern.
_REASONS: list[tuple[re.Pattern, str]] = [
    (re.compile(p, re.IGNORECASE), r)
    for p, r in [
        (r"^success$", SUCCESS),
        (r"^disallowed url scheme", "disallowed_scheme"),
        (r"^too large", "too_large"),
        (r"^invalid url", "bad_url"),
        (r"^empty response", "empty_response"),
        (r"^not an image", "not_an_image"),
        (r"^truncated image", "truncated_image"),
        (r"^decompression bomb", "decompression_bomb"),
        (r"^corrupt image", "corrupt_image"),
        (r"^missing image", "missing_image"),
        (r"^unreadable image", "unreadable_image"),
        (r"^missing caption", "missing_caption"),
        (r"^unreadable caption", "unreadable_caption"),
        (r"^caption not utf-8", "caption_not_utf8"),
        (r"^empty caption", "empty_caption"),
        (r"^duplicate url", "duplicate_url"),
        # urllib refuses a redirect to file:// (or any scheme but http/https/ftp) itself, as an HTTP error 30x
        (r"^HTTP Error 30\d: .*Redirection to url .* is not allowed", "disallowed_scheme"),
        (r"HTTP Error (\d{3})", "http_{0}"),
        (r"timed out|timeout", "timeout"),
        (r"connection refused", "connection_refused"),
        (r"name or service not known|name resolution|nodename nor servname|getaddrinfo", "dns_error"),
        (r"remote end closed|connection reset|connection aborted|broken pipe", "connection_error"),
        (r"incompleteread", "incomplete_transfer"),
        (r"ssl|certificate", "ssl_error"),
        (r"no such file or directory", "file_not_found"),
        (r"unknown url type|no host given|invalid url|url can't contain", "bad_url"),
        (r"x-robots-tag", "disallowed_by_robots_tag"),
        (r"hash mismatch", "hash_mismatch"),
        (r"image decoding error", "decode_error"),
        (r"image too small", "image_too_small"),
        (r"image area too large", "image_area_too_large"),
        (r"aspect ratio too large", "aspect_ratio_too_large"),
    ]
]


def classify(message: str) -> str:
    """A short reason for one status message: 'success', 'http_404', 'timeout', ... or 'other'."""
    for pattern, reason in _REASONS:
        match = pattern.search(message)
        if match:
            return reason.format(*match.groups())
    return "other"


def scrub(message: str) -> str:
    """Drop object addresses so equal errors aggregate ('<_io.BytesIO object at 0x7f..>')."""
    return _HEX_ADDRESS.sub("", message)[:300]


def summarize_status(status: dict[str, int], num_unrecorded: int = 0) -> dict[str, Any]:
    """Status messages (message -> count, img2dataset's ``status_dict``) -> successes, failures by
    reason (most frequent first) and the most frequent raw messages, addresses scrubbed."""
    reasons: Counter[str] = Counter()
    messages: Counter[str] = Counter()
    for message, n in status.items():
        reasons[classify(message)] += n
        if message != SUCCESS:
            messages[scrub(message)] += n
    if num_unrecorded:
        reasons["unrecorded"] += num_unrecorded
    num_success = reasons.pop(SUCCESS, 0)
    return {
        "num_success": num_success,
        "num_failed": sum(reasons.values()),
        "failed_by_reason": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
        "messages": dict(messages.most_common(MAX_RAW_MESSAGES)),
    }


def summarize(stats: dict[int, dict]) -> dict[str, Any]:
    """Totals over shards: samples, successes, failures by reason, raw messages, download seconds.

    Samples that img2dataset counted but gave no status (a writer exception it only printed) are
    reported as reason 'unrecorded', so the reasons always add up to ``num_samples``.
    """
    status: Counter[str] = Counter()
    num_samples = num_unrecorded = 0
    start, end = math.inf, -math.inf
    for shard in stats.values():
        count, recorded = int(shard.get("count", 0)), shard.get("status_dict") or {}
        num_samples += count
        start, end = min(start, shard.get("start_time", math.inf)), max(end, shard.get("end_time", -math.inf))
        status.update(recorded)
        num_unrecorded += max(0, count - sum(recorded.values()))
    summary = summarize_status(status, num_unrecorded)
    return {
        "num_samples": num_samples,
        **summary,
        "num_failed": num_samples - summary["num_success"],
        "span_s": round(end - start, 3) if stats else 0.0,
    }
