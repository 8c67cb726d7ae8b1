"""``toolkit plan --fsdp``: the per-device memory and traffic of a run with FSDP2 sharding
(``train/fsdp.py``).

With K ranks and the wrapping of ``train/fsdp.py`` (units: every transformer block, each tower's remaining
parameters, the root's), per device, P parameters (T trainable), p = bytes of an all-gathered parameter (2
with bf16 precision on CUDA, else 4):

| row | bytes |
|---|---|
| parameters (shards) | 4·P/K (fp32 master shards; CPU offload: in host memory) |
| gathered parameters | p·(root + 2 × largest block): at the peak (the backward's start, every activation
  held) the root stays gathered through the step and a block is gathered beside the next one prefetched;
  ``reshard`` false (ZeRO-2): p·P, every unit gathered from its forward to its backward |
| gathered gradients | without the gradient cache: 4·2 × largest block (a block's full gradient until it is
  reduce-scattered, beside the next); with it: 4·T, the whole unsharded gradient accumulated over the
  micro-batches and reduce-scattered once (``set_requires_gradient_sync(False)``) |
| gradient shards, last unit's backward | max(0, 4·T/K + max((p + 8)·U, 8·E) - activations - the two rows
  above), U the largest tower's own parameters, E the token embedding: the gradient shards exist from the
  reduce-scatters to the next ``zero_grad`` (set to None), so only at the backward's end, when the
  activations are freed; there the last unit's backward holds its gathered parameters (not the
  embedding's: its backward reads no weights), its whole gradient and the reduce-scatter's flat copy of it
  (4 each; with the cache the gradient is already in the whole one: p + 4 and 4; not resharded, the
  parameters are already in the gathered row; CPU offload: the shards are in host memory) |
| optimizer state | 4·T·slots/K (CPU offload: in host memory) |

Measured (benchmarks/trainer/fsdp_memory.py, cliptk-small, a 12.6 M-parameter token embedding of 22.5 M,
batch 64): planned / measured peak 484.0 / 446.1 MiB at 2 ranks (+8.5 %), 267.4 / 270.5 at 4 (-1.2 %);
counting the gradient shards beside the activations gave +18 % at 2 ranks, and the embedding gathered beside
the blocks +24 %. Not resharded (``--no-reshard``, ZeRO-2): 563.1 / 525.5 MiB at 2 ranks (+7.1 %).

The other rows (activations, inputs, cached features, the loss's) are DDP's. Traffic per rank per step:
all_gather (K-1)/K·p per parameter of a unit each time a forward finds it sharded (the cache: n graph-free
forwards and n with a graph; the root, never resharded after a forward, and every unit with ``reshard``
false, once per backward) and again in the backward of each resharded unit but the token embedding;
reduce_scatter (K-1)/K·4·T once (``tests/train/test_fsdp.py`` checks the ledger against the collectives
FSDP2 runs).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Units:
    """Parameter counts of FSDP's units in the model (``train/fsdp.py``'s wrapping)."""

    root: int  # parameters of neither tower (positional embedding, ln_final, text projection)
    tower: int  # the largest tower's own parameters (outside its blocks)
    block: int  # the largest transformer block
    num_blocks: int
    embedding: int = 0  # open_clip's token embedding: its own unit, not gathered again in its backward


def units_of(clip) -> Units:
    """``Units`` of an open_clip model (built on the meta device by the planner)."""
    from toolkit.train.fsdp import blocks_of

    towers = [
        t
        for t in (
            getattr(clip, "visual", None),
            getattr(clip, "text", None) or getattr(clip, "transformer", None),
        )
        if t is not None
    ]
    total = sum(p.numel() for p in clip.parameters() if p.ndim > 0)
    own, block, count = [], 0, 0
    for tower in towers:
        blocks = blocks_of(tower)
        sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
        own.append(sum(p.numel() for p in tower.parameters()) - sum(sizes))
        block, count = max([block, *sizes]), count + len(blocks)
    root = total - sum(sum(p.numel() for p in t.parameters()) for t in towers)
    embedding = getattr(clip, "token_embedding", None)  # its own unit (train/fsdp.py)
    size = 0 if embedding is None else sum(p.numel() for p in embedding.parameters())
    return Units(root - size, max(own, default=0), block, count, size)


def gathered_bytes(units: Units, param_bytes: int, num_params: int, reshard: bool) -> float:
    return float(param_bytes * (units.root + 2 * units.block if reshard else num_params))


def end_of_backward_bytes(
    units: Units, param_bytes: int, cached: bool, shard_grads: float, beside: float, reshard: bool
) -> float:
    """What the backward's end holds beyond ``beside`` (the activations and the gathered rows it outlives;
    module docstring): the gradient shards (``shard_grads``) and the largest non-block unit's backward, a
    tower's own parameters gathered again or the token embedding, whose backward reads no weights."""
    gathered = param_bytes if reshard else 0  # not resharded: already in the gathered row
    grads = 4 if cached else 8
    last = max((gathered + grads) * units.tower, grads * units.embedding)
    return max(0.0, shard_grads + last - beside)


