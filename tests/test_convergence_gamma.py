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
