"""YAML bombs (issue 15 item 1): a document whose aliases expand beyond reason is refused while loading,
in bounded time and memory, with a one-line error that names the file and quotes no value."""

from __future__ import annotations

import signal
import tracemalloc

import pytest
from typer.testing import CliRunner

from toolkit.cli.main import app
from toolkit.core import safeyaml
from toolkit.core.config import SHORT_REPR_CHARS, ConfigError
from toolkit.core.config_load import read_yaml


def billion_laughs(levels: int, key: str = "source") -> str:
    """``levels`` anchors of nine aliases each (9**levels strings) and ``key`` holding the last one."""
    lines = ["anchors:", '  - &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\n{key}: *l{levels - 1}\n"


@pytest.fixture
def deadline():
    """Fail instead of hanging: the unfixed loader spent > 30 s and 1.6 GB on nine levels."""

    def expire(signum, frame):
        raise TimeoutError("YAML load did not finish within 20 s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_billion_laughs_refused_quickly_and_in_little_memory(tmp_path, deadline):
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs(9))
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as err:
            read_yaml(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, f"peak {peak / 2**20:.1f} MiB while refusing the bomb"
    assert str(path) in str(err.value) and "aliases expand to more than" in str(err.value)
    assert "\n" not in str(err.value) and "lol" not in str(err.value)


@pytest.mark.parametrize("command", [["data", "shard", "--config"], ["pipeline", "validate"]])
def test_cli_refuses_bomb_in_one_line(tmp_path, deadline, command):
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs(9, key="name" if command[0] == "pipeline" else "source"))
    result = CliRunner().invoke(app, [*command, str(path)])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and str(path) in result.output, result.output


def test_set_override_bomb_refused(deadline):
    from toolkit.core.config_load import parse_override

    parts = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    parts += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    with pytest.raises(ConfigError) as err:
        parse_override("vars.x={" + ", ".join(parts) + "}")
    assert err.value.source == "--set" and "aliases expand" in err.value.message


def test_seven_levels_error_quotes_no_value(tmp_path):
    """Before: a 34 MB error message ('expected a string, got [[[...'); now refused at load."""
    path = tmp_path / "seven.yaml"
    path.write_text(billion_laughs(7))
    with pytest.raises(ConfigError) as err:
        read_yaml(path)
    assert len(str(err.value)) < 300


def test_long_values_are_cut_in_errors(tmp_path):
    from dataclasses import dataclass

    from toolkit.core.config import option
    from toolkit.core.config_load import load_config

    @dataclass(frozen=True)
    class Small:
        source: str = option("", doc="A string.")

    path = tmp_path / "long.yaml"
    path.write_text("source: [" + ", ".join(["word"] * 5000) + "]\n")  # 5000 nodes: within the limits
    with pytest.raises(ConfigError) as err:
        load_config(Small, path)
    assert len(str(err.value)) < len(str(path)) + SHORT_REPR_CHARS + 100 and "(40,000 characters)" in str(
        err.value
    )


def test_ordinary_documents_and_anchors_still_load(tmp_path):
    assert safeyaml.load("a: &x {b: 1}\nc: *x\n") == {"a": {"b": 1}, "c": {"b": 1}}
    assert safeyaml.load("") is None
    assert safeyaml.expanded_size(safeyaml.yaml.compose(billion_laughs(4))) < (
        safeyaml.MAX_EXPANDED_NODES,
        10**6,
    )


def test_recursive_alias_and_deep_nesting_refused():
    with pytest.raises(safeyaml.YamlTooLarge, match="contains it"):
        safeyaml.load("a: &a [1, *a]\n")
    with pytest.raises(safeyaml.YamlTooLarge, match="nests too deeply"):
        safeyaml.load("[" * 20000 + "]" * 20000)


def test_duplicate_keys_are_refused_naming_file_line_and_key(tmp_path):
    """Before: `steps: 2` then `steps: 5` trained 5 steps without a word (issue 43 item 10)."""
    path = tmp_path / "c.yaml"
    path.write_text("steps: 2\nloss:\n  kind: fastclip\n  fastclip: {version: v3, version: v1}\nsteps: 5\n")
    with pytest.raises(
        ConfigError,
        match=rf"^{path}:4: loss.fastclip.version: duplicate key 'loss.fastclip.version' "
        r"at line 4 \(first given at line 4\)",
    ):
        read_yaml(path)
    path.write_text("steps: 2\nmodel: x\nsteps: 5\n")
    with pytest.raises(
        ConfigError, match=rf"^{path}:3: steps: duplicate key 'steps' at line 3 \(first given at line 1\)"
    ):
        read_yaml(path)
    # a merge key's values may be overridden: that is what merging is for
    path.write_text("base: &b {steps: 2, model: x}\nrun:\n  <<: *b\n  steps: 5\n")
    assert read_yaml(path)["run"] == {"steps": 5, "model": "x"}
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        from toolkit.core.config_load import parse_override

        parse_override("vars={a: 1, a: 2}")


def test_duplicate_keys_in_a_config_and_a_pipeline_exit_2(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("steps: 2\nbatch_size: 8\nsteps: 5\n")
    result = CliRunner().invoke(
        app, ["train", "--config", str(config), "--data", str(tmp_path), "--out", str(tmp_path / "run")]
    )
    assert result.exit_code == 2 and f"{config}:3: steps: duplicate key" in result.output, result.output
    pipe = tmp_path / "p.yaml"
    pipe.write_text(
        f"run_dir: {tmp_path}/run\nstages:\n  - name: a\n    kind: shell\n    config: {{cmd: 'true'}}\n"
        f"    config: {{cmd: 'touch {tmp_path}/F'}}\nrun_dir: {tmp_path}/other\n"
    )
    result = CliRunner().invoke(app, ["pipeline", "run", str(pipe)])
    assert result.exit_code == 2 and f"{pipe}:6: stages[0].config: duplicate key" in result.output, (
        result.output
    )
    assert not (tmp_path / "F").exists() and not (tmp_path / "run").exists()
