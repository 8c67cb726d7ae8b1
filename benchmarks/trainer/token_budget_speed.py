"""Speed of the token-budget levers on the CPU: patch dropout 0 / 0.5 / 0.75 and half resolution.

For each setting, on random pixels and tokens of ``--batch-size`` pairs (no data loading: the levers act on
the towers), two timings in one process with one thread:

- tower: the image tower's forward + backward (``encode_image`` of a train-mode ``TrainModel``, the sum of
  its features back-propagated);
- step: the trainer's whole optimiser step: ``step.forward_backward`` (both towers, the OpenCLIP loss) and
  an AdamW update.

Half resolution builds the model at half the image size (its positional table then has a quarter of the
patches: what a low-resolution stage runs). The settings are timed round-robin, ``--rounds`` times, and the
median of each is kept, so load drifting during the run hits every setting alike. Ratios are full tokens'
median over the setting's. Counted tower FLOPs (models/flops.py) are printed beside the times.

    python -m benchmarks.trainer.token_budget_speed                   # cliptk-tiny, batch 64, 1 thread
    python -m benchmarks.trainer.token_budget_speed --model cliptk-small --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = {"full": (0.0, 1), "dropout 0.5": (0.5, 1), "dropout 0.75": (0.75, 1), "half resolution": (0.0, 2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cliptk-tiny", help="open_clip ViT model name or config JSON")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7, help="timed repetitions of every setting (round-robin)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "token_budget_speed.json"))
    return ap.parse_args(argv)


def build_setting(model_cfg: dict, dropout: float, shrink: int, batch: int, device: str = "cpu"):
    """(model, optimiser, loss, inputs, counted FLOPs) of one setting on ``device``, random init of seed 0."""
    import torch

    from toolkit.core.config import build
    from toolkit.models.factory import build_model
    from toolkit.models.flops import step_flops, tower_flops
    from toolkit.models.patch_dropout import install
    from toolkit.train.losses import LossConfig, build_loss
    from toolkit.train.model import TrainModel

    cfg = copy.deepcopy(model_cfg)
    size = cfg["vision_cfg"].get("image_size", 224) // shrink
    cfg["vision_cfg"]["image_size"] = size
    torch.manual_seed(0)
    clip = build_model(cfg)
    if dropout:
        install(clip, dropout)
    model = TrainModel(clip, "image", "tokens", (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)).to(device).train()
    gen = torch.Generator().manual_seed(1)
    image = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=gen)
    text = torch.randint(1, 1000, (batch, cfg["text_cfg"].get("context_length", 77)), generator=gen)
    loss = build_loss(build(LossConfig, {"kind": "openclip", "mode": "gather"}), data_size=batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    flops = tower_flops(cfg, patch_dropout=dropout)
    inputs = tuple(t.to(device) for t in (image, text, torch.arange(batch)))
    return model, opt, loss, inputs, {"image_fwd": flops.image, "step": step_flops(flops, batch)}


def _tower(model, image, index) -> float:
    from toolkit.models.patch_dropout import keyed

    start = time.perf_counter()
    with keyed(model, 1, index):
        model.encode_image(image).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def time_step(model, opt, loss, image, text, index, t: int, autocast=contextlib.nullcontext) -> float:
    """Seconds of one optimiser step (forward_backward + AdamW); the caller drains a CUDA queue."""
    from toolkit.core.seeds import stream_seed
    from toolkit.train.step import StepInputs, forward_backward

    start = time.perf_counter()
    forward_backward(
        model,
        loss,
        StepInputs(image, text, index, patch_seed=stream_seed(0, t, 0, 0)),
        micro_batch_size=0,
        seed_of=lambda i: stream_seed(0, t, 0, i),
        autocast=autocast,
    )
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict:
    import torch

    from toolkit.models.factory import resolve_spec

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    model_cfg = resolve_spec(args.model).model_cfg
    built = {name: build_setting(model_cfg, d, s, args.batch_size) for name, (d, s) in SETTINGS.items()}
    times: dict[str, dict[str, list[float]]] = {name: {"tower": [], "step": []} for name in SETTINGS}
    for r in range(args.rounds + 1):  # round 0 warms up (allocator, oneDNN primitives) and is dropped
        for name, (model, opt, loss, (image, text, index), _) in built.items():
            tower, step = _tower(model, image, index), time_step(model, opt, loss, image, text, index, r)
            if r:
                times[name]["tower"].append(tower)
                times[name]["step"].append(step)
    rows = []
    base = {k: statistics.median(times["full"][k]) for k in ("tower", "step")}
    for name, (*_, flops) in built.items():
        med = {k: statistics.median(times[name][k]) for k in ("tower", "step")}
        rows.append(
            {
                "setting": name,
                "tower_s": med["tower"],
                "step_s": med["step"],
                "tower_speedup": base["tower"] / med["tower"],
                "step_speedup": base["step"] / med["step"],
                "image_fwd_gflops": flops["image_fwd"] / 1e9,
                "step_gflops": flops["step"] / 1e9,
                "samples_per_s": args.batch_size / med["step"],
            }
        )
    return {
        "model": args.model,
        "batch_size": args.batch_size,
        "rounds": args.rounds,
        "threads": args.threads,
        "load_before": load_before,
        "load_after": None,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "rows": rows,
        "targets": {"dropout 0.5 tower speedup >=": 1.7, "dropout 0.5 step speedup >=": 1.3},
    }


def table(result: dict) -> str:
    head = (
        f"{result['model']}, batch {result['batch_size']}, {result['threads']} thread(s), median of "
        f"{result['rounds']} rounds, load {result['load_before'][0]:.1f} -> {result['load_after'][0]:.1f}"
    )
    lines = [
        head,
        "",
        "| setting | image fwd GFLOP/sample | tower fwd+bwd s | x | step s | x | samples/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['setting']} | {r['image_fwd_gflops']:.4f} | {r['tower_s']:.3f} | {r['tower_speedup']:.2f} "
            f"| {r['step_s']:.3f} | {r['step_speedup']:.2f} | {r['samples_per_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    result = measure(args)
    result["load_after"] = os.getloadavg()
    text = table(result)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        f"# Token-budget levers: speed\n\n`python -m benchmarks.trainer."
        f"token_budget_speed --model {args.model}`\n\n{text}\n"
    )


if __name__ == "__main__":
    main()
