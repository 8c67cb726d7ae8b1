"""Bytes sent per rank per step and wall time per step of the four distributed contrastive modes.

K gloo processes on this CPU train a small open_clip model (default ``cliptk-small``: ViT width 256,
6 layers, embed 512) on random local batches; for every mode (gather, disco, ring, fastclip) and
gradient all_reduce dtype (fp32, bf16) each rank runs ``--warmup`` + ``--steps`` DDP steps (forward,
contrastive loss, backward with bucketed gradient all_reduce; configurations interleaved round-robin)
and the communication ledger
(``toolkit.core.dist.LEDGER``) records every collective. Bytes are per rank per step from the ledger
(sent_bytes: ring-algorithm wire bytes, see toolkit/core/dist.py); time is the slowest rank's mean.

    python -m benchmarks.loss.comm_volume [--world 4 --batch 64 --steps 2]

Writes ``--out`` (JSON) and the same path with ``.md`` (markdown table), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from toolkit.train.losses.config import MODES

GRAD_DTYPES = ("fp32", "bf16")


def _model(name: str):
    import open_clip

    from toolkit.models.registry import register_builtin_configs

    register_builtin_configs()
    torch.manual_seed(0)
    return open_clip.create_model(name)


def _batch(rank: int, b: int, image_size: int, context: int):
    g = torch.Generator().manual_seed(100 + rank)
    return (
        torch.randn(b, 3, image_size, image_size, generator=g),
        torch.randint(1, 49407, (b, context), generator=g),
    )


def _step(model, mode: str, batch) -> tuple[float, dict, float]:
    """One DDP step; returns (seconds, this step's ledger, seconds of the loss alone).

    The loss alone: forward+backward of ``contrastive_loss`` on detached copies of the step's features
    (all of a mode's feature communication, none of the model's compute or gradient all_reduce)."""
    from toolkit.core import dist as D
    from toolkit.train.losses.modes import contrastive_loss

    model.zero_grad(set_to_none=True)
    D.barrier()  # uncounted: the ledger is reset right after
    D.LEDGER.reset()
    start = time.perf_counter()
    img, txt, scale = model(*batch)
    contrastive_loss(img, txt, scale, mode=mode).backward()
    elapsed = time.perf_counter() - start
    ledger = D.LEDGER.step()
    leaves = [t.detach().requires_grad_() for t in (img, txt, scale)]
    D.barrier()
    start = time.perf_counter()
    contrastive_loss(*leaves, mode=mode).backward()
    return elapsed, ledger, time.perf_counter() - start


def _worker(rank: int, args, port: int, out_dir: str) -> None:
    """Configurations run round-robin (one step of each per round) so that load changes on the shared
    CPU hit every mode alike; one DDP model per gradient dtype serves all modes."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(args.world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(args.world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(args.threads)
    from toolkit.core import dist as D
    from toolkit.models.registry import context_length, image_size
    from toolkit.train.ddp import wrap_ddp

    D.init_from_env(backend="gloo", timeout_s=1800)
    batch = _batch(rank, args.batch, image_size(args.model), context_length(args.model))
    models = {gd: wrap_ddp(_model(args.model), grad_dtype=gd) for gd in args.grad_dtypes}
    res = {
        f"{m}/{gd}": {"time_s": [], "loss_s": [], "ledger": None}
        for m in args.modes
        for gd in args.grad_dtypes
    }
    for rnd in range(args.warmup + args.steps):
        for mode in args.modes:
            for gd in args.grad_dtypes:
                elapsed, ledger, loss_s = _step(models[gd], mode, batch)
                entry = res[f"{mode}/{gd}"]
                if rnd < args.warmup:  # DDP rebuilds its buckets after the first step
                    continue
                if entry["ledger"] is not None and entry["ledger"] != ledger:
                    raise RuntimeError(f"{mode}/{gd}: rank {rank} sent different bytes in different steps")
                entry["ledger"] = ledger
                entry["time_s"].append(elapsed)
                entry["loss_s"].append(loss_s)
        if rank == 0:
            print(f"  round {rnd + 1}/{args.warmup + args.steps} done", flush=True)
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    D.destroy()


def _row(key: str, per_rank: list[dict], base: dict) -> dict:
    led = per_rank[0][key]["ledger"]

    def cat(name: str) -> float:
        return led.get(f"comm/category/{name}/sent_bytes", 0.0)

    feature = cat("features") + cat("feature_grads")
    mode, grad_dtype = key.split("/")
    return {
        "mode": mode,
        "grad_dtype": grad_dtype,
        "feature_bytes": feature,
        "scalar_bytes": cat("scalars"),
        "param_grad_bytes": cat("param_grads"),
        "check_bytes": cat("checks"),
        "total_bytes": led["comm/total/sent_bytes"],
        "calls": led["comm/total/calls"],
        "time_s": max(statistics.mean(r[key]["time_s"]) for r in per_rank),
        "time_min_s": max(min(r[key]["time_s"]) for r in per_rank),
        "loss_s": max(statistics.median(r[key]["loss_s"]) for r in per_rank),
        "time_s_per_rank": [r[key]["time_s"] for r in per_rank],
        "feature_vs_gather": feature / base["feature"],
        "total_vs_gather_fp32": led["comm/total/sent_bytes"] / base["total"],
        "ledger": led,
    }


def _table(rows: list[dict]) -> str:
    mb = 1e6
    lines = [
        "| mode | grad all_reduce | feature MB | scalar KB | param-grad MB | total MB | calls | s/step mean "
        "| s/step min | loss fwd+bwd ms | feature vs gather | total vs gather+fp32 |",
        "|" + "---|" * 12,
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['grad_dtype']} | {r['feature_bytes'] / mb:.3f} | "
            f"{(r['scalar_bytes'] + r['check_bytes']) / 1e3:.2f} | {r['param_grad_bytes'] / mb:.2f} | "
            f"{r['total_bytes'] / mb:.2f} | {r['calls']:.0f} | {r['time_s']:.2f} | {r['time_min_s']:.2f} | "
            f"{r['loss_s'] * 1e3:.0f} | "
            f"{r['feature_vs_gather']:.3f} | {r['total_vs_gather_fp32']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="number of gloo processes (ranks)")
    p.add_argument("--batch", type=int, default=64, help="local batch per rank")
    p.add_argument("--model", default="cliptk-small", help="open_clip / cliptk model config name")
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed steps per configuration (DDP rebuilds buckets)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--grad-dtypes", nargs="+", default=list(GRAD_DTYPES), choices=GRAD_DTYPES)
    p.add_argument(
        "--out", type=Path, default=Path("benchmarks/loss/results/comm_volume.json"), help="JSON output"
    )
    args = p.parse_args()
    if "gather" not in args.modes or "fp32" not in args.grad_dtypes:
        p.error("gather with fp32 is the baseline of the ratios: keep it in --modes/--grad-dtypes")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.parent / f".{args.out.stem}_ranks"
    tmp.mkdir(exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"{args.world} gloo ranks, {args.model}, local batch {args.batch}, {os.cpu_count()} CPUs")
    mp.spawn(_worker, args=(args, port, str(tmp)), nprocs=args.world, join=True)
    per_rank = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(args.world)]
    shutil.rmtree(tmp)
    for r, res in enumerate(per_rank[1:], 1):
        for key in res:
            if res[key]["ledger"] != per_rank[0][key]["ledger"]:
                raise RuntimeError(
                    f"{key}: rank {r} sent different bytes from rank 0 (the modes are symmetric)"
                )
    gather = per_rank[0]["gather/fp32"]["ledger"]
    base = {
        "feature": gather.get("comm/category/features/sent_bytes", 0.0)
        + gather.get("comm/category/feature_grads/sent_bytes", 0.0),
        "total": gather["comm/total/sent_bytes"],
    }
    rows = [_row(key, per_rank, base) for key in per_rank[0]]
    table = _table(rows)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"config": config, "cpus": os.cpu_count(), "rows": rows}, indent=2))
    args.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
