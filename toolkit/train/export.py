"""``toolkit export RUN --out DIR``: a trained model as a folder to share: ``run(ExportConfig) -> dict``.

DIR holds what open_clip loads offline with ``create_model_and_transforms("local-dir:DIR")`` and
``get_tokenizer("local-dir:DIR")``:

- ``open_clip_config.json`` and ``open_clip_model.safetensors``: the run's final model (RUN/model), or its
  EMA weights (RUN/model-ema, ``--weights ema``);
- the tokenizer: a Hugging Face text tower's tokenizer files (``save_pretrained``, where open_clip's
  local-dir loader looks for them), or the BPE vocabulary open_clip's SimpleTokenizer reads
  (``bpe_simple_vocab_16e6.txt.gz``, a copy, so the folder is complete without open_clip's package data);
- ``README.md``, the model card, and ``model_card.json`` (the same facts as data): the training config
  (RUN/config.yaml), the training set's path, size (samples) and fingerprint (the hash the run's manifest
  recorded for it), the training summary and the last evaluation results logged in RUN/metrics.jsonl.

Only finished runs export (a run's manifest says done): a preempted or failed run has no final model.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from toolkit.core.config import option

WEIGHT_FOLDERS = {"raw": "model", "ema": "model-ema"}
BPE_VOCAB = "bpe_simple_vocab_16e6.txt.gz"


@dataclass(frozen=True)
class ExportConfig:
    """``toolkit export``: one finished training run to a shareable open_clip folder."""

    run: str = option(is_input=True, doc="The training run directory (`toolkit train --out RUN`).")
    out: str = option(
        doc="The folder to write: new, empty, or an earlier export's (replaced); never the run "
        "or a folder holding it or inside it, nor a non-empty folder export did not write."
    )
    weights: Literal["raw", "ema"] = option(
        "raw", doc="raw: RUN/model; ema: RUN/model-ema (--ema-decay runs)."
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from err


def dataset_facts(manifest: dict[str, Any]) -> dict[str, Any]:
    """The training set of a run manifest: path, fingerprint (its hash) and size from its own manifest."""
    data = (manifest.get("inputs") or {}).get("data") or {}
    path = data.get("path", "")
    counts = _read_json(Path(path) / "manifest.json").get("counts", {}) if path else {}
    return {"path": path, "fingerprint": data.get("fingerprint"), "num_samples": counts.get("num_samples")}


def last_evaluation(run_dir: Path) -> dict[str, Any]:
    """The last logged value of every ``eval/...`` and ``eval_ema/...`` metric, with the step it is from."""
    out: dict[str, Any] = {}
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines:
        record = json.loads(line)
        for key, value in record.items():
            if key.startswith(("eval/", "eval_ema/")):
                out[key] = {"value": value, "step": record["step"]}
    return out


def write_tokenizer(model_dir: Path, out: Path) -> str:
    """The model's tokenizer files into ``out`` (module docstring); returns what was written."""
    from toolkit.models.registry import tokenizer

    tok = tokenizer(f"local-dir:{model_dir}")
    hf = getattr(tok, "tokenizer", None)
    if hf is not None and hasattr(hf, "save_pretrained"):
        hf.save_pretrained(str(out))
        return f"Hugging Face tokenizer ({type(hf).__name__})"
    import open_clip

    shutil.copyfile(Path(open_clip.__file__).parent / BPE_VOCAB, out / BPE_VOCAB)
    return f"open_clip SimpleTokenizer (BPE, {BPE_VOCAB})"


