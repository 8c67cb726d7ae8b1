"""How index-mode training data scales with the number of samples, and what each storage mode costs on disk.

Scale (synthetic raw shards of 1,000 samples, 16 px JPEGs and short captions, at each ``--sizes`` N):

- ``toolkit data precompute --storage index``: wall time per sample, peak RSS of the parent and of the
  largest worker (each measured in a fresh child process: ``ru_maxrss``);
- the loader's time to its first batch (256 samples, 0 workers) from a fresh ``make_loader``, imports
  (torch, and torchvision for the JPEG decoder) excluded;
- the trainer's start-up: wall time of ``toolkit train --steps 1 --loss fastclip-v3`` (cliptk-tiny, batch
  32, one CPU process), i.e. process start, FastCLIP's per-sample tables of size N, one step and exit.

Each quantity gets a fitted growth exponent (log-log least squares over the sizes), and the parent's peak
memory its growth in bytes per sample between the smallest and the largest size.

Disk (``--disk-samples`` samples): 256 px crops of the three real photographs that ship with matplotlib and
scikit-learn, in img2dataset's layout (jpg q95 + txt + json), precomputed at a 224 px model input in every
mode (jpeg at several qualities): bytes per sample on disk, index extra disk as % of the raw shards, jpeg as a
fraction of pixels, and the PSNR of jpeg against pixels (the loader's decoded uint8 images).

    python -m benchmarks.data.data_scale                                # 1e4 and 1e5, ~10 min on 2 cores
    python -m benchmarks.data.data_scale --sizes 10000 100000 1000000   # + 1e6, ~1 h

Writes benchmarks/data/results/data_scale.{json,md,png}; the work folder (``--work``) is removed at the end
unless ``--keep``. Imports nothing from the other benchmark scripts.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PER_SHARD = 1000
MODEL = "cliptk-tiny"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--workers", type=int, default=2, help="precompute worker processes")
    p.add_argument("--disk-samples", type=int, default=400)
    p.add_argument("--qualities", type=int, nargs="+", default=[75, 90, 95])
    p.add_argument("--work", default="/tmp/cliptk_data_scale")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--keep", action="store_true", help="keep --work (with --startup-only: its training sets)")
    p.add_argument(
        "--startup-only",
        action="store_true",
        help="re-measure only the loader's first batch and the trainer's start-up at --sizes (index "
        "sets in --work are reused, built untimed when missing) and merge them into the rows of "
        "the existing data_scale.json; the precompute columns stay as measured",
    )
    return p.parse_args(argv)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", WANDB_MODE="disabled")


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 0
    tar.addfile(info, io.BytesIO(data))


def make_synthetic(raw: Path, n: int) -> None:
    """N samples in shards of PER_SHARD: 16 px JPEGs (64 distinct ones) and 'a photo of thing K' captions."""
    from PIL import Image

    rng = np.random.default_rng(0)
    pool = []
    for _ in range(64):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        pool.append(buf.getvalue())
    raw.mkdir(parents=True, exist_ok=True)
    for shard in range(-(-n // PER_SHARD)):
        with tarfile.open(raw / f"{shard:05d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for k in range(shard * PER_SHARD, min(n, (shard + 1) * PER_SHARD)):
                key = f"{k:09d}"
                _member(tar, f"{key}.jpg", pool[k % 64])
                _member(tar, f"{key}.txt", f"a photo of thing {k}".encode())


def _child(code: str, timeout_s: int = 7200) -> dict:
    """Run ``code`` in a fresh python; it prints one JSON line last. Adds the peak RSS of the child itself
    (VmHWM: ru_maxrss would carry over this benchmark's own peak through fork + exec) and of its largest own
    child (pool workers, ru_maxrss: forked after the exec, from the child's RSS), in bytes."""
    wrap = (
        code + "\nimport resource as _r, json as _j\n"
        "_hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0].split()[1]\n"
        "print(_j.dumps(dict(RESULT, peak_self_bytes=int(_hwm) * 1024, "
        "peak_children_bytes=_r.getrusage(_r.RUSAGE_CHILDREN).ru_maxrss * 1024)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", wrap], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )
    if done.returncode:
        raise RuntimeError(f"child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def precompute(raw: Path, out: Path, storage: str, workers: int, **extra) -> dict:
    opts = {
        "input": str(raw),
        "out": str(out),
        "model": MODEL,
        "storage": storage,
        "num_workers": workers,
        **extra,
    }
    return _child(
        "import time\nfrom toolkit.core.config import build\n"
        "from toolkit.data.trainset.precompute.stage import PrecomputeConfig, run\n"
        f"cfg = build(PrecomputeConfig, {opts!r})\nt = time.monotonic()\nres = run(cfg)\n"
        "RESULT = {'wall_s': time.monotonic() - t, 'num_samples': res.counts['num_samples']}"
    )


def first_batch(path: Path) -> dict:
    return _child(
        # the index loader decodes JPEGs with libjpeg-turbo through torchvision, imported on first use (a
        # trainer has it already: open_clip imports it); imported here so that the first batch excludes it
        "import time\nimport torchvision.io\nfrom toolkit.data.trainset.loader import make_loader\n"
        "t = time.monotonic()\n"
        f"batch = next(iter(make_loader({str(path)!r}, batch_size=256, seed=0)))\n"
        "RESULT = {'first_batch_s': time.monotonic() - t}"
    )


def train_startup(path: Path, out: Path) -> dict:
    """Wall and CPU seconds (user + sys of the process tree) of ``toolkit train --steps 1``, and the load
    average beside it: on a shared 2-core machine the wall time follows the load, the CPU time much less."""
    cmd = [
        sys.executable,
        "-m",
        "toolkit",
        "--quiet",
        "train",
        "--data",
        str(path),
        "--model",
        MODEL,
        "--out",
        str(out),
        "--steps",
        "1",
        "--batch-size",
        "32",
        "--workers",
        "0",
        "--loss",
        "fastclip-v3",
        "--device",
        "cpu",
        "--set",
        "tensorboard=false",
    ]
    before, start = os.times(), time.monotonic()
    done = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=3600)
    wall, after = time.monotonic() - start, os.times()
    if done.returncode:
        raise RuntimeError(f"train failed:\n{done.stderr[-3000:]}")
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"train_startup_s": wall, "train_startup_cpu_s": cpu, "load_avg": os.getloadavg()[0]}


