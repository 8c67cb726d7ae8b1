"""Tracebacks and messages that named no culprit (issue 34, classes 10 and 11): each case is a real `toolkit`
run that must end with exactly one error line naming the file, key, URL or package, and no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from proctools import env


def _one_error(args: list[str], cwd) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "toolkit", *args],
        cwd=cwd,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode in (1, 2), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("[1, 2]", "expected a JSON object, found list"),
        (
            '{"format": "cliptk-train-v1", "fields": [], "shards": []}',
            "required key 'num_samples' is missing",
        ),
        (
            '{"format": "cliptk-train-v1", "num_samples": 1, "samples_per_shard": 1, "fields": [3], '
            '"shards": []}',
            "a value has the wrong shape or type",
        ),
        ("\n", "not a valid dataset.json"),
    ],
)
@pytest.mark.parametrize("command", ["verify", "train"])
def test_a_damaged_dataset_json_is_named(tmp_path, content, words, command):
    data = tmp_path / "D"
    data.mkdir()
    (data / "dataset.json").write_text(content)
    args = (
        ["data", "verify", str(data)]
        if command == "verify"
        else ["train", "--data", str(data), "--out", str(tmp_path / "run")]
    )
    line = _one_error(args, tmp_path)
    assert f"{data}/dataset.json: " in line and words in line, line


@pytest.mark.parametrize(
    "args",
    [
        ["data", "verify", "s3://bucket/train"],
        ["train", "--data", "s3://bucket/train", "--out", "OUT"],
        ["data", "precompute", "--in", "s3://bucket/raw", "--out", "OUT", "--model", "cliptk-tiny"],
    ],
)
def test_a_missing_fsspec_backend_names_the_package(tmp_path, args):
    pytest.importorskip("fsspec")
    if __import__("importlib").util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed here")
    line = _one_error([str(tmp_path / a) if a == "OUT" else a for a in args], tmp_path)
    assert "s3://bucket/" in line and "s3fs" in line, line


def test_an_unknown_url_scheme_names_the_option_and_url(tmp_path):
    line = _one_error(
        [
            "data",
            "precompute",
            "--in",
            "foobar://x/raw",
            "--out",
            str(tmp_path / "o"),
            "--model",
            "cliptk-tiny",
        ],
        tmp_path,
    )
    assert "input: foobar://x/raw: unknown URL scheme 'foobar'" in line, line


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (b"data: D\nout: O\nloss: openclip\n", "loss: is a section: expected a mapping of its keys"),
        (b"data: D\nout: O\nseed: \xff\xfe\n", "not UTF-8 text (byte 0xff at position"),
    ],
)
def test_a_config_file_of_the_wrong_shape_is_named(tmp_path, text, words):
    path = tmp_path / "c.yaml"
    path.write_bytes(text)
    line = _one_error(["train", "--config", str(path)], tmp_path)
    assert f"{path}: " in line and words in line, line


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("seed=99999999999999999999", "seed: must fit in 64 bits"),  # was: Overflow when unpacking long long
        ("loss.tau_init=1e999", "loss.tau_init: must be a finite number, got inf"),  # was: math domain error
    ],
)
def test_out_of_range_set_values_name_the_key(tmp_path, setting, words):
    line = _one_error(
        ["train", "--data", str(tmp_path / "D"), "--out", str(tmp_path / "run"), "--set", setting], tmp_path
    )
    assert f"--set {setting}: {words}" in line, line
