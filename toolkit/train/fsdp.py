"""``--fsdp``: the towers sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``), not DDP-replicated.

``shard(model, cfg, device)`` wraps, on a 1-D device mesh over every rank of the job (every rank calls it,
with the same freshly built model; a single process joins a group of one, so one code path serves every
world size):

1. every transformer block of each tower that runs in training (open_clip's ``resblocks``, timm's
   ``blocks``) - the unit whose parameters are all-gathered just before its forward and freed after it
   (``reshard_after_forward``), so one block's full weights are alive at a time (with
   ``fsdp_reshard_after_forward`` false every unit stays gathered from its forward to its backward: ZeRO-2,
   one all-gather per forward instead of two);
2. each tower (``clip.visual``; the text trunk ``clip.transformer`` or ``clip.text``): its remaining
   parameters (patch embedding, final norm, projection); and open_clip's token embedding, gathered only while
   it looks the tokens up (a vocabulary of 49,408 rows is most of a small model's parameters) and not again
   in its backward, which reads no weights;
3. the ``TrainModel`` (the root): the rest (positional embedding, ``ln_final``,
   ``text_projection``); not resharded after the forward, as the backward needs them at once.

Parameters, gradients and optimiser states are then ``DTensor`` shards (dim 0 over the ranks): a rank
holds 1/K of each. The 0-d learnable scalars (``logit_scale``, ``logit_bias``) cannot be sharded
(``fully_shard`` refuses scalars): they stay replicated, and :meth:`Sharded.finish_backward` averages
their gradients (one all_reduce per step). Frozen-tower (LiT) trunks never run in training (only their
heads do, called directly), so a tower whose input is stored features is left to the root.

Mixed precision follows ``precision``: bf16 gives ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` (all-gathers in bf16, gradients reduced in fp32, fp32 master shards); fp32 keeps
everything in fp32 (the CPU). ``fsdp_cpu_offload``: ``CPUOffloadPolicy`` (sharded parameters, gradients
and optimiser states in host memory; the optimiser step runs on the CPU).

The gradient cache's micro-batches accumulate unsharded gradients locally
(``set_requires_gradient_sync(False)``, ``ddp.grad_sync``) and reduce-scatter once, on the last one.
Communication is recorded in the ledger as FSDP2 performs it: an all_gather of each unit's parameters
whenever a forward finds it sharded (and again in the backward of a resharded unit but the token
embedding), one reduce_scatter of its gradients per step (category ``params`` for the gathers,
``param_grads`` for the reductions).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from toolkit.core import dist as D

PARAMS = "params"  # ledger category of the parameter all-gathers


def ensure_group(device: torch.device) -> bool:
    """A one-process group when the job has none (a plain ``toolkit train --fsdp``): the device mesh and
    the sharded checkpoints then run unchanged at world size 1. Returns whether it made one
    (``Sharded.close`` leaves it again)."""
    import torch.distributed as dist

    if D.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def blocks_of(tower: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a tower: open_clip's ``transformer.resblocks`` / ``resblocks``, timm's
    ``trunk.blocks`` / ``blocks``; [] for a tower of another shape (it is sharded whole)."""
    for path in ("transformer.resblocks", "resblocks", "trunk.blocks", "blocks"):
        found: Any = tower
        for part in path.split("."):
            found = getattr(found, part, None)
        if isinstance(found, (nn.ModuleList, nn.Sequential)):
            return list(found)
    return []


def _towers(model: nn.Module) -> list[nn.Module]:
    """The towers of ``model`` (a ``TrainModel``) whose forward runs in training (frozen trunks do not)."""
    clip, out = model.clip, []
    if model.image_role == "image" and getattr(clip, "visual", None) is not None:
        out.append(clip.visual)
    text = getattr(clip, "text", None) or getattr(clip, "transformer", None)
    if model.text_role == "tokens" and text is not None:
        out.append(text)
    return out


