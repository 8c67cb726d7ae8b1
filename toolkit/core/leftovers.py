"""Remove the temp files and folders that a killed run of a stage left in its own output folder.

cliptk writes every file through a temp name that carries the writer's pid and renames it into place
(``files.write_bytes_atomic``: ``.NAME.PID-XXXXXXXX``; ``files.replacing_dir``: ``.NAME.tmp-PID-XXXXXXXX`` and
``.NAME.old-PID-XXXXXXXX``; training shards: ``NNNNN.tar.tmp-PID``). A run killed between the two leaves
the temp behind (a checkpoint's is a whole model with its optimiser state), and nothing removed it. The
next run of a stage holds the folder's lock (:func:`toolkit.core.stage.stage_run` calls this right after
taking it), so a temp whose writer is no longer running is dead: it is removed, and the run says so.
Only the output folder and its direct sub-folders (``checkpoints/``) are searched, only names of these
shapes are touched, and a temp whose writer still runs (on this host) is left alone.
"""

from __future__ import annotations

import os
import re

from toolkit.core.files import remove_tree

_TEMP = [
    re.compile(r"^\..+\.(?:tmp-|old-)?(?P<pid>\d+)-[0-9a-f]{8}$"),  # atomic files, replaced folders
    re.compile(r"^[^.].*\.tmp-(?P<pid>\d+)$"),
]  # training shards being written


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead_temp(name: str) -> bool:
    for pattern in _TEMP:
        if (match := pattern.match(name)) is not None:
            pid = int(match["pid"])
            return pid != os.getpid() and not _running(pid)
    return False


def remove_dead_temps(out: str) -> list[str]:
    """Delete the dead temps (module docstring) in local folder ``out`` and its direct sub-folders;
    returns their paths relative to ``out``. Call only while holding ``out``'s lock."""
    removed: list[str] = []
    folders = [out] + [
        e.path for e in _scan(out) if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")
    ]
    for folder in folders:
        for entry in _scan(folder):
            if not _dead_temp(entry.name):
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    remove_tree(entry.path)
                else:
                    os.unlink(entry.path)
            except OSError:
                continue  # not ours to delete after all (another user's): left as it was
            removed.append(os.path.relpath(entry.path, out))
    return sorted(removed)


def _scan(folder: str) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except OSError:
        return []
