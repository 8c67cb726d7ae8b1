"""Serve a local folder over HTTP on 127.0.0.1, so ``toolkit data fetch`` runs over real HTTP.

``toolkit data serve DIR --port P`` blocks until Ctrl-C; tests and scripts use :func:`serve` as a
context manager. Only the loopback interface is bound: this is a test and demo tool, not a web server.
Files are served from inside the folder only: a symlink that points out of it answers 404. A single byte
range (``Range: bytes=a-b``) is answered with 206, as object stores and web servers do: an index
(``precompute --storage index``) over served shards reads each image that way (Python's own
``http.server`` answers every range with the whole file, which fsspec refuses).
"""

from __future__ import annotations

import collections
import errno
import functools
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from toolkit.core.config import option
from toolkit.core.log import get_logger
from toolkit.core.stage import StageResult

HOST = "127.0.0.1"
_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")  # one range; a list of ranges is answered with the whole file


class QuietHandler(SimpleHTTPRequestHandler):
    """Static files from the served folder; access lines go to the debug log, and every request
    path is counted on the server (``server.request_counts``) so callers can see what was fetched."""

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (stdlib signature)
        get_logger("serve").debug("%s %s", self.address_string(), format % args)

    def send_head(self):
        server = self.server
        with server.count_lock:  # type: ignore[attr-defined]
            server.request_counts[self.path.split("?", 1)[0]] += 1  # type: ignore[attr-defined]
        root = server.root  # type: ignore[attr-defined]
        real = os.path.realpath(self.translate_path(self.path))
        if real != root and not real.startswith(root + os.sep):  # a symlink pointing out of the folder
            self.send_error(404, "File not found")
            return None
        self.range_left: int | None = None
        header = self.headers.get("Range")
        match = _RANGE.match(header.strip()) if header and os.path.isfile(real) else None
        if match is None or match.groups() == ("", ""):
            return super().send_head()
        return self._send_range(real, match)

    def _send_range(self, path: str, match: re.Match):
        """206 with the bytes ``match`` asks for (``a-b``, ``a-`` or the last ``-n``), 416 past the end."""
        fh = open(path, "rb")  # noqa: SIM115 (do_GET copies from it and closes it)
        size = os.fstat(fh.fileno()).st_size
        first, last = match.groups()
        start, end = (
            (int(first), min(int(last or size - 1), size - 1))
            if first
            else (max(0, size - int(last)), size - 1)
        )
        if start >= size or start > end:
            fh.close()
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        fh.seek(start)
        self.range_left = end - start + 1
        self.send_response(206)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(self.range_left))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        return fh

    def copyfile(self, source, outputfile) -> None:
        left = getattr(self, "range_left", None)
        if left is None:
            super().copyfile(source, outputfile)
            return
        while left > 0:
            chunk = source.read(min(left, 1 << 16))
            if not chunk:
                break
            outputfile.write(chunk)
            left -= len(chunk)


class FolderServer(ThreadingHTTPServer):
    """A threading HTTP server with a per-path request counter; ``url`` ends with '/'."""

    daemon_threads = True  # a stuck client never blocks shutdown
    allow_reuse_address = True

    def __init__(self, root: str, port: int, handler_cls: type[SimpleHTTPRequestHandler]):
        self.root = os.path.realpath(root)
        self.request_counts: collections.Counter[str] = collections.Counter()
        self.count_lock = threading.Lock()
        super().__init__((HOST, port), functools.partial(handler_cls, directory=self.root))

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/"

    def handle_error(self, request, client_address) -> None:
        """A client that gave up (timeout, closed socket) is routine here: log it, no traceback on stderr."""
        import sys

        err = sys.exc_info()[1]
        if isinstance(err, ConnectionError):
            get_logger("serve").debug("%s went away: %s", client_address, err)
            return
        super().handle_error(request, client_address)

    def reset_counts(self) -> None:
        with self.count_lock:
            self.request_counts.clear()


def make_server(
    root: str, port: int = 0, handler_cls: type[SimpleHTTPRequestHandler] = QuietHandler
) -> FolderServer:
    """Bind a :class:`FolderServer` for ``root`` on 127.0.0.1 (``port`` 0 picks a free one)."""
    if not Path(root).is_dir():
        raise FileNotFoundError(f"cannot serve {root}: not a directory")
    try:
        return FolderServer(root, port, handler_cls)
    except OSError as err:  # a busy port, mostly: one line naming it, not a traceback
        hint = (
            "; pick another with --port, or --port 0 for a free one" if err.errno == errno.EADDRINUSE else ""
        )
        raise OSError(err.errno, f"cannot serve on {HOST}:{port}: {err.strerror}{hint}") from None


@contextmanager
def serve(
    root: str, port: int = 0, handler_cls: type[SimpleHTTPRequestHandler] = QuietHandler
) -> Iterator[FolderServer]:
    """Serve ``root`` from a background thread while the block runs; yields the server (``.url``)."""
    server = make_server(root, port, handler_cls)
    thread = threading.Thread(target=server.serve_forever, name=f"serve:{server.port}", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@dataclass(frozen=True)
class ServeConfig:
    """The pipeline kind ``data.serve``: a folder served for the rest of the pipeline's process."""

    root: str = option(doc="Folder to serve (created if missing, so a later stage may fill it).")
    port: int = option(
        0,
        ge=0,
        le=65535,
        doc="Port on 127.0.0.1 (0: a free one). Give a fixed port when a "
        "later stage's config holds the URL, or it changes every run.",
    )
    out: str = option("", doc="The stage's own folder (pipelines set it); a service writes nothing there.")


# (folder, port) -> its server, for the life of this process: a pipeline run twice in one process (tests,
# notebooks) reuses the server instead of failing on its own busy port.
_BACKGROUND: dict[tuple[str, int], FolderServer] = {}


def run(cfg: ServeConfig) -> StageResult:
    """Serve ``cfg.root`` from a daemon thread until this process exits; outputs ``url``. Writes no
    manifest: a service has no result to reuse, so a pipeline starts it again on every run (milliseconds)."""
    Path(cfg.root).mkdir(parents=True, exist_ok=True)
    key = (os.path.realpath(cfg.root), cfg.port)
    server = _BACKGROUND.get(key) if cfg.port else None
    if server is None:
        server = make_server(cfg.root, cfg.port)
        threading.Thread(target=server.serve_forever, name=f"serve:{server.port}", daemon=True).start()
        _BACKGROUND[(key[0], server.port)] = server
    get_logger("serve").info("serving %s at %s for the rest of this run", server.root, server.url)
    return StageResult(cfg.out, {"url": server.url}, {"port": server.port}, "")
