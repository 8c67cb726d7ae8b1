"""End-to-end training throughput: `toolkit train` against open_clip's own trainer, same model and data.

Data: the real Twemoji demo set (``toolkit data demo``, ~1,900 pairs) as raw img2dataset-layout JPEG shards
at ``--raw-image-size`` px (``toolkit data shard``); building them is not timed (both users need them).
Then, in one run and on the same machine state, each trainer's user does what that user does:

- cliptk: ``toolkit data precompute`` (decode, resize, tokenize once; ``--storage index``: only index the
  raw shards and tokenize, the loader decodes every sample in every epoch as open_clip's does) + ``toolkit
  train`` on the training set; once per ``--losses`` entry (``openclip``: the same objective as open_clip's
  trainer;
  ``fastclip-v3``: cliptk's default). The precompute is timed once and counted in every cliptk row.
- open_clip: ``python -m open_clip_train.main --dataset-type webdataset`` on the raw JPEG shards (decoding
  and augmenting every sample in every epoch, in its data-loader workers).

Both: one process, the same global batch, number of optimizer steps (open_clip_train rounds an epoch up to
a multiple of its workers; cliptk is given that many steps), learning rate and warmup, ``--workers``
data-loader processes, fp32 on CPU; each writes its final checkpoint as it does by default.
End-to-end samples/s = samples trained / (data stage + training wall time, process start-up included).
Steady-state samples/s = samples / summed step times over the steps after the first ``--skip-steps``
(each trainer's own per-step wall time, data wait included: ``--log-every 1`` / ``--log-every-n-steps 1``).

    python -m benchmarks.trainer.train_throughput                 # CPU, cliptk-tiny: ~5-10 min
    python -m benchmarks.trainer.train_throughput --cuda          # CUDA: ViT-B-32, bf16, 8 workers

The machine is shared: the load average before each run is recorded; compare rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

from benchmarks.shared import trainer_bench as tb
from benchmarks.trainer import trainer_profile as tp

TARGET = 1.2  # issue 11: cliptk end-to-end >= 1.2x open_clip's trainer
# Memory is only reported here, so the tree is polled rarely: at 0.05 s, reading smaps_rollup of the tree
# cost enough CPU on 2 cores to halve both trainers' step rate (136 vs ~240 samples/s, cliptk-tiny, B=256).
POLL_S = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cuda",
        action="store_true",
        help="CUDA comparison: defaults become --model ViT-B-32 --precision bf16 --workers 8",
    )
    p.add_argument("--model", default=None, help="model name (default cliptk-tiny; ViT-B-32 with --cuda)")
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default=None,
        help="fp32 (CPU default) or bf16 autocast (--cuda default; open_clip's amp_bf16)",
    )
    p.add_argument("--batch-size", type=int, default=256, help="global batch, both trainers")
    p.add_argument("--epochs", type=int, default=5, help="passes over the data set")
    p.add_argument(
        "--workers", type=int, default=None, help="data-loader processes, both (default 2; 8 on CUDA)"
    )
    p.add_argument(
        "--raw-image-size", type=int, default=256, help="side of the raw JPEGs (img2dataset's default)"
    )
    p.add_argument(
        "--samples-per-shard",
        type=int,
        default=250,
        help="raw shard size (open_clip needs >= workers shards)",
    )
    p.add_argument(
        "--losses",
        nargs="+",
        default=["openclip", "fastclip-v3"],
        help="cliptk objectives to run (openclip = open_clip's objective)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--skip-steps", type=int, default=2, help="steps left out of the steady-state rate")
    p.add_argument("--timeout-s", type=int, default=3600, help="wall limit of each command")
    p.add_argument("--work", type=Path, default=Path("runs/bench/train_throughput"), help="scratch folder")
    p.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="another cliptk checkout (`git worktree add /tmp/base REV`): instead of the open_clip "
        "comparison, its `toolkit train` and this checkout's run alternately on the same training "
        "shards, --rounds times per loss, and the table gives this/baseline steady-state ratios",
    )
    p.add_argument("--rounds", type=int, default=3, help="alternations per loss with --baseline-tree")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="cliptk processes (gloo on CPU); more than 1 only with --baseline-tree, since "
        "open_clip's trainer runs as one process here",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="cliptk trains with --compile (torch.compile of the "
        "towers; its compile time is inside the end-to-end time and the first --skip-steps)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the timed runs, run cliptk (first --losses entry) and open_clip_train once more "
        "under cProfile and add where each one's time goes (trainer_profile.py) to the results",
    )
    p.add_argument(
        "--storage",
        choices=("pixels", "jpeg", "index"),
        default="pixels",
        help="cliptk's training set: `toolkit data precompute --storage` (index: no copy, the loader "
        "decodes the raw JPEG shards as open_clip's does)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="writes OUT.json and OUT.md (default "
        "benchmarks/trainer/results/train_throughput[_cuda][_STORAGE])",
    )
    a = p.parse_args(argv)
    a.model = a.model or ("ViT-B-32" if a.cuda else "cliptk-tiny")
    a.precision = a.precision or ("bf16" if a.cuda else "fp32")
    a.workers = a.workers if a.workers is not None else (8 if a.cuda else 2)
    a.out = a.out or Path(
        "benchmarks/trainer/results/train_throughput"
        + ("_cuda" if a.cuda else "")
        + ("_vs_baseline" if a.baseline_tree else "")
        + ("" if a.storage == "pixels" else f"_{a.storage}")
    )
    if a.nproc_per_node > 1 and a.baseline_tree is None:
        p.error("--nproc-per-node > 1 needs --baseline-tree (open_clip's trainer runs as one process here)")
    return a


def plan_steps(num_samples: int, batch: int, epochs: int, workers: int) -> tuple[int, int]:
    """(open_clip's --train-num-samples, optimizer steps of the run): open_clip_train makes an epoch
    ceil(samples / batch) batches rounded up to a multiple of its workers; cliptk gets the same count."""
    per_epoch = num_samples // batch
    if per_epoch < 1:
        raise SystemExit(f"--batch-size {batch} exceeds the {num_samples} samples")
    w = max(1, workers)
    return per_epoch * batch, math.ceil(per_epoch / w) * w * epochs


def cliptk_run(
    a,
    train_dir: Path,
    loss: str,
    steps: int,
    run_dir: Path,
    tree: Path | None = None,
    profile: Path | None = None,
) -> dict:
    """``toolkit train`` from this checkout (or from ``tree``, another checkout of cliptk); under cProfile
    into ``profile`` if given."""
    shutil.rmtree(run_dir, ignore_errors=True)
    kind, _, version = loss.partition("-")
    cmd = tb.toolkit_cmd(
        "train",
        "--data",
        str(train_dir),
        "--out",
        str(run_dir),
        "--model",
        a.model,
        "--batch-size",
        str(a.batch_size),
        "--steps",
        str(steps),
        "--loss",
        loss,
        "--mode",
        "gather" if kind == "openclip" else "fastclip",
        "--workers",
        str(a.workers),
        "--precision",
        a.precision,
        "--device",
        "cuda" if a.cuda else "cpu",
        "--lr",
        str(a.lr),
        "--log-every",
        "1",
        "--resume",
        "none",
        "--set",
        f"optim.warmup_steps={a.warmup_steps}",
        "--nproc-per-node",
        str(a.nproc_per_node),
        *(["--compile"] if a.compile else []),
    )
    cmd = tp.profiled(cmd, profile) if profile else cmd
    load = tb.loadavg()
    r = tb.run_tree(cmd, tb.env_with_repo(str(tree) if tree else None), a.timeout_s, poll_s=POLL_S)
    if r.status != "ok":
        raise RuntimeError(f"toolkit train ({loss}) {r.status}:\n{r.stderr[-3000:]}")
    steps_log = tb.cliptk_steps(run_dir)
    return {
        "train_s": r.wall_s,
        "steps": len(steps_log),
        "samples": steps_log[-1]["samples_seen"],
        "step_times_s": [s["step_time_s"] for s in steps_log],
        "peak_tree_pss_bytes": r.peak_pss_bytes,
        "loadavg_before": load,
        "command": " ".join(cmd),
    }


def open_clip_run(
    a, raw: Path, train_num_samples: int, run_dir: Path, pythonpath: str | None, profile: Path | None = None
) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    precision = {"fp32": "fp32", "bf16": "amp_bf16"}[a.precision]
    cmd = tb.open_clip_cmd(
        a.model,
        [
            "--train-data",
            tb.shard_pattern(raw),
            "--dataset-type",
            "webdataset",
            "--train-num-samples",
            str(train_num_samples),
            "--batch-size",
            str(a.batch_size),
            "--epochs",
            str(a.epochs),
            "--workers",
            str(a.workers),
            "--precision",
            precision,
            "--device",
            "cuda" if a.cuda else "cpu",
            "--lr",
            str(a.lr),
            "--warmup",
            str(a.warmup_steps),
            "--log-every-n-steps",
            "1",
            "--save-frequency",
            "0",
            "--logs",
            str(run_dir.parent),
            "--name",
            run_dir.name,
            "--seed",
            "0",
        ],
    )
    cmd = tp.profiled(cmd, profile) if profile else cmd
    load = tb.loadavg()
    r = tb.run_tree(cmd, tb.env_with_repo(pythonpath), a.timeout_s, poll_s=POLL_S)
    if r.status != "ok":
        raise RuntimeError(f"open_clip_train {r.status}:\n{r.stderr[-3000:]}")
    steps_log = tb.open_clip_steps((run_dir / "out.log").read_text())
    return {
        "train_s": r.wall_s,
        "steps": len(steps_log),
        "samples": len(steps_log) * a.batch_size,
        "step_times_s": [s["step_time_s"] for s in steps_log],
        "peak_tree_pss_bytes": r.peak_pss_bytes,
        "loadavg_before": load,
        "command": " ".join(cmd),
    }


def finish_row(name: str, row: dict, data_s: float, a) -> dict:
    row = {"trainer": name, "data_stage_s": data_s, **row}
    row["end_to_end_s"] = data_s + row["train_s"]
    row["end_to_end_samples_per_s"] = row["samples"] / row["end_to_end_s"]
    row["train_only_samples_per_s"] = row["samples"] / row["train_s"]
    row["steady_samples_per_s"] = tb.steady_samples_per_s(row["step_times_s"], a.batch_size, a.skip_steps)
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    return markdown_rows(rows, meta) + "\n" + "\n".join(f"- {t}" for t in ratios(rows))


def markdown_rows(rows: list[dict], meta: dict) -> str:
    lines = [
        f"{meta['model']}, global batch {meta['batch_size']}, {meta['epochs']} epochs of "
        f"{meta['num_samples']} "
        f"Twemoji pairs ({meta['raw_image_size']} px JPEG raw shards), {meta['workers']} loader workers, "
        f"{meta['precision']}, {meta['device']}, cliptk storage {meta.get('storage', 'pixels')}; load "
        "average at "
        f"start {meta['loadavg_at_start']}",
        "",
        "| trainer | data stage (s) | train (s) | end-to-end (s) | steps | samples | end-to-end samples/s "
        "| train-only samples/s | steady-state samples/s | load avg before |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['trainer']} | {r['data_stage_s']:.1f} | {r['train_s']:.1f} | {r['end_to_end_s']:.1f} | "
            f"{r['steps']} | {r['samples']} | {r['end_to_end_samples_per_s']:.1f} | "
            f"{r['train_only_samples_per_s']:.1f} | {r['steady_samples_per_s']:.1f} | "
            f"{r['loadavg_before']:.1f} |"
        )
    lines.append("")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[str]:
    base = next(r for r in rows if r["trainer"] == "open_clip_train")
    out = []
    for r in rows:
        if r is base:
            continue
        e2e = r["end_to_end_samples_per_s"] / base["end_to_end_samples_per_s"]
        steady = r["steady_samples_per_s"] / base["steady_samples_per_s"]
        out.append(
            f"{r['trainer']} / open_clip_train: end-to-end {e2e:.2f}x (target >= {TARGET}x: "
            f"{'met' if e2e >= TARGET else 'MISSED'}), steady-state {steady:.2f}x"
        )
    return out


def compare_trees(a, train_dir: Path, steps: int, data_s: float) -> tuple[list[dict], list[str]]:
    """--baseline-tree: baseline and this checkout alternately, --rounds times per loss (a load change
    hits both); returns the rows and, per loss, this/baseline of the median steady-state rate."""
    import statistics

    rows, lines = [], []
    for loss in a.losses:
        rates: dict[str, list[float]] = {"baseline": [], "this checkout": []}
        for i in range(a.rounds):
            for name, tree in (("baseline", a.baseline_tree), ("this checkout", None)):
                run = cliptk_run(a, train_dir, loss, steps, a.work / f"cmp_{loss}", tree)
                row = finish_row(f"{name}: toolkit train --loss {loss} (round {i + 1})", run, data_s, a)
                rates[name].append(row["steady_samples_per_s"])
                print(
                    f"[train_throughput] {row['trainer']}: {row['steady_samples_per_s']:.1f} samples/s "
                    "steady",
                    file=sys.stderr,
                )
                rows.append(row)
        before, after = (statistics.median(rates[k]) for k in ("baseline", "this checkout"))
        lines.append(
            f"{loss}: this checkout / baseline ({a.baseline_tree}), median steady-state over "
            f"{a.rounds} alternating rounds: {after:.1f} / {before:.1f} samples/s = {after / before:.3f}x"
        )
    return rows, lines


def profile_runs(
    a, raw: Path, train_dir: Path, steps: int, train_num_samples: int, pythonpath: str | None
) -> dict[str, dict[str, float]]:
    """{trainer: {phase: seconds}}: cliptk (data stage and first --losses entry) and open_clip_train,
    each run once more under cProfile."""
    prof = a.work / "profiles"
    prof.mkdir(parents=True, exist_ok=True)
    pre_dir = a.work / "profile_precompute"
    shutil.rmtree(pre_dir, ignore_errors=True)
    pre = tb.run_tree(
        tp.profiled(
            tb.toolkit_cmd("data", "precompute", "--in", str(raw), "--out", str(pre_dir), "--model", a.model),
            prof / "precompute.prof",
        ),
        tb.env_with_repo(),
        a.timeout_s,
        poll_s=POLL_S,
    )
    if pre.status != "ok":
        raise RuntimeError(f"profiled precompute {pre.status}:\n{pre.stderr[-3000:]}")
    cliptk_run(a, train_dir, a.losses[0], steps, a.work / "profile_cliptk", profile=prof / "cliptk.prof")
    open_clip_run(
        a, raw, train_num_samples, a.work / "profile_open_clip", pythonpath, profile=prof / "open_clip.prof"
    )
    return {
        "toolkit data precompute": tp.phases(prof / "precompute.prof"),
        f"toolkit train --loss {a.losses[0]}": tp.phases(prof / "cliptk.prof"),
        "open_clip_train": tp.phases(prof / "open_clip.prof"),
    }


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    meta = tb.machine_meta() | {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    meta["device"] = "cuda" if a.cuda else "cpu"
    raw, n = tb.raw_shards(a.work, a.raw_image_size, a.samples_per_shard)
    # open_clip's own dependencies are installed only when its trainer runs (not for --baseline-tree)
    pythonpath = None if a.baseline_tree else tb.open_clip_pythonpath(a.work)
    train_num_samples, steps = plan_steps(n, a.batch_size, a.epochs, a.workers)
    meta |= {
        "num_samples": n,
        "steps": steps,
        "open_clip_train_num_samples": train_num_samples,
        "open_clip_pythonpath": pythonpath,
    }
    print(f"[train_throughput] {n} samples, batch {a.batch_size}, {steps} steps", file=sys.stderr)

    train_dir = a.work / f"train_{a.model}"
    shutil.rmtree(train_dir, ignore_errors=True)
    pre_cmd = tb.toolkit_cmd(
        "data",
        "precompute",
        "--in",
        str(raw),
        "--out",
        str(train_dir),
        "--model",
        a.model,
        "--storage",
        a.storage,
    )
    load = tb.loadavg()
    pre = tb.run_tree(pre_cmd, tb.env_with_repo(), a.timeout_s, poll_s=POLL_S)
    if pre.status != "ok":
        raise RuntimeError(f"toolkit data precompute {pre.status}:\n{pre.stderr[-3000:]}")
    meta |= {
        "precompute_s": pre.wall_s,
        "precompute_loadavg_before": load,
        "precompute_command": " ".join(pre_cmd),
    }
    print(f"[train_throughput] precompute {pre.wall_s:.1f} s", file=sys.stderr)

    if a.baseline_tree is not None:
        rows, lines = compare_trees(a, train_dir, steps, pre.wall_s)
        meta["comparison"] = lines
        text = markdown_rows(rows, meta) + "\n" + "\n".join(f"- {t}" for t in lines)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".json").write_text(
            json.dumps({"meta": meta, "rows": rows, "ratios": lines}, indent=2)
        )
        a.out.with_suffix(".md").write_text(text + "\n")
        print(text)
        return
    rows = []
    # open_clip runs between the cliptk objectives, so a load change hits both sides.
    order = [("cliptk", a.losses[0])] + [("open_clip", None)] + [("cliptk", loss) for loss in a.losses[1:]]
    for who, loss in order:
        if who == "cliptk":
            row = finish_row(
                f"toolkit train --loss {loss}",
                cliptk_run(a, train_dir, loss, steps, a.work / f"cliptk_{loss}"),
                pre.wall_s,
                a,
            )
        else:
            row = finish_row(
                "open_clip_train",
                open_clip_run(a, raw, train_num_samples, a.work / "open_clip", pythonpath),
                0.0,
                a,
            )
        print(
            f"[train_throughput] {row['trainer']}: {row['end_to_end_s']:.1f} s end-to-end, "
            f"{row['steady_samples_per_s']:.1f} samples/s steady",
            file=sys.stderr,
        )
        rows.append(row)

    table = markdown(rows, meta)
    profile = profile_runs(a, raw, train_dir, steps, train_num_samples, pythonpath) if a.profile else None
    if profile:
        table += (
            "\n\nWhere the time goes (main process under cProfile, a separate untimed run of each; "
            "`benchmarks/trainer/trainer_profile.py`):\n\n" + tp.markdown(profile)
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "rows": rows, "ratios": ratios(rows), "profile_s": profile}, indent=2)
    )
    a.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
