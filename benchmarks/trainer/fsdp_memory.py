"""`--fsdp` against DDP on the CPU (gloo): per-rank state memory, step time with the ledger's bytes, plan vs
peak.

One gloo job per world size (torch.multiprocessing, 1 thread per rank) builds the trainer's real parts for a
model (``TrainModel``, ``train/fsdp.shard`` or ``train/ddp.wrap_ddp``, ``Update`` with AdamW, the objective)
and runs ``step.forward_backward`` + ``Update.finish`` on synthetic pixels and tokens (the data path is not
what is compared). Per rank it records:

- state bytes: parameters + gradients + optimiser state this rank holds after a step (local shards under FSDP;
  exact, from the tensors), at ``--memory-world`` ranks (issue 42 target: FSDP <= 0.3x DDP);
- step time: the median of steps 3.. at ``--time-world`` ranks (target: FSDP <= 1.3x DDP), with the ledger's
  bytes sent per step (``toolkit/core/dist.py``: FSDP's all-gathers and reduce-scatter as train/fsdp.py
  records
  them, DDP's counted all_reduce buckets) beside it;
- peak: the resident-memory peak of steps 2.. (``/proc/self/clear_refs`` after step 1) minus the resident set
  before the parts were built, against ``toolkit plan``'s prediction of the same run (target: within 15 %).

    python -m benchmarks.trainer.fsdp_memory                         # cliptk-small, ~10 min on 2 loaded cores
    python -m benchmarks.trainer.fsdp_memory --model cliptk-tiny --steps 6
    python -m benchmarks.trainer.fsdp_memory --replan    # the plan columns again, after a planner change
    python -m benchmarks.trainer.fsdp_memory --no-reshard --memory-world 2 --out .../fsdp_memory_zero2.json

Writes benchmarks/trainer/results/fsdp_memory.{json,md} (``--out`` to change).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {"state_ratio": 0.3, "time_ratio": 1.3, "plan_error": 0.15}


def _synthetic(model, batch: int, seed: int, mine: slice):
    """This rank's rows of the global batch (the same global batch on every rank, by seed); only they stay
    resident, as a rank's loader holds its local batch only."""
    import torch

    from toolkit.train.plan.memprobe import tower_inputs

    torch.manual_seed(seed)
    image, text = tower_inputs(model, batch, torch.device("cpu"))
    return image[mine].clone(), text[mine].clone(), torch.arange(batch)[mine]


def _state_bytes(clip, optimizer) -> int:
    """Parameters, gradients and optimiser state this rank holds (local shards of DTensors)."""

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in clip.parameters():
        total += local(p).numel() * local(p).element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * local(p.grad).element_size()
    for state in optimizer.state.values():
        total += sum(
            local(v).numel() * local(v).element_size()
            for v in state.values()
            if hasattr(v, "numel") and v.dim() > 0
        )
    return total


def _run(kind: str, args, rank: int, world: int) -> dict:
    import open_clip  # noqa: F401
    import torch

    import toolkit.train.model  # noqa: F401
    from toolkit.core import dist as D
    from toolkit.core.config import build
    from toolkit.core.seeds import stream_seed
    from toolkit.train.ddp import wrap_ddp
    from toolkit.train.losses import LossConfig, build_loss
    from toolkit.train.optim import OptimConfig
    from toolkit.train.plan.memprobe import build_tower_model, peak_rss_bytes, reset_peak_rss, rss_bytes
    from toolkit.train.step import StepInputs, forward_backward
    from toolkit.train.update import Update

    # as memprobe measures the plan's constants: imports (open_clip above) and the previous trainer's garbage
    # are not this trainer's memory; before, the first trainer (DDP) was charged open_clip's import
    gc.collect()
    before = rss_bytes()
    model = build_tower_model(args.model)
    loss_cfg = build(LossConfig, {"kind": "fastclip", "fastclip": {"version": "v3"}, "mode": "fastclip"})
    if kind == "fsdp":
        from toolkit.train import fsdp

        reshard = not args.no_reshard
        sharded, wrapped = fsdp.shard(model, "fp32", False, torch.device("cpu"), reshard), model
    else:
        sharded, wrapped = None, wrap_ddp(model)
    loss_fn = build_loss(loss_cfg, data_size=args.batch, check_sizes=False)
    update = Update(model.clip, loss_fn, build(OptimConfig, {"lr": 1e-4}), loss_cfg, args.steps)
    if sharded is not None:
        update.clip_grad_norm = sharded.clip_grad_norm
    b = args.batch // world
    image, text, index = _synthetic(model, args.batch, 1, slice(rank * b, (rank + 1) * b))
    times, comm, state = [], [], 0
    D.LEDGER.reset()
    for t in range(args.steps):
        start = time.perf_counter()
        update.begin(t, args.steps)
        forward_backward(
            wrapped,
            loss_fn,
            StepInputs(image, text, index),
            micro_batch_size=args.micro,
            seed_of=lambda i, t=t: stream_seed(0, t, rank, i),
            autocast=contextlib.nullcontext,
        )
        if sharded is not None:
            sharded.finish_backward()
        if t == 1:
            state = _state_bytes(
                model.clip, update.optimizer
            )  # gradients still there, before finish zeroes them
        update.finish(loss_fn.global_value())
        times.append(time.perf_counter() - start)
        comm.append(D.LEDGER.step()["comm/total/sent_bytes"])
        if t == 0:
            reset_peak_rss()
    return {
        "state_bytes": state,
        "step_s": statistics.median(times[2:]) if len(times) > 2 else times[-1],
        "comm_bytes_per_step": statistics.median(comm[1:]),
        "peak_bytes": peak_rss_bytes() - before,
    }


