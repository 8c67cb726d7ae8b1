"""Smoke checks of the trainer benchmarks' helpers (the benchmarks themselves take minutes and are not run).

Argument parsing, step planning, log parsing of both trainers, and the process-tree memory runner on a
child that allocates a known amount: seconds in all.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.objectives.convergence import main as convergence
from benchmarks.shared import trainer_bench as tb
from benchmarks.trainer import train_memory, train_throughput

MB = 2**20


def test_throughput_args_and_steps():
    a = train_throughput.parse_args([])
    assert (a.model, a.precision, a.workers) == ("cliptk-tiny", "fp32", 2)
    cuda = train_throughput.parse_args(["--cuda"])
    assert (cuda.model, cuda.precision, cuda.workers) == ("ViT-B-32", "bf16", 8)
    # 1898 samples, batch 256: 7 batches per epoch, open_clip rounds to 8 for 2 workers; 5 epochs -> 40 steps
    assert train_throughput.plan_steps(1898, 256, 5, 2) == (1792, 40)
    with pytest.raises(SystemExit):
        train_throughput.plan_steps(100, 256, 1, 2)


def test_memory_args_snap_to_micro_batch_times_workers(tmp_path):
    a = train_memory.parse_args(["--micro-batch-size", "32", "--workers", "3"])
    assert train_memory.batch_step(a) == 96
    for i in range(3):
        (tmp_path / f"{i:05d}.tar").touch()
    cmd = train_memory.open_clip_cmd(a, tmp_path, 960, tmp_path / "t")
    assert cmd[cmd.index("--accum-freq") + 1] == "30" and cmd[cmd.index("--batch-size") + 1] == "32"
    assert cmd[cmd.index("--train-data") + 1] == str(tmp_path / "{00000..00002}.tar")


def test_open_clip_log_parsing():
    log = (
        "2026-11-23,12:37:51 | INFO | Train Epoch: 0 [ 256/2048 (12%)] Data (t): 0.711 Batch (t): 2.845, "
        "89.9957/s, 89.9957/s/gpu LR: 0.000500 Logit Scale: 14.286 Loss: 5.6861 (5.6861)\n"
        "2026-11-23,12:37:52 | INFO | Train Epoch: 0 [ 512/2048 (25%)] Data (t): 0.005 Batch (t): 1.436, "
        "178.265/s, 178.265/s/gpu LR: 0.001000\n"
    )
    steps = tb.open_clip_steps(log)
    assert [s["samples_done"] for s in steps] == [256, 512]
    assert [s["step_time_s"] for s in steps] == [2.845, 1.436]
    assert tb.steady_samples_per_s([s["step_time_s"] for s in steps], 256, skip=1) == pytest.approx(
        256 / 1.436
    )


def test_run_tree_measures_and_enforces_memory():
    grow = [
        sys.executable,
        "-c",
        "import time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(0.5)",
    ]
    ok = tb.run_tree(grow, tb.env_with_repo(), timeout_s=60, poll_s=0.05)
    assert ok.status == "ok" and ok.returncode == 0
    assert 300 * MB <= ok.peak_main_rss_bytes < 400 * MB  # exact peak from the rusage wrapper
    assert ok.peak_pss_bytes >= 250 * MB  # polled while it slept
    killed = tb.run_tree(grow, tb.env_with_repo(), timeout_s=60, budget_bytes=100 * MB, poll_s=0.05)
    assert killed.status == "over budget" and killed.peak_pss_bytes > 100 * MB


def test_tower_speed_summary_table_and_bare_rate(tmp_path):
    """benchmarks/data/tower_speed.py: its arguments, the ratios and verdicts it prints, and its bare-forward
    timer on a small conv net (the real run takes minutes)."""
    import torch

    from benchmarks.data import tower_speed

    a = tower_speed.parse_args(["--num-images", "16", "--repeats", "1", "--out", str(tmp_path / "t")])
    assert (a.num_images, a.repeats, a.threads) == (16, 1, 2)
    rates = {
        "bare eager": [10.0, 12.0],
        "bare fast": [20.0, 20.0],
        "precompute": [17.0, 18.0],
        "precompute (wall)": [8.0, 9.0],
        "eval cold": [15.0, 15.0],
        "eval cached": [400.0, 600.0],
    }
    summary = tower_speed.summarise(rates)
    assert summary["vs_bare_fast"]["precompute"] == pytest.approx(17.5 / 20)
    assert summary["fast_vs_eager"] == pytest.approx(20 / 11)
    assert summary["cached_speedup"] == pytest.approx(500 / 15)
    targets = summary["targets"]
    assert targets["precompute_vs_bare"]["met"] and not targets["eval_cold_vs_bare"]["met"]
    text = tower_speed.table(
        summary,
        rates,
        {
            "num_images": 16,
            "batch_size": 8,
            "threads": 2,
            "repeats": 2,
            "loadavg_at_start": 1.0,
            "torch": "x",
            "cpu_count": 2,
        },
    )
    assert "| eval cached | 500.0 | 400.0, 600.0 | 25.00x |" in text
    assert "eval_cold_vs_bare: 0.75 (target >= 0.8): missed by 0.05" in text
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval()
    assert tower_speed.bare_rate(net, torch.randn(5, 3, 16, 16), 2, channels_last=True) > 0


def _synthetic_artists(cache: Path, num_concepts: int = 120) -> None:
    """A feature cache as benchmarks/objectives/convergence/emoji_artists.py writes it: each artist draws a
    concept's latent through a shared projection plus its own smaller one (so the heads can learn and
    transfer to the held-out artist); one artist misses some concepts."""
    import numpy as np

    rng = np.random.default_rng(0)
    latent = rng.standard_normal((num_concepts, 16))
    codes = np.asarray([f"c{i}" for i in range(num_concepts)])
    (cache / "features").mkdir(parents=True)
    text = latent @ rng.standard_normal((16, 384)) + 3.0 * rng.standard_normal((num_concepts, 384))
    np.savez(
        cache / "features" / "captions.npz", codepoints=codes, captions=codes, text=text.astype(np.float32)
    )
    shared = rng.standard_normal((16, 1280))
    for artist, keep in (
        ("twemoji", num_concepts),
        ("noto", num_concepts - 7),
        ("fluent", num_concepts),
        ("openmoji", num_concepts),
    ):
        own = shared + 0.5 * rng.standard_normal((16, 1280))
        image = latent[:keep] @ own + 12.0 * rng.standard_normal((keep, 1280))
        np.savez(
            cache / "features" / f"{artist}.npz", codepoints=codes[:keep], image=image.astype(np.float32)
        )


@pytest.fixture
def torch_threads():
    """The convergence benchmark's workers run one torch thread each (Bench sets it process-wide); with
    --workers 1 that worker is this process, so the count is put back for the tests that follow (a
    one-thread in-process run made test_launch's 1-process vs 2-rank FastCLIP tables differ by 3e-5)."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_convergence_quick_end_to_end(tmp_path, capsys, torch_threads):
    """--quick on a synthetic feature cache: every available method tuned and run, tables, PNG, JSON;
    a second call reuses every finished run from CACHE/runs.jsonl."""

    _synthetic_artists(tmp_path / "cache")
    out = tmp_path / "res" / "convergence.json"
    argv = [
        "--quick",
        "--workers",
        "1",
        "--cache",
        str(tmp_path / "cache"),
        "--out",
        str(out),
        "--methods",
        "openclip (learnable τ)",
        "openclip (fixed τ)",
        "fastclip-v3",
        "neuclip",
        "siglip",
    ]
    report = convergence.main(argv)
    (cell,) = report["results"]
    assert (cell["regime"], cell["batch"], cell["epochs"]) == ("short", 32, 2)
    assert report["config"]["num_val_pairs"] + report["config"]["num_train_pairs"] == 3 * 120 - 7
    assert cell["best_openclip"] in ("openclip (learnable τ)", "openclip (fixed τ)")
    for name, row in cell["rows"].items():
        assert len(row["paired_diff_vs_best_openclip"]["per_seed"]) == 2, name
        grids, chosen = row["tuning"]["grids"], row["tuning"]["chosen"]
        for (
            knob
        ) in grids:  # a grid end wins only when the extension limit says so (inherited knobs: not searched)
            value = chosen[knob]
            assert value not in (grids[knob][0], grids[knob][-1]) or knob in row["tuning"]["ends_at_best"]
        for knob, value in row["tuning"]["inherited"].items():  # NeuCLIP starts from v3's tuned knobs
            assert cell["rows"]["fastclip-v3"]["tuning"]["chosen"][knob] == value
    assert out.with_suffix(".md").read_text().count("| 32 | 2 (") == len(cell["rows"])
    assert (out.parent / "convergence_short.png").stat().st_size > 0
    lines = (tmp_path / "cache" / "runs.jsonl").read_text().splitlines()
    capsys.readouterr()
    again = convergence.main(argv)
    assert "s in all)" not in capsys.readouterr().out  # nothing retrained
    assert len((tmp_path / "cache" / "runs.jsonl").read_text().splitlines()) == len(lines)
    assert again["results"][0]["rows"] == cell["rows"]


def test_scratch_quick_end_to_end(tmp_path, capsys):
    """--quick of the from-scratch benchmark with one method: a real glyph set (60 characters), real shards,
    one `toolkit train` run from random init with its zero-shot evaluations; the table, PNG and JSON; a second
    call retrains nothing (CACHE/runs.jsonl)."""
    from benchmarks.objectives.scratch import main as scratch

    out = tmp_path / "res" / "scratch.json"
    argv = [
        "--quick",
        "--workers",
        "1",
        "--cache",
        str(tmp_path / "cache"),
        "--out",
        str(out),
        "--methods",
        "openclip (learnable τ)",
    ]
    handler = signal.getsignal(signal.SIGTERM)
    report = scratch.main(argv)
    assert signal.getsignal(signal.SIGTERM) is handler  # the runs' SIGTERM handler is the caller's again
    (cell,) = report["results"]
    assert (cell["regime"], cell["batch"], cell["epochs"]) == ("short", 32, 1)
    assert cell["steps"] == report["config"]["num_train_pairs"] // 32
    row = cell["rows"]["openclip (learnable τ)"]
    assert cell["best_openclip"] == "openclip (learnable τ)" and row["num_seeds"] == 1
    assert 0.0 <= row["heldout_r1"]["mean"] <= row["heldout_r10"]["mean"] <= 1.0
    assert 1 <= row["heldout_median_rank"]["mean"] <= report["config"]["num_held_pairs"]
    assert row["curve_samples"][-1] == cell["steps"] * 32 and len(row["curve_train_s"]) == len(
        row["curve_heldout"]
    )
    assert report["config"]["num_held_distinct_pairs"] <= report["config"]["num_held_pairs"]
    assert len(report["config"]["pixels_sha1"]) == 40 and "FreeType" in report["config"]["drawn_with"]
    assert "| short | 32 | 1 (" in out.with_suffix(".md").read_text()
    assert (out.parent / "scratch.png").stat().st_size > 0
    assert len(json.loads((out.parent / "scratch_runs.json").read_text())) == 1
    capsys.readouterr()
    again = scratch.main(argv)
    assert "s in all)" not in capsys.readouterr().out  # nothing retrained
    assert again["results"][0]["rows"] == cell["rows"]
    # scratch.candidate pairs a method's runs with the recorded ones by label: the recorded method itself,
    # whose runs the cache holds, pairs with a Δ of exactly 0 and retrains nothing but the check, which is
    # trained again although cached (a cached check would compare the cache with itself) and matches
    from benchmarks.objectives.scratch import candidate

    paired = candidate.main(
        [
            *("--cache", str(tmp_path / "cache"), "--min-fonts", "12", "--limit", "60", "--eval-points", "2"),
            *(
                "--pages",
                str(out),
                "--runs",
                str(out.parent / "scratch_runs.json"),
                "--check-cell",
                "short b32",
            ),
            *("--candidate", "openclip (learnable τ)", "--out", str(tmp_path / "cand.json")),
        ]
    )
    assert capsys.readouterr().out.count("s in all)") == 1
    (pc,) = paired["cells"]
    assert pc["delta"] == [0.0] and pc["candidate_r1"] == [100 * row["heldout_r1"]["mean"]]
    assert paired["check"]["rerun"] == paired["check"]["recorded"]
    assert "| short b32 (scratch.json) | 1 | openclip (learnable τ) |" in (tmp_path / "cand.md").read_text()
    # --extra-seeds: seed 1 is trained (once: the candidate's and the reference's run are the same task),
    # seed 0 still comes from the record
    more = candidate.main(
        [
            *("--cache", str(tmp_path / "cache"), "--min-fonts", "12", "--limit", "60", "--eval-points", "2"),
            *("--pages", str(out), "--runs", str(out.parent / "scratch_runs.json"), "--no-check"),
            *(
                "--candidate",
                "openclip (learnable τ)",
                "--extra-seeds",
                "1",
                "--out",
                str(tmp_path / "c2.json"),
            ),
        ]
    )
    assert capsys.readouterr().out.count("s in all)") == 1
    (pc,) = more["cells"]
    assert pc["num_seeds"] == 2 and pc["delta"] == [0.0, 0.0]
    assert pc["candidate_r1"][0] == paired["cells"][0]["candidate_r1"][0]
    # the page's runs file lists the runs of its own cells, once each, not the shared cache (which now also
    # holds seed 1 and a second line for the re-trained check)
    scratch.main(argv)
    rows = json.loads((out.parent / "scratch_runs.json").read_text())
    assert [r["label"] for r in rows] == ["short b32 openclip (learnable τ) s0"], rows


def test_scratch_stopped_by_sigterm_leaves_no_run_behind(tmp_path):
    """SIGTERM to a running from-scratch benchmark (a scheduler's stop, `kill`) stops its `toolkit train` runs
    too: no process of it outlives it, and no cut-short run enters the run cache."""
    from proctools import ROOT, alive, descendants, env, wait_for

    argv = [
        "--quick",
        "--workers",
        "1",
        "--cache",
        str(tmp_path / "cache"),
        "--out",
        str(tmp_path / "r.json"),
    ]
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.objectives.scratch",
        *argv,
        "--methods",
        "openclip (learnable τ)",
    ]
    bench = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def training() -> set[int]:  # the benchmark's processes once its `toolkit train` runs
        procs = descendants(bench.pid)
        for pid in procs:
            try:
                if b"toolkit\0train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return procs
            except OSError:
                continue
        return set()

    try:
        procs = wait_for(training, 300, "the benchmark's toolkit train")
        bench.send_signal(signal.SIGTERM)
        out, _ = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert not [pid for pid in procs if alive(pid)], out[-3000:]
    runs = tmp_path / "cache" / "runs.jsonl"
    assert not runs.is_file() or not runs.read_text().strip()
    # the next call trains the stopped run again, from its start, into the same run folder
    again = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert len(runs.read_text().splitlines()) == 1


