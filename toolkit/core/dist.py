"""Process-group helpers, counted collectives and the communication ledger.

Every helper works without a process group (world size 1: rank 0, collectives are identities), so
single-process code paths need no special cases. Every collective cliptk issues goes through the
wrappers here, which record it in a :class:`CommLedger` (``LEDGER`` by default); DDP's gradient
buckets are recorded by the comm hooks in ``toolkit.train.dist.ddp``.

Ledger convention, per rank and per collective *type* (op) and *category* (what is sent):
- ``calls``: number of calls; ``bytes``: bytes of the tensor this rank hands to the op
  (all_gather: the local input; reduce_scatter: the full [K·b, ...] input; all_reduce: the tensor;
  send/recv: the message);
- ``sent_bytes``: bytes this rank puts on the wire under the bandwidth-optimal ring algorithms
  (NCCL's "bus bytes"): all_gather (K−1)·n, reduce_scatter (K−1)/K·n, all_reduce 2(K−1)/K·n,
  broadcast n, send n, recv 0.
Categories used by cliptk: ``features``, ``feature_grads``, ``scalars`` (per-sample LSEs, u, ids),
``param_grads`` (DDP buckets), ``checks`` (shape agreement).
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

FEATURES, FEATURE_GRADS, SCALARS, PARAM_GRADS, CHECKS = (
    "features",
    "feature_grads",
    "scalars",
    "param_grads",
    "checks",
)
# Shapes are exchanged padded to this many dims so ranks with different ndim still agree on sizes.
_MAX_NDIM = 8


# --------------------------------------------------------------------------- rank / world helpers
def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    """Rank in ``group`` (default: world); 0 without a process group."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    """Number of ranks in ``group`` (default: world); 1 without a process group."""
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """Rank on this node (torchrun's LOCAL_RANK); 0 when not launched by torchrun."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_local_world_size() -> int:
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE); 1 when not launched by torchrun."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return get_rank() == 0


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str | None  # None: no process group
    device: torch.device


def init_from_env(backend: str | None = None, timeout_s: float = 1800.0) -> DistInfo:
    """Join the job described by torchrun's env vars (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK).

    Called once by every rank. Without RANK/WORLD_SIZE this is a single process: no group is created.
    Backend: ``nccl`` when CUDA is available, else ``gloo`` (override with ``backend``). On CUDA the
    current device is set to LOCAL_RANK. Calling it again after the group exists only reports it.
    """
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    local_rank = get_local_rank()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not is_initialized() and "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not: launch with torchrun "
                "or set the rendezvous address"
            )
        name, timeout = backend or ("nccl" if use_cuda else "gloo"), timedelta(seconds=timeout_s)
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(name, init_method="env://", timeout=timeout)
        else:
            dist.init_process_group(
                name,
                store=store,
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timeout,
            )
    if not is_initialized():
        return DistInfo(0, 1, local_rank, 1, None, device)
    return DistInfo(
        dist.get_rank(), dist.get_world_size(), local_rank, get_local_world_size(), dist.get_backend(), device
    )


