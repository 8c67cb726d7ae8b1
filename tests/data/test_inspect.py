"""inspect on training and raw shard folders: counts, skip reasons, caption histogram, contact sheet."""

from __future__ import annotations

import json

import pytest
from datakit import precompute
from PIL import Image

from toolkit.core.config import build
from toolkit.data.inspect import InspectConfig, histogram, run


def _inspect(input_dir, out, **kw):
    return run(build(InspectConfig, {"input": str(input_dir), "out": str(out), **kw}))


def test_inspect_training_shards(bad_train, tmp_path):
    out, pre = bad_train
    result = _inspect(out, tmp_path / "report", num_contact=9, thumb_size=16)
    d = result.details
    assert d["kind"] == "training" and d["num_samples"] == 19 and d["num_shards"] == 3
    assert d["skipped"] == {"precompute": pre.counts["skipped"]}
    assert d["converted"] == pre.counts["converted"]
    assert sum(b["count"] for b in d["caption_words"]) == 19
    words = {b["words"]: b["count"] for b in d["caption_words"]}
    assert words["5-8"] == 10  # "photo number i of a|f|g" captions
    sheet = Image.open(result.outputs["contact_sheet"])
    assert sheet.size == (3 * 16, 3 * (16 + 12))
    assert json.loads((tmp_path / "report" / "report.json").read_text())["num_samples"] == 19


def test_inspect_raw_shards_reports_damage(bad_raw, tmp_path):
    raw, _ = bad_raw
    d = _inspect(raw, tmp_path / "report", num_contact=100).details
    assert d["kind"] == "raw" and d["num_shards"] == 4
    assert d["num_samples"] == 29  # 21 + 5 + 3 readable before the truncation + 0 (not a tar)
    assert set(d["tar_errors"]) == {"00002.tar", "00003.tar"}
    assert d["contact_sheet_decode_errors"] == {"corrupt_image": 2, "decompression_bomb": 1}
    assert d["members_by_ext"]["webp"] == 1


def test_inspect_features_only_has_no_sheet(small_raw, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "00000.tar").write_bytes((small_raw / "00003.tar").read_bytes())
    precompute(raw, tmp_path / "lit", num_workers=1, image_tower="open_clip", image_tower_model="cliptk-tiny")
    result = _inspect(tmp_path / "lit", tmp_path / "report")
    assert "contact_sheet" not in result.outputs and "no pixels" in result.details["contact_sheet_note"]


def test_histogram_bins():
    bins = histogram([0, 1, 2, 3, 4, 5, 70])
    assert [b["words"] for b in bins][:4] == ["0", "1", "2", "3-4"] and bins[-1]["words"] == "65+"
    assert [b["count"] for b in bins] == [1, 1, 1, 2, 1, 0, 0, 0, 1]


def test_cli_inspect_prints_summary(bad_train, tmp_path):
    from typer.testing import CliRunner

    from toolkit.cli.main import app

    out, _ = bad_train
    res = CliRunner().invoke(
        app, ["data", "inspect", str(out), "--out", str(tmp_path / "r"), "--num-contact", "4"]
    )
    assert res.exit_code == 0, res.output
    assert "19 samples" in res.output and "truncated_tar 3" in res.output and "caption length" in res.output


@pytest.mark.filterwarnings(
    "ignore:value is deprecated:DeprecationWarning"
)  # img2dataset's resizer, not ours
def test_cli_inspect_of_raw_shards_prints_skip_reasons_and_compressed_tars(tmp_path):
    import io as _io

    import numpy as np
    from typer.testing import CliRunner

    from toolkit.cli.main import app
    from toolkit.data.acquire.shard import ShardConfig
    from toolkit.data.acquire.shard import run as shard

    src = tmp_path / "src"
    src.mkdir()
    buf = _io.BytesIO()
    Image.fromarray(np.full((9, 9, 3), 200, np.uint8)).save(buf, "PNG")
    for name in ("a", "b", "c"):
        (src / f"{name}.png").write_bytes(buf.getvalue())
    (src / "a.txt").write_text("a caption")
    (src / "b.txt").write_text("   ")  # empty caption; c has none
    raw = tmp_path / "raw"
    shard(build(ShardConfig, {"source": str(src), "out": str(raw), "image_size": 8}))
    (raw / "more.tar.gz").write_bytes(b"\x1f\x8b")
    res = CliRunner().invoke(app, ["data", "inspect", str(raw), "--out", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    assert "skipped (shards): empty_caption 1, missing_caption 1" in res.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["skipped"] == {"shards": {"empty_caption": 1, "missing_caption": 1}}
    log = (tmp_path / "r" / "log.jsonl").read_text()
    assert "1 compressed tar(s) ignored (more.tar.gz): only plain .tar shards are read" in log


def test_cli_precompute_names_the_mode_of_converted_images(tmp_path):
    import numpy as np
    from datakit import MODEL, encode, write_raw_shard
    from typer.testing import CliRunner

    from toolkit.cli.main import app

    raw = tmp_path / "raw"
    raw.mkdir()
    bilevel = encode(Image.fromarray(np.eye(16, dtype=bool)), "PNG")  # mode '1'
    write_raw_shard(raw / "00000.tar", [("k0", {"png": bilevel, "txt": b"a diagonal"})])
    res = CliRunner().invoke(
        app,
        [
            "data",
            "precompute",
            "--in",
            str(raw),
            "--out",
            str(tmp_path / "t"),
            "--model",
            MODEL,
            "--workers",
            "1",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "converted to RGB: 1 from mode '1'" in res.output and "converted: 1 1" not in res.output
