"""Shell stages treat substituted values as data and clean up after a timeout (issue 15 items 5, 15)."""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from toolkit.cli.main import app


def invoke(*args: str):
    return CliRunner().invoke(app, ["--quiet", "pipeline", *args])


def write_pipeline(path, run_dir, cmd: str, extra: str = "") -> None:
    path.write_text(
        f"run_dir: {json.dumps(str(run_dir))}\nvars: {{name: plain}}\nstages:\n"
        f"  - name: say\n    kind: shell\n    config:\n      cmd: {json.dumps(cmd)}\n{extra}"
    )


@pytest.mark.parametrize(
    "cmd",
    [
        "printf '%s\\n' ${vars.name} > $STAGE_OUT/said.txt",  # bare
        "printf '%s\\n' \"${vars.name}\" > $STAGE_OUT/said.txt",  # inside double quotes
        "printf '%s\\n' 'name: ${vars.name}' > $STAGE_OUT/said.txt",  # inside single quotes
    ],
)
def test_set_value_reaches_the_command_as_text(tmp_path, cmd):
    path = tmp_path / "p.yaml"
    write_pipeline(path, tmp_path / "run", cmd)
    value = f"x; touch {tmp_path}/F; echo \"$(touch {tmp_path}/G)\" 'q' `touch {tmp_path}/H` $HOME \\"
    result = invoke("run", str(path), "--set", f"vars.name={value}")
    assert result.exit_code == 0, result.output
    assert not any((tmp_path / name).exists() for name in "FGH")
    said = (tmp_path / "run" / "say" / "said.txt").read_text()
    assert said.strip() == (f"name: {value}" if "'name: " in cmd else value)


@pytest.mark.parametrize(
    "cmd",
    [
        "echo \"$(printf '%s' ${vars.name})\" > $STAGE_OUT/said.txt",  # inside "$(...)"
        "echo \"`printf '%s' ${vars.name}`\" > $STAGE_OUT/said.txt",  # inside "`...`"
        'echo "$(printf \'%s\' "${vars.name}")" > $STAGE_OUT/said.txt',  # "..." inside "$(...)"
        "echo \"$(printf '%s' '${vars.name}')\" > $STAGE_OUT/said.txt",  # '...' inside "$(...)"
        "cat > $STAGE_OUT/said.txt <<EOF\n${vars.name}\nEOF",  # a here-document's body
        "# it's a comment with ${vars.name}\nprintf '%s\\n' ${vars.name} > $STAGE_OUT/said.txt",
    ],
)
def test_set_value_is_text_in_substitutions_and_here_documents(tmp_path, cmd):
    """Before: in "$(...)" and "`...`" the value was escaped as in a plain "..." string, so `touch F` ran;
    in a here-document it arrived with literal quote marks."""
    path = tmp_path / "p.yaml"
    write_pipeline(path, tmp_path / "run", cmd)
    value = f"x; touch {tmp_path}/F ; $(touch {tmp_path}/G) 'q' \"d\" `touch {tmp_path}/H` $HOME \\"
    result = invoke("run", str(path), "--set", f"vars.name={value}")
    assert result.exit_code == 0, result.output
    assert not any((tmp_path / name).exists() for name in "FGH")
    assert (tmp_path / "run" / "say" / "said.txt").read_text().strip() == value


@pytest.mark.parametrize(
    "cmd, where",
    [
        ("cat > $STAGE_OUT/s.txt <<'EOF'\n${vars.name}\nEOF", "here-document whose delimiter is quoted"),
        ("echo $((${vars.name} + 1))", "arithmetic"),
    ],
)
def test_a_reference_where_no_value_can_be_text_is_refused(tmp_path, cmd, where):
    path = tmp_path / "p.yaml"
    write_pipeline(path, tmp_path / "run", cmd)
    result = invoke("run", str(path))
    assert result.exit_code == 2, result.output
    assert "stages.say.config.cmd" in result.output and where in result.output and "env:" in result.output


def test_run_dir_with_a_space_and_stage_outputs(tmp_path):
    run_dir = tmp_path / "my runs"
    path = tmp_path / "p.yaml"
    path.write_text(
        f"run_dir: {json.dumps(str(run_dir))}\nstages:\n"
        "  - {name: make, kind: shell, config: {cmd: 'echo hi > ${run_dir}/make/data.txt', "
        "outputs: {data: '${run_dir}/make/data.txt'}}}\n"
        "  - {name: use, kind: shell, config: {cmd: 'cat ${stages.make.outputs.data} > "
        '"$STAGE_OUT/copy.txt"\'}}\n'
    )
    result = invoke("run", str(path))
    assert result.exit_code == 0, result.output
    assert (run_dir / "use" / "copy.txt").read_text() == "hi\n"


def test_quote_refs_false_inserts_raw_shell_text(tmp_path):
    path = tmp_path / "p.yaml"
    write_pipeline(path, tmp_path / "run", "cd $STAGE_OUT && ${vars.name}", "      quote_refs: false\n")
    result = invoke("run", str(path), "--set", "vars.name=echo a > said.txt; touch F")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "say" / "F").exists() and (
        tmp_path / "run" / "say" / "said.txt"
    ).read_text() == "a\n"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_timeout_kills_the_whole_process_group(tmp_path):
    """Before: bash was killed, `sleep 25` (a pipeline member) kept running for 25 s."""
    pid_file = tmp_path / "sleep.pid"
    path = tmp_path / "p.yaml"
    write_pipeline(
        path,
        tmp_path / "run",
        f"sh -c 'echo $$ > {pid_file}; exec sleep 25' >/dev/null 2>&1 | cat",
        "      timeout_s: 1\n",
    )
    result = invoke("run", str(path))
    assert result.exit_code == 1 and "timed out after 1.0 s" in result.output, result.output
    pid = int(pid_file.read_text())
    for _ in range(50):  # reaping by the init process may take a moment
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid), f"sleep (pid {pid}) outlived the stage's timeout"
