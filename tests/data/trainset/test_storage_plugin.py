"""A storage mode from another package: registered from outside the project, it runs precompute -> verify ->
inspect -> train with no project file changed (issue 39). The mode below (lossless PNG, written into a package
in tmp_path) is a real mode: its stored pixels must equal pixels mode's, byte for byte."""

from __future__ import annotations

import importlib
import sys
import textwrap

import numpy as np
import pytest
from datakit import MODEL, precompute

from toolkit.data.trainset import storage
from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.loader import make_loader

PLUGIN = textwrap.dedent('''
    """A storage mode of another package: each stored image as a lossless PNG, in NNNNN.pngs."""
    import io

    from toolkit.data.trainset import storage
    from toolkit.data.trainset.storage.tablemode import EncodedMode


    class PngMode(EncodedMode):
        name = "png"
        data_ext = "pngs"
        scratch_ext = ".png"
        bytes_per_pixel = 3.0  # noise does not compress

        def encode(self, pixels, job):
            from PIL import Image

            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, "PNG")
            return buf.getvalue()

        def extra(self, job):
            return {"png": True}


    MODE = storage.register(PngMode())
''')


@pytest.fixture
def png_mode(tmp_path, monkeypatch):
    """The outside package ``cliptk_png_mode`` imported (which registers the mode), unregistered after."""
    (tmp_path / "plugin" / "cliptk_png_mode").mkdir(parents=True)
    (tmp_path / "plugin" / "cliptk_png_mode" / "__init__.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path / "plugin"))
    module = importlib.import_module("cliptk_png_mode")
    yield module.MODE
    storage._MODES.pop("png", None)  # noqa: SLF001 - the registry has no way out: a mode stays for good
    sys.modules.pop("cliptk_png_mode", None)


def _all(path) -> dict[str, np.ndarray]:
    batches = list(make_loader(str(path), batch_size=16, shuffle=False))
    return {k: np.concatenate([b[k].numpy() for b in batches]) for k in ("image", "tokens", "index")}


def test_a_mode_registered_from_outside_runs_precompute_verify_inspect_and_train(
    png_mode, small_raw, small_train, tmp_path
):
    from toolkit.core.config import build
    from toolkit.data import inspect
    from toolkit.data.trainset import verify

    assert storage.get("png") is png_mode and storage.names()[-1] == "png"
    out = tmp_path / "png"
    result = precompute(small_raw, out, num_workers=2, samples_per_shard=10, storage="png")
    assert result.counts["num_samples"] == 103
    ds = TrainDataset.open(str(out))
    assert ds.storage == "png" and storage.of(ds) is png_mode and ds.extra["png"] is True
    assert sorted(p.name for p in out.glob("*.pngs")) == ds.data_files and len(ds.data_files) == 11
    assert not list(out.glob("*.tar"))

    pixels, png = _all(small_train[0]), _all(out)  # lossless: the very pixels pixels mode stores
    assert (png["index"] == np.arange(103)).all()
    assert (png["image"] == pixels["image"]).all() and (png["tokens"] == pixels["tokens"]).all()

    checked = verify.run(verify.VerifyConfig(input=str(out)))
    assert checked.ok and checked.num_samples == 103, checked.problems
    report = inspect.run(
        build(inspect.InspectConfig, {"input": str(out), "out": str(tmp_path / "report"), "num_contact": 4})
    )
    pngs = sum(p.stat().st_size for p in out.glob("*.pngs"))
    assert report.details["storage"] == "png" and report.details["stored_bytes"] > pngs

    part = out / ds.data_files[3]  # a flipped byte in one stored PNG: verify names it
    original = part.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    damaged = verify.run(verify.VerifyConfig(input=str(out)))
    assert damaged.num_damaged_samples == 1 and ds.data_files[3] in damaged.problems[0]
    part.write_bytes(original)

    from toolkit.train.config import TrainConfig
    from toolkit.train.run import run as train

    cfg = build(
        TrainConfig,
        {
            "data": str(out),
            "out": str(tmp_path / "run"),
            "model": MODEL,
            "batch_size": 16,
            "steps": 2,
            "log_every": 1,
            "tensorboard": False,
            "loader": {"num_workers": 0},
        },
    )
    train(cfg)
    assert (tmp_path / "run" / "model" / "open_clip_model.safetensors").is_file()


def test_a_dataset_of_a_mode_nobody_registered_is_refused_naming_the_known_ones(
    png_mode, small_raw, tmp_path
):
    out = tmp_path / "png"
    precompute(small_raw, out, num_workers=1, samples_per_shard=50, storage="png")
    storage._MODES.pop("png")  # noqa: SLF001 - as a process that never imported the plugin
    refused = r"dataset.json: storage 'png': not a storage mode.*known: pixels, jpeg, index"
    with pytest.raises(ValueError, match=refused):
        make_loader(str(out), batch_size=16)
    with pytest.raises(ValueError, match="storage 'png'"):
        precompute(small_raw, tmp_path / "again", storage="png")


def test_a_second_mode_under_a_taken_name_is_refused(png_mode):
    with pytest.raises(ValueError, match="'png' is registered already"):
        storage.register(type(png_mode)())
    assert storage.register(png_mode) is png_mode  # the same object again: no change