class Sharded:
    """The FSDP2 state of one rank's model (module docstring): the replicated scalars and the ledger hooks
    of the wrapped units. Every rank builds one with :func:`shard`."""

    def __init__(self, model: nn.Module, world_size: int):
        self.model, self.world_size = model, world_size
        self.device = torch.device("cpu")  # where the step computes (shard sets it); offloaded shards aside
        self.owns_group = False  # the one-process group ensure_group made, left by close()
        self.replicated = [p for p in model.parameters() if p.ndim == 0]

    def wrap(self, module: nn.Module, kwargs: dict, reshard: bool, backward_gather: bool = True) -> None:
        """``fully_shard`` ``module``'s parameters not yet in a unit. ``backward_gather`` false: its backward
        needs no weights (an embedding's gradient is a scatter of the output's), so a resharded unit is not
        all-gathered again there (``set_unshard_in_backward``)."""
        from torch.distributed.fsdp import fully_shard

        # not yet in a unit: fully_shard swaps a unit's parameters for DTensor ones (new objects)
        mine = {n: p for n, p in module.named_parameters() if not isinstance(p, DTensor) and p.ndim > 0}
        policy = kwargs.get("mp_policy")
        dtype_bytes = 2 if policy is not None and policy.param_dtype == torch.bfloat16 else 4
        fully_shard(module, reshard_after_forward=reshard, ignored_params=set(self.replicated), **kwargs)
        if not backward_gather:
            module.set_unshard_in_backward(False)
        unit_bytes = sum(p.numel() for p in mine.values()) * dtype_bytes
        if mine:  # a unit of no parameters of its own (open_clip's text trunk: its blocks) gathers nothing
            hook = self._gathered(unit_bytes, reshard and backward_gather, next(iter(mine)))
            module.register_forward_pre_hook(hook, prepend=True)  # before FSDP's own, which gathers

    def _gathered(self, unit_bytes: int, regather: bool, name: str):
        def hook(module, args):
            # FSDP2 registers a DTensor while the unit is sharded, the gathered tensor while not: a unit left
            # gathered (the root, or any with reshard off) is not gathered again until its backward reshards
            # it (the gradient cache's graph-free forwards)
            if not isinstance(module.get_parameter(name), DTensor):
                return
            calls = 2 if regather and torch.is_grad_enabled() else 1  # and again in the backward
            D.LEDGER.record("all_gather", unit_bytes // self.world_size, PARAMS, self.world_size, calls)

        return hook

    def close(self) -> None:
        """Leave the one-process group made for this run (a later run in the same process starts clean)."""
        if self.owns_group:
            D.destroy()
            self.owns_group = False

    def finish_backward(self) -> None:
        """After the step's backward (every rank): the mean of the replicated scalars' gradients, and the
        ledger's record of the reduce-scatters FSDP2 ran (gradients in fp32, once per step)."""
        grads = [p.grad for p in self.replicated if p.grad is not None]
        if grads and self.world_size > 1:
            flat = torch.stack([g.reshape(()) for g in grads])
            D.all_reduce_sum(flat, category=D.PARAM_GRADS).div_(self.world_size)
            for g, v in zip(grads, flat, strict=True):
                g.copy_(v)
        if self.world_size > 1:
            grad_bytes = sum(p.numel() for p in self.model.parameters() if p.requires_grad and p.ndim > 0) * 4
            D.LEDGER.record("reduce_scatter", grad_bytes, D.PARAM_GRADS, self.world_size)

    def clip_grad_norm(self, params: list[Tensor], max_norm: float) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over sharded (DTensor) and replicated gradients: the global
        L2 norm (0-d, equal on every rank); gradients scaled by max_norm / (norm + 1e-6) when above it."""
        grads = [p.grad for p in params if p.grad is not None]
        shards = [g.to_local() for g in grads if isinstance(g, DTensor)]
        whole = [g for g in grads if not isinstance(g, DTensor)]
        # summed on the compute device: with --fsdp-cpu-offload the shards' gradients live in host memory
        # while the replicated scalars' stay on the GPU, and nccl reduces device tensors only
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in shards:
            sq += g.detach().float().pow(2).sum().to(self.device)
        D.all_reduce_sum(sq, category=D.CHECKS)
        for g in whole:
            sq += g.detach().float().pow(2).sum().to(self.device)
        norm = sq.sqrt()
        if math.isfinite(max_norm):
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            by_device: dict[torch.device, list[Tensor]] = {}
            for g in [*shards, *whole]:
                by_device.setdefault(g.device, []).append(g)
            for dev, group in by_device.items():
                torch._foreach_mul_(group, coef.to(dev))
        return norm

    def full_state(self) -> dict[str, Tensor]:
        """The whole model's state dict (the open_clip model's keys), on rank 0 in host memory ({} on the
        others). Collective: every rank calls it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        return {k.removeprefix("clip."): v for k, v in state.items() if k.startswith("clip.")}

    def gathered(self, built: Any, ema: Any) -> tuple[Any, Any]:
        """(``built`` with the whole model, the EMA as a whole ``ema.EMA``) on rank 0 for evaluation and
        saving; the arguments unchanged on the other ranks. Collective: every rank calls it."""
        from dataclasses import replace

        from toolkit.train import ema as ema_lib
        from toolkit.train.model import TrainModel

        state = self.full_state()
        ema_state = ema.full_state() if isinstance(ema, ShardedEMA) else None
        if not state:
            return built, ema
        clip, old = plain_clip(built.model_cfg, state), built.model
        pre = built.preprocess_cfg
        built = replace(
            built,
            model=TrainModel(clip, old.image_role, old.text_role, tuple(pre["mean"]), tuple(pre["std"])),
        )
        if ema_state is not None:
            ema = ema_lib.EMA(plain_clip(built.model_cfg, ema_state), ema.decay)
        return built, ema


