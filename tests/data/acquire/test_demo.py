"""`toolkit data demo`: Twemoji + OpenMoji of the same concepts from registry packages, in the contract
layout."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from toolkit.data.acquire.demo import COLUMNS, DemoConfig, caption_for, load_concepts, run

GROUPS = {
    "Smileys & Emotion",
    "People & Body",
    "Animals & Nature",
    "Food & Drink",
    "Travel & Places",
    "Activities",
    "Objects",
    "Symbols",
    "Flags",
}
pytestmark = pytest.mark.filterwarnings("ignore:value is deprecated:DeprecationWarning")


def read_csv(path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    return rows, reader.fieldnames


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "emoji"
    return out, run(DemoConfig(out=str(out), limit=30))


def test_demo_layout_contract(demo):
    out, result = demo
    assert result.outputs == {
        "root": str(out),
        "train_csv": str(out / "twemoji.csv"),
        "eval_csv": str(out / "openmoji.csv"),
        "train_urls": str(out / "twemoji_urls.csv"),
        "eval_urls": str(out / "openmoji_urls.csv"),
    }
    assert result.counts["num_concepts"] == 30 and result.counts["num_groups"] == 9
    tw, tw_cols = read_csv(out / "twemoji.csv")
    om, om_cols = read_csv(out / "openmoji.csv")
    assert (
        tuple(tw_cols) == COLUMNS == ("path", "caption", "group", "subgroup", "codepoints") == tuple(om_cols)
    )
    assert len(tw) == len(om) == 30
    assert {r["group"] for r in tw} == GROUPS
    assert tw[0]["caption"] == "grinning face" and tw[0]["codepoints"] == "1f600"
    captions = [r["caption"] for r in tw]
    assert len(set(captions)) == 30 and all(c.strip() == c and c for c in captions)
    for t, o in zip(tw, om, strict=True):
        assert (t["caption"], t["group"], t["subgroup"], t["codepoints"]) == (
            o["caption"],
            o["group"],
            o["subgroup"],
            o["codepoints"],
        )
        assert (
            t["path"] == f"twemoji/{t['codepoints']}.png" and o["path"] == f"openmoji/{o['codepoints']}.png"
        )
        a, b = Image.open(out / t["path"]), Image.open(out / o["path"])
        assert (a.format, a.mode, a.size) == (b.format, b.mode, b.size) == ("PNG", "RGB", (72, 72))
        x, y = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert x.std() > 10 and y.std() > 10  # drawn, not blank
        assert np.abs(x - y).mean() > 5  # two different artists
    assert len(list((out / "twemoji").glob("*.png"))) == len(list((out / "openmoji").glob("*.png"))) == 30
    for artist, rows in (("twemoji", tw), ("openmoji", om)):
        urls, cols = read_csv(out / f"{artist}_urls.csv")
        assert tuple(cols) == ("url", "caption")
        assert [u["url"] for u in urls] == [(out.resolve().as_uri() + "/" + r["path"]) for r in rows]
        assert [u["caption"] for u in urls] == [r["caption"] for r in rows]
    assert "CC BY-SA 4.0" in (out / "ATTRIBUTION.md").read_text()
    assert json.loads((out / "manifest.json").read_text())["status"] == "done"


def test_all_concepts_have_both_artists_and_unicode_names():
    concepts, skipped = load_concepts()
    assert len(concepts) > 1800 and skipped["component"] > 0
    assert {c.group for c in concepts} == GROUPS
    assert len({c.caption for c in concepts}) == len(concepts)  # a caption names one concept
    by_caption = {c.caption: c for c in concepts}
    assert by_caption["dog face"].codepoints == "1f436"
    assert by_caption["woman scientist"].codepoints == "1f469-200d-1f52c"
    assert by_caption["flag: Japan"].subgroup == "country-flag"
    assert by_caption["keycap: #"].codepoints == "0023-fe0f-20e3"
    assert caption_for(":Santa_Claus:", "person-fantasy") == "Santa Claus"


def test_demo_cli_base_url_then_shard_the_training_csv(tmp_path):
    out = tmp_path / "demo"
    config = tmp_path / "demo.yaml"
    config.write_text(f"out: {out}\n")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolkit",
            "data",
            "demo",
            "-c",
            str(config),
            "--limit",
            "12",
            "--base-url",
            "http://127.0.0.1:8765",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stdout.startswith("12 concepts in") and f"train_urls: {out / 'twemoji_urls.csv'}" in proc.stdout
    )
    urls, _ = read_csv(out / "openmoji_urls.csv")
    assert all(u["url"].startswith("http://127.0.0.1:8765/openmoji/") for u in urls)

    from toolkit.data.acquire.shard import ShardConfig
    from toolkit.data.acquire.shard import run as shard

    result = shard(ShardConfig(source=str(out / "twemoji.csv"), out=str(tmp_path / "raw"), image_size=32))
    assert (result.counts["num_success"], result.counts["num_failed"]) == (12, 0)


def test_pipeline_validates_demo_fetch_shard_references(tmp_path):
    from toolkit.core.config import ConfigError
    from toolkit.pipeline.load import load_pipeline

    text = """
