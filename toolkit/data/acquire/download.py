"""One URL's download for ``fetch``: a scheme allow-list, a size limit enforced while streaming, and
redirects held to the same allow-list.

URL lists come from the internet. img2dataset hands every URL to ``urllib.request.urlopen``, which also
opens ``file://`` (local files), ``ftp://`` and ``data:`` URLs and follows redirects to ``ftp://``, and
reads each response whole into memory, however large. :func:`make_download_image` builds a drop-in
replacement for ``img2dataset.downloader.download_image`` (same arguments, same ``(key, stream, error)``
result) that refuses other schemes (``disallowed url scheme ...``: reason ``disallowed_scheme``) and aborts
a body larger than ``max_bytes`` as soon as it is announced or received (``too large ...``: reason
``too_large``), so one download never holds more than about ``max_bytes`` in memory.
:mod:`.fetch_worker` installs it in every download process.
"""

from __future__ import annotations

import http.client
import io
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable

DEFAULT_SCHEMES = ("http", "https")
# Schemes urllib can open at all; the ones beyond DEFAULT_SCHEMES read local files or other servers and
# must be asked for explicitly (--allow-schemes).
KNOWN_SCHEMES = ("http", "https", "file", "ftp", "data")
CHUNK_BYTES = 1 << 16
# A download's total deadline when none is set: this many socket timeouts (10 s -> 100 s for one image).
DEADLINE_PER_TIMEOUT = 10
# img2dataset's own User-Agent (its download_image), so servers see the same client as before.
USER_AGENT = "Mozilla/5.0 (X11; Ubuntu; Linux x86_64; rv:72.0) Gecko/20100101 Firefox/72.0"