@pytest.mark.dist
def test_fsdp_capacity_bisects_the_widths_with_real_jobs(tmp_path):
    """fsdp_capacity at a tiny budget: real 2-rank gloo jobs per measured width; the largest fitting width of
    each trainer was measured under the budget and the next measured one over it; FSDP fits at least DDP's."""
    from benchmarks.trainer import fsdp_capacity

    out = tmp_path / "cap.json"
    argv = ["--budget-gib", "0.25", "--world", "2", "--local-batch", "2", "--steps", "2"]
    argv += ["--min-width", "64", "--max-width", "384", "--work", str(tmp_path / "work"), "--out", str(out)]
    result = fsdp_capacity.main(argv)
    budget = 0.25 * 2**30
    for kind in ("ddp", "fsdp"):
        best = result["largest"][kind]
        points = [p for p in result["points"] if p["kind"] == kind]
        assert best["fits"] and best["peak_bytes"] <= budget and best["peak_bytes"] > best["state_bytes"] > 0
        above = [p for p in points if p["width"] > best["width"]]
        assert all(not p["fits"] for p in above)
    assert result["largest"]["fsdp"]["params"] >= result["largest"]["ddp"]["params"]
    assert result["params_ratio"] == result["largest"]["fsdp"]["params"] / result["largest"]["ddp"]["params"]
    assert "largest fsdp: width" in out.with_suffix(".md").read_text()