stages:
  - {name: demo, kind: data.demo, config: {limit: 20}}
  - {name: fetch, kind: data.fetch, config: {urls: "${stages.demo.outputs.train_urls}", image_size: 64}}
  - {name: local, kind: data.shard, config: {source: "${stages.demo.outputs.eval_csv}"}}
"""
    path = tmp_path / "p.yaml"
    path.write_text(text)
    pipe = load_pipeline(str(path))
    assert [s.kind for s in pipe.stages] == ["data.demo", "data.fetch", "data.shard"]
    path.write_text(text.replace("outputs.eval_csv", "outputs.eval_set"))
    with pytest.raises(ConfigError, match="has no output 'eval_set'"):
        load_pipeline(str(path))


@pytest.mark.slow
def test_demo_served_over_http_fetches_every_image(demo, tmp_path):
    from toolkit.data.acquire.fetch import run as fetch
    from toolkit.data.acquire.fetch_config import FetchConfig
    from toolkit.data.acquire.serve import serve

    out, _ = demo
    with serve(str(out)) as server:
        urls = tmp_path / "urls.csv"
        rows, _ = read_csv(out / "twemoji.csv")
        with open(urls, "w", newline="") as fh:
            csv.writer(fh).writerows(
                [("url", "caption")] + [(server.url + r["path"], r["caption"]) for r in rows]
            )
        result = fetch(FetchConfig(urls=str(urls), out=str(tmp_path / "raw"), image_size=64))
        assert (result.counts["num_success"], result.counts["num_failed"]) == (30, 0)
        assert sum(server.request_counts.values()) == 30


def _datasource_tgz(path, set_name: str, codepoints: list[str]) -> None:
    """An npm emoji-datasource-<set>-like archive: package/img/<set>/64/<codepoints>.png (+ a sheet)."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for i, cp in enumerate(codepoints + ["sheet"]):
            buf = io.BytesIO()
            Image.new("RGBA", (64, 64), (40 * i % 255, 90, 200, 255 if i % 2 else 128)).save(buf, "PNG")
            name = (
                f"package/img/{set_name}/64/{cp}.png"
                if cp != "sheet"
                else f"package/img/{set_name}/sheets/s.png"
            )
            info = tarfile.TarInfo(name)
            info.size = len(buf.getvalue())
            tar.addfile(info, io.BytesIO(buf.getvalue()))


def test_extra_artist_archives_join_the_training_urls(tmp_path):
    """An emoji-datasource archive adds an artist for the concepts it draws (fully qualified or FE0F-less
    file names); train_urls lists every training artist, never OpenMoji; a missing archive fails unless
    missing_ok."""
    base = tmp_path / "first"
    first = run(DemoConfig(out=str(base), limit=12))
    rows, _ = read_csv(base / "twemoji.csv")
    drawn = [r["codepoints"] for r in rows[:7]]
    names = [cp if i % 2 else "-".join(p for p in cp.split("-") if p != "fe0f") for i, cp in enumerate(drawn)]
    archive = tmp_path / "emoji-datasource-fake-1.0.0.tgz"
    _datasource_tgz(archive, "fake", names)
    out = tmp_path / "demo"
    result = run(
        DemoConfig(
            out=str(out), limit=12, extra_artists=[str(archive), str(tmp_path / "none.tgz")], missing_ok=True
        )
    )
    assert first.outputs["train_urls"].endswith("twemoji_urls.csv")
    assert result.outputs["train_urls"] == str(out / "train_urls.csv")
    assert result.counts["num_train_images"] == {"twemoji": 12, "fake": 7}
    fake, _ = read_csv(out / "fake.csv")
    assert [r["codepoints"] for r in fake] == drawn
    with Image.open(out / fake[0]["path"]) as img:
        assert (img.mode, img.size) == ("RGB", (72, 72))
    urls, _ = read_csv(out / "train_urls.csv")
    assert len(urls) == 19 and sum("/fake/" in u["url"] for u in urls) == 7
    assert not any("openmoji" in u["url"] for u in urls)
    with pytest.raises(ValueError, match="none.tgz: no such file"):
        run(DemoConfig(out=str(tmp_path / "strict"), limit=12, extra_artists=[str(tmp_path / "none.tgz")]))
