"""`toolkit data shard`: local folders and CSVs into fetch's raw shard layout, bad inputs counted by
reason."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from datakit import read_tar
from PIL import Image

from toolkit.data.acquire.shard import PARQUET_COLUMNS, ShardConfig, run
from toolkit.data.raw import layout, reasons

SIZE = 20
# img2dataset's resizer passes albumentations a deprecated argument; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:value is deprecated:DeprecationWarning")


def _image(rng, mode="RGB", fmt="JPEG", size: tuple[int, int] | None = None) -> bytes:
    w, h = size or (int(rng.integers(5, 50)), int(rng.integers(5, 50)))
    arr = rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr[..., 0] if mode == "L" else arr, mode).save(buf, fmt)
    return buf.getvalue()


def _write_deep_images(src: Path, rng: np.random.Generator) -> None:
    """deep.png (16-bit grey around 0x8000) and deep_rgb.png (16-bit RGB at 1/4, 1/2, 3/4), with captions."""
    import cv2

    deep = np.full((25, 25), 0x8000, np.uint16) + rng.integers(0, 256, (25, 25), dtype=np.uint16)
    Image.fromarray(deep).save(src / "deep.png")
    (src / "deep.txt").write_text("caption of deep.png")
    levels = np.array([0x4000, 0x8000, 0xC000], np.uint16) + rng.integers(
        0, 256, (25, 25, 3), dtype=np.uint16
    )
    (src / "deep_rgb.png").write_bytes(cv2.imencode(".png", levels)[1].tobytes())
    (src / "deep_rgb.txt").write_text("caption of deep_rgb.png")


def read_shards(out) -> dict[str, dict]:
    """Caption -> sample metadata over all tars in ``out``; checks each sample's members."""
    found = {}
    for tar_path in sorted(out.glob("*.tar")):
        for key, files in read_tar(tar_path).items():
            assert {"jpg", "txt", "json"} <= set(files)
            meta = json.loads(files["json"])
            assert list(meta) == list(PARQUET_COLUMNS) and meta["key"] == key and meta["status"] == "success"
            assert files["txt"].decode() == meta["caption"]
            img = Image.open(io.BytesIO(files["jpg"]))
            assert img.format == "JPEG" and img.size == (SIZE, SIZE)
            assert img.mode == (
                "L" if meta["url"].endswith(("c.png", "deep.png")) else "RGB"
            )  # grey stays grey
            found[meta["caption"]] = meta
    return found


def read_pixels(out) -> dict[str, np.ndarray]:
    """Caption -> decoded image array over all tars in ``out``."""
    return {
        files["txt"].decode(): np.asarray(Image.open(io.BytesIO(files["jpg"])), np.float64)
        for tar_path in sorted(out.glob("*.tar"))
        for files in read_tar(tar_path).values()
        if "jpg" in files
    }