def _attempt_store(timeout: timedelta):
    """Under torchrun's elastic agent: a client of the agent's store with keys private to this restart.

    torch 2.14's env:// rendezvous reuses the agent's store across restarts without a prefix, so the
    workers of restart n found the previous attempt's process-group keys (addresses of dead workers) and
    hung in ProcessGroupGloo's constructor (seen: a SIGKILLed worker, ``--max-restarts 1``, the restarted
    pair never left init_process_group). None when not launched by an elastic agent (plain env://)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"cliptk/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)


def destroy() -> None:
    """Leave the process group (no-op without one)."""
    if is_initialized():
        dist.destroy_process_group()


def barrier(group=None) -> None:
    if get_world_size(group) > 1:
        dist.barrier(group)


# --------------------------------------------------------------------------- ledger
def wire_bytes(op: str, nbytes: int, world_size: int) -> float:
    """Bytes one rank sends for ``op`` on an ``nbytes`` tensor under ring algorithms (module docstring)."""
    k = world_size
    factor = {
        "all_gather": k - 1,
        "reduce_scatter": (k - 1) / k,
        "all_reduce": 2 * (k - 1) / k,
        "broadcast": 1,
        "send": 1,
        "recv": 0,
        "all_to_all": (k - 1) / k,
    }[op]
    return factor * nbytes


class CommLedger:
    """Counts calls, bytes and sent bytes per (op, category) for the current step and all closed steps.

    Thread-safe (DDP comm hooks may fire on autograd's device threads). The trainer calls
    :meth:`step` once per optimiser step and logs the dict it returns.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.enabled = True
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._current: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
            self._total: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
            self.num_steps = 0

    def record(self, op: str, nbytes: int, category: str, world_size: int, calls: int = 1) -> None:
        """Count one collective of ``op`` handing ``nbytes`` bytes to the network layer."""
        if not self.enabled:
            return
        sent = wire_bytes(op, nbytes, world_size) * calls
        with self._lock:
            entry = self._current[(op, category)]
            entry[0] += calls
            entry[1] += nbytes * calls
            entry[2] += sent

    @staticmethod
    def _flat(table: dict[tuple[str, str], list[float]], divisor: float = 1.0) -> dict[str, float]:
        out: dict[str, float] = {}
        calls = sent = 0.0
        for (op, cat), (c, b, s) in sorted(table.items()):
            out[f"comm/{op}/{cat}/calls"] = c / divisor
            out[f"comm/{op}/{cat}/bytes"] = b / divisor
            out[f"comm/{op}/{cat}/sent_bytes"] = s / divisor
            calls, sent = calls + c, sent + s
        by_cat: dict[str, float] = defaultdict(float)
        for (_, cat), (_, _, s) in table.items():
            by_cat[cat] += s
        for cat, s in sorted(by_cat.items()):
            out[f"comm/category/{cat}/sent_bytes"] = s / divisor
        out["comm/total/calls"] = calls / divisor
        out["comm/total/sent_bytes"] = sent / divisor
        return out

    def current(self) -> dict[str, float]:
        """Flat metrics of the open step (``comm/<op>/<category>/{calls,bytes,sent_bytes}``, totals)."""
        with self._lock:
            return self._flat(self._current)

    def step(self) -> dict[str, float]:
        """Close the open step: returns its flat metrics and adds them to the totals."""
        with self._lock:
            out = self._flat(self._current)
            for key, (c, b, s) in self._current.items():
                tot = self._total[key]
                tot[0], tot[1], tot[2] = tot[0] + c, tot[1] + b, tot[2] + s
            self._current.clear()
            self.num_steps += 1
            return out

    def summary(self) -> dict:
        """{"steps": n, "total": flat metrics over closed steps, "per_step": their mean per step}."""
        with self._lock:
            n = self.num_steps
            return {
                "steps": n,
                "total": self._flat(self._total),
                "per_step": self._flat(self._total, max(n, 1)),
            }


LEDGER = CommLedger()


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _record(ledger: CommLedger | None, op: str, t: Tensor, category: str, group) -> None:
    (ledger or LEDGER).record(op, _nbytes(t), category, get_world_size(group))


# --------------------------------------------------------------------------- counted collectives
_all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(
    dist, "reduce_scatter_tensor", None
)


def check_equal_sizes(t: Tensor, group=None, what: str = "batch", ledger: CommLedger | None = None) -> None:
    """Raise ValueError on every rank if ``t``'s shape differs across the ranks of ``group``.

    Called by all ranks of ``group``; one tiny all_gather (category ``checks``) when world > 1.
    """
    k = get_world_size(group)
    if k == 1:
        return
    if t.dim() > _MAX_NDIM:
        raise ValueError(f"{what}: tensors with more than {_MAX_NDIM} dims are not supported, got {t.dim()}")
    shape = torch.full((_MAX_NDIM + 1,), -1, dtype=torch.int64, device=t.device)
    shape[0] = t.dim()
    shape[1 : 1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    out = _gather(shape, k, group, CHECKS, ledger)
    shapes = [tuple(int(v) for v in row[1 : 1 + int(row[0])]) for row in out.view(k, -1).cpu()]
    if len(set(shapes)) > 1:
        listing = ", ".join(f"rank {r}: {list(s)}" for r, s in enumerate(shapes))
        raise ValueError(
            f"{what} sizes differ across ranks ({listing}); every rank must pass the same "
            "shape (use last_batch='drop' in make_loader so each rank gets a full local batch)"
        )


def _gather(t: Tensor, k: int, group, category: str, ledger: CommLedger | None) -> Tensor:
    """The counted all_gather of [b, ...] -> [k·b, ...] behind both gather wrappers (sizes already agreed)."""
    t = t.contiguous()
    out = torch.empty((k * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    _record(ledger, "all_gather", t, category, group)
    _all_gather_single(out, t, group=group)
    return out


def all_gather_nograd(
    t: Tensor,
    group=None,
    category: str = FEATURES,
    check_sizes: bool = True,
    ledger: CommLedger | None = None,
) -> Tensor:
    """Concatenate ``t`` [b, ...] from every rank along dim 0 -> [K·b, ...] (rank order), no autograd.

    Called by all ranks of ``group``. Sizes must agree (checked unless ``check_sizes=False``, for callers
    that checked the batch already); world 1 returns ``t`` detached.
    """
    k = get_world_size(group)
    t = t.detach()
    if k == 1:
        return t
    if check_sizes:
        check_equal_sizes(t, group, ledger=ledger)
    return _gather(t, k, group, category, ledger)


def reduce_scatter_sum(
    t: Tensor, group=None, category: str = FEATURE_GRADS, ledger: CommLedger | None = None
) -> Tensor:
    """Sum [K·b, ...] over ranks and return this rank's [b, ...] slice (rows rank·b ... rank·b+b−1).

    Called by all ranks of ``group`` with equal shapes; world 1 returns ``t``.
    """
    k = get_world_size(group)
    if k == 1:
        return t
    if t.shape[0] % k:
        raise ValueError(f"reduce_scatter: dim 0 ({t.shape[0]}) is not divisible by the world size {k}")
    t = t.contiguous()
    out = torch.empty((t.shape[0] // k, *t.shape[1:]), dtype=t.dtype, device=t.device)
    _record(ledger, "reduce_scatter", t, category, group)
    _reduce_scatter_single(out, t, group=group)
    return out


def all_reduce_sum(
    t: Tensor, group=None, category: str = SCALARS, ledger: CommLedger | None = None
) -> Tensor:
    """In-place sum over ranks (returns ``t``); called by all ranks of ``group``; identity at world 1."""
    if get_world_size(group) > 1:
        _record(ledger, "all_reduce", t, category, group)
        dist.all_reduce(t, group=group)
    return t


def all_reduce_future(
    t: Tensor, group=None, category: str = PARAM_GRADS, ledger: CommLedger | None = None
) -> torch.futures.Future:
    """Asynchronous in-place sum over ranks; the future's value is ``t`` (for DDP comm hooks)."""
    _record(ledger, "all_reduce", t, category, group)
    work = dist.all_reduce(t, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class _AllGatherWithGrad(torch.autograd.Function):
    """all_gather whose backward reduce-scatters (sums) the [K·b, ...] gradient to this rank's rows."""

    @staticmethod
    def forward(ctx, t: Tensor, group, category: str, ledger):
        ctx.group, ctx.ledger = group, ledger
        return _gather(t, get_world_size(group), group, category, ledger)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reduce_scatter_sum(grad, ctx.group, FEATURE_GRADS, ctx.ledger), None, None, None


def all_gather_with_grad(
    t: Tensor,
    group=None,
    category: str = FEATURES,
    check_sizes: bool = True,
    ledger: CommLedger | None = None,
) -> Tensor:
    """Like :func:`all_gather_nograd` but differentiable: the backward sums every rank's gradient of the
    gathered tensor and keeps this rank's rows (a reduce_scatter of [K·b, ...], category feature_grads).

    Called by all ranks of ``group``; world 1 returns ``t`` itself.
    """
    if get_world_size(group) == 1:
        return t
    if check_sizes:
        check_equal_sizes(t, group, ledger=ledger)
    return _AllGatherWithGrad.apply(t, group, category, ledger)


def ring_peers(group=None) -> tuple[int, int]:
    """Global ranks of the next (rank+1) and previous (rank−1) members of ``group`` on the ring."""
    k, r = get_world_size(group), get_rank(group)
    nxt, prev = (r + 1) % k, (r - 1) % k
    if group is not None:
        nxt, prev = dist.get_global_rank(group, nxt), dist.get_global_rank(group, prev)
    return nxt, prev


def ring_shift(
    tensors: Sequence[Tensor], categories: Sequence[str], group=None, ledger: CommLedger | None = None
) -> tuple[list[Tensor], Callable[[], None]]:
    """Start sending ``tensors`` to rank+1 and receiving same-shaped ones from rank−1 (one P2P batch).

    Returns (receive buffers, wait): the buffers are valid after ``wait()``; the sent tensors must not
    be modified before it. Called by all ranks of ``group`` with equal shapes; world 1 is not a ring
    (callers skip it). Message i uses tag i so gloo matches the messages in order.
    """
    nxt, prev = ring_peers(group)
    sends = [t.contiguous() for t in tensors]  # kept alive by wait()'s closure until the sends finish
    bufs = [torch.empty_like(t) for t in sends]
    ops = []
    for i, (t, buf, cat) in enumerate(zip(sends, bufs, categories, strict=True)):
        _record(ledger, "send", t, cat, group)
        _record(ledger, "recv", buf, cat, group)
        ops.append(dist.P2POp(dist.isend, t, nxt, group, tag=i))
        ops.append(dist.P2POp(dist.irecv, buf, prev, group, tag=i))
    works = dist.batch_isend_irecv(ops)

    def wait() -> None:
        for w in works:
            w.wait()
        sends.clear()

    return bufs, wait
