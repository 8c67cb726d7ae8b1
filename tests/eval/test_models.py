"""load_model / save_model: round trip, open_clip local-dir compatibility, offline-only specs, clear
errors."""

from __future__ import annotations

import json

import pytest
import torch

from toolkit.models import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    find_weights,
    is_checkpoint_dir,
    load_model,
    save_model,
)


@pytest.fixture(scope="module")
def tiny():
    return load_model("cliptk-tiny", seed=1)


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory):
    return save_model(tiny.model, tiny.model_cfg, tmp_path_factory.mktemp("ckpt") / "tiny")


def _features(model, tokenizer, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(3, 3, 32, 32, generator=g)
    tokens = tokenizer(["a dog", "an odd-sized caption with more words", "x"])
    with torch.no_grad():
        return model.encode_image(images), model.encode_text(tokens)


def test_loaded_model_unpacks_and_is_in_eval_mode(tiny):
    model, tokenizer, image_size = tiny
    assert image_size == 32 and tiny.context_length == 32 and not model.training
    assert tokenizer(["a b c"]).shape == (1, 32) and tiny.weights is None
    assert tiny.preprocess(__import__("PIL.Image").Image.new("RGB", (50, 40))).shape == (3, 32, 32)


def test_seed_makes_random_init_reproducible(tiny):
    again, other = load_model("cliptk-tiny", seed=1), load_model("cliptk-tiny", seed=2)
    a, b, c = (_features(m.model, tiny.tokenizer)[0] for m in (tiny, again, other))
    assert torch.equal(a, b) and not torch.allclose(a, c)


def test_round_trip_and_open_clip_local_dir(tiny, tiny_dir):
    import open_clip

    assert sorted(p.name for p in tiny_dir.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    config = json.loads((tiny_dir / CONFIG_NAME).read_text())
    assert config["model_cfg"] == tiny.model_cfg and config["preprocess_cfg"]["size"] == 32
    back = load_model(str(tiny_dir))
    assert back.name == "tiny" and back.weights == str(tiny_dir / WEIGHTS_NAME)
    for x, y in zip(
        _features(tiny.model, tiny.tokenizer), _features(back.model, back.tokenizer), strict=True
    ):
        assert torch.equal(x, y)
    oc_model, _, oc_preprocess = open_clip.create_model_and_transforms(f"local-dir:{tiny_dir}")
    oc_model.eval()
    tokenizer = open_clip.get_tokenizer(f"local-dir:{tiny_dir}")
    for x, y in zip(_features(tiny.model, tiny.tokenizer), _features(oc_model, tokenizer), strict=True):
        assert torch.equal(x, y)
    assert torch.equal(tokenizer(["a dog"]), tiny.tokenizer(["a dog"]))


def test_failed_save_leaves_old_checkpoint(tiny, tiny_dir, tmp_path):
    out = save_model(tiny.model, tiny.model_cfg, tmp_path / "ck")
    before = (out / WEIGHTS_NAME).read_bytes()

    def explode(_):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_model(load_model("cliptk-tiny", seed=5).model, tiny.model_cfg, out, write_extra=explode)
    assert (out / WEIGHTS_NAME).read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "ck"
    ]


def test_save_replaces_whole_dir_and_unwraps_wrappers(tiny, tmp_path):
    out = tmp_path / "ck"
    save_model(tiny.model, tiny.model_cfg, out)
    (out / "stale.txt").write_text("old run")
    other = load_model("cliptk-tiny", seed=3)
    wrapper = torch.nn.Module()
    wrapper.module = other.model  # what DistributedDataParallel looks like
    save_model(
        wrapper, other.model_cfg, out, write_extra=lambda d: (d / "trainer_state.pt").write_bytes(b"s")
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp or old folders left
    assert not (out / "stale.txt").exists() and (out / "trainer_state.pt").read_bytes() == b"s"
    assert is_checkpoint_dir(out) and find_weights(out).name == WEIGHTS_NAME
    back = load_model(str(out))
    assert torch.equal(_features(back.model, back.tokenizer)[1], _features(other.model, other.tokenizer)[1])


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_name_plus_weights_file(tiny, tiny_dir, tmp_path, suffix):
    if suffix == ".pt":
        path = tmp_path / "w.pt"
        torch.save({"state_dict": {f"module.{k}": v for k, v in tiny.model.state_dict().items()}}, path)
    else:
        path = tiny_dir / WEIGHTS_NAME
    loaded = load_model("cliptk-tiny", weights=str(path))
    assert torch.equal(_features(loaded.model, loaded.tokenizer)[0], _features(tiny.model, tiny.tokenizer)[0])


def test_config_json_spec(tiny_dir, tmp_path):
    cfg = tmp_path / "my-model.json"
    cfg.write_text((tiny_dir / CONFIG_NAME).read_text())  # {"model_cfg": ...} is accepted as well
    loaded = load_model(str(cfg), weights=str(tiny_dir / WEIGHTS_NAME))
    assert loaded.name == "my-model" and loaded.image_size == 32
    # The registry's name-level helpers (used by precompute) agree with the loaded model.
    from toolkit.models import context_length, image_size, tokenizer

    assert image_size(str(cfg)) == loaded.image_size and context_length(str(cfg)) == loaded.context_length
    captions = ["a dog", "an odd caption of nine words to tokenize here"]
    assert torch.equal(tokenizer(str(cfg))(captions), loaded.tokenizer(captions))


def test_errors_name_the_missing_file(tiny_dir, tmp_path):
    with pytest.raises(CheckpointError, match=r"open_clip_config.json: missing"):
        load_model(str(tmp_path))
    broken = tmp_path / "noweights"
    broken.mkdir()
    (broken / CONFIG_NAME).write_text((tiny_dir / CONFIG_NAME).read_text())
    with pytest.raises(CheckpointError, match=r"noweights/open_clip_model.safetensors: missing"):
        load_model(str(broken))
    with pytest.raises(CheckpointError, match=r"weights file not found: .*nope.safetensors"):
        load_model("cliptk-tiny", weights=str(tmp_path / "nope.safetensors"))
    with pytest.raises(CheckpointError, match=r"model config file not found: .*missing.json"):
        load_model(str(tmp_path / "missing.json"))
    with pytest.raises(CheckpointError, match=r"checkpoint directory not found"):
        load_model(f"local-dir:{tmp_path / 'gone'}")
    with pytest.raises(ValueError, match=r"unknown model 'cliptk-huge'.*cliptk-tiny"):
        load_model("cliptk-huge")
    with pytest.raises(
        ValueError, match=r"open_clip_model.safetensors: weights do not match the model config"
    ):
        load_model("cliptk-small", weights=str(tiny_dir / WEIGHTS_NAME))
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        load_model("cliptk-tiny", precision="fp8")


def test_bf16_precision_casts_matmul_weights(tiny_dir):
    loaded = load_model(str(tiny_dir), precision="bf16")
    assert loaded.model.visual.conv1.weight.dtype == torch.bfloat16
    assert loaded.model.ln_final.weight.dtype == torch.float32


def test_a_checkpoint_directory_given_as_weights_says_to_pass_it_as_the_model(tiny_dir):
    """`--model cliptk-tiny --weights CKPT_DIR` said 'weights file not found: CKPT_DIR', which exists."""
    with pytest.raises(
        CheckpointError,
        match=r"weights: .*tiny is a directory, not a weights file; a checkpoint "
        r"directory is a model: pass it as the model itself \(--model DIR\)",
    ):
        load_model("cliptk-tiny", weights=str(tiny_dir))