def _job(rank: int, world: int, port: int, args, out: str, kinds: tuple[str, ...]) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
        }
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {kind: _run(kind, args, rank, world) for kind in kinds}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def run_world(args, world: int, work: Path, kinds: tuple[str, ...] = ("ddp", "fsdp")) -> dict:
    """{kind: per-rank maxima} of one gloo job at ``world`` ranks running the trainers ``kinds`` in turn."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = work / f"world{world}"
    folder.mkdir(parents=True, exist_ok=True)
    mp.spawn(_job, args=(world, port, args, str(folder), kinds), nprocs=world, join=True)
    ranks = [torch.load(folder / f"rank{r}.pt") for r in range(world)]
    return {kind: {key: max(r[kind][key] for r in ranks) for key in ranks[0][kind]} for kind in kinds}


def planned(args, world: int, fsdp: bool) -> float:
    from toolkit.core.config import build
    from toolkit.train.plan.config import PlanConfig
    from toolkit.train.plan.planner import run

    plan = run(
        build(
            PlanConfig,
            {
                "model": args.model,
                "batch_size": args.batch,
                "nproc_per_node": world,
                "device": "cpu",
                "micro_batch_size": args.micro,
                "fsdp": fsdp,
                "fsdp_reshard_after_forward": not args.no_reshard,
                "num_samples": args.batch,
            },
        )
    )
    return plan.total


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="cliptk-small")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--micro", type=int, default=0, help="gradient-cache micro-batch per rank (0: off)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--memory-world", type=int, default=4)
    p.add_argument("--time-world", type=int, default=2)
    p.add_argument(
        "--no-reshard",
        action="store_true",
        help="FSDP keeps every unit gathered from its forward to its backward "
        "(`--no-fsdp-reshard-after-forward`, ZeRO-2)",
    )
    p.add_argument("--work", type=Path, default=Path("/tmp/cliptk-fsdp-bench"))
    p.add_argument("--out", type=Path, default=RESULTS / "fsdp_memory.json")
    p.add_argument(
        "--replan",
        action="store_true",
        help="train nothing: recompute the plan columns of --out's measurements with the current planner",
    )
    args = p.parse_args(argv)
    if args.replan:
        return _write(replan(json.loads(args.out.read_text())), args.out)
    # as toolkit plan's MEASURED constants were taken: freed blocks leave the resident set (the ranks inherit
    # it)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    rows, started = {}, time.time()
    for world in sorted({args.memory_world, args.time_world}):
        got = run_world(args, world, args.work)
        for kind in ("ddp", "fsdp"):
            got[kind]["planned_bytes"] = planned(args, world, kind == "fsdp")
        rows[world] = got
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "summary": summary(rows, args.memory_world, args.time_world),
        "targets": TARGETS,
        "loadavg": os.getloadavg()[0],
        "wall_s": time.time() - started,
    }
    return _write(result, args.out)


def summary(rows: dict, memory_world: int, time_world: int) -> dict:
    mem, tim = rows[memory_world], rows[time_world]
    return {
        "state_ratio": mem["fsdp"]["state_bytes"] / mem["ddp"]["state_bytes"],
        "time_ratio": tim["fsdp"]["step_s"] / tim["ddp"]["step_s"],
        "plan_error": {
            f"{kind}@{w}": rows[w][kind]["planned_bytes"] / rows[w][kind]["peak_bytes"] - 1
            for w in rows
            for kind in ("ddp", "fsdp")
        },
    }


def replan(result: dict) -> dict:
    """``result`` (a written JSON) with its plan columns and errors from the current planner; the measured
    columns are the run's own."""
    flags = {"True": True, "False": False}
    args = argparse.Namespace(
        **{k: int(v) if v.isdigit() else flags.get(v, v) for k, v in result["args"].items()}
    )
    rows = {int(w): kinds for w, kinds in result["rows"].items()}
    for world, kinds in rows.items():
        for kind in kinds:
            kinds[kind]["planned_bytes"] = planned(args, world, kind == "fsdp")
    return {**result, "rows": rows, "summary": summary(rows, args.memory_world, args.time_world)}


def _write(result: dict, out: Path) -> dict:
    table = format_table(result)
    print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(table + "\n")
    return result


def format_table(result: dict) -> str:
    mib = 2**20
    lines = [
        f"model {result['args']['model']}, global batch {result['args']['batch']}, micro-batch "
        f"{result['args']['micro']}, AdamW fp32, gloo CPU, 1 thread per rank, load {result['loadavg']:.1f}"
        + (
            ", FSDP not resharded after the forward (ZeRO-2)"
            if result["args"].get("no_reshard") == "True"
            else ""
        ),
        "",
        "| ranks | trainer | state MiB/rank | step s | sent MiB/step | peak MiB | plan MiB | plan/peak - 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world, kinds in result["rows"].items():
        for kind, r in kinds.items():
            lines.append(
                f"| {world} | {kind} | {r['state_bytes'] / mib:.1f} | {r['step_s']:.3f} | "
                f"{r['comm_bytes_per_step'] / mib:.1f} | {r['peak_bytes'] / mib:.1f} | "
                f"{r['planned_bytes'] / mib:.1f} | {r['planned_bytes'] / r['peak_bytes'] - 1:+.1%} |"
            )
    s = result["summary"]
    lines += [
        "",
        f"state FSDP/DDP at {result['args']['memory_world']} ranks: {s['state_ratio']:.3f} "
        f"(target <= {TARGETS['state_ratio']})",
        f"step time FSDP/DDP at {result['args']['time_world']} ranks: {s['time_ratio']:.3f} "
        f"(target <= {TARGETS['time_ratio']})",
        "plan vs measured peak: "
        + ", ".join(f"{k} {v:+.1%}" for k, v in s["plan_error"].items())
        + f" (target within {TARGETS['plan_error']:.0%})",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
