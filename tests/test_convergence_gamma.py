"""The convergence benchmark's γ methods (benchmarks/objectives/convergence/methods.py): FastCLIP's final γ is
a tuned knob like τ, lr_tau and ρ; DRRho-CLIP's γ rule decays over all of a cell's epochs; SCENT's update
tunes its γ_s. Run for real through the trainer's step on a synthetic feature cache (seconds)."""

from __future__ import annotations

import pytest

from benchmarks.objectives.convergence import main as convergence
from benchmarks.objectives.convergence import methods as cm
from benchmarks.objectives.convergence.runs import Data, Runner
from tests.test_benchmarks import _synthetic_artists

DRRHO, SCENT, DRIFT = "fastclip-v3 (u_drift, drrho γ)", "fastclip-v3 (scent)", "fastclip-v3 (u_drift)"


@pytest.fixture
def torch_threads():
    """Bench sets one torch thread process-wide; put the count back for the tests that follow."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_gamma_methods_build_and_decay_over_the_right_epochs(tmp_path):
    by = {m.name: m for m in cm.METHODS}
    for name in (DRRHO, SCENT, DRIFT, "fastclip-v1", "fastclip-v3"):
        assert cm.unavailable(by[name]) == "", name
    for name in (
        DRIFT,
        "fastclip-v1",
        "fastclip-v3",
    ):  # the moving average's γ is searched like the other knobs
        assert "gamma_min" in by[name].grid and by[name].bounds["gamma_min"][1] == 1.0
    _synthetic_artists(tmp_path / "cache")
    args = convergence.parse_args(["--cache", str(tmp_path / "cache"), "--long-epochs", "30"])
    runner = Runner(args, Data(args))
    (cell,) = [c for c in convergence.make_cells(args, 300) if c["regime"] == "long" and c["batch"] == 32]
    assert cell["gamma_decay_epochs"] == 15  # the CC3M preset's share, 18 of 37 epochs
    drrho = runner.task(cell, by[DRRHO], {}, 0)["fields"]
    assert drrho["gamma_decay_epochs"] == 30 and drrho["gamma_rule"] == "drrho"  # E = all the run's epochs
    cfg = cm.loss_config(drrho, DRRHO)
    from toolkit.train.losses.fastclip.schedules import final_gamma

    assert final_gamma(cfg.fastclip) == pytest.approx(min(1.0, 4.177 * 30**-0.7265))
    assert runner.task(cell, by[DRIFT], {"gamma_min": 0.3}, 0)["fields"]["gamma_decay_epochs"] == 15


def test_gamma_methods_tuned_and_run(tmp_path, torch_threads):
    """--quick (2 epochs): DRRho's rule gives γ = 1 throughout (4.177·2^-0.7265 > 1), so its run is the drift-
    corrected v3's tuning run at γ_min = 1 with the same τ, lr_tau and ρ, bit for bit; SCENT's γ_s is
    searched."""
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
        "openclip (fixed τ)",
        DRIFT,
        DRRHO,
        SCENT,
    ]
    report = convergence.main(argv)
    (cell,) = report["results"]
    rows = cell["rows"]
    drift = rows[DRIFT]["tuning"]
    assert set(drift["grids"]["gamma_min"]) >= {0.1, 0.3, 1.0}
    robust = {k: drift["chosen"][k] for k in ("tau_init", "lr_tau", "rho")}
    for name in (DRRHO, SCENT):  # the robust loss's knobs come from the drift-corrected v3 of the cell
        assert rows[name]["tuning"]["inherited"] == robust
    assert rows[DRRHO]["tuning"]["grids"] == {}
    assert len(rows[SCENT]["tuning"]["scores"]) >= 3 and "scent_gamma" in rows[SCENT]["tuning"]["chosen"]
    assert "drrho" in out.with_suffix(".md").read_text()
    args = convergence.parse_args(argv)
    runner = Runner(args, Data(args))  # every run below is read from CACHE/runs.jsonl, none retrained
    (cell_def,) = convergence.make_cells(args, report["config"]["num_train_pairs"])
    by = {m.name: m for m in cm.METHODS}
    (rule,) = runner.curves([runner.task(cell_def, by[DRRHO], robust, 0)])
    (fixed,) = runner.curves([runner.task(cell_def, by[DRIFT], {**robust, "gamma_min": 1.0}, 0)])
    (decayed,) = runner.curves([runner.task(cell_def, by[DRIFT], {**robust, "gamma_min": 0.1}, 0)])
    assert rule["val"] == fixed["val"] and rule["heldout"] == fixed["heldout"]
    assert decayed["heldout"] != fixed["heldout"]  # γ reaches the estimators: a smaller γ changes the run


OVER_RUN, SHORT_DEFAULT = "fastclip-v3 (u_drift, γ over the run)", "fastclip-v3 (u_drift), defaults"


def test_default_candidates_decay_gamma_over_their_share_of_the_run(tmp_path):
    """The candidate defaults run at the trainer's defaults (nothing tuned) and differ only in γ's decay:
    over all the cell's epochs, or over 18/37 of them (today's short-run default)."""
    import dataclasses

    from toolkit.train.losses import LossConfig

    by = {m.name: m for m in cm.METHODS}
    _synthetic_artists(tmp_path / "cache")
    args = convergence.parse_args(["--cache", str(tmp_path / "cache"), "--long-epochs", "30"])
    runner = Runner(args, Data(args))
    (cell,) = [c for c in convergence.make_cells(args, 300) if c["regime"] == "long" and c["batch"] == 32]
    over_run = cm.loss_config(runner.task(cell, by[OVER_RUN], {}, 0)["fields"], OVER_RUN)
    short = cm.loss_config(runner.task(cell, by[SHORT_DEFAULT], {}, 0)["fields"], SHORT_DEFAULT)
    assert (over_run.fastclip.gamma_decay_epochs, short.fastclip.gamma_decay_epochs) == (30, 15)
    assert dataclasses.replace(over_run, fastclip=short.fastclip) == short
    defaults = LossConfig()
    assert (short.tau_init, short.lr_tau, short.lr_tau_schedule, short.rho) == (
        defaults.tau_init,
        defaults.lr_tau,
        defaults.lr_tau_schedule,
        defaults.rho,
    )
    assert (short.fastclip.version, short.fastclip.u_drift) == ("v3", "batch")
    assert short.fastclip.gamma_min == defaults.fastclip.gamma_min
    assert not by[OVER_RUN].grid and not by[SHORT_DEFAULT].grid


def test_knobs_adopted_from_the_first_file_with_the_batch(tmp_path):
    """--long-knobs-from A B: a cell takes a method's knobs from the first file with a cell of its batch that
    holds the method; a method without a grid has nothing to adopt (no source needed), one no file has is
    tuned here."""
    import json

    def result(batch: int, lr_tau: float) -> dict:
        row = {"tuning": {"chosen": {"lr_tau": lr_tau}}}
        return {"results": [{"regime": "long", "batch": batch, "rows": {"openclip (learnable τ)": row}}]}

    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(result(64, 1e-4)))
    second.write_text(json.dumps({"results": [*result(32, 1e-5)["results"], *result(64, 1e-2)["results"]]}))
    by = {m.name: m for m in cm.METHODS}
    searches = {
        (b, name): ({"regime": "long", "batch": b}, by[name], cm.Search(by[name]))
        for b in (32, 64)
        for name in ("openclip (learnable τ)", OVER_RUN)
    }
    convergence.adopt_knobs([str(first), str(second)], searches, {"long"})
    assert searches[(64, "openclip (learnable τ)")][2].best == {"lr_tau": 1e-4}
    assert searches[(32, "openclip (learnable τ)")][2].best == {"lr_tau": 1e-5}
    assert str(second) in searches[(32, "openclip (learnable τ)")][2].adopted_from
    assert not searches[(32, OVER_RUN)][2].pending() and not searches[(32, OVER_RUN)][2].adopted_from
    # a batch no file has: the method is tuned in this run (its search left pending, nothing adopted)
    missing = {
        "x": (
            {"regime": "long", "batch": 256},
            by["openclip (learnable τ)"],
            cm.Search(by["openclip (learnable τ)"]),
        )
    }
    convergence.adopt_knobs([str(first)], missing, {"long"})
    assert missing["x"][2].pending() and not missing["x"][2].adopted_from


def test_knobs_adopted_from_the_same_regime_before_an_earlier_file(tmp_path, capsys):
    """--knobs-from SHORT LONG: a long cell takes the long cell's knobs although the short file comes first
    (a short cell's lr_tau is not the long budget's); with only a short cell it takes that one and says so."""
    import json

    def result(regime: str, lr_tau: float) -> dict:
        row = {"tuning": {"chosen": {"lr_tau": lr_tau}}}
        return {"results": [{"regime": regime, "batch": 32, "rows": {"openclip (learnable τ)": row}}]}

    short, long = tmp_path / "short.json", tmp_path / "long.json"
    short.write_text(json.dumps(result("short", 1e-4)))
    long.write_text(json.dumps(result("long", 1e-5)))
    method = next(m for m in cm.METHODS if m.name == "openclip (learnable τ)")

    def adopted(paths: list) -> cm.Search:
        searches = {"x": ({"regime": "long", "batch": 32}, method, cm.Search(method))}
        convergence.adopt_knobs([str(p) for p in paths], searches, {"short", "long"})
        return searches["x"][2]

    assert adopted([short, long]).best == {"lr_tau": 1e-5}
    assert "taking the short cell" not in capsys.readouterr().out
    only_short = adopted([short])
    assert only_short.best == {"lr_tau": 1e-4} and str(short) in only_short.adopted_from
    assert "no long batch-32 cell with openclip (learnable τ); taking the short cell's knobs" in (
        capsys.readouterr().out
    )


def test_runs_go_seed_by_seed(tmp_path, monkeypatch, torch_threads):
    """A benchmark stopped early has the same paired seeds of every method in every cell: seed k of every
    task runs before any seed k + 1 (within a seed, the costliest cell first)."""
    from benchmarks.objectives.convergence import runs

    order = []

    def fake_run(task):
        order.append((task["seed"], task["batch"], task["method"]))
        return task["key"], {"val": [[0.5, 0.5]], "heldout": [[0.1, 0.1]], "wall_s": 0.0}

    monkeypatch.setattr(runs, "_run_task", fake_run)
    _synthetic_artists(tmp_path / "cache")
    args = convergence.parse_args(["--cache", str(tmp_path / "cache"), "--workers", "1"])
    runner = Runner(args, Data(args))
    cells = [c for c in convergence.make_cells(args, 300) if c["regime"] == "short"]
    by = {m.name: m for m in cm.METHODS}
    runner.run_all(
        [runner.task(c, by[n], {}, s) for c in cells for n in (OVER_RUN, SHORT_DEFAULT) for s in range(3)]
    )
    assert [s for s, _, _ in order] == sorted(s for s, _, _ in order) and len(order) == 3 * 2 * len(cells)
    assert [b for s, b, _ in order if s == 0][::2] == sorted(c["batch"] for c in cells)