def test_candidate_reads_several_runs_files(tmp_path):
    """scratch.candidate --runs A B: one record of every label; a label whose two records differ (runs from
    another glyph set or trainer) stops it, naming the file and the label."""
    from benchmarks.objectives.scratch import candidate

    def runs(path, **finals):
        rows = [{"label": k.replace("_", " "), "heldout_r1": list(v)} for k, v in finals.items()]
        path.write_text(json.dumps(rows))
        return str(path)

    a = runs(tmp_path / "a.json", short_b32_x_s0=(0.1, 0.3), long_b32_x_s0=(0.5, 0.5))
    b = runs(tmp_path / "b.json", short_b32_x_s0=(0.1, 0.3), short_b32_x_s1=(0.2, 0.2))
    assert candidate.recorded_runs([a, b]) == pytest.approx(
        {"short b32 x s0": 0.2, "long b32 x s0": 0.5, "short b32 x s1": 0.2}
    )
    c = runs(tmp_path / "c.json", short_b32_x_s0=(0.1, 0.31))
    with pytest.raises(SystemExit, match=r"c\.json: 'short b32 x s0' differs"):
        candidate.recorded_runs([a, c])


def test_candidate_stops_on_a_page_drawn_from_other_pixels(tmp_path):
    """A page whose glyph set had other pixels (another Pillow/FreeType draws other glyphs) cannot pair with
    runs on this build: scratch.candidate stops and names the page and both renderers; a page from before
    the fingerprint, or from the same pixels, passes."""
    from benchmarks.objectives.scratch import candidate

    here = {"pixels_sha1": "a" * 40, "drawn_with": "Pillow 13.0.0 (FreeType 2.14.3), matplotlib 3.11.2"}
    pages = {}
    for name, config in (
        ("same", here),
        ("old", {}),
        ("other", {"pixels_sha1": "b" * 40, "drawn_with": "X"}),
    ):
        pages[name] = tmp_path / f"{name}.json"
        pages[name].write_text(json.dumps({"config": config, "results": []}))
    candidate.check_same_set([str(pages["same"]), str(pages["old"])], here)
    with pytest.raises(SystemExit, match=r"other\.json: .*drawn with X; here Pillow 13\.0\.0"):
        candidate.check_same_set([str(pages["same"]), str(pages["other"])], here)


