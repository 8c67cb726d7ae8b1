"""How the towers run: locked layers (fine-tuning), activation checkpointing and ``torch.compile``.

Every rank calls :func:`prepare` on its freshly built model, before the optimiser is built (locked
parameters get no optimiser group) and before DDP wraps it (DDP registers only trainable parameters).

- ``patch_dropout``: open_clip's ViT ``visual.patch_dropout`` replaced by ``models.patch_dropout``'s seeded
  one (masks from the step and the sample id, so world size, micro-batches and resume see the same masks).
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
  equal steady-state steps (1.47 / 1.74 s vs 1.79 / 1.68 s; eager 1.67 / 1.59 s); a ViT-B's 12 + 12 blocks
  gain
  more. A tower without open_clip's ``resblocks`` (timm, Hugging Face text, LiT heads) is compiled whole.
  Parameter names, the state dict and the saved model are unchanged, and DDP wraps the model as before.
"""

from __future__ import annotations

from typing import Any

from toolkit.core.log import get_logger


def _tower_params(clip: Any, tower: str) -> list[Any]:
    """The parameters of the image tower (``clip.visual``) or of the text tower (every other one but the
    logit scale and bias)."""
    visual = {id(p) for p in clip.visual.parameters()}
    if tower == "image":
        return list(clip.visual.parameters())
    return [
        p
        for n, p in clip.named_parameters()
        if id(p) not in visual and n not in ("logit_scale", "logit_bias")
    ]


def _check_locks_something(clip: Any, tower: str, count: int, relock: Any) -> None:
    """ValueError when ``count`` unlocked groups/layers leave the whole tower trainable: open_clip takes the
    last ``count`` of its groups, so a count at or past their number locks nothing, without a word."""
    params = _tower_params(clip, tower)
    if not count or not params or any(not p.requires_grad for p in params):
        return
    # the number of groups: the smallest count that leaves everything trainable (one relock per count)
    num = next(n for n in range(count + 1) if (relock(n), all(p.requires_grad for p in params))[1])
    key = "lock_image_unlocked_groups" if tower == "image" else "lock_text_unlocked_layers"
    raise ValueError(
        f"{key} {count}: the {tower} tower has {num} layer groups as open_clip counts them (embeddings, "
        f"blocks, final norm, projection), so {num} or more leave all of it "
        f"trainable and nothing is locked; use at most {num - 1} (or drop lock_{tower} to train it "
        "whole)"
    )


def lock(
    clip: Any, lock_image: bool, image_unlocked_groups: int, lock_text: bool, text_unlocked_layers: int
) -> None:
    """Freeze the towers as open_clip_train does (module docstring). Refuses a model without the hook, and a
    count of unlocked groups/layers that would lock nothing (:func:`_check_locks_something`)."""
    if lock_image:
        if not hasattr(clip, "lock_image_tower"):
            raise ValueError(f"lock_image: {type(clip).__name__} has no image tower to lock")
        clip.lock_image_tower(unlocked_groups=image_unlocked_groups)
        _check_locks_something(
            clip, "image", image_unlocked_groups, lambda n: clip.lock_image_tower(unlocked_groups=n)
        )
    if lock_text:
        if not hasattr(clip, "lock_text_tower"):
            raise ValueError(f"lock_text: {type(clip).__name__} has no text tower to lock")
        clip.lock_text_tower(unlocked_layers=text_unlocked_layers)
        _check_locks_something(
            clip, "text", text_unlocked_layers, lambda n: clip.lock_text_tower(unlocked_layers=n)
        )


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
    towers = [
        getattr(clip, "visual", None),
        getattr(clip, "transformer", None) or getattr(clip, "text", None),
    ]
    targets: list[Any] = []
    for tower in (t for t in towers if t is not None):
        blocks = getattr(getattr(tower, "transformer", tower), "resblocks", None)
        targets += list(blocks) if blocks is not None else [tower]
    if not targets:  # no tower found (a model of another shape): the whole model, as before
        targets = [model]
    for module in targets:
        module.compile()
    get_logger("train").info(
        "compile: %d module(s) compiled (regional: one per transformer block)", len(targets)
    )
    return len(targets)