def import_floor() -> dict:
    """Wall and CPU seconds of a bare ``python -c "import torch, open_clip"``: the third-party imports every
    start-up pays (open_clip pulls in torchvision, timm, transformers and torch._dynamo at import)."""
    before, start = os.times(), time.monotonic()
    subprocess.run(
        [sys.executable, "-c", "import torch, open_clip"],
        env=_env(),
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=600,
    )
    wall, after = time.monotonic() - start, os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"import_floor_s": round(wall, 2), "import_floor_cpu_s": round(cpu, 2)}


def startup_columns(idx: Path, out: Path) -> dict:
    """The loader's first batch and the trainer's start-up on training set ``idx``, with the import floor
    measured right after (same load)."""
    row = {"first_batch_s": round(first_batch(idx)["first_batch_s"], 3)}
    start = train_startup(idx, out)
    row.update(
        train_startup_s=round(start["train_startup_s"], 2),
        train_startup_cpu_s=round(start["train_startup_cpu_s"], 2),
        load_avg=round(start["load_avg"], 1),
    )
    row.update(import_floor())
    shutil.rmtree(out, ignore_errors=True)
    return row


def dir_bytes(path: Path, pattern: str = "0*") -> int:
    return sum(p.stat().st_size for p in path.glob(pattern) if p.is_file())