class Refused(Exception):
    """A URL not downloaded on purpose: a disallowed scheme or too many bytes."""


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """urllib follows redirects to ftp:// on its own; hold every redirect to the allow-list."""

    def __init__(self, allowed: frozenset[str]):
        self.allowed = allowed

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # urllib's signature
        scheme = urllib.parse.urlsplit(newurl).scheme.lower()
        if scheme not in self.allowed:
            raise Refused(
                f"disallowed url scheme {scheme!r} in a redirect (allowed: {', '.join(sorted(self.allowed))})"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def check_scheme(url: object, allowed: frozenset[str]) -> None:
    """Raise :class:`Refused` unless ``url`` is a string whose scheme is in ``allowed``."""
    if not isinstance(url, str) or not url.strip():
        raise Refused("invalid url: empty")
    scheme = urllib.parse.urlsplit(url.strip()).scheme.lower()
    if not scheme:
        raise Refused("invalid url: no scheme (expected http:// or https://)")
    if scheme not in allowed:
        raise Refused(
            f"disallowed url scheme {scheme!r} (allowed: {', '.join(sorted(allowed))}; "
            "--allow-schemes adds more)"
        )


# Characters left as they are when a URL is made ASCII: RFC 3986's reserved set, '%' (escapes already there)
# and '~' (requests' requote_uri keeps the same set).
_URI_SAFE = "!#$%&'()*+,/:;=?@[]~"


def to_uri(url: str) -> str:
    """An IRI as browsers send it: a non-ASCII host in IDNA, spaces and non-ASCII characters in the path,
    query and fragment percent-encoded as UTF-8. urllib sends the URL as given and fails on them ('ascii'
    codec can't encode, 'URL can't contain control characters'); real URL lists hold many such URLs."""
    if url.isascii() and " " not in url:
        return url
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if parts.hostname and not parts.hostname.isascii():
        host = parts.hostname.encode("idna").decode("ascii")
        netloc = netloc.rsplit("@", 1)[0] + "@" + host if "@" in netloc else host
        netloc += f":{parts.port}" if parts.port else ""
    return urllib.parse.urlunsplit(
        (
            parts.scheme,
            netloc,
            *(urllib.parse.quote(p, safe=_URI_SAFE) for p in (parts.path, parts.query, parts.fragment)),
        )
    )


def read_limited(
    response, max_bytes: int, deadline: float | None = None, total_s: float | None = None
) -> bytes:
    """The body of an open ``response``, aborted as soon as it is known to exceed ``max_bytes``, or past
    ``deadline`` (``time.monotonic()``; ``total_s`` is what it allowed, for the message).

    The socket timeout bounds each read only: a server that sends a few bytes every half second never
    trips it, so the body is read with ``read1`` (whatever has arrived) and the deadline checked in
    between."""
    length = response.headers.get("Content-Length") if response.headers else None
    expected = int(length) if length and length.strip().isdigit() else None
    if expected is not None and expected > max_bytes:
        raise Refused(f"too large: Content-Length {expected} bytes exceeds max_bytes={max_bytes}")
    body, read = bytearray(), getattr(response, "read1", response.read)
    while chunk := read(CHUNK_BYTES):
        body += chunk
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(
                f"timed out: the download took longer than its total deadline of {total_s:g} s "
                f"({len(body)} bytes received; download_timeout_s)"
            )
        if len(body) > max_bytes:
            raise Refused(f"too large: more than max_bytes={max_bytes} bytes received")
    if (
        expected is not None
        and len(body) < expected
        and urllib.parse.urlsplit(response.url).scheme in DEFAULT_SCHEMES
    ):
        # read(n) returns short at a closed connection where read() raises IncompleteRead: keep the reason
        raise http.client.IncompleteRead(bytes(body[-16:]), expected - len(body))
    return bytes(body)


def make_download(
    allowed_schemes: Iterable[str],
    max_bytes: int,
    on_done: Callable[[], None] | None = None,
    total_s: float = 0.0,
):
    """img2dataset's ``download_image_with_retry(row, timeout, retries, user_agent_token,
    disallowed_header_directives)`` with the allow-list (``allowed_schemes``), the size limit and a total
    deadline per attempt (``total_s``; 0: ``DEADLINE_PER_TIMEOUT`` x the socket timeout); refused URLs are
    not retried, and ``on_done`` is called once per URL (progress)."""
    from img2dataset.downloader import is_disallowed

    allowed = frozenset(s.lower() for s in allowed_schemes)
    opener = urllib.request.build_opener(_CheckedRedirects(allowed))  # replaces the default redirect handler

    def attempt(url: str, timeout: float, agent: str, user_agent_token, directives) -> bytes | str:
        """The body, or the error message (img2dataset's contract: every failure is a message)."""
        request = urllib.request.Request(to_uri(url.strip()), data=None, headers={"User-Agent": agent})
        allowed_s = total_s or DEADLINE_PER_TIMEOUT * timeout
        deadline = time.monotonic() + allowed_s
        with opener.open(request, timeout=timeout) as response:
            if directives and is_disallowed(response.headers, user_agent_token, directives):
                return "Use of image disallowed by X-Robots-Tag directive"
            return read_limited(response, max_bytes, deadline, allowed_s)

    def download_image_with_retry(row, timeout, retries, user_agent_token, disallowed_header_directives):
        key, url = row
        agent = USER_AGENT
        if user_agent_token:
            agent += f" (compatible; {user_agent_token}; +https://github.com/rom1504/img2dataset)"
        try:
            check_scheme(url, allowed)
            error = "no attempt"
            for _ in range(retries + 1):
                try:
                    body = attempt(url, timeout, agent, user_agent_token, disallowed_header_directives)
                except Refused:
                    raise
                except Exception as err:  # noqa: BLE001 (any failure of one attempt: try again)
                    error = str(err)
                    continue
                if isinstance(body, str):
                    return key, None, body
                return key, io.BytesIO(body), None
            return key, None, error
        except Refused as err:
            return key, None, str(err)
        finally:
            if on_done is not None:
                on_done()

    return download_image_with_retry
