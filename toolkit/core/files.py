"""fsspec-backed file helpers: local paths and any fsspec URL (s3://, gs://, memory://, ...)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec

HASH_CHUNK_BYTES = 1 << 22  # file_sha256's reads: 4 MiB, so a weights file never sits in memory whole
# How long an http(s):// open or read waits for the server (connecting, and between received bytes) before it
# fails: fsspec's aiohttp client otherwise waits 300 s per request, which read as about 5 silent minutes and
# then an empty FSTimeoutError when a server serving an index set stopped answering (issue 43 item 6). A live
# server answers a range request in well under a second; 60 s leaves room for a slow link. The environment
# variable CLIPTK_HTTP_TIMEOUT_S sets it (seconds).
HTTP_TIMEOUT_S = float(os.environ.get("CLIPTK_HTTP_TIMEOUT_S", "60"))


def is_local(path: str) -> bool:
    return "://" not in str(path) or str(path).startswith("file://")


def local_path(path: str) -> str:
    return str(path)[len("file://") :] if str(path).startswith("file://") else str(path)


def open_file(path: str, mode: str = "rb", **kwargs: Any):
    """Open a local path or fsspec URL (caller closes, or use ``with``).

    A local path opened for reading must be a regular file: a FIFO (or socket, or device) in its place
    would block the reader forever, which used to hang training and ``data verify`` on a damaged folder."""
    if is_local(path):
        if "r" in mode:
            check_regular(local_path(path))
        return open(local_path(path), mode, **kwargs)
    return fsspec.open(path, mode, **{**http_options(path), **kwargs}).open()


def http_options(path: str) -> dict[str, Any]:
    """fsspec options that bound an http(s) URL's waits by :data:`HTTP_TIMEOUT_S` (read when called), or
    {}."""
    if not str(path).lower().startswith(("http://", "https://")):
        return {}
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=HTTP_TIMEOUT_S, sock_read=HTTP_TIMEOUT_S)
    return {"client_kwargs": {"timeout": timeout}}


def open_ranges(path: str):
    """Open a local path or fsspec URL for reading scattered byte ranges (seek, then read): on a URL every
    read is one range request of exactly its bytes, without fsspec's read-ahead (a 5 MB block per read over
    HTTP, 50 MB on S3, for a ~30 kB image at a random offset)."""
    return open_file(path, "rb") if is_local(path) else open_file(path, "rb", cache_type="none")


_NOT_REGULAR = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def check_regular(path: str) -> None:
    """Raise OSError naming ``path`` when it exists but is a FIFO, socket or device (reading could block)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # missing or unreadable: open() says so itself
    for test, what in _NOT_REGULAR:
        if test(mode):
            raise OSError(
                f"{path} is {what}, not a regular file: reading it could wait forever; replace it "
                "with the real file"
            )


def file_sha256(
    path: str | os.PathLike, chunk_bytes: int = HASH_CHUNK_BYTES, fs: fsspec.AbstractFileSystem | None = None
) -> str:
    """Hex sha256 of a file's bytes, read ``chunk_bytes`` at a time: a local path or fsspec URL (through
    :func:`open_file`, which refuses a FIFO), or a path inside ``fs``. Read errors propagate as OSError.
    Used for checkpoint manifests (writer's verify, ``load_model``'s check) and reference weights."""
    digest = hashlib.sha256()
    with fs.open(path, "rb") if fs is not None else open_file(str(path)) as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def exists(path: str) -> bool:
    """Whether ``path`` exists; on a URL, a server that cannot be reached raises ConnectionError naming the
    URL (fsspec's ``exists`` answers False to every error, so a dead server read as "dataset.json: not
    found", and huggingface_hub's connection errors went up as 138-line tracebacks)."""
    if is_local(path):
        return os.path.exists(local_path(path))
    fs, p = fsspec.core.url_to_fs(path)
    try:
        fs.info(p)
    except Exception as err:  # noqa: BLE001 - each backend has its own (aiohttp, httpx, botocore...)
        cause = network_cause(err)
        if cause is not None:
            raise unreachable(path, cause) from err
        if isinstance(err, FileNotFoundError):
            return False
        raise
    return True


# Modules whose exceptions mean "the server did not answer": fsspec backends raise their HTTP client's own
# errors (aiohttp for http(s)://, httpx for hf://, requests/urllib3 elsewhere), none of them an OSError.
NETWORK_MODULES = ("aiohttp", "httpx", "httpcore", "requests", "urllib3", "huggingface_hub", "botocore")


def is_network_error(err: BaseException) -> bool:
    """Whether ``err`` is an HTTP client's connection or transport error (see NETWORK_MODULES)."""
    if isinstance(err, (ConnectionError, TimeoutError)):
        return True
    return any(cls.__module__.split(".")[0].startswith(NETWORK_MODULES) for cls in type(err).__mro__[:-2])


