"""Every bad-input kind is skipped (or converted) and counted by reason and key; nothing crashes."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from datakit import MODEL, SIZE, encode, good_samples, precompute, random_image, read_meta, write_raw_shard
from PIL import Image

from toolkit.data.images import ImageError, decode_rgb
from toolkit.data.trainset.loader import make_loader


def test_skips_by_reason_and_key(bad_raw, bad_train):
    _, expected = bad_raw
    out, result = bad_train
    skipped = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    by_reason: dict[str, set] = {}
    for s in skipped:
        by_reason.setdefault(s["reason"], set()).add(s["key"])
    assert by_reason == expected["skipped"]
    counts = result.counts
    assert counts["skipped"] == {r: len(k) for r, k in expected["skipped"].items()}
    assert counts["num_skipped"] == len(skipped) == 14
    assert counts["num_samples"] == len(expected["kept"]) == 19
    assert counts["num_read"] == counts["num_samples"] + counts["num_skipped"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "done"
    assert manifest["counts"]["skipped"] == counts["skipped"]
    assert set(manifest["details"]["skipped_keys"]["truncated_tar"]) == {
        "00002.tar:g0003",
        "00002.tar:g0004",
        "00002.tar:g0005",
    }
    assert manifest["details"]["tar_errors"].keys() == {"00002.tar", "00003.tar"}


def test_conversions_counted_and_kept(bad_raw, bad_train):
    _, expected = bad_raw
    out, result = bad_train
    assert result.counts["converted"] == expected["converted"]
    meta = read_meta(out)
    assert {m["key"] for m in meta} == expected["kept"]
    assert [m["id"] for m in meta] == list(range(len(meta)))
    # duplicates: the first occurrence (tar order, then shard order) is the one kept
    captions = {m["key"]: m["caption"] for m in meta}
    assert captions["a0001"] == "photo number 1 of a" and captions["a0000"] == "photo number 0 of a"
    assert captions["b_exact"] == expected["captions"]["b_exact"]


def test_exact_pixels_after_conversion(bad_raw, bad_train):
    _, expected = bad_raw
    out, _ = bad_train
    ids = {m["key"]: m["id"] for m in read_meta(out)}
    images = {}
    for batch in make_loader(str(out), batch_size=5, shuffle=False):
        images.update(zip(batch["index"].tolist(), batch["image"].numpy(), strict=True))
    assert len(images) == len(ids)
    for key, pixels in expected["pixels"].items():
        np.testing.assert_array_equal(images[ids[key]], pixels, err_msg=key)


def test_no_valid_sample_is_an_error_naming_the_input(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    write_raw_shard(
        raw / "00000.tar",
        [
            ("k1", {"jpg": b"not an image", "txt": b"x"}),
            ("k2", {"jpg": encode(Image.new("RGB", (8, 8)), "JPEG"), "txt": b" "}),
        ],
    )
    with pytest.raises(ValueError, match=str(raw)) as err:
        precompute(raw, tmp_path / "out", num_workers=1)
    assert "corrupt_image: 1" in str(err.value) and "empty_caption: 1" in str(err.value)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "failed"


def test_out_equal_to_input_is_refused(bad_raw):
    from toolkit.core.config import ConfigError

    with pytest.raises(ConfigError, match="must differ from input"):
        precompute(bad_raw[0], str(bad_raw[0]) + "/", num_workers=1)


def test_truncation_without_parquet_uses_stats_count(tmp_path):
    rng = np.random.default_rng(5)
    raw = tmp_path / "raw"
    raw.mkdir()
    samples = [
        (f"k{i}", {"jpg": encode(random_image(rng, 20, 20), "JPEG"), "txt": b"a cat"}) for i in range(5)
    ]
    path = write_raw_shard(raw / "00000.tar", samples)
    (raw / "00000.parquet").unlink()
    with tarfile.open(path) as tar:  # cut exactly at a member boundary: tarfile itself sees no error
        boundary = [m for m in tar.getmembers() if m.name == "k3.jpg"][0].offset
    path.write_bytes(path.read_bytes()[:boundary])
    result = precompute(raw, tmp_path / "out", num_workers=1, max_truncated_share=1)
    assert result.counts["num_samples"] == 3
    # no end-of-archive marker: the tar was cut, so the two samples it lost are truncated_tar
    assert result.counts["skipped"] == {"truncated_tar": 2}
    assert result.counts["num_damaged_tars"] == 1


def test_clean_tar_with_fewer_samples_than_promised_is_missing_from_tar(tmp_path):
    rng = np.random.default_rng(6)
    raw = tmp_path / "raw"
    raw.mkdir()
    samples = [
        (f"k{i}", {"jpg": encode(random_image(rng, 20, 20), "JPEG"), "txt": b"a cat"}) for i in range(3)
    ]
    write_raw_shard(raw / "00000.tar", samples, successes=5)  # a whole tar, but the stats promise 5
    (raw / "00000.parquet").unlink()
    result = precompute(raw, tmp_path / "out", num_workers=1, max_truncated_share=1)
    assert result.counts["skipped"] == {"missing_from_tar": 2} and result.counts["num_damaged_tars"] == 0


@pytest.mark.parametrize("mode", ["center_crop", "pad"])
def test_decode_rgb_shapes_and_odd_sizes(mode):
    rng = np.random.default_rng(0)
    for w, h in [(1, 1), (97, 61), (5, 300)]:
        arr, converted = decode_rgb(encode(random_image(rng, w, h), "PNG"), 17, mode)
        assert arr.shape == (17, 17, 3) and arr.dtype == np.uint8 and converted is None


def test_decode_rgb_cmyk_and_bomb_limit():
    rng = np.random.default_rng(1)
    cmyk = random_image(rng, 24, 24, "CMYK")
    arr, converted = decode_rgb(encode(cmyk, "TIFF"), 24)
    np.testing.assert_array_equal(arr, np.asarray(cmyk.convert("RGB")))  # lossless TIFF: PIL's own converter
    assert converted == "CMYK"
    with pytest.raises(ImageError) as err:
        decode_rgb(encode(random_image(rng, 30, 30), "PNG"), 8, max_pixels=899)
    assert err.value.reason == "decompression_bomb"
    assert decode_rgb(encode(random_image(rng, 30, 30), "PNG"), 8, max_pixels=900)[0].shape == (8, 8, 3)


def test_truncated_image_is_not_half_decoded():
    data = encode(random_image(np.random.default_rng(2), 64, 64), "PNG")
    with pytest.raises(ImageError) as err:
        decode_rgb(data[: len(data) - 100], SIZE)
    assert err.value.reason == "corrupt_image"


def test_raw_reader_keeps_samples_before_damage(tmp_path):
    from toolkit.data.raw.reader import RawShardReader

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [("a.jpg", b"1" * 600), ("a.txt", b"cap"), ("b.jpg", b"2" * 2000), ("b.txt", b"c")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path = tmp_path / "x.tar"
    path.write_bytes(buf.getvalue()[: 2048 + 512 + 700])  # inside b.jpg
    reader = RawShardReader(str(path))
    assert [s.key for s in reader.samples()] == ["a"]
    assert reader.error_kind == "truncated_tar" and reader.cut_key == "b"


def _two_sample_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in [("a.jpg", b"1" * 600), ("a.txt", b"cap"), ("b.jpg", b"2" * 700), ("b.txt", b"c")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return (
        buf.getvalue()
    )  # members at 0 (a.jpg), 1536 (a.txt), 2560 (b.jpg), 4096 (b.txt); end marker at 5120


@pytest.mark.parametrize(
    "cut, keys, cut_key, where",
    [
        (4096 + 100, ["a"], "b", "cut inside the member header at byte 4096"),  # b.txt's header cut: b lost
        (
            4096,
            ["a"],
            "b",
            "no end-of-archive marker after byte 4096",
        ),  # at a member boundary inside sample b
        (2560, ["a"], None, "no end-of-archive marker after byte 2560"),  # at a sample boundary: nothing cut
        (5120, ["a", "b"], None, "no end-of-archive marker after byte 5120"),  # every member, no end marker
    ],
)
def test_raw_reader_detects_cuts_tarfile_takes_for_a_clean_end(tmp_path, caplog, cut, keys, cut_key, where):
    from toolkit.data.raw.reader import RawShardReader

    path = tmp_path / "x.tar"
    path.write_bytes(_two_sample_tar()[:cut])
    reader = RawShardReader(str(path))
    assert [s.key for s in reader.samples()] == keys
    assert reader.error_kind == "truncated_tar" and reader.cut_key == cut_key and where in reader.error
    assert any(where in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


def test_raw_reader_whole_tar_and_damaged_header(tmp_path):
    from toolkit.data.raw.reader import RawShardReader

    data = _two_sample_tar()
    path = tmp_path / "x.tar"
    path.write_bytes(data)
    reader = RawShardReader(str(path))
    assert [s.key for s in reader.samples()] == ["a", "b"] and reader.error is None
    path.write_bytes(data[:2560] + b"garbage!" * 64 + data[3072:])  # b.jpg's header overwritten
    reader = RawShardReader(str(path))
    assert [s.key for s in reader.samples()] == ["a"]
    assert reader.error_kind == "truncated_tar" and "damaged member header at byte 2560" in reader.error


def test_precompute_reports_a_tar_cut_mid_header_on_the_terminal_log_and_counts(tmp_path):
    import json as _json

    rng = np.random.default_rng(8)
    raw = tmp_path / "raw"
    raw.mkdir()
    samples = [
        (f"k{i}", {"jpg": encode(random_image(rng, 20, 20), "JPEG"), "txt": b"a cat"}) for i in range(4)
    ]
    path = write_raw_shard(raw / "00000.tar", samples)
    with tarfile.open(path) as tar:  # cut inside k2.txt's header: k2 has its image, not its caption
        header = [m for m in tar.getmembers() if m.name == "k2.txt"][0].offset
    path.write_bytes(path.read_bytes()[: header + 200])
    out = tmp_path / "out"
    result = precompute(raw, out, num_workers=1, max_truncated_share=1)
    assert result.counts["skipped"] == {"truncated_tar": 2}  # k2 (cut) and k3 (lost); not missing_caption
    assert result.counts["num_damaged_tars"] == 1
    logged = [_json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert any(
        e["level"] == "WARNING"
        and "00000.tar" in e["message"]
        and "cut inside the member header" in e["message"]
        for e in logged
    )
    from typer.testing import CliRunner

    from toolkit.cli.main import app

    res = CliRunner().invoke(
        app,
        [
            "data",
            "precompute",
            "--in",
            str(raw),
            "--out",
            str(tmp_path / "cli"),
            "--model",
            MODEL,
            "--workers",
            "1",
            "--set",
            "max_truncated_share=1",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "damaged: 00000.tar: tar file ends early or is damaged: cut inside the member header" in res.output


def test_precompute_over_mostly_truncated_shards_fails_naming_them(tmp_path):
    """Issue 34 class 9: 3 of 4 raw shards cut by a full disk; precompute kept 117 of 400 samples and exited
    0."""
    rng = np.random.default_rng(9)
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(4):
        path = write_raw_shard(raw / f"{i:05d}.tar", good_samples(rng, f"s{i}_", 10, size=(20, 20)))
        if i:
            path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 3])  # as a full disk leaves it
    with pytest.raises(
        ValueError,
        match=r"of 40 samples .* lost to truncated or unreadable raw shards, more than "
        r"max_truncated_share=0.05: 00001.tar \(\d+ lost\), 00002.tar",
    ) as err:
        precompute(raw, tmp_path / "out", num_workers=1)
    assert "00000.tar" not in str(err.value)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["status"] == "failed"
    kept = precompute(raw, tmp_path / "kept", num_workers=1, max_truncated_share=1)  # explicitly allowed
    assert 10 <= kept.counts["num_samples"] < 40
