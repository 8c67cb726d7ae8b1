"""Pipeline runner with real shell stages: skip on rerun, resume after failure, --from/--only,
references, and validation that fails before any stage runs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from toolkit.cli.main import app

PIPELINE = """
run_dir: {root}/run
vars: {{greeting: hello}}
stages:
  - name: make
    kind: shell
    config:
      cmd: 'echo ${{vars.greeting}} >> {root}/make_calls.txt; echo ${{vars.greeting}} > $STAGE_OUT/data.txt'
      outputs: {{data: "${{run_dir}}/make/data.txt"}}
  - name: use
    kind: shell
    config:
      cmd: '[ ! -e {root}/fail ] && cat ${{stages.make.outputs.data}} >> {root}/use_calls.txt'
      inputs: ["${{stages.make.outputs.data}}"]
"""


@pytest.fixture
def pipe(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(root=tmp_path))
    return path


def invoke(*args: str):
    return CliRunner().invoke(app, ["--quiet", "pipeline", *args])


def lines(path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def manifest(tmp_path, stage: str) -> dict:
    return json.loads((tmp_path / "run" / stage / "manifest.json").read_text())


def test_run_then_rerun_is_a_noop(pipe, tmp_path):
    result = invoke("run", str(pipe))
    assert result.exit_code == 0, result.output
    assert "make: ran" in result.output and "use: ran" in result.output
    assert lines(tmp_path / "use_calls.txt") == ["hello"]
    m = manifest(tmp_path, "use")
    assert m["status"] == "done" and m["kind"] == "shell" and m["outputs"]["out"] == f"{tmp_path}/run/use"
    assert list(m["inputs"].values())[0]["path"] == f"{tmp_path}/run/make/data.txt"
    assert (tmp_path / "run" / "use" / "config.yaml").exists() and (
        tmp_path / "run" / "use" / "log.jsonl"
    ).exists()
    again = invoke("run", str(pipe))
    assert again.exit_code == 0 and "make: skipped" in again.output and "use: skipped" in again.output
    assert lines(tmp_path / "make_calls.txt") == ["hello"] and lines(tmp_path / "use_calls.txt") == ["hello"]


def test_failure_stops_then_rerun_resumes_at_failed_stage(pipe, tmp_path):
    (tmp_path / "fail").touch()
    result = invoke("run", str(pipe))
    assert result.exit_code == 1 and "stage 'use' failed" in result.output
    assert manifest(tmp_path, "make")["status"] == "done" and manifest(tmp_path, "use")["status"] == "failed"
    (tmp_path / "fail").unlink()
    result = invoke("run", str(pipe))
    assert result.exit_code == 0 and "make: skipped" in result.output and "use: ran" in result.output
    assert lines(tmp_path / "make_calls.txt") == ["hello"] and lines(tmp_path / "use_calls.txt") == ["hello"]


def test_changed_config_reruns_stage_and_dependents(pipe, tmp_path):
    assert invoke("run", str(pipe)).exit_code == 0
    result = invoke("run", str(pipe), "--set", "vars.greeting=bye")
    assert result.exit_code == 0 and "make: ran" in result.output and "use: ran" in result.output
    assert lines(tmp_path / "use_calls.txt") == ["hello", "bye"]


def test_from_only_and_dry_run(pipe, tmp_path):
    assert invoke("run", str(pipe), "--only", "use").exit_code == 2  # 'make' has not run yet
    assert invoke("run", str(pipe)).exit_code == 0
    dry = invoke("run", str(pipe), "--dry-run")
    assert dry.exit_code == 0 and lines(tmp_path / "use_calls.txt") == ["hello"]
    assert invoke("run", str(pipe), "--only", "use").exit_code == 0
    assert lines(tmp_path / "make_calls.txt") == ["hello"] and len(lines(tmp_path / "use_calls.txt")) == 2
    assert invoke("run", str(pipe), "--from", "make").exit_code == 0
    assert len(lines(tmp_path / "make_calls.txt")) == 2 and len(lines(tmp_path / "use_calls.txt")) == 3
    result = invoke("run", str(pipe), "--from", "mkae")
    assert result.exit_code == 2 and "did you mean 'make'" in result.output


def test_dry_run_before_the_first_run_plans_every_stage(pipe, tmp_path):
    dry = invoke("run", str(pipe), "--dry-run")
    assert dry.exit_code == 0, dry.output  # 'use' reads outputs 'make' has not written yet
    assert "make: run: no manifest" in dry.output and "use: run: after make" in dry.output
    assert (
        lines(tmp_path / "make_calls.txt") == []
        and not (tmp_path / "run" / "make" / "manifest.json").exists()
    )
    assert invoke("run", str(pipe)).exit_code == 0
    changed = invoke("run", str(pipe), "--dry-run", "--set", "vars.greeting=bye")
    assert "make: run: config changed" in changed.output and "use: run: after make" in changed.output


@pytest.mark.parametrize(
    ("old", "new", "words"),
    [
        ("      inputs:", "      inptus:", "stages.use.config.inptus: unknown key; did you mean 'inputs'"),
        (
            "kind: shell\n    config:\n      cmd: '[",
            "kind: shel\n    config:\n      cmd: '[",
            "unknown stage kind 'shel'",
        ),
        ("${{stages.make.outputs.data}} >>", "${{stages.use.outputs.out}} >>", "must name an earlier stage"),
        ("${{stages.make.outputs.data}} >>", "${{stages.make.outputs.dta}} >>", "has no output 'dta'"),
        ("echo ${{vars.greeting}} >", "echo ${{vars.greting}} >", "unknown variable"),
        ("name: use", "name: make", "duplicate stage name"),
        ("run_dir:", "rundir:", "unknown key; did you mean 'run_dir'"),
    ],
)
def test_validation_fails_before_anything_runs(tmp_path, old, new, words):
    path = tmp_path / "bad.yaml"
    text = PIPELINE.replace(old, new, 1)
    assert text != PIPELINE
    path.write_text(text.format(root=tmp_path))
    result = invoke("run", str(path))
    assert result.exit_code == 2, result.output
    assert words in result.output and str(path) in result.output
    assert not (tmp_path / "make_calls.txt").exists() and not (tmp_path / "run" / "make").exists()


def test_whole_value_reference_keeps_type_and_shell_timeout(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(
        f"run_dir: {tmp_path}/r\nvars: {{t: 0.2}}\nstages:\n"
        "  - {name: slow, kind: shell, config: {cmd: 'sleep 5', timeout_s: '${vars.t}'}}\n"
    )
    result = invoke("run", str(path))
    assert result.exit_code == 1 and "timed out after 0.2 s" in result.output
    assert json.loads((tmp_path / "r" / "slow" / "manifest.json").read_text())["status"] == "failed"


def test_jsonl_logs_record_stage_output(pipe, tmp_path):
    assert invoke("run", str(pipe)).exit_code == 0
    records = [
        json.loads(line) for line in (tmp_path / "run" / "pipeline.log.jsonl").read_text().splitlines()
    ]
    assert any("stage use (shell): running" in r["message"] for r in records)
    stage_log = [
        json.loads(line) for line in (tmp_path / "run" / "make" / "log.jsonl").read_text().splitlines()
    ]
    assert any(
        r["message"].startswith('$ echo "${CLIPTK_VAR_greeting}"')
        and "CLIPTK_VAR_greeting='hello'" in r["message"]
        for r in stage_log
    )  # the command as run, and the values of its ${...}
    assert {"time", "level", "logger", "message"} <= set(stage_log[0])


def test_changed_input_folder_is_walked_once_and_recorded(tmp_path, monkeypatch):
    from toolkit.core import stage

    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "a.txt").write_text("a")
    path = tmp_path / "p.yaml"
    path.write_text(
        f"run_dir: {tmp_path}/run\nstages:\n  - name: read\n    kind: shell\n    config:\n"
        f"      cmd: 'ls {folder} > $STAGE_OUT/ls.txt'\n      inputs: ['{folder}']\n"
    )
    assert invoke("run", str(path)).exit_code == 0
    (folder / "b.txt").write_text("b")
    measured: list[str] = []
    real = stage._measure
    monkeypatch.setattr(stage, "_measure", lambda p: measured.append(p) or real(p))
    result = invoke("run", str(path))
    assert result.exit_code == 0 and "read: ran" in result.output, result.output
    assert measured == [str(folder)]  # the up-to-date check's walk is the one the manifest records
    recorded = manifest(tmp_path, "read")["inputs"]["inputs[0]"]["fingerprint"]
    assert recorded == stage.fingerprint(str(folder))
    assert "read: skipped" in invoke("run", str(path)).output


def test_dry_run_writes_nothing(pipe, tmp_path):
    """Issue 15 item 11: a dry run created run_dir, pipeline.log.jsonl and pipeline.resolved.yaml."""
    dry = invoke("run", str(pipe), "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert not (tmp_path / "run").exists()
    assert invoke("run", str(pipe)).exit_code == 0
    before = sorted((p, p.stat().st_mtime_ns) for p in (tmp_path / "run").rglob("*"))
    assert invoke("run", str(pipe), "--dry-run", "--set", "vars.greeting=bye").exit_code == 0
    assert sorted((p, p.stat().st_mtime_ns) for p in (tmp_path / "run").rglob("*")) == before


def test_unwritable_run_dir_is_one_line(pipe, tmp_path):
    """Issue 15 item 9: a run_dir that cannot be created was a traceback (root ignores chmod, so: under a
    file)."""
    (tmp_path / "afile").write_text("x")
    result = invoke("run", str(pipe), "--set", f"run_dir={tmp_path}/afile/run")
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert f"cannot write to {tmp_path}/afile/run" in result.output and str(pipe) in result.output


@pytest.mark.parametrize(
    ("override", "source_words"),
    [
        ("vars.greting=x", "defines no variable 'greting'; did you mean 'greeting'"),
        ("run_dir=", "run_dir: expected a non-empty string"),
        ("name.x=1", "name.x: use vars.NAME=V"),
        ("run_dir.x=1", "run_dir.x: use vars.NAME=V"),
        ("vars.greeting.x=1", "vars.greeting.x: use vars.NAME=V"),
        ("stages.mkae.cmd=true", "no such stage; did you mean 'make'"),
        ("stages.make.timeout_s=-1", "stages.make.config.timeout_s: must be > 0"),
        ("stages.make.cmdd=true", "stages.make.config.cmdd: unknown key"),
    ],
)
def test_set_errors_name_the_set_text(pipe, override, source_words):
    """Issue 15 item 13: --set errors were blamed on the YAML file, and some were accepted silently."""
    result = invoke("validate", str(pipe), "--set", override)
    assert result.exit_code == 2, result.output
    assert f"--set {override}" in result.output and source_words in result.output, result.output


def test_bad_var_value_from_set_is_blamed_on_set(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(
        f"run_dir: {tmp_path}/r\nvars: {{t: 1}}\nstages:\n"
        "  - {name: slow, kind: shell, config: {cmd: 'true', timeout_s: '${vars.t}'}}\n"
    )
    result = invoke("validate", str(path), "--set", "vars.t=-5")
    assert (
        result.exit_code == 2
        and "--set vars.t=-5: stages.slow.config.timeout_s: must be > 0" in result.output
    )
    path.write_text(path.read_text().replace("t: 1", "t: -1"))
    result = invoke("validate", str(path))
    assert result.exit_code == 2 and f"{path}: stages.slow.config.timeout_s: must be > 0" in result.output


def test_empty_run_dir_or_name_in_the_file_is_an_error(tmp_path):
    for text in ("run_dir: ''\n", "name: [a]\n"):
        path = tmp_path / "e.yaml"
        path.write_text(text + "stages:\n  - {name: s, kind: shell, config: {cmd: 'true'}}\n")
        result = invoke("validate", str(path))
        assert result.exit_code == 2 and "expected a non-empty string" in result.output, result.output
