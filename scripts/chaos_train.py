"""Chaos check of elastic training: kill workers at random, kill the whole job, resume elsewhere, compare.

    .venv/bin/python scripts/chaos_train.py --out runs/chaos [--kills 3] [--steps 48] [--seed 0]
    .venv/bin/python scripts/chaos_train.py --loss neuclip --set loss.neuclip.restart_every_steps=8
    .venv/bin/python scripts/chaos_train.py --fsdp     # every run FSDP2-sharded, sharded checkpoints

1. Builds a real training set (the demo's Twemoji pairs -> raw shards -> training shards for cliptk-tiny)
   unless ``--data`` names one.
2. Reference: an uninterrupted `toolkit train` (``--loss``, default FastCLIP-v3; fastclip mode; 2 processes on
   this machine; ``--set KEY=VALUE`` passed on to every run).
3. Chaos run, same settings under the elastic agent with ``--max-restarts KILLS``: SIGKILLs a random
   worker at ``--kills`` random steps (waiting for each restart before the next kill), then SIGKILLs the
   whole job (launcher and workers) and resumes it with ``--resume latest`` at ``--resume-nproc``
   processes (default 1: another world size).
4. Prints the largest weight and loss-state difference (FastCLIP's tables, NeuCLIP's network) from the
   reference, the samples seen twice and skipped within each epoch, the kills survived; writes
   OUT/chaos_report.json. Exit 1 when a
   duplicate, a skip or a difference above ``--max-rel-diff`` is found.

The sample accounting comes from ``audit_samples`` (OUT/samples/rank-*.jsonl): one line per step and rank
with the ids trained on; a resume truncates the lines after its checkpoint, so what remains is what the
final model learned from. Expect weight differences of about 1e-7 relative: the resume at another world
size sums gradients in another order, which AdamW turns into small weight differences.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_trainset(out: Path, num_concepts: int) -> Path:
    """The demo's first ``num_concepts`` Twemoji pairs as training shards for cliptk-tiny."""
    from toolkit.core.config import build
    from toolkit.data.acquire import demo, shard
    from toolkit.data.trainset.precompute import stage as precompute

    result = demo.run(build(demo.DemoConfig, {"out": str(out / "demo"), "limit": num_concepts}))
    shard.run(
        build(
            shard.ShardConfig,
            {
                "source": result.outputs["train_csv"],
                "out": str(out / "raw"),
                "image_size": 64,
                "samples_per_shard": 50,
            },
        )
    )
    precompute.run(
        build(
            precompute.PrecomputeConfig,
            {
                "input": str(out / "raw"),
                "out": str(out / "train"),
                "model": "cliptk-tiny",
                "samples_per_shard": 50,
                "num_workers": 1,
            },
        )
    )
    return out / "train"


def train_argv(data: Path, out: Path, args: argparse.Namespace, nproc: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "toolkit",
        "train",
        "--data",
        str(data),
        "--out",
        str(out),
        "--loss",
        args.loss,
        "--mode",
        "fastclip",
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--workers",
        "1",
        "--log-every",
        "1",
        "--checkpoint-every",
        str(args.checkpoint_every),
        "--nproc-per-node",
        str(nproc),
        "--set",
        "tensorboard=false",
        "--set",
        "audit_samples=true",
        "--set",
        "optim.warmup_steps=4",
        *[x for kv in args.set for x in ("--set", kv)],
        *(["--fsdp"] if args.fsdp else []),
        *extra,
    ]


