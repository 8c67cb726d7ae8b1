"""Checkpoints under damage (issue 25 items 4 and 5): a full disk, an unreadable folder, a missing one, and
the checkpoints around a non-finite abort.

The full disk is real where the machine allows it (a 150 MB tmpfs mounted in a user and mount namespace,
`unshare -rm`, no root needed) and otherwise simulated at the os level: ``_diskfull`` makes ``os.write``
under the checkpoint folder raise ENOSPC once the space left is used up, in the training subprocess. An
unreadable folder is chmod 000; a root test process drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from
its child's capability bounding set, so the permission bits apply to it as to any user.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from trainkit import ROOT, env, metrics, train_cfg

from toolkit.train.checkpoint import format as ckpt

CKPT_BYTES_FREE = 150 * 2**20  # one cliptk-tiny checkpoint (92 MiB: weights + AdamW state) fits, two do not


def _train_args(data, out, ckpt_dir) -> list[str]:
    return [
        "train",
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        "6",
        "--batch-size",
        "16",
        "--workers",
        "0",
        "--log-every",
        "1",
        "--checkpoint-every",
        "2",
        "--keep-checkpoints",
        "1",
        "--set",
        "tensorboard=false",
        "--set",
        f"checkpoint.dir={ckpt_dir}",
    ]


def _assert_stopped_at_the_next_step(out: Path, ckpt_dir: Path, stderr: str) -> None:
    """Step 2's checkpoint fits, step 4's fails; training stops after step 5 (it went on to step 6, the next
    checkpoint, before), naming step 4's folder and the step-2 checkpoint it kept."""
    target = ckpt_dir / "step-00000004"
    assert (
        f"writing checkpoint step 4 to {target} failed: OSError: [Errno 28] No space left on device" in stderr
    ), stderr[-3000:]
    assert f"the previous checkpoints are kept (newest: {ckpt_dir / 'step-00000002'})" in stderr
    assert max(r["step"] for r in metrics(out)) == 4  # step 5 ran, the error stopped it before its log line
    assert "Traceback" not in stderr


def test_a_full_disk_stops_training_at_the_next_step_naming_the_checkpoint(demo_train, tmp_path):
    out, ckpt_dir = tmp_path / "run", tmp_path / "ckpt"
    boot = (
        f"import sys; sys.argv[0] = 'toolkit'; import _diskfull; _diskfull.install({str(ckpt_dir)!r}, "
        f"{CKPT_BYTES_FREE}); from toolkit.cli.main import main; main()"
    )
    child_env = dict(env(), PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), env()["PYTHONPATH"]]))
    result = subprocess.run(
        [sys.executable, "-c", boot, *_train_args(demo_train, out, ckpt_dir)],
        cwd=ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    _assert_stopped_at_the_next_step(out, ckpt_dir, result.stderr)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-00000002"]  # no half-written folder left
    ckpt.verify(ckpt_dir / "step-00000002")


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _unshare_works(), reason="no unprivileged user+mount namespaces (unshare -rm) here")
def test_a_real_full_tmpfs_stops_training_at_the_next_step(demo_train, tmp_path):
    out, ckpt_dir = tmp_path / "run", tmp_path / "ckpt"
    ckpt_dir.mkdir()
    args = " ".join(_train_args(demo_train, out, ckpt_dir))
    script = (
        f"mount -t tmpfs -o size={CKPT_BYTES_FREE} tmpfs {ckpt_dir} && {sys.executable} -m toolkit {args}; "
        f"echo rc=$?; ls -a {ckpt_dir}; {sys.executable} -c 'from toolkit.train.checkpoint.format import "
        "verify; "
        f'verify("{ckpt_dir}/step-00000002"); print("verified")\''
    )
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "rc=1" in result.stdout, result.stderr[-3000:]
    _assert_stopped_at_the_next_step(out, ckpt_dir, result.stderr)
    listed = result.stdout.split("rc=1", 1)[1].split()
    assert [n for n in listed if n not in (".", "..", "verified")] == ["step-00000002"]
    assert "verified" in result.stdout


UNREADABLE = """
import json, os, sys
from pathlib import Path
from toolkit.train.checkpoint import format as ckpt

root = Path(sys.argv[1])
def blobs(step):
    return {"trainer.json": json.dumps({"state": {"step": step, "nonfinite_in_row": 0}}).encode(),
            "optimizer.pt": os.urandom(4096)}
for step in (2, 4):
    ckpt.write_blobs(str(root), step, blobs(step), keep=3)
os.chmod(root / "step-00000004", 0)
try:
    ckpt.verify(root / "step-00000004")
except ckpt.CheckpointInvalid as err:
    print("VERIFY:", err)
print("LATEST:", ckpt.latest_valid(str(root)))
ckpt.write_blobs(str(root), 4, blobs(4), keep=3)  # training past step 2 again rewrites step 4
print("LEFT:", sorted(os.listdir(root)))
ckpt.verify(root / "step-00000004")
"""


def _without_dac_override() -> None:
    """preexec_fn: drop the capabilities that let root ignore permission bits (prctl PR_CAPBSET_DROP 24,
    CAP_DAC_OVERRIDE 1, CAP_DAC_READ_SEARCH 2); the exec that follows computes root's capabilities from it."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_an_unreadable_checkpoint_folder_is_named_as_such_and_replaced_without_leftovers(tmp_path):
    root = tmp_path / "ckpt"
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(UNREADABLE), str(root)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_without_dac_override if os.geteuid() == 0 else None,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    assert lines["VERIFY"].startswith(f"{root / 'step-00000004'}: unreadable (Permission denied)"), (
        result.stdout
    )
    assert "missing" not in lines["VERIFY"]
    assert lines["LATEST"] == str(root / "step-00000002")
    assert lines["LEFT"] == "['step-00000002', 'step-00000004']", (
        result.stdout
    )  # no hidden .step-*.old-* left


def test_resume_from_a_folder_that_does_not_exist_says_not_found(demo_train, tmp_path):
    from toolkit.train.run import run

    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(FileNotFoundError, match=f"--resume {missing}: not found"):
        run(train_cfg(demo_train, tmp_path / "run", checkpoint={"resume": str(missing)}))
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_nonfinite_abort_keeps_and_names_the_last_checkpoint_before_it(demo_train, tmp_path):
    """Steps 3 and 4 are non-finite (max 2 in a row): checkpoints every step with keep 1 used to keep only
    step 3's, written during the failure; now step 2's is kept and named, and step 3's is set aside."""
    from toolkit.train.loop import TrainingAborted
    from toolkit.train.run import run

    out = tmp_path / "run"
    cfg = train_cfg(
        demo_train,
        out,
        steps=6,
        max_nonfinite_steps=2,
        nonfinite_test_steps=[2, 3],
        checkpoint={"every_steps": 1, "keep": 1},
    )
    with pytest.raises(TrainingAborted) as info:
        run(cfg)
    ckpts = out / "checkpoints"
    message = str(info.value)
    assert (
        f"the last checkpoint written before the first non-finite step (3) is {ckpts / 'step-00000002'}"
        in message
    )
    assert f"--init {ckpts / 'step-00000002'}" in message
    assert f"set aside, written after it: {ckpts / 'step-00000003.nonfinite'}" in message
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002", "step-00000003.nonfinite"]
    assert ckpt.latest_valid(str(ckpts)) == str(ckpts / "step-00000002")
