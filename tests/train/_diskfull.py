"""A full disk under one folder, at the os level, for a training subprocess (issue 25 item 4).

``install(folder, free_bytes)`` makes ``os.write`` to any file under ``folder`` fail with ENOSPC once
``free_bytes`` have been written there in total, as a disk with that much space left does (the checkpoint
writer writes with ``os.write``). Files deleted under the folder do not give space back; the tests size
``free_bytes`` so that the first checkpoint fits and the second does not. Used as
``python -c "import _diskfull; _diskfull.install(F, N); from toolkit.cli.main import main; main()" ARGS``.
"""

from __future__ import annotations

import errno
import os

_real_write = os.write


def install(folder: str, free_bytes: int) -> None:
    root = os.path.realpath(folder) + os.sep
    left = [free_bytes]

    def write(fd: int, data) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target.startswith(root):
            if len(data) > left[0]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            left[0] -= len(data)
        return _real_write(fd, data)

    os.write = write
