"""core.stage input fingerprints: measured once per pipeline stage, afresh after the recorder has them."""

from __future__ import annotations

from toolkit.core import stage
from toolkit.pipeline.shell import ShellConfig


def test_fingerprints_once_serves_the_recorder_then_measures_afresh(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"a")
    cfg = ShellConfig(cmd="true", out=str(tmp_path / "out"), inputs=[str(folder)])
    outside = stage.fingerprint(str(folder))
    with stage.fingerprints_once():
        before = stage.fingerprint(str(folder))
        (folder / "b.png").write_bytes(b"bb")
        assert before == outside and stage.fingerprint(str(folder)) == before  # not walked again
        with stage.stage_run("shell", cfg, cfg.out) as rec:
            assert rec.manifest["inputs"]["inputs[0]"]["fingerprint"] == before
            assert stage.fingerprint(str(folder)) != before  # the body sees the folder as it is now
    assert stage.fingerprint(str(folder)) != outside