def network_cause(err: BaseException) -> BaseException | None:
    """The HTTP client's error behind ``err`` (itself, or the cause of fsspec's FileNotFoundError: its http
    backend turns every failure into one, a refused connection too), None for a real "not found" (404) and
    for other errors. An :class:`Unreachable` already names its URL: None."""
    if isinstance(err, Unreachable):
        return None
    if isinstance(err, FileNotFoundError):
        cause = err.__cause__
        not_found = getattr(cause, "status", None) in (404, 410)
        return cause if cause is not None and is_network_error(cause) and not not_found else None
    return err if is_network_error(err) else None


class Unreachable(ConnectionError):
    """A URL's server did not answer; the message names the URL (and what was being read)."""


def unreachable(url: str, err: BaseException) -> Unreachable:
    """The one-line error for a URL whose server did not answer (connection refused, timeout, DNS, 5xx)."""
    detail = " ".join(str(err).split()) or "no answer"
    return Unreachable(
        f"{url}: cannot read it from its server ({type(err).__name__}: {detail}); check the "
        "network and that the server is up"
    )


def makedirs(path: str) -> None:
    if is_local(path):
        os.makedirs(local_path(path), exist_ok=True)
    else:
        fs, p = fsspec.core.url_to_fs(path)
        fs.makedirs(p, exist_ok=True)


def join(base: str, *parts: str) -> str:
    return "/".join([str(base).rstrip("/"), *[p.strip("/") for p in parts]])


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write ``data`` so that readers never see a half-written file (temp file + rename locally)."""
    if not is_local(path):
        with fsspec.open(path, "wb") as fh:  # object stores publish whole objects on close
            fh.write(data)
        return
    target = Path(local_path(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    # os.open with 0666 applies the umask like open() does (mkstemp would make every file 0600, unlike the
    # tars beside it); O_EXCL and a per-writer name keep concurrent writers apart.
    tmp = str(target.parent / f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str, text: str) -> None:
    """UTF-8 ``text`` written like :func:`write_bytes_atomic`."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


@contextmanager
def replacing_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a new empty sibling folder of local directory ``path`` to fill; when the block ends without
    an error it replaces ``path`` as a whole (an old ``path`` is renamed aside first, then deleted), and
    when it fails it is removed and ``path`` stays as it was. Readers see the old folder or the new one.
    """
    target = Path(local_path(str(path)))
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # unique per writer; mkdir (not mkdtemp) keeps the umask
    tmp = target.parent / f".{target.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        yield tmp
        if target.exists():
            old = target.parent / f".{target.name}.old-{tag}"
            os.replace(target, old)
            os.replace(tmp, target)
            _remove_replaced(old)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_replaced(old: Path) -> None:
    """Delete the folder a replacement set aside; if that fails, say so (it is hidden and may be large)."""
    try:
        remove_tree(old)
    except OSError as err:
        from toolkit.core.log import get_logger

        get_logger("files").warning(
            "could not delete the replaced folder %s (%s): delete it by hand", old, err
        )


def remove_tree(path: str | os.PathLike) -> None:
    """Delete a local folder and everything in it, including parts its owner made unreadable (chmod 000:
    shutil.rmtree cannot list them, and ``ignore_errors`` used to leave them behind silently). Missing: no-op.
    Raises OSError when it still cannot (another user's files)."""
    target = Path(local_path(str(path)))
    try:
        shutil.rmtree(target)
        return
    except FileNotFoundError:
        return
    except PermissionError:
        pass
    _make_owner_accessible(target)
    shutil.rmtree(target)


def _make_owner_accessible(folder: Path) -> None:
    """chmod u+rwx every folder below ``folder`` (itself first, so it can be listed); symlinks untouched."""
    os.chmod(folder, os.stat(folder).st_mode | stat.S_IRWXU)
    for entry in os.scandir(folder):
        if entry.is_dir(follow_symlinks=False):
            _make_owner_accessible(Path(entry.path))


def read_json(path: str) -> Any:
    with open_file(path, "r") as fh:
        return json.load(fh)


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: running
        return True
    return True


def remove_stale_temp_dirs(parent: str | None, prefix: str, all_stale: bool = False) -> list[str]:
    """Delete the temp folders ``parent/<prefix>*`` that a killed run left behind; returns their names.

    A folder named ``<prefix><host>-<pid>-<suffix>`` (how precompute named its scratch before it kept a
    resumable work folder) is stale when its owner (this host, that pid) is no longer
    running; folders of other hosts are left alone. With ``all_stale`` (the caller holds the lock of the
    output folder that ``parent`` belongs to, so no other run can be using it) every ``<prefix>*`` folder
    is stale, whatever its name. A missing ``parent`` (or None) has nothing to clean.
    """
    if not parent or not os.path.isdir(parent):
        return []
    owned = re.compile(rf"^{re.escape(prefix)}(?P<host>.+)-(?P<pid>\d+)-[^-]*$")
    removed = []
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name)
        if not name.startswith(prefix) or not os.path.isdir(path) or os.path.islink(path):
            continue
        match = owned.match(name)
        if match and int(match["pid"]) == os.getpid() and match["host"] == socket.gethostname():
            continue  # this very process: never stale
        mine = match is not None and match["host"] == socket.gethostname()
        if all_stale or (mine and not _pid_running(int(match["pid"]))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed
