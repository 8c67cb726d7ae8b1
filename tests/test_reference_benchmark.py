"""benchmarks/objectives/reference end to end at tiny size: a reference trained on one of three synthetic
artists, drrho students reading its embeddings through the trainer's step, tables and JSON; and the refusal
of an objective kind this checkout does not register."""

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.objectives.reference import main as reference
from benchmarks.objectives.reference import methods as rm


def _synthetic_artists(cache: Path, num_concepts: int = 90) -> None:
    """A feature cache as emoji_artists.py writes it: each artist draws a concept's latent through a shared
    projection plus its own (the heads can learn and transfer to the held-out artist)."""
    rng = np.random.default_rng(0)
    latent = rng.standard_normal((num_concepts, 16))
    codes = np.asarray([f"c{i}" for i in range(num_concepts)])
    (cache / "features").mkdir(parents=True)
    text = latent @ rng.standard_normal((16, 384)) + 3.0 * rng.standard_normal((num_concepts, 384))
    np.savez(
        cache / "features" / "captions.npz", codepoints=codes, captions=codes, text=text.astype(np.float32)
    )
    shared = rng.standard_normal((16, 1280))
    for artist in ("twemoji", "noto", "fluent", "openmoji"):
        image = latent @ (shared + 0.5 * rng.standard_normal((16, 1280))) + 12.0 * rng.standard_normal(
            (num_concepts, 1280)
        )
        np.savez(cache / "features" / f"{artist}.npz", codepoints=codes, image=image.astype(np.float32))


def _knobs(path: Path) -> None:
    """A convergence result's short batch-32 cell: the best OpenCLIP and FastCLIP v3's tuned knobs."""
    rows = {
        "openclip (fixed τ)": {"tuning": {"chosen": {"tau_init": 0.07}}},
        "fastclip-v3": {"tuning": {"chosen": {"tau_init": 0.07, "lr_tau": 2e-4, "rho": 6.5}}},
    }
    path.write_text(
        json.dumps(
            {
                "results": [
                    {"regime": "short", "batch": 32, "best_openclip": "openclip (fixed τ)", "rows": rows}
                ]
            }
        )
    )


@pytest.fixture
def torch_threads():
    """Bench sets one torch thread process-wide; put the count back for the tests that follow."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_reference_quick_end_to_end(tmp_path, capsys, torch_threads):
    _synthetic_artists(tmp_path / "cache")
    _knobs(tmp_path / "knobs.json")
    out = tmp_path / "res" / "reference.json"
    argv = [
        "--quick",
        "--workers",
        "1",
        "--cache",
        str(tmp_path / "cache"),
        "--knobs-from",
        str(tmp_path / "knobs.json"),
        "--out",
        str(out),
        "--methods",
        "drrho",
    ]
    report = reference.main(argv)
    ref = report["reference"]
    # the reference saw Twemoji's training pairs only: about a third of the students' pairs
    assert (
        ref["artists"] == ["twemoji"] and 0 < ref["num_train_pairs"] < report["config"]["num_train_pairs"] / 2
    )
    assert ref["num_pass_pairs"] == report["config"]["num_train_pairs"] and ref["heads_pass_s"] > 0
    embeddings = np.load(tmp_path / "cache" / "reference_twemoji_b32_e2.npz")
    assert embeddings["image"].shape == (report["config"]["num_train_pairs"], ref["d_ref"])
    np.testing.assert_allclose(np.linalg.norm(embeddings["image"].astype(np.float32), axis=1), 1.0, atol=2e-3)
    (cell,) = report["results"]
    assert set(cell["rows"]) == {"openclip (fixed τ)", "drrho", rm.CONTROL}
    assert cell["rows"][rm.CONTROL]["tuning"]["chosen"]["drrho.ref_weight"] == 0.0
    # β > 0 reads the reference: its runs differ from the control's (same seeds, same other knobs)
    assert cell["rows"]["drrho"]["tuning"]["chosen"]["drrho.ref_weight"] > 0
    assert (
        cell["rows"]["drrho"]["paired_diff_vs_best_openclip"]["per_seed"]
        != cell["rows"][rm.CONTROL]["paired_diff_vs_best_openclip"]["per_seed"]
    )
    (target,) = report["targets"]
    assert target["method"] == "drrho" and "met" in target
    text = out.with_suffix(".md").read_text()
    assert "Cost of the reference pass" in text and "| short | 32 | drrho |" in text
    capsys.readouterr()
    again = reference.main(argv)  # the reference and every run are reused
    assert "s in all)" not in capsys.readouterr().out
    assert again["results"][0]["rows"] == cell["rows"]


def test_distill_by_registry_name(tmp_path):
    """--methods distill: the registry's "unknown loss kind" message where the distill objective is not
    registered (before its branch lands), else chosen; nothing is trained or read before that check."""
    why = rm.check_registered("distill")
    if why:
        assert "unknown loss kind 'distill'" in why
        with pytest.raises(SystemExit, match="unknown loss kind 'distill'"):
            reference.main(
                ["--methods", "distill", "--cache", str(tmp_path / "none"), "--out", str(tmp_path / "r.json")]
            )
    else:
        assert rm.choose(["distill"]) == (["distill"], {})
    with pytest.raises(SystemExit, match="unknown method"):
        rm.choose(["no-such-objective"])


def _reference(num_rows: int, seed: int, artists: list[str]):
    """A Reference with random unit rows: the embeddings of some reference trained on ``artists``."""
    from benchmarks.objectives.reference.teacher import Reference

    rng = np.random.default_rng(seed)
    image, text = (rng.standard_normal((num_rows, 8)) for _ in range(2))
    unit = [(a / np.linalg.norm(a, axis=1, keepdims=True)).astype(np.float16) for a in (image, text)]
    return Reference(*unit, {"artists": artists, "batch": 64, "epochs": 30})


def test_run_keys_name_the_reference(tmp_path):
    """A student's run key includes its reference (the hash of the embeddings it reads), so the runs of a
    reference trained on other artists are never served from another reference's cache; the rows that read
    no reference keep the convergence benchmark's keys (its finished runs are reused)."""
    from benchmarks.objectives.convergence import methods as cm
    from benchmarks.objectives.convergence.main import make_cells
    from benchmarks.objectives.convergence.runs import Data, Runner
    from benchmarks.objectives.reference.bench import RefRunner

    _synthetic_artists(tmp_path / "cache")
    args = reference.parse_args(["--cache", str(tmp_path / "cache")])
    data = Data(args)
    num_train = len(data.pairs["train"])
    (cell, _) = make_cells(args, num_train)
    plain = Runner(args, data)
    runners = {
        who: RefRunner(args, data, _reference(num_train, seed, artists), False, rm.READS_REFERENCE)
        for who, seed, artists in (("one", 1, ["twemoji"]), ("two", 2, ["twemoji", "noto"]))
    }
    openclip = next(m for m in cm.METHODS if m.is_openclip)
    students = [
        (rm.drrho(False), {"drrho.ref_weight": 0.5}),
        (rm.control(), {}),
        (rm.distill(openclip.fields, 0.07), {"distill.weight": 0.25}),
    ]
    for method, knobs in students:
        keys = {who: r.task(cell, method, knobs, 0)["key"] for who, r in runners.items()}
        assert keys["one"] != keys["two"] and plain.task(cell, method, knobs, 0)["key"] not in keys.values()
        assert runners["one"].task(cell, method, knobs, 0)["key"] == keys["one"]  # stable: the cache finds it
    baseline = plain.task(cell, openclip, {"tau_init": 0.07}, 0)["key"]
    assert all(r.task(cell, openclip, {"tau_init": 0.07}, 0)["key"] == baseline for r in runners.values())


def test_scratch_cell_tunes_distill_on_its_own_split(tmp_path, torch_threads):
    """--scratch-tune: the from-scratch cell's distill row is searched on that cell's own validation runs (λ
    up to the objective's bound 1, the teacher's τ around the reference's), not adopted from the LiT batch-64
    cell; its best OpenCLIP still comes from --knobs-from."""
    cache = tmp_path / "cache"
    _synthetic_artists(cache, num_concepts=60)
    rng = np.random.default_rng(1)
    for artist in ("twemoji", "noto", "fluent", "openmoji"):  # the 32 px drawings, as load_pixels caches them
        codes = np.load(cache / "features" / f"{artist}.npz")["codepoints"]
        np.savez(
            cache / "features" / f"{artist}_px32.npz",
            codepoints=codes,
            pixels=rng.integers(0, 256, (len(codes), 32, 32, 3), dtype=np.uint8),
        )
    _knobs(tmp_path / "knobs.json")
    knobs = json.loads((tmp_path / "knobs.json").read_text())
    knobs["results"].append({**knobs["results"][0], "batch": 64})
    (tmp_path / "knobs.json").write_text(json.dumps(knobs))
    report = reference.main(
        [
            "--workers",
            "1",
            "--cache",
            str(cache),
            "--knobs-from",
            str(tmp_path / "knobs.json"),
            "--out",
            str(tmp_path / "r.json"),
            "--methods",
            "distill",
            "--batches",
            "32",
            "--short-epochs",
            "1",
            "--seeds",
            "1",
            "--reference-batch",
            "32",
            "--reference-epochs",
            "1",
            "--eval-points",
            "1",
            "--tower-timing-pairs",
            "0",
            "--scratch-seeds",
            "1",
            "--scratch-epochs",
            "1",
            "--scratch-methods",
            "distill",
            "--scratch-tune",
            "distill.weight",
            "distill.teacher_tau",
        ]
    )
    lit, scratch = report["results"]
    assert scratch["regime"] == "scratch" and set(scratch["rows"]) == {"openclip (fixed τ)", "distill"}
    assert scratch["rows"]["openclip (fixed τ)"]["tuning"]["adopted_from"]
    tuning = scratch["rows"]["distill"]["tuning"]
    assert not tuning["adopted_from"]
    tau = round(report["reference"]["final_tau"], 5)
    assert (
        set(rm.SCRATCH_WEIGHTS) <= set(tuning["grids"]["distill.weight"])
        and max(tuning["grids"]["distill.weight"]) == 1.0
    )
    assert set(tuning["grids"]["distill.teacher_tau"]) >= {round(tau / 2, 5), tau, round(2 * tau, 5)}
    scored = {(s["distill.weight"], s["distill.teacher_tau"]): s["val_r1"] for s in tuning["scores"]}
    assert {w for w, t in scored if t == tau} >= set(rm.SCRATCH_WEIGHTS)  # λ swept at the reference's τ
    chosen = (tuning["chosen"]["distill.weight"], tuning["chosen"]["distill.teacher_tau"])
    assert scored[chosen] == max(scored.values())
    # scored by the scratch cell's own validation runs (1 tuning seed = its 1 seed), not by the LiT cell's
    assert scored[chosen] == scratch["rows"]["distill"]["val_r1"]
    assert lit["rows"]["distill"]["tuning"]["grids"]["distill.weight"] != tuning["grids"]["distill.weight"]