def scale_row(work: Path, n: int, workers: int) -> dict:
    raw, idx = work / f"raw_{n}", work / f"index_{n}"
    start = time.monotonic()
    make_synthetic(raw, n)
    made = time.monotonic() - start
    pre = precompute(raw, idx, "index", workers)
    row = {
        "num_samples": n,
        "make_raw_s": round(made, 1),
        "precompute_s": round(pre["wall_s"], 2),
        "precompute_us_per_sample": round(pre["wall_s"] / n * 1e6, 1),
        "precompute_parent_peak_mb": round(pre["peak_self_bytes"] / 2**20, 1),
        "precompute_worker_peak_mb": round(pre["peak_children_bytes"] / 2**20, 1),
        "raw_bytes": dir_bytes(raw, "*.tar"),
        "index_bytes": dir_bytes(idx),
    }
    row.update(startup_columns(idx, work / f"train_{n}"))
    print(json.dumps(row), flush=True)
    shutil.rmtree(raw)  # keep the disk small between sizes
    shutil.rmtree(idx)
    shutil.rmtree(work / f"train_{n}", ignore_errors=True)
    return row


def exponent(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y over log x (y ~ x^slope)."""
    if len(xs) < 2:
        return None
    return round(float(np.polyfit(np.log(xs), np.log(ys), 1)[0]), 3)


def make_photos(raw: Path, n: int) -> None:
    """N img2dataset-style samples (jpg q95 at 256 px, txt, json) cropped from three real photographs."""
    import matplotlib
    import sklearn
    from PIL import Image

    sources = [
        Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg",
        *(Path(sklearn.__file__).parent / "datasets" / "images" / f for f in ("china.jpg", "flower.jpg")),
    ]
    photos = [Image.open(p).convert("RGB") for p in sources]
    rng = np.random.default_rng(1)
    raw.mkdir(parents=True, exist_ok=True)
    for shard in range(-(-n // 100)):
        with tarfile.open(raw / f"{shard:05d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for k in range(shard * 100, min(n, (shard + 1) * 100)):
                img = photos[k % 3]
                side = int(rng.integers(160, min(img.size) + 1))
                x, y = int(rng.integers(0, img.width - side + 1)), int(rng.integers(0, img.height - side + 1))
                buf = io.BytesIO()
                img.crop((x, y, x + side, y + side)).resize((256, 256), Image.BICUBIC).save(
                    buf, "JPEG", quality=95
                )
                key = f"{k:09d}"
                _member(tar, f"{key}.jpg", buf.getvalue())
                _member(tar, f"{key}.txt", f"a photograph, crop {k} of picture {k % 3}".encode())
                _member(tar, f"{key}.json", json.dumps({"key": key, "status": "success"}).encode())


def _images(path: Path) -> np.ndarray:
    from toolkit.data.trainset.loader import make_loader

    return np.concatenate([b["image"].numpy() for b in make_loader(str(path), batch_size=64, shuffle=False)])


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return round(10 * math.log10(255.0**2 / mse), 2)


def disk_rows(work: Path, n: int, qualities: list[int], workers: int) -> dict:
    raw = work / "photos"
    make_photos(raw, n)
    raw_bytes, sets = dir_bytes(raw, "*.tar"), {}
    for name, storage, extra in [
        ("pixels", "pixels", {}),
        ("index", "index", {}),
        *((f"jpeg_q{q}", "jpeg", {"jpeg_quality": q}) for q in qualities),
    ]:
        sets[name] = work / f"disk_{name}"
        precompute(raw, sets[name], storage, workers, image_size=224, **extra)
    pixels = _images(sets["pixels"])
    out = {
        "num_samples": n,
        "model_input_px": 224,
        "raw_bytes_per_sample": round(raw_bytes / n, 1),
        "modes": {},
    }
    for name, path in sets.items():
        stored = dir_bytes(path)
        row = {
            "bytes_per_sample": round(stored / n, 1),
            "vs_raw_percent": round(100 * stored / raw_bytes, 2),
            "meta_bytes_per_sample": round(dir_bytes(path, "*.meta.jsonl") / n, 1),
        }
        if name.startswith("jpeg") or name == "index":
            row["psnr_vs_pixels_db"] = psnr(_images(path), pixels) if name != "index" else "identical"
        out["modes"][name] = row
    pix = out["modes"]["pixels"]["bytes_per_sample"]
    for row in out["modes"].values():
        row["vs_pixels"] = round(row["bytes_per_sample"] / pix, 4)
    print(json.dumps(out), flush=True)
    return out


def summarise(rows: list[dict]) -> dict:
    ns = [r["num_samples"] for r in rows]
    first, last = rows[0], rows[-1]
    growth = None
    if len(rows) > 1:
        growth = round(
            (last["precompute_parent_peak_mb"] - first["precompute_parent_peak_mb"])
            * 2**20
            / (last["num_samples"] - first["num_samples"]),
            2,
        )
    return {
        "precompute_time_exponent": exponent(ns, [r["precompute_s"] for r in rows]),
        "precompute_parent_peak_bytes_per_sample": growth,
        "first_batch_exponent": exponent(ns, [r["first_batch_s"] for r in rows]),
        "train_startup_exponent": exponent(ns, [r["train_startup_s"] for r in rows]),
        "train_startup_cpu_exponent": exponent(ns, [r["train_startup_cpu_s"] for r in rows])
        if all("train_startup_cpu_s" in r for r in rows)
        else None,
    }


def markdown(rows: list[dict], fits: dict, disk: dict | None, cmd: str) -> str:
    lines = [
        f"# Index-mode scale and storage-mode disk (`{cmd}`)",
        "",
        "| N | precompute s | us/sample | parent peak MB | worker peak MB | index / raw | first batch s "
        "| train start-up s | start-up CPU s | import floor s (CPU) | load |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        floor = f"{r['import_floor_s']} ({r['import_floor_cpu_s']})" if "import_floor_s" in r else ""
        lines.append(
            f"| {r['num_samples']:,} | {r['precompute_s']} | {r['precompute_us_per_sample']} | "
            f"{r['precompute_parent_peak_mb']} | {r['precompute_worker_peak_mb']} | "
            f"{100 * r['index_bytes'] / r['raw_bytes']:.1f} % | {r['first_batch_s']} | "
            f"{r['train_startup_s']} | {r.get('train_startup_cpu_s', '')} | {floor} | "
            f"{r.get('load_avg', '')} |"
        )
    lines += [
        "",
        "Fitted growth (y ~ N^k): " + ", ".join(f"{k} = {v}" for k, v in fits.items()),
        "",
        "Synthetic samples are 16 px JPEGs (~2.5 kB of tar a sample, headers included), so the index's "
        "share of them is large here; the disk table below gives it for real photos. Parent peak: the "
        "precompute process's VmHWM (torch and the tokenizer are ~570 MB of it); worker peak: the "
        "largest pool worker's ru_maxrss. Train start-up: `toolkit train --steps 1` wall time, process "
        'start to exit, and its CPU seconds (user + sys); import floor: a bare `python -c "import torch, '
        'open_clip"` measured right after it (the third-party imports every start-up pays); load: the '
        "1-minute load average of the 2-core machine beside the start-up (wall times follow it).",
    ]
    if any("startup_command" in r for r in rows):
        lines.append(
            "First batch and start-up re-measured by "
            + "; ".join(sorted({f"`{r['startup_command']}`" for r in rows if "startup_command" in r}))
            + "."
        )
    lines.append("")
    if disk:
        lines += [
            f"Disk, {disk['num_samples']} real-photo samples (256 px JPEG q95 raw shards, "
            f"{disk['raw_bytes_per_sample']:,} B a sample), model input {disk['model_input_px']} px:",
            "",
            "| mode | bytes/sample | vs raw shards | vs pixels | PSNR vs pixels |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, r in disk["modes"].items():
            lines.append(
                f"| {name} | {r['bytes_per_sample']:,} | {r['vs_raw_percent']} % | {r['vs_pixels']} | "
                f"{r.get('psnr_vs_pixels_db', '')} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], disk: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["num_samples"] for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [
        ("precompute us/sample", ["precompute_us_per_sample"]),
        ("precompute peak RSS MB", ["precompute_parent_peak_mb", "precompute_worker_peak_mb"]),
        ("loader first batch s", ["first_batch_s"]),
        ("train start-up s (1 step)", ["train_startup_s", "train_startup_cpu_s", "import_floor_s"]),
    ]
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):
        for key in keys:
            if all(key in r for r in rows):
                ax.plot(ns, [r[key] for r in rows], "o-", label=key)
        ax.set(xscale="log", title=title, xlabel="samples N")
        ax.set_ylim(bottom=0)  # flat is the target: a zoomed axis would make noise look like growth
        ax.legend(fontsize=7)
    if disk:
        names = list(disk["modes"])
        axes.flat[4].bar(names, [disk["modes"][m]["bytes_per_sample"] for m in names])
        axes.flat[4].set(
            yscale="log",
            title=f"disk bytes/sample at {disk['model_input_px']} px (raw: "
            f"{disk['raw_bytes_per_sample']:,.0f})",
        )
        axes.flat[4].tick_params(axis="x", labelsize=7)
        jpegs = [m for m in names if m.startswith("jpeg")]
        axes.flat[5].plot(
            [disk["modes"][m]["bytes_per_sample"] for m in jpegs],
            [disk["modes"][m]["psnr_vs_pixels_db"] for m in jpegs],
            "o-",
        )
        for m in jpegs:
            axes.flat[5].annotate(
                m, (disk["modes"][m]["bytes_per_sample"], disk["modes"][m]["psnr_vs_pixels_db"])
            )
        axes.flat[5].set(title="jpeg: PSNR vs pixels", xlabel="bytes/sample", ylabel="dB")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def rewrite_report(out: Path) -> None:
    """Regenerate data_scale.md and .png from data_scale.json (after a change to the report's text)."""
    result = json.loads((out / "data_scale.json").read_text())
    (out / "data_scale.md").write_text(
        markdown(result["scale"], result["fits"], result["disk"], result["command"])
    )
    plot(result["scale"], result["disk"], out / "data_scale.png")


def startup_only(args: argparse.Namespace, cmd: str) -> None:
    """--startup-only: the start-up columns at each size, merged into the existing data_scale.json."""
    work, out = Path(args.work), Path(args.out)
    result = json.loads((out / "data_scale.json").read_text())
    for n in sorted(args.sizes):
        raw, idx = work / f"raw_{n}", work / f"index_{n}"
        if not (idx / "dataset.json").is_file():
            make_synthetic(raw, n)
            precompute(raw, idx, "index", args.workers)
        cols = {**startup_columns(idx, work / f"train_{n}"), "startup_command": cmd.strip()}
        print(json.dumps({"num_samples": n, **cols}), flush=True)
        for row in result["scale"]:
            if row["num_samples"] == n:
                row.update(cols)
        result["fits"] = summarise(result["scale"])
        (out / "data_scale.json").write_text(json.dumps(result, indent=2) + "\n")
        rewrite_report(out)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print((out / "data_scale.md").read_text())


def main(argv=None) -> None:
    args = parse_args(argv)
    work, out = Path(args.work), Path(args.out)
    if args.startup_only:
        return startup_only(
            args,
            "python -m benchmarks.data.data_scale " + " ".join(argv if argv is not None else sys.argv[1:]),
        )
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python -m benchmarks.data.data_scale " + " ".join(argv if argv is not None else sys.argv[1:])
    disk = disk_rows(work, args.disk_samples, args.qualities, args.workers) if args.disk_samples else None
    rows = []
    for n in sorted(args.sizes):  # results rewritten after each size: a long run stopped early keeps its rows
        rows.append(scale_row(work, n, args.workers))
        fits = summarise(rows)
        result = {
            "command": cmd,
            "cpu_cores": len(os.sched_getaffinity(0)),
            "workers": args.workers,
            "scale": rows,
            "fits": fits,
            "disk": disk,
        }
        (out / "data_scale.json").write_text(json.dumps(result, indent=2) + "\n")
        text = markdown(rows, fits, disk, cmd.strip())
        (out / "data_scale.md").write_text(text)
        plot(rows, disk, out / "data_scale.png")
    print(text)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