def env() -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        WANDB_MODE="disabled",
    )


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (the elastic agent's workers), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def workers(pid: int) -> list[int]:
    """The training workers of launcher ``pid``: the children of its one child, torchrun's agent."""
    return [w for agent in children(pid) for w in children(agent)]


def last_step(run_dir: Path) -> int:
    """The newest step in RUN_DIR/metrics.jsonl (0 when none yet)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    try:
        return int(json.loads(lines[-1]).get("step", 0)) if lines else 0
    except json.JSONDecodeError:  # a line being written
        return 0


def wait_until(predicate, proc: subprocess.Popen, what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise SystemExit(f"chaos: the job ended (code {proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"chaos: timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher, its agent and its workers, as a lost node would (the agent and each worker run
    in sessions of their own, so killing the launcher's process group leaves them running)."""
    others = [*children(proc.pid), *workers(proc.pid)]
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in others:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def chaos_run(data: Path, out: Path, args: argparse.Namespace, rng: random.Random) -> list[dict]:
    """The interrupted run (module docstring, step 3). Returns one record per kill."""
    kill_steps = sorted(rng.sample(range(2, args.steps - 4), args.kills + 1))
    proc = subprocess.Popen(
        train_argv(data, out, args, 2, "--max-restarts", str(args.kills)),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    kills = []
    try:
        for i, step in enumerate(kill_steps):
            wait_until(
                lambda s=step: last_step(out) >= s and len(workers(proc.pid)) == 2, proc, f"step {step}"
            )
            if i < args.kills:
                victim = rng.choice(workers(proc.pid))
                os.kill(victim, signal.SIGKILL)
                kills.append({"kind": "worker", "at_step": last_step(out), "pid": victim})
                print(f"chaos: SIGKILL worker {victim} at step {kills[-1]['at_step']}", flush=True)
                wait_until(
                    lambda v=victim: v not in workers(proc.pid) and len(workers(proc.pid)) == 2,
                    proc,
                    "the restart",
                )
            else:
                kills.append({"kind": "job", "at_step": last_step(out)})
                print(f"chaos: SIGKILL the whole job at step {kills[-1]['at_step']}", flush=True)
                kill_job(proc)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            kill_job(proc)
    resumed = subprocess.run(
        train_argv(data, out, args, args.resume_nproc, "--resume", "latest"),
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
    )
    if resumed.returncode != 0:
        raise SystemExit(
            f"chaos: the resumed job failed (code {resumed.returncode}):\n{resumed.stderr[-3000:]}"
        )
    return kills


def max_diff(got: dict, want: dict) -> tuple[float, float]:
    """(largest absolute difference, relative difference of the whole vectors) over common keys."""
    if set(got) != set(want):
        raise SystemExit(f"chaos: different tensors: {sorted(set(got) ^ set(want))}")
    abs_diff = max(((got[k].double() - want[k].double()).abs().max().item() for k in want), default=0.0)
    num = sum(((got[k].double() - want[k].double()) ** 2).sum().item() for k in want) ** 0.5
    den = sum((want[k].double() ** 2).sum().item() for k in want) ** 0.5
    return abs_diff, num / den if den else num


def final_tensors(run_dir: Path) -> tuple[dict, dict]:
    """(model weights, loss state) of a finished run: RUN_DIR/model and its newest checkpoint."""
    from safetensors.torch import load_file

    from toolkit.train.checkpoint import format as ckpt

    newest = ckpt.latest_valid(str(run_dir / ckpt.CHECKPOINTS))
    if newest is None:
        raise SystemExit(f"chaos: {run_dir} has no complete checkpoint")
    return (
        load_file(str(run_dir / "model" / "open_clip_model.safetensors")),
        load_file(str(Path(newest) / ckpt.LOSS_STATE)),
    )


def accounting(got: dict[int, list[int]], want: dict[int, list[int]], steps_per_epoch: int) -> dict:
    """Samples trained on twice and never, per epoch, against the reference's epochs; batches that differ."""
    if sorted(got) != list(range(1, max(got, default=0) + 1)):
        missing = sorted(set(range(1, max(want) + 1)) - set(got))
        raise SystemExit(f"chaos: the audit lacks steps {missing[:10]}")
    duplicates = skipped = 0
    for first in range(1, max(want) + 1, steps_per_epoch):
        span = range(first, min(first + steps_per_epoch, max(want) + 1))
        seen = Counter(i for t in span for i in got.get(t, []))
        duplicates += sum(n - 1 for n in seen.values() if n > 1)
        skipped += len({i for t in span for i in want[t]} - set(seen))
    return {
        "samples_seen_twice": duplicates,
        "samples_skipped": skipped,
        "batches_differing": sum(got.get(t) != ids for t, ids in want.items()),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--out", type=Path, default=Path("runs/chaos"), help="Work folder (default runs/chaos).")
    p.add_argument("--data", type=Path, help="Training shards to use instead of building the demo's.")
    p.add_argument("--num-concepts", type=int, default=160, help="Demo pairs to build (default 160).")
    p.add_argument("--kills", type=int, default=3, help="Random worker SIGKILLs (default 3).")
    p.add_argument("--steps", type=int, default=48, help="Training steps (default 48, = 5 epochs of 160).")
    p.add_argument("--batch-size", type=int, default=16, help="Global batch (default 16).")
    p.add_argument(
        "--checkpoint-every", type=int, default=4, help="Checkpoint interval in steps (default 4)."
    )
    p.add_argument("--resume-nproc", type=int, default=1, help="Processes of the resumed job (default 1).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the kill schedule (default 0).")
    p.add_argument(
        "--loss",
        default="fastclip-v3",
        help="Objective of every run (default fastclip-v3; any\n"
        "objective of the fastclip mode: fastclip-v0..v3, neuclip).",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="Shard every run with FSDP2 (--fsdp): the kills land in sharded steps and\n"
        "checkpoints, the resume reshards them to --resume-nproc ranks.",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Config override passed to every run (repeatable), e.g.\nloss.neuclip.restart_every_steps=8.",
    )
    p.add_argument(
        "--max-rel-diff",
        type=float,
        default=1e-5,
        help="Largest accepted relative difference of the weights and of the loss state\n(default 1e-5).",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.steps - 6 < args.kills + 1:
        raise SystemExit(f"chaos: --steps {args.steps} leaves no room for {args.kills} kills")
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.data or build_trainset(args.out / "data", args.num_concepts)
    from toolkit.data.trainset.format import TrainDataset
    from toolkit.train.metrics import read_audit

    ref, out = args.out / "reference", args.out / "chaos"
    for run_dir in (ref, out):
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    done = subprocess.run(train_argv(data, ref, args, 2), cwd=ROOT, env=env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"chaos: the reference run failed:\n{done.stderr[-3000:]}")
    kills = chaos_run(data, out, args, random.Random(args.seed))
    (w_got, t_got), (w_want, t_want) = final_tensors(out), final_tensors(ref)
    weights_abs, weights_rel = max_diff(w_got, w_want)
    tables_abs, tables_rel = max_diff(t_got, t_want)
    steps_per_epoch = TrainDataset.open(str(data)).num_samples // args.batch_size
    report = {
        "loss": args.loss,
        "fsdp": args.fsdp,
        "kills": kills,
        "kills_survived": len(kills),
        "resume_nproc": args.resume_nproc,
        "weights_max_abs_diff": weights_abs,
        "weights_rel_diff": weights_rel,
        "tables_max_abs_diff": tables_abs,
        "tables_rel_diff": tables_rel,
        **accounting(read_audit(str(out)), read_audit(str(ref)), steps_per_epoch),
    }
    (args.out / "chaos_report.json").write_text(json.dumps(report, indent=2) + "\n")
    for key, value in report.items():
        if key != "kills":
            print(f"{key:>22}: {value:.3g}" if isinstance(value, float) else f"{key:>22}: {value}")
    ok = (
        report["samples_seen_twice"] == 0
        and report["samples_skipped"] == 0
        and report["batches_differing"] == 0
        and weights_rel <= args.max_rel_diff
        and tables_rel <= args.max_rel_diff
    )
    print("chaos: PASS" if ok else "chaos: FAIL", f"(report: {args.out / 'chaos_report.json'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