def test_default_runs_are_keyed_by_what_the_default_resolves_to(tmp_path, monkeypatch):
    """A "trainer default" run names no loss; its cache key holds the objective the rule resolves to, so a run
    finished under an earlier default is trained again instead of being reused under the same label."""
    from types import SimpleNamespace

    from benchmarks.objectives.scratch import methods as sm
    from benchmarks.objectives.scratch import runs
    from toolkit.train.losses import choice

    args = SimpleNamespace(cache=str(tmp_path), fresh=False, lr=2e-3, model="cliptk-glyph", eval_points=6)
    runner = runs.Runner(args, SimpleNamespace(signature="set"))
    cell = {"regime": "short", "batch": 32, "steps": 2604, "epochs": 6, "gamma_decay_epochs": 3}
    default = next(m for m in sm.METHODS if m.name == "trainer default")
    named = next(m for m in sm.METHODS if m.name == "openclip (learnable τ)")
    before = runner.task(cell, default, {}, 0), runner.task(cell, named, {}, 0)
    changed = {**choice.DEFAULT_LOSS, "fastclip": {"version": "v3", "u_drift": "none"}}
    monkeypatch.setattr(choice, "DEFAULT_LOSS", changed)
    after = runner.task(cell, default, {}, 0), runner.task(cell, named, {}, 0)
    assert before[0]["label"] == after[0]["label"] and before[0]["key"] != after[0]["key"]
    assert before[1]["key"] == after[1]["key"]  # a named objective does not depend on the default
