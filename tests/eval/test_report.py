"""results.json keeps clip-benchmark's schema through a write/read round trip; markdown and PNG."""

from __future__ import annotations

import json
import math

import pytest

from toolkit.eval import report


def _records():
    return [
        report.make_record(
            "cls7",
            "cliptk-tiny",
            None,
            "zeroshot_classification",
            {"acc1": 0.5, "acc5": float("nan"), "mean_per_class_recall": 0.25},
        ),
        report.make_record(
            "fm",
            "cliptk-tiny",
            None,
            "zeroshot_classification",
            {"acc1": 0.25, "acc5": 0.75, "mean_per_class_recall": 0.5},
        ),
        report.make_record(
            "ret9",
            "cliptk-tiny",
            None,
            "zeroshot_retrieval",
            {
                "image_retrieval_recall@1": 0.2,
                "text_retrieval_recall@1": 0.4,
                "image_retrieval_recall@10": math.nan,
                "text_retrieval_recall@10": None,
            },
        ),
    ]


def test_round_trip_keeps_clip_benchmark_schema(tmp_path):
    path = str(tmp_path / "results.json")
    written = report.write_results(path, "cliptk-tiny", None, _records())
    text = (tmp_path / "results.json").read_text()
    assert "NaN" not in text  # strict JSON: undefined metrics are null
    loaded = report.read_results(path)
    assert loaded == json.loads(json.dumps(written))
    for record in loaded["results"]:
        assert list(record) == list(report.RECORD_KEYS)
        assert record["dataset"].startswith("wds/") and record["language"] == "en"
    assert loaded["results"][0]["metrics"]["acc5"] is None
    avg = loaded["average"]
    assert avg["zeroshot_classification"] == {"acc1": 0.375, "acc5": 0.75, "mean_per_class_recall": 0.375}
    assert avg["zeroshot_retrieval"]["image_retrieval_recall@1"] == pytest.approx(0.2)
    assert "image_retrieval_recall@10" not in avg["zeroshot_retrieval"]
    assert avg["primary"] == pytest.approx((0.5 + 0.25 + 0.3) / 3) and avg["num_datasets"] == 3


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.pop("task"), r"results\[1\]: missing key\(s\) task"),
        (lambda r: r.update(metrics={"acc1": "high"}), r"results\[1\]: 'metrics' must map names to numbers"),
    ],
)
def test_read_rejects_broken_records(tmp_path, mutate, message):
    data = {"model": "m", "pretrained": None, "results": _records()}
    mutate(data["results"][1])
    (tmp_path / "r.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        report.read_results(str(tmp_path / "r.json"))


def test_markdown_and_chart(tmp_path):
    from PIL import Image

    data = report.write_results(str(tmp_path / "r.json"), "cliptk-tiny", "w.safetensors", _records())
    chance = {
        "cls7": report.chance_level("classification", 14, 7),
        "ret9": report.chance_level("retrieval", 9, 0),
    }
    md = report.markdown_table(data, {"cls7": 14, "fm": 20, "ret9": 9}, [1, 10], chance)
    assert "| cls7 | 14 | 14.29 | 50.00 | – | 25.00 |" in md  # chance of top-1 with 7 classes: 1/7
    assert "| ret9 | 9 | 11.11 | 40.00 | – | 20.00 | – |" in md  # chance of R@1 among 9 pairs: 1/9
    assert "| fm | 20 | – |" in md  # no chance level given: a dash
    assert "**35.00%**" in md
    report.bar_chart(data, str(tmp_path / "c.png"))
    with Image.open(tmp_path / "c.png") as img:
        assert img.format == "PNG" and img.height > 4 * 26
