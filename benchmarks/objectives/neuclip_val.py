"""Quick validation check of objectives on frozen-tower (LiT) features: does an objective learn, and which of
its settings is best, judged on a validation split of the training artist only (never the held-out artist).

The features come from ``pipelines/lit.yaml``'s precompute stage (Twemoji drawings). ``--val-fraction`` of
the pairs (a fixed split, the same as benchmarks/objectives/convergence/'s) are never trained on; the heads
train on the rest through the trainer's own pieces (``model.build``, ``build_loss``, ``build_optimizer``,
``TemperatureControl``, ``set_lr``, ``forward_backward``, ``BatchOrder``) and the objective's hooks in the
trainer's order (``begin_step``, forward/backward, optimiser step, ``end_step``). Each method is given as
NAME=JSON (LossConfig fields), e.g.

    python -m benchmarks.objectives.neuclip_val --batch 32 --steps 200 --seeds 3 \\
        v3='{"kind": "fastclip", "fastclip": {"version": "v3"}, "lr_tau": 2e-4,
            "lr_tau_schedule": "step_thresh", "rho": 6.5}' \\
        neuclip='{"kind": "neuclip", "lr_tau": 2e-4, "lr_tau_schedule": "step_thresh", "rho": 6.5}'

Prints validation mean R@1 (image->text and text->image averaged) per method, mean ± std over seeds and
the paired difference to the first method; writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.functional import normalize

from benchmarks.objectives.convergence.runs import SPLIT_SEED  # the same validation split
from toolkit.core.config import build
from toolkit.core.seeds import stream_seed
from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.loader import make_loader
from toolkit.data.trainset.order import BatchOrder
from toolkit.train import model as model_lib
from toolkit.train.losses import LossConfig, build_loss
from toolkit.train.losses.temperature import TemperatureControl
from toolkit.train.optim import OptimConfig, build_optimizer, logit_scale_group
from toolkit.train.schedule import set_lr
from toolkit.train.step import StepInputs, forward_backward


def load_split(run_dir: Path, val_fraction: float):
    """(dataset, train (img, txt), val (img, txt)) tensors of the lit precompute output."""
    ds = TrainDataset.open(str(run_dir / "precompute"))
    batch = next(iter(make_loader(ds, batch_size=ds.num_samples, num_steps=1, num_workers=0)))
    order = np.argsort(batch["index"].numpy())
    img, txt = batch["image_features"].float()[order], batch["text_features"].float()[order]
    perm = np.random.default_rng(SPLIT_SEED).permutation(ds.num_samples)
    num_val = int(round(ds.num_samples * val_fraction))
    val, train = torch.from_numpy(np.sort(perm[:num_val])), torch.from_numpy(np.sort(perm[num_val:]))
    return ds, (img[train], txt[train]), (img[val], txt[val])


def val_r1(built, val) -> float:
    """Mean of image->text and text->image R@1 on the validation pairs (one caption per image)."""
    built.model.clip.eval()
    with torch.no_grad():
        x = normalize(built.model.encode_image(val[0]), dim=-1)
        y = normalize(built.model.encode_text(val[1]), dim=-1)
    built.model.clip.train()
    s, truth = x @ y.T, torch.arange(x.shape[0])
    return ((s.argmax(1) == truth).float().mean().item() + (s.argmax(0) == truth).float().mean().item()) / 2


def train_one(args, ds, train, val, loss_cfg: LossConfig, seed: int) -> dict:
    built = model_lib.build(args.heads, "", ds, loss_cfg.tau_init, loss_cfg.learns_logit_scale, seed)
    clip = built.model.clip
    optim_cfg = OptimConfig(lr=args.lr, weight_decay=0.1, warmup_steps=args.steps // 10)
    num_train = train[0].shape[0]
    loss_fn = build_loss(loss_cfg, data_size=num_train)
    optimizer = build_optimizer(clip, optim_cfg, loss_cfg.lr_tau)
    group = logit_scale_group(optimizer)
    tau_ctl = (
        None
        if group is None
        else TemperatureControl(
            clip.logit_scale, group, lr_tau=loss_cfg.lr_tau or args.lr, schedule=loss_cfg.lr_tau_schedule
        )
    )
    order = BatchOrder(num_train, args.batch, seed)
    curve = []
    for t in range(args.steps):
        loss_fn.begin_step(t, order.batches_per_pass)
        set_lr(optimizer, t, args.steps, optim_cfg)
        if tau_ctl is not None and loss_cfg.lr_tau_schedule != "cosine":
            tau_ctl.before_step(t)
        ids = torch.from_numpy(order.batch_ids(t))
        forward_backward(
            built.model,
            loss_fn,
            StepInputs(train[0][ids], train[1][ids], ids),
            micro_batch_size=0,
            seed_of=lambda i, t=t: stream_seed(seed, t, 0, i),
            autocast=contextlib.nullcontext,
        )
        optimizer.step()
        loss_fn.end_step(True)
        if tau_ctl is not None:
            tau_ctl.after_step()
        optimizer.zero_grad(set_to_none=True)
        if (t + 1) % args.eval_every == 0 or t + 1 == args.steps:
            curve.append((t + 1, val_r1(built, val)))
    return {
        "curve": curve,
        "val_r1": curve[-1][1],
        "tau": loss_fn.temperature(clip.logit_scale.detach().exp()),
        **{k: v for k, v in loss_fn.metrics().items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "methods", nargs="+", help="NAME=JSON of LossConfig fields; the first is the reference"
    )
    parser.add_argument("--run-dir", default="runs/lit", help="the lit pipeline's run folder")
    parser.add_argument("--heads", default="cliptk-small")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--val-fraction", type=float, default=0.15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/objectives/results/neuclip_val.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ds, train, val = load_split(Path(args.run_dir), args.val_fraction)
    methods = {m.split("=", 1)[0]: json.loads(m.split("=", 1)[1]) for m in args.methods}
    results, start = {}, time.monotonic()
    for name, fields in methods.items():
        cfg = build(LossConfig, fields)
        results[name] = [train_one(args, ds, train, val, cfg, seed) for seed in range(args.seeds)]
        finals = [r["val_r1"] for r in results[name]]
        print(
            f"{name}: val R@1 {100 * statistics.fmean(finals):.2f} ({time.monotonic() - start:.0f} s)",
            flush=True,
        )
    ref = [r["val_r1"] for r in results[next(iter(methods))]]
    lines = [
        f"batch {args.batch}, {args.steps} steps "
        f"({args.steps / math.ceil(train[0].shape[0] / args.batch):.1f} "
        f"epochs), {args.seeds} seeds; validation mean R@1 (%), paired Δ vs {next(iter(methods))}",
        "| method | val R@1 | Δ | τ |",
        "|---|---|---|---|",
    ]
    for name, rs in results.items():
        v, d = (
            [100 * r["val_r1"] for r in rs],
            [100 * (r["val_r1"] - b) for r, b in zip(rs, ref, strict=True)],
        )
        sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0  # noqa: E731
        lines.append(
            f"| {name} | {statistics.fmean(v):.2f} ± {sd(v):.2f} | {statistics.fmean(d):+.2f} ± {sd(d):.2f} "
            f"| {statistics.fmean(r['tau'] for r in rs):.3f} |"
        )
    print("\n".join(lines))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"args": vars(args), "methods": methods, "results": results, "table": lines}, indent=1)
        + "\n"
    )


if __name__ == "__main__":
    main()
