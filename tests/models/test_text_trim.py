"""The text tower on cut token batches (toolkit.models.text_trim) against open_clip's own encode_text,
float64."""

from __future__ import annotations

import pytest
import torch

from toolkit.models import text_trim

CONTEXT, VOCAB = 16, 64
EOT = VOCAB - 1  # argmax pooling: the end-of-text token is the highest id


def make_clip(seed: int = 0, **text_cfg):
    import open_clip

    torch.manual_seed(seed)
    text = {"context_length": CONTEXT, "vocab_size": VOCAB, "width": 32, "heads": 4, "layers": 2, **text_cfg}
    clip = open_clip.CLIP(
        embed_dim=24,
        vision_cfg={"image_size": 8, "layers": 1, "width": 32, "head_width": 16, "patch_size": 4},
        text_cfg=text,
    )
    return clip.double()


def captions(lengths: list[int], end: int = EOT, seed: int = 0) -> torch.Tensor:
    """Token ids [b, CONTEXT]: start token 1, random words, ``end`` at position length-1, zero padding."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(len(lengths), CONTEXT, dtype=torch.long)
    for row, n in enumerate(lengths):
        out[row, 0] = 1
        out[row, 1 : n - 1] = torch.randint(3, EOT - 1, (n - 2,), generator=g)
        out[row, n - 1] = end
    return out


def grads(clip, loss) -> dict[str, torch.Tensor]:
    clip.zero_grad()
    loss.backward()
    return {k: p.grad.clone() for k, p in clip.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lengths", [[3], [2, 7, 5], [4, 4, 11, 3, 9, 16, 6], [16, 16]])
@pytest.mark.parametrize("text_cfg", [{}, {"proj_bias": True}, {"pool_type": "eos", "eos_id": 2}])
def test_cut_batch_equals_full_context(lengths, text_cfg):
    clip = make_clip(**text_cfg)
    assert text_trim.trimmable(clip)
    end = text_cfg.get("eos_id", EOT)
    tokens = captions(lengths, end=end, seed=len(lengths))
    cut = text_trim.trim_tokens(tokens, clip.text_pool_type, clip.text_eos_id)
    assert cut.shape == (len(lengths), max(lengths))
    weight = torch.randn(len(lengths), 24, dtype=torch.float64)
    full = clip.encode_text(tokens)
    want = grads(clip, (full * weight).sum())
    got_values = text_trim.encode_text(clip, cut)
    got = grads(clip, (got_values * weight).sum())
    torch.testing.assert_close(got_values, full, rtol=1e-12, atol=1e-12)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    "text_cfg", [{"no_causal_mask": True}, {"pool_type": "last"}, {"pool_type": "first"}]
)
def test_towers_where_padding_matters_are_not_cut(text_cfg):
    assert not text_trim.trimmable(make_clip(**text_cfg))


def test_train_model_cuts_only_what_its_tower_ignores():
    from toolkit.train.model import TrainModel

    clip = make_clip()
    model = TrainModel(clip, "image", "tokens", (0.5,) * 3, (0.25,) * 3).double()
    tokens = captions([5, 9, 4])
    assert model.trim_tokens(tokens).shape == (3, 9)
    image = torch.randint(0, 256, (3, 8, 8, 3), dtype=torch.uint8)
    x_full, y_full, *_ = model(image, tokens)  # Towers(x, y, a, bias)
    x_cut, y_cut, *_ = model(image, model.trim_tokens(tokens))
    torch.testing.assert_close(y_cut, y_full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x_cut, x_full)
    causal_off = TrainModel(make_clip(no_causal_mask=True), "image", "tokens", (0.5,) * 3, (0.25,) * 3)
    assert causal_off.trim_tokens(tokens) is tokens