class ShardedEMA:
    """``--ema-decay`` under FSDP: the moving average kept as shards like the weights it follows (each rank
    averages its own pieces: no communication), saved in the sharded checkpoint; ``full_state`` gathers it."""

    def __init__(self, clip: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.restart_from(clip)

    @torch.no_grad()
    def restart_from(self, clip: nn.Module) -> None:
        self.shadow = {k: v.detach().clone() for k, v in clip.state_dict().items()}

    @torch.no_grad()
    def update(self, clip: nn.Module) -> None:
        """One step toward ``clip``'s weights (every rank, after an applied step), shard by shard."""
        source = clip.state_dict()
        floats = [k for k, v in self.shadow.items() if v.is_floating_point()]
        targets = [_local(self.shadow[k]) for k in floats]
        sources = [_local(source[k]).to(t.dtype) for k, t in zip(floats, targets, strict=True)]
        torch._foreach_lerp_(targets, sources, 1.0 - self.decay)
        for k, v in self.shadow.items():
            if not v.is_floating_point():
                _local(v).copy_(_local(source[k]))

    def full_state(self) -> dict[str, Tensor]:
        """The whole averaged state dict on rank 0 (host memory), {} elsewhere. Collective."""
        out = {}
        for k, v in self.shadow.items():
            whole = v.full_tensor() if hasattr(v, "full_tensor") else v
            if D.get_rank() == 0:
                out[k] = whole.detach().cpu()
        return out


def build_ema(built: Any, decay: float) -> ShardedEMA | None:
    """The sharded EMA of ``built``'s model for ``--ema-decay`` (None when 0)."""
    return ShardedEMA(built.model.clip, decay) if decay > 0 else None


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def plain_clip(model_cfg: dict[str, Any], state: dict[str, Tensor]) -> nn.Module:
    """An unsharded open_clip model (CPU) of ``model_cfg`` holding ``state`` (rank 0: evaluation, saving)."""
    from toolkit.models.factory import build_model

    clip = build_model(model_cfg)
    clip.load_state_dict(state, strict=False)  # non-persistent buffers (attention masks) are rebuilt
    missing = set(clip.state_dict()) - set(state)
    if missing:
        raise RuntimeError(f"the gathered FSDP state lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")
    return clip.eval()


def shard(
    model: nn.Module, precision: str, cpu_offload: bool, device: torch.device, reshard: bool = True
) -> Sharded:
    """Wrap ``model`` (a ``TrainModel`` on ``device``, after ``towers.prepare``) in place (module docstring);
    every rank, before the optimiser is built. ``reshard``: the blocks', towers' and token embedding's
    ``reshard_after_forward`` (the root never reshards)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    owns_group = ensure_group(device)
    world = dist.get_world_size()
    kwargs: dict[str, Any] = {"mesh": init_device_mesh(device.type, (world,))}
    if precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    sharded = Sharded(model, world)
    sharded.device = device
    sharded.owns_group = owns_group
    towers = _towers(model)
    for tower in towers:
        for block in blocks_of(tower):
            sharded.wrap(block, kwargs, reshard)
    for tower in towers:
        sharded.wrap(tower, kwargs, reshard)
    # open_clip's [vocab, width] token table: the largest unit of small models (6.3 of cliptk-tiny's 8.0 M),
    # gathered for the lookup only: not again in the backward (a plain nn.Embedding's backward reads no
    # weights). Measured (benchmarks/trainer/fsdp_memory.py, cliptk-small at 2 ranks, quiet machine): step
    # time FSDP/DDP 1.34-1.40 (3 runs) -> 1.25-1.32 (7 runs), peak 465 -> 446 MiB
    embedding = getattr(model.clip, "token_embedding", None)
    if model.text_role == "tokens" and isinstance(embedding, nn.Module):
        plain = isinstance(embedding, nn.Embedding) and embedding.max_norm is None
        sharded.wrap(embedding, kwargs, reshard, backward_gather=not plain)
    sharded.wrap(model, kwargs, False)
    return sharded
