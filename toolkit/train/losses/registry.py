"""The objectives ``build_loss`` knows, by ``kind``, and the ``--loss`` names that select them (torch-free,
so the CLI validates ``--loss`` without importing torch).

A new objective plugs in with one ``register`` call here, naming its ``TrainingLoss`` subclass as
``"module:Class"`` (imported only when built) and the ``--loss`` names that select it with the
``LossConfig`` fields each sets (docs/architecture.md has a worked example).
"""

from __future__ import annotations

from collections.abc import Mapping

# kind -> "module:Class" of its TrainingLoss
KINDS: dict[str, str] = {}
# --loss NAME -> the LossConfig fields it sets ({"kind": ..., "version": ...})
NAMES: dict[str, dict[str, str]] = {}


def register(kind: str, target: str, names: Mapping[str, Mapping[str, str]] | None = None) -> None:
    """Make ``kind`` buildable from ``target`` ("module:Class"); ``names``: --loss NAME -> extra LossConfig
    fields (default: the single name ``kind``)."""
    if ":" not in target:
        raise ValueError(f"register({kind!r}): target must be 'module:Class', got {target!r}")
    KINDS[kind] = target
    for name, fields in (names or {kind: {}}).items():
        NAMES[name] = {"kind": kind, **fields}


register("openclip", "toolkit.train.losses.openclip:OpenCLIPLoss")
register("fastclip", "toolkit.train.losses.fastclip.loss:FastCLIPLoss",
         {f"fastclip-{v}": {"version": v} for v in ("v0", "v1", "v2", "v3")})
register("siglip", "toolkit.train.losses.siglip.loss:SigLIPLoss")
register("neuclip", "toolkit.train.losses.neuclip.loss:NeuCLIPLoss")