def model_card(facts: dict[str, Any], config_yaml: str) -> str:
    """README.md: a model card from ``facts`` (model_card.json's content) and the training config."""
    d, s = facts["dataset"], facts["training"]
    lines = [
        "---",
        "library_name: open_clip",
        "tags: [clip, cliptk]",
        "---",
        f"# {facts['name']}",
        "",
        f"A CLIP model ({facts['model']}) trained with cliptk {facts['toolkit_version']}; "
        f"{'EMA' if facts['weights'] == 'ema' else 'final'} weights.",
        "",
        "```python",
        "import open_clip",
        "model, _, preprocess = open_clip.create_model_and_transforms('local-dir:PATH')",
        "tokenizer = open_clip.get_tokenizer('local-dir:PATH')",
        "```",
        "",
        "## Training data",
        "",
        f"- path: `{d['path']}`",
        f"- samples: {d['num_samples']}",
        f"- fingerprint: `{d['fingerprint']}`",
        "",
        "## Training",
        "",
        f"- steps: {s.get('step')}, samples seen: {s.get('samples_seen')}, ranks: {s.get('world_size')}",
        f"- tokenizer: {facts['tokenizer']}",
        "",
        "## Evaluation",
        "",
    ]
    evals = facts["evaluation"]
    lines += ["| metric | value | step |", "|---|---|---|"] if evals else ["No evaluation was logged."]
    lines += [f"| {k} | {v['value']:.4f} | {v['step']} |" for k, v in evals.items() if v["value"] is not None]
    lines += ["", "## Training config", "", "```yaml", config_yaml.rstrip(), "```", ""]
    return "\n".join(lines)


def _written_by_export(out: Path) -> bool:
    """Whether folder ``out`` is an earlier export's: its model_card.json holds the facts export writes."""
    try:
        card = json.loads((out / "model_card.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(card, dict) and {"weights", "dataset", "training", "toolkit_version"} <= set(card)


def check_out(run_dir: Path, out: Path) -> None:
    """Refuse an ``out`` that export would destroy by replacing it: the run itself, a folder holding it (its
    parent holds other runs too) or inside it, a file, or a non-empty folder an earlier export did not write
    (a user's folder). OutputIsInput (exit 2) or ValueError, naming both paths."""
    from toolkit.core.pathguard import check_output_apart

    check_output_apart("export", str(out), {"run": str(run_dir)})
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ValueError(f"--out {out}: not a folder (export replaces its folder whole); choose a new folder")
    if out.is_dir() and any(out.iterdir()) and not _written_by_export(out):
        raise ValueError(
            f"--out {out}: a non-empty folder that no earlier export wrote (it has no export's "
            "model_card.json); export replaces its folder whole, so choose a new or empty folder"
        )


def run(cfg: ExportConfig) -> dict[str, Any]:
    """Write cfg.out (module docstring); returns the model card's facts. Refuses an unfinished run and an
    out it would destroy (:func:`check_out`)."""
    from toolkit.core.files import replacing_dir

    run_dir = Path(cfg.run)
    manifest = _read_json(run_dir / "manifest.json")
    if manifest.get("kind") != "train" or manifest.get("status") != "done":
        raise ValueError(
            f"{run_dir}: not a finished training run (its manifest.json says kind "
            f"{manifest.get('kind')!r}, status {manifest.get('status')!r}); export needs one"
        )
    check_out(run_dir, Path(cfg.out))
    model_dir = run_dir / WEIGHT_FOLDERS[cfg.weights]
    if not (model_dir / "open_clip_config.json").is_file():
        raise FileNotFoundError(
            f"{model_dir}: no open_clip model here"
            + (" (train with --ema-decay for EMA weights)" if cfg.weights == "ema" else "")
        )
    config_yaml = (run_dir / "config.yaml").read_text() if (run_dir / "config.yaml").is_file() else ""
    facts = {
        "name": Path(cfg.out).name,
        "model": manifest.get("config", {}).get("model"),
        "weights": cfg.weights,
        "toolkit_version": manifest.get("toolkit_version"),
        "dataset": dataset_facts(manifest),
        "training": manifest.get("counts", {}),
        "evaluation": last_evaluation(run_dir),
        "config": manifest.get("config", {}),
    }
    with replacing_dir(Path(cfg.out)) as tmp:
        for name in ("open_clip_config.json", "open_clip_model.safetensors"):
            shutil.copyfile(model_dir / name, tmp / name)
        facts["tokenizer"] = write_tokenizer(model_dir, tmp)
        (tmp / "model_card.json").write_text(json.dumps(facts, indent=2, default=str) + "\n")
        (tmp / "README.md").write_text(model_card(facts, config_yaml))
    return facts
