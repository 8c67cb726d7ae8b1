"""Model configs and tokenizers by name without importing open_clip (toolkit.models.registry's light path)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from toolkit.models import registry

CAPTIONS = ["grinning face", "a photo of a cat, Ünïcode & <html>", "", "word " * 60]


@pytest.mark.parametrize(
    "name", ["cliptk-tiny", "cliptk-small", "cliptk-glyph", "ViT-B-32", "RN50", "ViT-L-14-336"]
)
def test_light_tokenizer_and_config_equal_open_clips(name):
    import open_clip

    registry.register_builtin_configs()
    light = registry._light_tokenizer(name)
    assert light is not None
    assert light(CAPTIONS).equal(open_clip.get_tokenizer(name)(CAPTIONS))
    assert registry.model_config(name) == open_clip.get_model_config(name)


@pytest.mark.parametrize(
    "name", ["ViT-B-16-SigLIP", "hf-hub:org/model", "local-dir:/nowhere", "no-such-model"]
)
def test_names_open_clip_must_resolve_take_the_full_path(name):
    assert registry._light_tokenizer(name) is None


def test_unknown_name_still_named_in_the_error():
    with pytest.raises(ValueError, match="no-such-model"):
        registry.model_config("no-such-model")


def test_tokenizing_for_a_bundled_config_does_not_import_open_clip():
    code = (
        "import sys; from toolkit.models.registry import tokenizer, image_size, context_length; "
        "t = tokenizer('cliptk-tiny')(['a cat']); assert t.shape == (1, context_length('cliptk-tiny')); "
        "assert image_size('ViT-B-32') == 224; assert 'open_clip' not in sys.modules, 'open_clip imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_glyph_model_context_holds_every_drawable_unicode_name():
    """cliptk-glyph's 26 tokens hold the longest Unicode name `toolkit data glyphs` can caption (25 tokens
    with start and end, Unicode 15: ZNAMENNY NEUME ...; matplotlib's fonts' longest is 22): no caption is
    cut."""
    import unicodedata

    from toolkit.data.acquire.glyphs import is_candidate

    names = [unicodedata.name(chr(c)) for c in range(0x110000) if is_candidate(c, [])]
    tokens = registry.tokenizer("cliptk-glyph")(names)
    assert tokens.shape[1] == registry.context_length("cliptk-glyph") == 26
    assert int((tokens != 0).sum(1).max()) < 26  # the last position is padding for every name: none was cut