def sharded_rows(
    rows: dict[str, float],
    *,
    num_params: int,
    num_trainable: int,
    slots: int,
    world: int,
    units: Units,
    param_bytes: int,
    cached: bool,
    offload: bool,
    reshard: bool = True,
) -> dict[str, float]:
    """DDP's ``rows`` (memory.memory_rows) with the parameter, gradient and optimiser rows sharded (module
    docstring); offloaded shards leave the device's rows (``host_rows`` lists them)."""
    out = {k: v for k, v in rows.items() if not k.startswith(("parameters", "gradients", "optimizer"))}
    optimizer = next(k for k in rows if k.startswith("optimizer"))
    head = (
        {}
        if offload
        else {
            "parameters (shards)": 4.0 * num_params / world,
            f"{optimizer} (shards)": 4.0 * num_trainable * slots / world,
        }
    )
    # made by the reduce-scatters and freed by zero_grad(set_to_none) after the step: never beside the
    # activation peak (measured: counting them there put the plan 18 % over cliptk-small's peak at 2 ranks)
    shard_grads = 0.0 if offload else 4.0 * num_trainable / world
    head["gathered parameters"] = gathered_bytes(units, param_bytes, num_params, reshard)
    head["gathered gradients" + (" (whole: cache)" if cached else "")] = (
        4.0 * num_trainable if cached else 4.0 * 2 * units.block
    )
    activations = next(v for k, v in rows.items() if k.startswith("activations"))
    beside = activations + head["gathered parameters"] + (0.0 if cached else 4.0 * 2 * units.block)
    head["gradient shards, last unit's backward (beyond the activations)"] = end_of_backward_bytes(
        units, param_bytes, cached, shard_grads, beside, reshard
    )
    return {**head, **out}


def host_rows(*, num_params: int, num_trainable: int, slots: int, world: int) -> dict[str, float]:
    """What ``--fsdp-cpu-offload`` keeps in host memory per rank."""
    return {
        "host: parameter, gradient, optimizer shards": 4.0
        * (num_params + num_trainable * (1 + slots))
        / world
    }


def traffic(
    *,
    num_params: int,
    num_trainable: int,
    units: Units,
    world: int,
    param_bytes: int,
    num_micro: int,
    reshard: bool = True,
) -> dict[str, float]:
    """Bytes one rank sends per step (ring algorithms): {"params": all-gathers, "param_grads": the
    reduce-scatter, "total"}; ``num_micro`` 0: no gradient cache."""
    k = world
    with_graph = num_micro or 1  # forwards with a graph (and backwards): one per micro-batch of the cache
    if reshard:  # every forward gathers each unit but the root, and its backward again but the embedding's
        gathers_fwd = 2 * num_micro if num_micro else 1  # the cache's graph-free forwards too
        others = num_params - units.root
        count = gathers_fwd * others + with_graph * (others - units.embedding + units.root)
    else:  # a unit stays gathered from a forward to the next backward (the cache's graph-free forwards too)
        count = with_graph * num_params
    params = (k - 1) / k * param_bytes * count
    grads = (k - 1) / k * 4.0 * num_trainable
    return {"params": params, "param_grads": grads, "total": params + grads}
