"""`toolkit data glyphs`: real fonts (matplotlib's), real PNGs, shardable CSVs, byte-identical reruns."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from toolkit.data.acquire.glyphs import BUILTIN_FONTS, GlyphsConfig, is_candidate, run


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def data_files(root: Path) -> dict[str, bytes]:
    """Every file the command writes for users (the stage's own manifest and config carry times and paths)."""
    skip = {"manifest.json", "config.yaml", "log.jsonl"}
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in skip and not p.name.startswith(".")
    }


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("glyphs") / "set"
    result = run(GlyphsConfig(out=str(out), limit=120, min_fonts=3))
    return out, result


def test_layout_names_and_cmap(small):
    out, result = small
    styles = json.loads((out / "styles.json").read_text())
    assert [s["name"] for s in styles["styles"]] == [Path(f).stem for f in BUILTIN_FONTS]
    chars = rows(out / "characters.csv")
    assert len(chars) == result.counts["num_characters"] <= 120
    assert all(int(c["num_styles"]) >= 3 for c in chars)
    total = 0
    for s in styles["styles"]:
        listed = rows(out / f"{s['name']}.csv")
        assert len(listed) == s["num_characters"]
        total += len(listed)
        for r in listed:
            ch = chr(int(r["codepoint"], 16))
            assert r["caption"] == unicodedata.name(ch) and is_candidate(ord(ch), [])
            with Image.open(out / r["path"]) as img:
                assert (img.mode, img.size) == ("L", (32, 32))
                assert np.asarray(img).min() < 128  # ink: never a blank drawing
    assert total == result.counts["num_pairs"]


def test_one_font_never_draws_two_characters_identically(small):
    out, _ = small
    for s in json.loads((out / "styles.json").read_text())["styles"]:
        seen = {}
        for r in rows(out / f"{s['name']}.csv"):
            key = (out / r["path"]).read_bytes()
            assert key not in seen, f"{s['name']}: {r['caption']} drawn as {seen.get(key)}"
            seen[key] = r["caption"]


def test_lookalikes_are_recorded_and_flagged(tmp_path):
    # LATIN CAPITAL LETTER I (0049) and GREEK CAPITAL LETTER IOTA (0399) are one drawing in DejaVu Sans
    out = tmp_path / "set"
    run(GlyphsConfig(out=str(out), scripts=["0049-0049", "0399-0399"]))
    groups = json.loads((out / "lookalikes.json").read_text())["groups"]
    assert groups[0]["codepoints"] == ["0049", "0399"] and "DejaVuSans" in groups[0]["styles"]
    sans = rows(out / "DejaVuSans.csv")
    assert [r["codepoint"] for r in sans] == ["0049"]  # the lowest code point keeps the drawing
    assert {r["codepoint"]: r["lookalike"] for r in rows(out / "characters.csv")} == {
        "0049": "1",
        "0399": "1",
    }


def test_two_runs_are_byte_identical_and_the_csv_shards(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "toolkit",
                "data",
                "glyphs",
                "--out",
                str(out),
                "--limit",
                "40",
                "--scripts",
                "LATIN,GREEK",
                "--size",
                "24",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert "characters" in proc.stdout and "DejaVuSerif-Bold:" in proc.stdout
    first, second = (data_files(o) for o in outs)
    assert first == second and len(first) > 100
    assert all(r["caption"].startswith(("LATIN ", "GREEK ")) for r in rows(outs[0] / "DejaVuSans.csv"))

    from toolkit.data.acquire.shard import ShardConfig
    from toolkit.data.acquire.shard import run as shard

    source = outs[0] / "DejaVuSans.csv"
    result = shard(ShardConfig(source=str(source), out=str(tmp_path / "raw"), image_size=24))
    assert (result.counts["num_success"], result.counts["num_failed"]) == (len(rows(source)), 0)


def test_bad_font_file_is_named(tmp_path):
    bad = tmp_path / "broken.ttf"
    bad.write_bytes(b"not a font at all")
    with pytest.raises(ValueError, match=r"fonts: .*broken\.ttf: not a readable TrueType/OpenType font"):
        run(GlyphsConfig(out=str(tmp_path / "o1"), fonts=[str(bad)], limit=5))
    with pytest.raises(ValueError, match=r"fonts: .*missing\.ttf: no such font file"):
        run(GlyphsConfig(out=str(tmp_path / "o2"), fonts=[str(tmp_path / "missing.ttf")], limit=5))


def test_extra_font_is_a_style_named_after_its_file(tmp_path):
    import matplotlib

    src = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
    mine = tmp_path / "MyFont.ttf"
    mine.write_bytes(src.read_bytes())
    out = tmp_path / "set"
    result = run(GlyphsConfig(out=str(out), fonts=[str(mine)], builtin_fonts=False, limit=30))
    assert list(result.details["styles"]) == ["MyFont"]
    assert len(rows(out / "MyFont.csv")) == result.counts["num_characters"] > 0
    dup = tmp_path / "DejaVuSans.ttf"
    dup.write_bytes(src.read_bytes())
    with pytest.raises(ValueError, match="style name 'DejaVuSans' is taken"):
        run(GlyphsConfig(out=str(tmp_path / "o3"), fonts=[str(dup)], limit=5))
