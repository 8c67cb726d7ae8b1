"""Eval trusted damaged checkpoints (issue 34, class 8): load_model (what `eval zeroshot --model` calls)
checks the sizes and sha256 that checkpoint.json recorded, and refuses NaN weights naming the tensors.
Checkpoints are written by the trainer's own writer."""

from __future__ import annotations

import pytest
import torch

from toolkit.models.factory import build_model, default_preprocess_cfg, load_model
from toolkit.models.registry import model_config
from toolkit.models.weights import CheckpointError, model_files
from toolkit.train.checkpoint import format as ckpt


def _write(tmp_path, poison: bool = False):
    torch.manual_seed(0)
    cfg = model_config("cliptk-tiny")
    model = build_model(cfg)
    if poison:
        with torch.no_grad():
            model.logit_scale.fill_(float("nan"))
            next(model.visual.parameters()).view(-1)[0] = float("inf")
    return ckpt.write_blobs(
        str(tmp_path / "checkpoints"), 4, model_files(model, cfg, default_preprocess_cfg(cfg)), 3
    )


def test_a_checkpoint_whose_bytes_changed_is_refused_naming_the_file(tmp_path):
    path = _write(tmp_path)
    load_model(path)  # intact: loads
    weights = next(
        p for p in (tmp_path / "checkpoints" / "step-00000004").iterdir() if p.suffix == ".safetensors"
    )
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF  # a flipped byte in the tensor data: safetensors itself still reads it
    weights.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=rf"{weights}: sha256 differs from the one .*checkpoint.json recorded"
    ):
        load_model(path)


def test_non_finite_weights_are_refused_by_name(tmp_path):
    path = _write(tmp_path, poison=True)
    with pytest.raises(ValueError, match=r"non-finite weights \(NaN or infinity\) in .*logit_scale") as err:
        load_model(path)
    assert "visual." in str(err.value)


def test_weights_of_another_architecture_say_what_differs_in_one_line(tmp_path):
    """Issue 34 class 12: mismatches printed PyTorch's key dump twice, cut mid-word."""
    from safetensors.torch import save_file

    small_cfg = model_config("cliptk-small")
    small = build_model(small_cfg)
    path = tmp_path / "small.safetensors"
    save_file({k: v.contiguous() for k, v in small.state_dict().items()}, str(path))
    with pytest.raises(ValueError) as err:
        load_model("cliptk-tiny", weights=str(path))
    text = str(err.value)
    assert text.startswith(f"{path}: weights do not match the model config: ") and "\n" not in text, text
    assert "differ in shape: " in text and "(file [" in text and ", model [" in text, text
    assert len(text) < 1200 and "Error(s) in loading state_dict" not in text, text


def test_a_checkpoint_hands_over_the_weights_digest_it_checked_and_a_plain_folder_none(tmp_path):
    """load_model read a checkpoint's weights for checkpoint.json's check: it returns their sha256 (a
    reference model's identity needs it), and None where nothing read them (no manifest)."""
    import hashlib

    from toolkit.models.weights import WEIGHTS_NAME, save_model

    path = _write(tmp_path)
    weights = tmp_path / "checkpoints" / "step-00000004" / WEIGHTS_NAME
    assert load_model(path).weights_sha256 == hashlib.sha256(weights.read_bytes()).hexdigest()
    cfg = model_config("cliptk-tiny")
    plain = save_model(build_model(cfg), cfg, tmp_path / "plain")
    assert load_model(str(plain)).weights_sha256 is None
