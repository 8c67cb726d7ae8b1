"""Which checkpoint a run resumes from, and the refusal of one written with another configuration.

Torch-free, so the launching process checks before any rank starts (``run.preflight``): a rerun after a
change of ``steps`` fails at once, naming the keys that differ, instead of in every launched rank. The
ranks check again when they load (``StateIO.resume``), for jobs started by torchrun or srun.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from toolkit.core import files
from toolkit.core.config import config_hash, output_dict
from toolkit.core.config_changes import absent_values, changed_keys, describe_changes
from toolkit.train.checkpoint import format as ckpt
from toolkit.train.config import CheckpointConfig, TrainConfig

CLI_REMEDY = (
    "resume it with its own config, use --resume none to start afresh, or --init to start from its weights"
)


def output_hash(cfg: TrainConfig) -> str:
    """Hash of the fields that change what training produces (a resume refuses a different one)."""
    return config_hash(cfg, "train")


def output_config(cfg: TrainConfig) -> dict[str, Any]:
    """The hashed fields themselves (trainer.json's ``config``), so a refusal can name what changed."""
    return output_dict(cfg)


class ConfigMismatch(ValueError):
    """A checkpoint written with another output-affecting configuration. ``changes``: (key, checkpoint's
    value, this run's value), or None for a checkpoint that recorded only the hash (before cliptk stored
    its config); ``where``: the run's checkpoint folder (or run directory) that holds it; ``remedy``: what
    the user can do, in the terms of the command they ran."""

    def __init__(
        self,
        path: str,
        saved_hash: Any,
        new_hash: str,
        changes: list[tuple[str, Any, Any]] | None,
        where: str = "",
        remedy: str = CLI_REMEDY,
    ):
        self.path, self.saved_hash, self.new_hash, self.changes = path, saved_hash, new_hash, changes
        self.where, self.remedy = where, remedy
        what = (
            f"checkpoint -> this run: {describe_changes(changes)}"
            if changes
            else f"config hash {saved_hash} != {new_hash}"
        )
        super().__init__(f"{path}: written by a run with a different configuration ({what}); {remedy}")

    def in_pipeline(self, stage: str) -> ConfigMismatch:
        """The same refusal with the remedies of ``pipeline run`` for stage ``stage`` (the runner calls this
        on any error that has it: ``--resume none`` is no option there). The checkpoint stays either way."""
        return ConfigMismatch(
            self.path,
            self.saved_hash,
            self.new_hash,
            self.changes,
            self.where,
            f"restore the old values to resume it, or start afresh with --set "
            f"stages.{stage}.checkpoint.resume=none (deletes its checkpoints) or after moving "
            f"{self.where} away",
        )


class FlatLayoutRecord(ConfigMismatch):
    """A checkpoint recorded in the flat loss layout of before 2026-11-26 (``loss.version``, not
    ``loss.fastclip.version``), which cliptk no longer reads: the refusal names each flat key and its new
    place."""

    def __init__(self, path: str, moved: dict[str, str], where: str = "", remedy: str = ""):
        self.path, self.moved, self.where, self.changes = path, moved, where, None
        self.saved_hash = self.new_hash = ""
        self.remedy = remedy or (
            f"start afresh from its weights with --init {path} (a new run folder, or "
            "--resume none), or with the cliptk it was written with"
        )
        names = ", ".join(f"{old} is {new} now" for old, new in moved.items())
        ValueError.__init__(
            self,
            f"{path}: recorded in the flat loss layout of before 2026-11-26 ({names}); "
            "this cliptk reads the sectioned layout only and cannot resume it: "
            f"{self.remedy}",
        )

    def in_pipeline(self, stage: str) -> FlatLayoutRecord:
        return FlatLayoutRecord(
            self.path,
            self.moved,
            self.where,
            f"start afresh with --set stages.{stage}.checkpoint.resume=none (deletes its "
            f"checkpoints) or after moving {self.where} away",
        )


def flat_loss_keys(record: Any) -> dict[str, str]:
    """{loss.FLAT: loss.SECTION.KEY} of the flat loss keys a recorded config holds ({} for a sectioned
    one)."""
    from toolkit.train.losses.config import MOVED_KEYS

    loss = record.get("loss") if isinstance(record, Mapping) else None
    if not isinstance(loss, Mapping):
        return {}
    return {f"loss.{key}": f"loss.{MOVED_KEYS[key]}" for key in loss if key in MOVED_KEYS}


def check_config(path: str, saved: Mapping[str, Any], cfg: TrainConfig) -> None:
    """Raise :class:`ConfigMismatch` unless checkpoint ``path`` (``saved``: its trainer.json) was written
    with ``cfg``'s output-affecting configuration."""
    new_hash = output_hash(cfg)
    if saved.get("config_hash") == new_hash:
        return
    old = saved.get("config")
    moved = flat_loss_keys(old)
    if moved:
        raise FlatLayoutRecord(path, moved, cfg.checkpoint.dir or cfg.out)
    changes = changed_keys(old, output_config(cfg), absent_values(cfg)) if isinstance(old, Mapping) else None
    if changes is not None:
        changes = _with_effect(changes, cfg)
    if changes == []:  # written before some fields existed, and this run uses what their absence meant
        return
    raise ConfigMismatch(
        path, saved.get("config_hash"), new_hash, changes or None, cfg.checkpoint.dir or cfg.out
    )


def _with_effect(changes: list[tuple[str, Any, Any]], cfg: TrainConfig) -> list[tuple[str, Any, Any]]:
    """``changes`` less the ``augment.*`` keys when the run's data holds frozen-tower image features: the
    augmentation crops pixels, so there it changes nothing (a LiT run recorded before ``augment`` existed
    resumes with its defaults). The data's dataset.json is read only when such a key differs."""
    if not any(key.startswith("augment.") for key, _, _ in changes):
        return changes
    from toolkit.data.trainset.format import TrainDataset

    if TrainDataset.open(cfg.data).field("image") is not None:
        return changes
    return [change for change in changes if not change[0].startswith("augment.")]


def checkpoints_dir(checkpoint: CheckpointConfig, out: str) -> str:
    """Where run folder ``out``'s checkpoints go: ``checkpoint.dir``, else OUT/checkpoints."""
    return checkpoint.dir or files.join(out, ckpt.CHECKPOINTS)


def find_checkpoint(how: str, ckpt_dir: str) -> str | None:
    """The checkpoint ``checkpoint.resume`` = ``how`` (auto, latest or a directory; not none) resumes from:
    the newest that verifies (latest: one must exist), or the directory given, verified."""
    if how in ("auto", "latest"):
        path = ckpt.latest_valid(ckpt_dir)
        if path is None and how == "latest":
            raise FileNotFoundError(f"--resume latest: no complete checkpoint under {ckpt_dir}")
        return path
    require_resume_folder(how)
    ckpt.verify(how)
    return how


def require_resume_folder(how: str) -> None:
    """A checkpoint folder given as ``checkpoint.resume`` must exist: FileNotFoundError saying so (it was
    reported as 'checkpoint.json: missing (the checkpoint was not completed)')."""
    if not files.exists(how):
        raise FileNotFoundError(
            f"--resume {how}: not found (expected auto, latest, none or a checkpoint folder "
            "such as RUN_DIR/checkpoints/step-00000100)"
        )


def _saved_hash(path: str) -> Any:
    try:
        return ckpt.read_trainer_state(path).get("config_hash")
    except (ckpt.CheckpointInvalid, AttributeError):
        return None


def refuse_other_config(cfg: TrainConfig) -> None:
    """Before any rank starts: raise :class:`ConfigMismatch` if the checkpoint the run would resume from has
    another configuration. Only the small trainer.json files are read unless one of them differs; then the
    checkpoint is chosen as the ranks choose it (verified, damaged ones skipped). Anything else that is
    wrong (no checkpoint for ``latest``, a damaged directory) is left to the ranks, as before, except a
    checkpoint folder given that does not exist (refused here: FileNotFoundError)."""
    how = cfg.checkpoint.resume
    if how == "none":
        return
    if how not in ("auto", "latest"):
        require_resume_folder(how)
    ckpt_dir, new_hash = checkpoints_dir(cfg.checkpoint, cfg.out), output_hash(cfg)
    candidates = [p for _, p in ckpt.list_checkpoints(ckpt_dir)] if how in ("auto", "latest") else [how]
    if all(_saved_hash(p) in (None, new_hash) for p in candidates):
        return
    path = find_checkpoint(how, ckpt_dir)
    if path is not None:
        check_config(path, ckpt.read_trainer_state(path), cfg)


def nonfinite_abort_note(good: str | None, first_bad_step: int, moved: list[str]) -> str:
    """The end of the message of a run aborted for non-finite steps: ``good``, the last checkpoint written
    before ``first_bad_step`` (None: none), and ``moved``, what was set aside (``StateIO.nonfinite_note``)."""
    aside = f"; set aside, written after it: {', '.join(moved)}" if moved else ""
    if good is None:
        return f"; no checkpoint was written before the first non-finite step ({first_bad_step}){aside}"
    return (
        f"; the last checkpoint written before the first non-finite step ({first_bad_step}) is {good}: "
        f"start from its weights with --init {good} and a lower --lr (a resume with another lr is "
        f"refused){aside}"
    )
