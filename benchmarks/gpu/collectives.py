"""Section 6: all_gather and all_reduce on every GPU of the machine (nccl): bytes moved per rank and
bus bandwidth, at the features' size of a FastCLIP step (B rows of d=512 fp32 per rank, twice) and of a
ViT-B-32 gradient all_reduce (151 M fp32). Needs two or more GPUs; the dry run runs the same code on 2
CPU processes with gloo at tiny sizes."""

from __future__ import annotations

import os
import socket
import time

from benchmarks.gpu.common import Context, Section

VIT_B32_PARAMS = 151_277_313


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, sizes: list[int], out) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    # torch 2.14 deprecates all_gather_into_tensor for all_gather_single, which older torch (2.11 on the
    # lent GPU machines) lacks
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    rows = []
    for numel in sizes:
        t = torch.ones(numel, device=device)
        gathered = torch.empty(world * numel, device=device)
        for op, fn in (
            ("all_gather", lambda g=gathered, t=t: dist.all_gather_into_tensor(g, t)),
            ("all_reduce", lambda t=t: dist.all_reduce(t)),
        ):
            fn()  # warm-up
            dist.barrier()
            start = time.perf_counter()
            fn()
            if backend == "nccl":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            # bytes each rank sends in a ring: (K-1)·n for all_gather, 2(K-1)/K·n for all_reduce (nccl-tests'
            # bus bytes)
            nbytes = (world - 1) * numel * 4 * (1 if op == "all_gather" else 2 / world)
            rows.append(
                {
                    "op": op,
                    "numel": numel,
                    "bytes_per_rank": int(nbytes),
                    "ms": elapsed * 1e3,
                    "bus_gb_per_s": nbytes / elapsed / 1e9,
                }
            )
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def run(ctx: Context, sec: Section) -> None:
    import torch
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count() if ctx.device == "cuda" else 0
    if ctx.device == "cuda" and gpus < 2:
        sec.skip("nccl all_gather / all_reduce", f"{gpus} GPU on this machine (needs 2 or more)")
        return
    world, backend = (gpus, "nccl") if gpus >= 2 else (2, "gloo")
    sizes = [4096 * 512 * 2, VIT_B32_PARAMS] if backend == "nccl" else [1024, 4096]
    ctx_mp = mp.get_context("spawn")
    queue = ctx_mp.Queue()
    port = _free_port()
    procs = [
        ctx_mp.Process(target=_worker, args=(r, world, port, backend, sizes, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    rows = queue.get(timeout=max(sec.left_s(), 30))
    for p in procs:
        p.join(timeout=30)
    sec.rows += [r | {"backend": backend, "world": world} for r in rows]
