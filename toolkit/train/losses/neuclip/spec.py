"""NeuCLIP's registry entry: ``--loss neuclip``, the fastclip mode only (as FastCLIP, its step needs no
feature-gradient communication); its normaliser network is model-sized state, not per-sample tables."""

from toolkit.train.losses.spec import ObjectiveSpec

SPEC = ObjectiveSpec(
    kind="neuclip",
    title="NeuCLIP",
    target="toolkit.train.losses.neuclip.loss:NeuCLIPLoss",
    modes=("fastclip",),
    modes_note="its step needs no feature-gradient communication. Use mode: fastclip, or kind: openclip for "
    "gather/disco/ring",
)
