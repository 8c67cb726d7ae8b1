"""The token-budget benchmark (benchmarks/objectives/scratch/tokens.py): equal-FLOPs planning, the curve
arithmetic, and --quick end to end (a real glyph set, real `toolkit train` runs with and without patch
dropout)."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from benchmarks.objectives.scratch import tokens
from benchmarks.objectives.scratch import tokens_report as tr
from toolkit.models.factory import resolve_spec
from toolkit.models.flops import step_flops, tower_flops


def test_first_reach_and_value_at_interpolate_from_chance():
    xs, ys = [10.0, 20.0, 30.0], [0.1, 0.3, 0.2]
    assert tr.first_reach(xs, ys, 0.2, chance=0.0) == pytest.approx(15.0)  # between the 1st and 2nd point
    assert tr.first_reach(xs, ys, 0.05, chance=0.0) == pytest.approx(5.0)  # from (0, chance)
    assert tr.first_reach(xs, ys, 0.01, chance=0.02) == 10.0  # at or below chance: the first evaluation
    assert tr.first_reach(xs, ys, 0.31, chance=0.0) is None
    assert tr.value_at(xs, ys, 25.0, chance=0.0) == (pytest.approx(0.25), False)
    assert tr.value_at(xs, ys, 40.0, chance=0.0) == (pytest.approx(0.2), True)  # ended before: its last


def test_equal_flops_steps_buy_more_steps_for_fewer_tokens():
    cfg = resolve_spec("cliptk-glyph").model_cfg
    full = step_flops(tower_flops(cfg), 128)
    budget = 600 * full
    drop = tokens.equal_flops_steps(cfg, 128, {"patch_dropout": 0.5}, budget)
    assert abs(drop * step_flops(tower_flops(cfg, patch_dropout=0.5), 128) - budget) <= full / 2 + 1
    assert drop > 600
    plan = {"stages": "16px:0.8;:0.2", "stage_lr": "run"}
    steps = tokens.equal_flops_steps(cfg, 128, plan, budget)
    counted = tokens.StepFlops(cfg, 128, plan, steps)
    low = step_flops(tower_flops(cfg, image_size=16), 128)
    stop = round(0.8 * steps)  # stages.schedule's boundary
    assert counted.at(stop) == pytest.approx(stop * low)  # the low-resolution steps, then full ones
    assert counted.at(steps) == pytest.approx(stop * low + (steps - stop) * full)
    assert abs(counted.at(steps) - budget) <= full and steps > 600


def test_tokens_quick_end_to_end(tmp_path, capsys):
    """--quick: full tokens and patch dropout 0.5 at equal counted FLOPs, one seed each, through real
    `toolkit train` runs; the table, targets, PNG and JSON; the same objective in both runs; the full run's
    cache key is the scratch benchmark's untuned run of that objective in that cell; a second call retrains
    nothing."""
    from benchmarks.objectives.scratch import main as scratch
    from benchmarks.objectives.scratch import methods as sm
    from benchmarks.objectives.scratch.glyphset import GlyphSet
    from benchmarks.objectives.scratch.runs import Runner

    cache, out = tmp_path / "cache", tmp_path / "res" / "tokens.json"
    argv = ["--quick", "--workers", "1", "--cache", str(cache), "--out", str(out)]
    report = tokens.main(argv)
    rows = report["results"]["rows"]
    assert list(rows) == ["full", "patch dropout 0.5"]
    full, drop = rows["full"], rows["patch dropout 0.5"]
    assert full["steps"] == report["config"]["num_train_pairs"] // 32 and drop["steps"] > full["steps"]
    per_step = full["flops"] / full["steps"]
    assert abs(drop["flops"] - full["flops"]) <= per_step / 2  # equal compute, to a whole step
    assert drop["curve"]["samples"][-1] == drop["steps"] * 32 == drop["samples"]
    assert drop["curve"]["flops"][-1] == pytest.approx(drop["flops"])
    assert 0.0 <= drop["heldout_r1"]["mean"] <= 1.0 and len(drop["curve"]["train_s"]) == 2
    md = out.with_suffix(".md").read_text()
    assert "| patch dropout 0.5 |" in md and "**any variant**" in md
    assert out.with_suffix(".png").stat().st_size > 0 and json.loads(out.read_text())["results"]

    configs = {}
    for line in (cache / "runs.jsonl").read_text().splitlines():
        key = json.loads(line)["key"]
        configs[key] = yaml.safe_load((cache / "runs" / key / "run" / "config.yaml").read_text())
    by_drop = {c["patch_dropout"]: c for c in configs.values()}
    assert sorted(by_drop) == [0.0, 0.5] and by_drop[0.5]["steps"] == drop["steps"]
    assert by_drop[0.0]["loss"]["kind"] == by_drop[0.5]["loss"]["kind"]
    assert by_drop[0.0]["loss"]["fastclip"]["u_drift"] == by_drop[0.5]["loss"]["fastclip"]["u_drift"]

    s_args = scratch.parse_args(["--quick", "--cache", str(cache), "--methods", "openclip (learnable τ)"])
    s_runner = Runner(s_args, GlyphSet(s_args))
    (cell,) = scratch.make_cells(s_args, report["config"]["num_train_pairs"])
    method = next(m for m in sm.METHODS if m.name == report["config"]["objective"][0])
    assert method.fields == report["config"]["objective"][1]  # the default objective is one of the methods
    assert s_runner.task(cell, method, {}, 0)["key"] in configs  # its untuned run: shared with the benchmark

    capsys.readouterr()
    again = tokens.main(argv)
    assert "s in all)" not in capsys.readouterr().out  # nothing retrained
    assert again["results"]["rows"]["full"]["heldout_r1"] == full["heldout_r1"]


def test_parse_args_refuses_unknown_variants_and_a_missing_reference():
    with pytest.raises(SystemExit):
        tokens.parse_args(["--variants", "patch dropout 0.9", "full"])
    with pytest.raises(SystemExit):
        tokens.parse_args(["--variants", "patch dropout 0.5"])
    args = tokens.parse_args(["--objective", "openclip (learnable τ)"])
    assert isinstance(args, argparse.Namespace) and args.variants == list(tokens.VARIANTS)
