"""core.files atomic writers: files and whole directories appear complete or not at all."""

from __future__ import annotations

import os

import pytest

from toolkit.core import files


def test_replacing_dir_swaps_whole_folder_and_cleans_up(tmp_path):
    target = tmp_path / "set" / "test"
    with files.replacing_dir(target) as tmp:
        (tmp / "0.tar").write_bytes(b"first")
        assert not target.exists()  # nothing visible until the block ends
    (target / "stale.txt").write_text("from the first run")
    with files.replacing_dir(str(target)) as tmp:
        (tmp / "0.tar").write_bytes(b"second")
    assert (
        sorted(p.name for p in target.iterdir()) == ["0.tar"] and (target / "0.tar").read_bytes() == b"second"
    )
    assert sorted(p.name for p in target.parent.iterdir()) == ["test"]  # no temp or old folders left
    umask = os.umask(0o022)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o777 & ~umask  # like mkdir, not mkdtemp's 0700


def test_replacing_dir_failure_keeps_old_folder(tmp_path):
    target = tmp_path / "ck"
    with files.replacing_dir(target) as tmp:
        (tmp / "w").write_bytes(b"old")
    with pytest.raises(OSError, match="disk full"), files.replacing_dir(target) as tmp:
        (tmp / "w").write_bytes(b"half")
        raise OSError("disk full")
    assert (target / "w").read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_write_bytes_atomic_replaces_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "chart.png"
    files.write_bytes_atomic(str(path), b"\x89PNG one")
    files.write_bytes_atomic(str(path), b"\x89PNG two")
    assert path.read_bytes() == b"\x89PNG two" and [p.name for p in path.parent.iterdir()] == ["chart.png"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_write_bytes_atomic_follows_the_umask_like_open(tmp_path, umask):
    # mkstemp creates 0600 files whatever the umask; atomically written manifests and reports must get
    # the same mode as the tars beside them (open() with 0666 & ~umask)
    old = os.umask(umask)
    try:
        files.write_text_atomic(str(tmp_path / "manifest.json"), "{}")
        (tmp_path / "plain.tar").write_bytes(b"")
    finally:
        os.umask(old)
    assert (tmp_path / "manifest.json").stat().st_mode & 0o777 == 0o666 & ~umask
    assert (tmp_path / "manifest.json").stat().st_mode & 0o777 == (
        tmp_path / "plain.tar"
    ).stat().st_mode & 0o777