def test_shard_folder_with_sidecar_captions_counts_bad_inputs(tmp_path):
    rng = np.random.default_rng()
    src = tmp_path / "src"
    (src / "nested").mkdir(parents=True)
    good = {
        "a.jpg": ("RGB", "JPEG"),
        "b.png": ("RGBA", "PNG"),
        "nested/c.png": ("L", "PNG"),
        "d.webp": ("RGB", "WEBP"),
    }
    for name, (mode, fmt) in good.items():
        (src / name).write_bytes(_image(rng, mode, fmt))
        (src / name).with_suffix(".txt").write_text(f"  caption of {name}\n")
    # 16 bits per sample: img2dataset alone would saturate these to white; they must keep their levels
    _write_deep_images(src, rng)
    (src / "nocap.jpg").write_bytes(_image(rng))
    (src / "blank.jpg").write_bytes(_image(rng))
    (src / "blank.txt").write_text(" \n\t")
    (src / "latin1.jpg").write_bytes(_image(rng))
    (src / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    half = _image(
        rng, size=(48, 40)
    )  # a tiny JPEG cut in half can end inside its Huffman tables: not_an_image
    (src / "half.jpg").write_bytes(half[: len(half) // 2])
    (src / "half.txt").write_text("a truncated file")
    (src / "fake.png").write_bytes(b"not a png at all")
    (src / "fake.txt").write_text("fake")
    (src / "orphan.txt").write_text("no image")
    (src / "notes.md").write_text("ignored")

    out = tmp_path / "raw"
    result = run(ShardConfig(source=str(src), out=str(out), image_size=SIZE, samples_per_shard=3))
    c = result.counts
    assert (c["num_inputs"], c["num_success"], c["num_failed"], c["num_shards"]) == (11, 6, 5, 4)
    assert c["failed_by_reason"] == {
        "caption_not_utf8": 1,
        "empty_caption": 1,
        "missing_caption": 1,
        "not_an_image": 1,
        "truncated_image": 1,
    }
    assert result.details["other_files"] == {"captions_without_image": 1, "ignored_files": 1}
    samples = read_shards(out)
    assert sorted(samples) == sorted(f"caption of {name}" for name in [*good, "deep.png", "deep_rgb.png"])
    assert samples["caption of nested/c.png"]["url"] == (src / "nested" / "c.png").as_uri()
    pixels = read_pixels(out)
    assert abs(pixels["caption of deep.png"].mean() - 128) < 3
    assert sorted(
        np.round(pixels["caption of deep_rgb.png"].reshape(-1, 3).mean(0)).tolist()
    ) == pytest.approx([64, 128, 192], abs=3)
    assert layout.finished_shards(str(out)) == {0, 1, 2, 3}
    stats = layout.read_stats(str(out))
    assert reasons.summarize(stats)["failed_by_reason"] == c["failed_by_reason"]  # the same reasons as fetch
    import pyarrow.parquet as pq

    rows = [r for i in range(4) for r in pq.read_table(out / f"{layout.shard_stem(i)}.parquet").to_pylist()]
    assert len(rows) == 11 and sum(r["status"] == "success" for r in rows) == 6
    assert all(r["error_message"] for r in rows if r["status"] != "success")


def test_deep_images_keep_their_levels_without_the_strict_check(tmp_path):
    # the 16-bit handling is not part of the strict check: strict_decode=False must not turn them white
    rng = np.random.default_rng()
    src = tmp_path / "src"
    src.mkdir()
    _write_deep_images(src, rng)
    out = tmp_path / "raw"
    result = run(ShardConfig(source=str(src), out=str(out), image_size=SIZE, strict_decode=False))
    assert (result.counts["num_success"], result.counts["num_failed"]) == (2, 0)
    assert sorted(read_shards(out)) == ["caption of deep.png", "caption of deep_rgb.png"]
    pixels = read_pixels(out)
    assert abs(pixels["caption of deep.png"].mean() - 128) < 3
    assert sorted(
        np.round(pixels["caption of deep_rgb.png"].reshape(-1, 3).mean(0)).tolist()
    ) == pytest.approx([64, 128, 192], abs=3)


def test_shard_csv_relative_and_absolute_paths_and_rerun_replaces_shards(tmp_path):
    rng = np.random.default_rng()
    (tmp_path / "imgs").mkdir()
    for i in range(5):
        (tmp_path / "imgs" / f"{i}.jpg").write_bytes(_image(rng))
    absolute = tmp_path / "imgs" / "4.jpg"
    csv_path = tmp_path / "list.csv"
    csv_path.write_text(
        "path,caption,extra\n"
        'imgs/0.jpg,"a dog, sitting",x\n'
        "imgs/1.jpg,   ,x\n"  # whitespace caption
        "imgs/missing.jpg,lost,x\n"
        ",no path,x\n"
        f"{absolute},absolute path,x\n"
        "imgs/2.jpg,two,x\n"
    )
    out = tmp_path / "raw"
    result = run(ShardConfig(source=str(csv_path), out=str(out), image_size=SIZE, samples_per_shard=4))
    assert (result.counts["num_success"], result.counts["num_shards"]) == (3, 2)
    assert result.counts["failed_by_reason"] == {"missing_image": 2, "empty_caption": 1}
    assert sorted(read_shards(out)) == ["a dog, sitting", "absolute path", "two"]

    # a smaller source replaces the earlier shards instead of leaving shard 1 behind
    csv_path.write_text("path,caption\nimgs/3.jpg,three\n")
    result = run(ShardConfig(source=str(csv_path), out=str(out), image_size=SIZE, samples_per_shard=4))
    assert result.counts["num_shards"] == 1 and sorted(read_shards(out)) == ["three"]
    assert sorted(p.name for p in out.glob("0*")) == ["00000.parquet", "00000.tar", "00000_stats.json"]


def test_shard_errors_name_the_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="shard source not found"):
        run(ShardConfig(source=str(tmp_path / "nowhere"), out=str(tmp_path / "o")))
    bad_cols = tmp_path / "cols.csv"
    bad_cols.write_text("file,text\na.jpg,hi\n")
    with pytest.raises(ValueError, match=r"cols.csv: no column 'path' \(path_col\); columns are: file, text"):
        run(ShardConfig(source=str(bad_cols), out=str(tmp_path / "o")))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "x.jpg").write_bytes(b"\xff\xd8 broken")  # no caption either
    with pytest.raises(RuntimeError, match=r"no valid sample .*missing_caption 1"):
        run(ShardConfig(source=str(empty), out=str(tmp_path / "o2")))
    manifest = json.loads((tmp_path / "o2" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["counts"]["failed_by_reason"] == {"missing_caption": 1}


def test_threaded_shard_keeps_stdout_and_stderr(tmp_path, capfd):
    # img2dataset's resizer silences fds 1 and 2 around each call with dup2; called from several threads
    # at once, that leaves the whole process writing to /dev/null. Shard resizes on one thread only.
    rng = np.random.default_rng()
    src = tmp_path / "many"
    src.mkdir()
    for i in range(150):
        (src / f"{i}.png").write_bytes(_image(rng, "RGB", "PNG"))
        (src / f"{i}.txt").write_text(f"image {i}")
    result = run(ShardConfig(source=str(src), out=str(tmp_path / "raw"), image_size=SIZE, num_threads=4))
    assert result.counts["num_success"] == 150
    os.write(1, b"stdout still open\n")
    os.write(2, b"stderr still open\n")
    captured = capfd.readouterr()
    assert "stdout still open" in captured.out and "stderr still open" in captured.err


def test_shard_csv_with_a_bom_duplicate_paths_and_bom_captions(tmp_path, caplog):
    rng = np.random.default_rng()
    (tmp_path / "imgs").mkdir()
    for i in range(3):
        (tmp_path / "imgs" / f"{i}.jpg").write_bytes(_image(rng))
    csv_path = tmp_path / "excel.csv"  # "CSV UTF-8" from a spreadsheet: a byte order mark before 'path'
    csv_path.write_bytes(
        "\ufeffpath,caption\n"
        "imgs/0.jpg,\ufeffzero\n"
        "imgs/1.jpg,one\n"
        "imgs/./0.jpg,zero again\n"  # the same file, spelled differently
        f"{tmp_path / 'imgs' / '0.jpg'},zero a third time\n"
        "imgs/2.jpg,two\n".encode()
    )
    out = tmp_path / "raw"
    result = run(ShardConfig(source=str(csv_path), out=str(out), image_size=SIZE))
    assert (result.counts["num_success"], result.counts["failed_by_reason"]) == (3, {"duplicate_url": 2})
    assert sorted(read_shards(out)) == ["one", "two", "zero"]  # the first row of each image, no BOM left
    assert any("excel.csv line 4 names the image of line 2" in m for m in result.details["error_messages"])
    kept = run(
        ShardConfig(source=str(csv_path), out=str(tmp_path / "all"), image_size=SIZE, keep_duplicates=True)
    )
    assert kept.counts["num_success"] == 5

    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.jpg").write_bytes(_image(rng))
    (folder / "a.txt").write_bytes("\ufeffa caption saved by notepad\r\n".encode())
    (folder / "more.tar.gz").write_bytes(b"\x1f\x8b not read")
    result = run(ShardConfig(source=str(folder), out=str(tmp_path / "f"), image_size=SIZE))
    assert sorted(read_shards(tmp_path / "f")) == ["a caption saved by notepad"]
    assert result.details["ignored_files"] == ["more.tar.gz"]
    log = (tmp_path / "f" / "log.jsonl").read_text()
    assert "are neither images" in log and "more.tar.gz" in log


def test_shard_and_fetch_overwrite_never_delete_files_they_did_not_write(tmp_path):
    from toolkit.data.acquire.fetch import run as fetch
    from toolkit.data.acquire.fetch_config import FetchConfig

    rng = np.random.default_rng()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.jpg").write_bytes(_image(rng))
    (tmp_path / "src" / "a.txt").write_text("a")
    mine = tmp_path / "mine"  # a user's folder with files that merely look like shards
    mine.mkdir()
    for name in ("00000.tar", "00001.parquet", "2023.parquet", "1.tar"):
        (mine / name).write_bytes(b"precious " + name.encode())
    with pytest.raises(
        ValueError,
        match=r"mine holds 2 file\(s\) named like shards \(e\.g\. 00000\.tar\) and no "
        r"manifest: they were not written by data\.shard",
    ):
        run(ShardConfig(source=str(tmp_path / "src"), out=str(mine), image_size=SIZE))
    urls = tmp_path / "urls.txt"
    urls.write_text("http://127.0.0.1:1/a.jpg\n")
    with pytest.raises(ValueError, match="named like shards .* not written by data.fetch or data.shard"):
        fetch(FetchConfig(urls=str(urls), out=str(mine), overwrite=True))
    assert sorted(p.name for p in mine.iterdir()) == ["00000.tar", "00001.parquet", "1.tar", "2023.parquet"]
    assert all(p.read_bytes() == b"precious " + p.name.encode() for p in mine.iterdir())

    (mine / "00000.tar").unlink()
    (mine / "00001.parquet").unlink()
    run(
        ShardConfig(source=str(tmp_path / "src"), out=str(mine), image_size=SIZE)
    )  # only unrelated names left
    run(ShardConfig(source=str(tmp_path / "src"), out=str(mine), image_size=SIZE))  # replaces its own shards
    assert {"1.tar", "2023.parquet", "00000.tar"} <= {p.name for p in mine.iterdir()}
    assert (mine / "2023.parquet").read_bytes() == b"precious 2023.parquet"


def test_progress_counts_samples_not_shards(tmp_path, monkeypatch):
    """Nine inputs into one shard: progress moves per sample (it used to sit at 0/1 shards to the end)."""
    import toolkit.core.log as log

    monkeypatch.setattr(log, "PROGRESS_LOG_INTERVAL_S", 0.0)
    rng = np.random.default_rng(2)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(9):
        (src / f"{i}.jpg").write_bytes(_image(rng))
        (src / f"{i}.txt").write_text(f"caption {i}")
    out = tmp_path / "raw"
    run(ShardConfig(source=str(src), out=str(out), image_size=SIZE, samples_per_shard=100))
    messages = [json.loads(x)["message"] for x in (out / "log.jsonl").read_text().splitlines()]
    counts = [m.split(" (")[0] for m in messages if m.startswith("shard: ") and " samples (" in m]
    assert counts == [f"shard: {i}/9 samples" for i in range(1, 10)]
