"""How the towers run: locked layers (fine-tuning), activation checkpointing and ``torch.compile``.

Every rank calls :func:`prepare` on its freshly built model, before the optimiser is built (locked
parameters get no optimiser group) and before DDP wraps it (DDP registers only trainable parameters).

- ``patch_dropout``: open_clip's ViT ``visual.patch_dropout`` replaced by ``models.patch_dropout``'s seeded one
  (masks from the step and the sample id, so world size, micro-batches and resume see the same masks).
- Locking uses open_clip's own ``lock_image_tower(unlocked_groups)`` / ``lock_text_tower(unlocked_layers)``,
  so a count means what it means in ``open_clip_train --lock-image-unlocked-groups N``: the last N layer
  groups (image) or layers (text, with the final LayerNorm and projection) stay trainable.
- ``grad_checkpointing``: open_clip's ``set_grad_checkpointing``; its transformers then wrap every block
  in ``torch.utils.checkpoint(use_reentrant=False)``, which keeps only each block's input and recomputes
  the block in the backward. The gradient cache's second pass (``step.py``) is a forward with a graph, so
  it is checkpointed too; the first pass runs without a graph, where checkpointing does nothing. The RNG
  state is replayed inside ``checkpoint`` (``preserve_rng_state``), so dropout draws the same masks.
- ``compile``: regional compilation: ``nn.Module.compile`` (inductor) of every transformer block of the
  towers, in place, rather than of the whole ``TrainModel``. A tower's blocks share one forward, so inductor
  compiles it about once per tower instead of tracing every layer: on cliptk-tiny (4 + 4 blocks, batch 64,
  one thread, 2 loaded CPU cores) the first step took 92 / 106 s against 194 / 154 s for the whole model, with
  equal steady-state steps (1.47 / 1.74 s vs 1.79 / 1.68 s; eager 1.67 / 1.59 s); a ViT-B's 12 + 12 blocks gain
  more. A tower without open_clip's ``resblocks`` (timm, Hugging Face text, LiT heads) is compiled whole.
  Parameter names, the state dict and the saved model are unchanged, and DDP wraps the model as before.
"""

from __future__ import annotations

from typing import Any

from toolkit.core.log import get_logger


def lock(clip: Any, lock_image: bool, image_unlocked_groups: int, lock_text: bool, text_unlocked_layers: int) -> None:
    """Freeze the towers as open_clip_train does (module docstring). Refuses a model without the hook."""
    if lock_image:
        if not hasattr(clip, "lock_image_tower"):
            raise ValueError(f"lock_image: {type(clip).__name__} has no image tower to lock")
        clip.lock_image_tower(unlocked_groups=image_unlocked_groups)
    if lock_text:
        if not hasattr(clip, "lock_text_tower"):
            raise ValueError(f"lock_text: {type(clip).__name__} has no text tower to lock")
        clip.lock_text_tower(unlocked_layers=text_unlocked_layers)


def set_grad_checkpointing(clip: Any) -> None:
    """Turn on open_clip's activation checkpointing in both towers (module docstring)."""
    if not hasattr(clip, "set_grad_checkpointing"):
        raise ValueError(f"grad_checkpointing: {type(clip).__name__} has no set_grad_checkpointing")
    clip.set_grad_checkpointing(True)


def prepare(model: Any, cfg: Any) -> None:
    """Apply ``cfg``'s locks, checkpointing and compile to ``model`` (a ``TrainModel``) in place; every
    rank, before the optimiser and DDP are built."""
    clip = model.clip
    if cfg.patch_dropout:  # before compile: the blocks compiled then see the shorter sequence
        from toolkit.models.patch_dropout import install

        install(clip, cfg.patch_dropout)
        get_logger("train").info("patch dropout %.2f: seeded per step and sample id", cfg.patch_dropout)
    lock(clip, cfg.lock_image, cfg.lock_image_unlocked_groups, cfg.lock_text, cfg.lock_text_unlocked_layers)
    if cfg.lock_image or cfg.lock_text:
        trainable = sum(p.numel() for p in clip.parameters() if p.requires_grad)
        get_logger("train").info("locked towers: %.2fM trainable parameters remain", trainable / 1e6)
    if cfg.grad_checkpointing:
        set_grad_checkpointing(clip)
    if cfg.compile:
        compile_towers(model)


def compile_towers(model: Any) -> int:
    """Compile ``model`` (a ``TrainModel``) in place, block by block (module docstring); returns the number
    of modules compiled."""
    clip = model.clip
    towers = [getattr(clip, "visual", None), getattr(clip, "transformer", None) or getattr(clip, "text", None)]
    targets: list[Any] = []
    for tower in (t for t in towers if t is not None):
        blocks = getattr(getattr(tower, "transformer", tower), "resblocks", None)
        targets += list(blocks) if blocks is not None else [tower]
    if not targets:  # no tower found (a model of another shape): the whole model, as before
        targets = [model]
    for module in targets:
        module.compile()
    get_logger("train").info("compile: %d module(s) compiled (regional: one per transformer block)", len(targets))
    return len(targets)
