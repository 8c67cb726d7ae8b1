"""FastCLIP vs OpenCLIP's loss at small global batches: frozen towers (LiT) on the demo, held-out style.

The features come from ``pipelines/lit.yaml`` (run it first): EfficientNet-Lite0 image features and
MiniLM text features of the demo's Twemoji drawings (the training artist). Only the two linear heads and
τ are trained, in this process, through the trainer's own pieces: ``toolkit.train.model.build`` (heads and
logit scale initialised exactly as ``toolkit train`` does for that seed), ``build_loss``,
``build_optimizer``, ``TemperatureControl``, the lr schedule, ``step.forward_backward`` and the global batch
order (``BatchOrder``). Per global batch size (default 32, 64, 256), every method runs the same number of
steps on the same batches from the same initial heads for each seed, so differences are paired by seed:

- ``openclip`` (learnable τ, lr = model lr) and ``openclip-fixed`` (τ from ``--taus``);
- ``fastclip-v1`` (constant τ from ``--taus``) and ``fastclip-v3`` (the CC3M preset's τ rule and ρ: lr_tau
  2e-4 with step_thresh, ρ 6.5, γ_min 0.2);
both FastCLIP versions decay γ over the first 18/37 of the run's epochs, the CC3M preset's proportion.

Fixed τ values are chosen on a validation split carved from the training artist's concepts (``--val-
fraction`` of the Twemoji pairs, never trained on), by mean validation R@1 over seeds at the last step; the
"best OpenCLIP" of a batch size is the OpenCLIP variant (learnable or tuned fixed τ) with the better
validation R@1. Scores are held-out retrieval R@1 on the OpenMoji drawings of every concept (the set
``toolkit eval build-set --source openmoji --task retrieval`` writes), computed from the towers' features
of those images (preprocessed as the zero-shot stage does) through the heads, with clip-benchmark's
recall definition; image->text is clip-benchmark's ``text_retrieval_recall@1``.

    PYTHONPATH=$PWD python benchmarks/convergence.py [--run-dir runs/lit --steps 200 --seeds 5]

Writes ``--out`` (JSON), the same path with ``.md`` (table) and ``.png`` (held-out R@1 curves), and prints
the table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn.functional import normalize

from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.loader import make_loader
from toolkit.data.trainset.order import BatchOrder
from toolkit.train import model as model_lib
from toolkit.train.losses import LossConfig, build_loss
from toolkit.train.optim import OptimConfig
from toolkit.train.runtime import autocast
from toolkit.train.step import StepInputs, forward_backward, stream_seed
from toolkit.train.update import Update

# The CC3M FastCLIP-v3 preset decays γ over 18 of its 37 epochs; v3's τ rule and ρ are that preset's too.
GAMMA_DECAY_FRACTION = 18 / 37
V3 = dict(lr_tau=2e-4, lr_tau_schedule="step_thresh", rho=6.5, gamma_min=0.2)
SPLIT_SEED = 20240607  # which training concepts form the validation split (fixed, independent of --seeds)


def load_features(run_dir: Path) -> tuple[TrainDataset, np.ndarray, np.ndarray]:
    """(dataset, image features [N, 1280], text features [N, 384]) of the lit pipeline's precompute output,
    row i = sample id i."""
    ds = TrainDataset.open(str(run_dir / "precompute"))
    batch = next(iter(make_loader(ds, batch_size=ds.num_samples, num_steps=1, num_workers=0)))
    order = np.argsort(batch["index"].numpy())
    return ds, batch["image_features"].float().numpy()[order], batch["text_features"].float().numpy()[order]


def heldout_features(run_dir: Path, preprocess_cfg: dict, cache: Path) -> dict[str, np.ndarray]:
    """Tower features of the OpenMoji retrieval set: images [M, 1280] through the zero-shot stage's
    transform, captions [T, 384], and the image of each caption [T] (cached in ``cache``)."""
    if cache.is_file():
        return dict(np.load(cache))
    from toolkit.eval.datasets import make_eval_loader, open_eval_set
    from toolkit.models import frozen
    from toolkit.models.factory import eval_transform

    eval_set = open_eval_set(run_dir / "evalsets", "openmoji_retrieval")
    image_tower, text_tower = frozen.load_image_tower("efficientnet_lite0"), frozen.load_text_tower("minilm")
    images, captions, owner = [], [], []
    with torch.no_grad():
        for pixels, texts in make_eval_loader(eval_set, eval_transform(preprocess_cfg), 64):
            start = sum(len(x) for x in images)  # images so far: this batch's first image index
            owner.extend(start + i for i, caps in enumerate(texts) for _ in caps)
            captions.extend(c for caps in texts for c in caps)
            images.append(image_tower.forward(pixels).float().numpy())
    out = {"image": np.concatenate(images), "text": text_tower.encode(captions).astype(np.float32),
           "owner": np.asarray(owner, dtype=np.int64)}
    np.savez(cache, **out)
    return out


def recall_at_1(image_emb: torch.Tensor, text_emb: torch.Tensor, owner: torch.Tensor) -> tuple[float, float]:
    """(image->text, text->image) R@1 as clip-benchmark computes them (top-1 by torch.topk)."""
    scores = text_emb @ image_emb.T  # [T, M]
    t2i = (scores.topk(1, dim=1).indices[:, 0] == owner).float().mean().item()
    top_text = scores.T.topk(1, dim=1).indices[:, 0]  # [M]
    i2t = (owner[top_text] == torch.arange(image_emb.shape[0])).float().mean().item()
    return i2t, t2i


class Bench:
    """Features, splits and each seed's initial heads; ``run`` trains one (method, batch, seed) cell."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        run_dir = Path(args.run_dir)
        ds, img, txt = load_features(run_dir)
        rng = np.random.default_rng(SPLIT_SEED)
        perm = rng.permutation(ds.num_samples)
        num_val = int(round(ds.num_samples * args.val_fraction))
        val_ids, train_ids = np.sort(perm[:num_val]), np.sort(perm[num_val:])
        self.train_img, self.train_txt = torch.from_numpy(img[train_ids]), torch.from_numpy(txt[train_ids])
        self.val = (torch.from_numpy(img[val_ids]), torch.from_numpy(txt[val_ids]), torch.arange(num_val))
        self.num_train, self.num_val = len(train_ids), num_val
        self.dataset = ds
        self.inits: dict[int, dict[str, torch.Tensor]] = {}
        self.built = self._build(0)
        self.clip = self.built.model.clip
        held = heldout_features(run_dir, self.built.preprocess_cfg, run_dir / "convergence_heldout_features.npz")
        self.held = (torch.from_numpy(held["image"]), torch.from_numpy(held["text"]), torch.from_numpy(held["owner"]))

    def _build(self, seed: int):
        built = model_lib.build(self.args.heads, "", self.dataset, 0.07, True, seed)
        self.inits[seed] = {k: v.detach().clone() for k, v in built.model.clip.named_parameters() if v.requires_grad}
        return built

    def _reset(self, seed: int, loss_cfg: LossConfig) -> None:
        """Heads as ``toolkit train --seed seed`` initialises them; logit scale log(1/tau_init)."""
        if seed not in self.inits:
            self._build(seed)
        params = dict(self.clip.named_parameters())
        with torch.no_grad():
            for name, value in self.inits[seed].items():
                params[name].copy_(value)
                params[name].requires_grad_(True)
            self.clip.logit_scale.fill_(math.log(1.0 / loss_cfg.tau_init))
        self.clip.logit_scale.requires_grad_(loss_cfg.learns_logit_scale)

    def scores(self, feats: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> tuple[float, float]:
        self.clip.eval()
        with torch.no_grad():
            x = normalize(self.built.model.encode_image(feats[0]), dim=-1)
            y = normalize(self.built.model.encode_text(feats[1]), dim=-1)
        self.clip.train()
        return recall_at_1(x, y, feats[2])

    def run(self, loss_cfg: LossConfig, batch: int, seed: int) -> dict:
        """Train the heads ``--steps`` steps; held-out and validation R@1 every ``--eval-every`` steps."""
        args = self.args
        self._reset(seed, loss_cfg)
        optim_cfg = OptimConfig(lr=args.lr, weight_decay=0.1, warmup_steps=args.steps // 10)
        loss_fn = build_loss(loss_cfg, data_size=self.num_train)
        update = Update(self.clip, loss_fn, optim_cfg, loss_cfg, args.steps)  # the trainer's own update part
        order = BatchOrder(self.num_train, batch, seed)
        per_epoch = order.batches_per_pass
        curve = {"step": [], "heldout": [], "val": []}
        for t in range(args.steps):
            update.begin(t, per_epoch)
            ids = torch.from_numpy(order.batch_ids(t))
            inputs = StepInputs(self.train_img[ids], self.train_txt[ids], ids)
            forward_backward(self.built.model, loss_fn, inputs, micro_batch_size=0,
                             seed_of=lambda i, t=t: stream_seed(seed, t, 0, i), autocast=autocast("fp32", "cpu"))
            update.finish(loss_fn.global_value())
            if (t + 1) % args.eval_every == 0 or t + 1 == args.steps:
                curve["step"].append(t + 1)
                curve["heldout"].append(self.scores(self.held))
                curve["val"].append(self.scores(self.val))
        curve["tau"] = update.temperature()
        return curve


def methods(taus: list[float], gamma_decay_epochs: int) -> dict[str, LossConfig]:
    """Every objective of one batch size, by name (fixed-τ ones once per τ of the grid)."""
    out = {"openclip": LossConfig(kind="openclip", mode="gather", learn_tau=True)}
    for tau in taus:
        out[f"openclip-fixed@{tau:g}"] = LossConfig(kind="openclip", mode="gather", learn_tau=False, tau_init=tau)
    for tau in taus:
        out[f"fastclip-v1@{tau:g}"] = LossConfig(kind="fastclip", version="v1", tau_init=tau, gamma_min=0.2,
                                                  gamma_decay_epochs=gamma_decay_epochs)
    out["fastclip-v3"] = LossConfig(kind="fastclip", version="v3", gamma_decay_epochs=gamma_decay_epochs, **V3)
    return out


def _mean_r1(pair: list[float]) -> float:
    return (pair[0] + pair[1]) / 2


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarise(batch: int, runs: dict[str, list[dict]], seeds: list[int]) -> dict:
    """Tuned τ (validation), best OpenCLIP, held-out R@1 mean ± std, paired differences, steps to reach."""
    val = {m: statistics.fmean(_mean_r1(r["val"][-1]) for r in rs) for m, rs in runs.items()}

    def best(prefix: str) -> str:
        return max((m for m in runs if m.startswith(prefix + "@")), key=lambda m: val[m])

    chosen = {"openclip (learnable τ)": "openclip", "openclip (tuned fixed τ)": best("openclip-fixed"),
              "fastclip-v1 (tuned τ)": best("fastclip-v1"), "fastclip-v3": "fastclip-v3"}
    best_open = max(("openclip (learnable τ)", "openclip (tuned fixed τ)"), key=lambda k: val[chosen[k]])
    ref = [_mean_r1(r["heldout"][-1]) for r in runs[chosen[best_open]]]
    target = statistics.fmean(ref)
    rows = {}
    for label, m in chosen.items():
        rs = runs[m]
        final = [r["heldout"][-1] for r in rs]
        curve = np.mean([[_mean_r1(p) for p in r["heldout"]] for r in rs], axis=0)
        reach = next((s for s, v in zip(rs[0]["step"], curve, strict=True) if v >= target), None)
        diffs = [_mean_r1(f) - b for f, b in zip(final, ref, strict=True)]
        d = _stats(diffs)
        rows[label] = {"method": m, "val_r1": val[m], "heldout_i2t": _stats([f[0] for f in final]),
                       "heldout_t2i": _stats([f[1] for f in final]), "heldout_mean": _stats([_mean_r1(f) for f in final]),
                       "final_tau": _stats([r["tau"] for r in rs]), "steps_to_reach_best_openclip": reach,
                       "paired_diff_vs_best_openclip": {**d, "per_seed": diffs,
                                                        "ahead_by_2_std": len(diffs) > 1 and d["mean"] > 2 * d["std"] and d["mean"] > 0},
                       "curve_steps": rs[0]["step"], "curve_heldout_mean": curve.tolist()}
    return {"batch": batch, "seeds": seeds, "best_openclip": best_open, "best_openclip_final_r1": target,
            "val_r1_by_method": val, "rows": rows}


def table(results: list[dict], steps: int) -> str:
    lines = [f"Held-out (OpenMoji) retrieval R@1 after {steps} steps, mean ± std over seeds; Δ = paired "
             "difference of the mean R@1 vs the best OpenCLIP (± std of the difference); steps: first evaluation "
             "at which the seed-mean R@1 reaches the best OpenCLIP's final value.", "",
             "| batch | method | τ | val R@1 | image→text R@1 | text→image R@1 | mean R@1 | Δ vs best OpenCLIP | "
             "> 2 std | steps to reach |", "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for label, r in res["rows"].items():
            tag = " (best)" if label == res["best_openclip"] else ""
            d = r["paired_diff_vs_best_openclip"]
            delta = "—" if tag else f"{100 * d['mean']:+.2f} ± {100 * d['std']:.2f}"
            ahead = "—" if tag else ("yes" if d["ahead_by_2_std"] else "no")
            pm = lambda s: f"{100 * s['mean']:.2f} ± {100 * s['std']:.2f}"  # noqa: E731
            lines.append(f"| {res['batch']} | {label}{tag} | {r['final_tau']['mean']:.3f} | {100 * r['val_r1']:.2f} | "
                         f"{pm(r['heldout_i2t'])} | {pm(r['heldout_t2i'])} | {pm(r['heldout_mean'])} | {delta} | "
                         f"{ahead} | {r['steps_to_reach_best_openclip'] or 'not reached'} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        for label, r in res["rows"].items():
            ax.plot(r["curve_steps"], [100 * v for v in r["curve_heldout_mean"]], label=label)
        ax.axhline(100 * res["best_openclip_final_r1"], color="grey", lw=0.8, ls="--")
        ax.set(title=f"global batch {res['batch']}", xlabel="step", ylabel="held-out mean R@1 (%)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", default="runs/lit", help="the lit pipeline's run folder")
    parser.add_argument("--heads", default="cliptk-small", help="model config whose embed_dim the heads use")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64, 256])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--taus", type=float, nargs="+", default=[0.01, 0.02, 0.03, 0.05, 0.07])
    parser.add_argument("--val-fraction", type=float, default=0.15)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the heads' matrices are "
                        "small: one thread avoids oversubscribing a shared CPU)")
    parser.add_argument("--out", default="benchmarks/results/convergence.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.monotonic()
    bench = Bench(args)
    seeds = list(range(args.seeds))
    results = []
    for batch in args.batches:
        per_epoch = BatchOrder(bench.num_train, batch).batches_per_pass
        epochs = math.ceil(args.steps / per_epoch)
        gamma_epochs = max(1, round(epochs * GAMMA_DECAY_FRACTION))
        runs: dict[str, list[dict]] = {}
        for name, loss_cfg in methods(args.taus, gamma_epochs).items():
            runs[name] = [bench.run(loss_cfg, batch, seed) for seed in seeds]
            print(f"batch {batch} {name}: held-out mean R@1 "
                  f"{statistics.fmean(_mean_r1(r['heldout'][-1]) for r in runs[name]):.4f} "
                  f"({time.monotonic() - start:.0f} s)", flush=True)
        res = summarise(batch, runs, seeds)
        res.update(epochs=epochs, gamma_decay_epochs=gamma_epochs, steps_per_epoch=per_epoch)
        results.append(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"steps": args.steps, "lr": args.lr, "taus": args.taus, "val_fraction": args.val_fraction,
            "num_train": bench.num_train, "num_val": bench.num_val, "num_heldout_images": int(bench.held[0].shape[0]),
            "heads": args.heads, "v3": V3, "gamma_decay_fraction": GAMMA_DECAY_FRACTION,
            "wall_s": round(time.monotonic() - start, 1), "torch_threads": torch.get_num_threads()}
    out.write_text(json.dumps({"config": meta, "results": results}, indent=2) + "\n")
    text = table(results, args.steps)
    out.with_suffix(".md").write_text(f"# Convergence: FastCLIP vs OpenCLIP (frozen towers, demo)\n\n{text}")
    plot(results, out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
