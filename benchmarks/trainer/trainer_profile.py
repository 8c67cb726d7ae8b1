"""Where a trainer's time goes: its main process under cProfile, summed into phases.

``profiled(cmd, out)`` runs a Python command (``python -m X ...`` or ``python script.py ...``) under
``python -m cProfile -o out``; ``phases(out)`` sums the cumulative seconds of the functions of each phase
(outermost calls only, as cProfile counts a recursive function) for cliptk's and open_clip_train's code
alike, and puts the rest under "other" (Python-side step bookkeeping, logging, process start-up that is
not an import). Loader workers are other processes: their work shows here as the main process's wait in
the loader's ``__next__``. cProfile adds per-call overhead to Python-heavy code (the trainers' steps are
mostly native torch kernels), so compare a phase between trainers, not with the timed runs' wall seconds.
"""

from __future__ import annotations

import pstats
from pathlib import Path

# phase -> (file path suffix, function name) patterns; a function counts in the first phase it matches
PHASES: dict[str, list[tuple[str, str]]] = {
    "imports": [("<frozen importlib._bootstrap>", "_find_and_load")],
    "data wait (loader __next__)": [("torch/utils/data/dataloader.py", "__next__")],
    "loss forward": [("toolkit/train/step.py", "_loss"), ("open_clip/loss.py", "forward")],
    "backward": [("~", "<method 'run_backward' of 'torch._C._EngineBase' objects>")],
    "optimizer step": [("torch/optim/adam.py", "step"), ("torch/optim/adamw.py", "step")],
    "model forward (towers)": [("torch/nn/modules/module.py", "_call_impl")],
    "checkpoint and final model": [
        ("toolkit/train/checkpoint/state.py", "save"),
        ("toolkit/train/checkpoint/state.py", "close"),
        ("toolkit/train/report.py", "final_model"),
        ("torch/serialization.py", "save"),
    ],
    "plots": [("toolkit/train/metrics.py", "write_plots")],
}


def profiled(cmd: list[str], out: Path) -> list[str]:
    """``cmd`` (``[python, -m, module, ...]`` or ``[python, script, ...]``) run under cProfile into
    ``out``."""
    return [cmd[0], "-m", "cProfile", "-o", str(out), *cmd[1:]]


def _matches(key: tuple[str, int, str], patterns: list[tuple[str, str]]) -> bool:
    path, _line, func = key
    return any(path.endswith(suffix) and func == name for suffix, name in patterns)


def phases(prof: Path) -> dict[str, float]:
    """{phase: seconds} for one profile, with "total" (the profiled program's run) and "other"."""
    stats = pstats.Stats(str(prof)).stats  # {(file, line, func): (cc, nc, tt, ct, callers)}
    out = {name: 0.0 for name in PHASES}
    for key, (_cc, _nc, _tt, cumulative, _callers) in stats.items():
        for name, patterns in PHASES.items():
            if _matches(key, patterns):
                out[name] += cumulative
                break
    # the loss module is called through Module._call_impl too: towers = all module calls - loss
    out["model forward (towers)"] = max(0.0, out["model forward (towers)"] - out["loss forward"])
    total = max(ct for (_cc, _nc, _tt, ct, _callers) in stats.values())
    out["other"] = max(0.0, total - sum(out.values()))
    out["total"] = total
    return out


def markdown(profiles: dict[str, dict[str, float]]) -> str:
    """A table of phases (rows) by trainer (columns), seconds and share of the total."""
    names = list(profiles)
    lines = ["| phase | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for phase in [*PHASES, "other", "total"]:
        cells = [f"{p[phase]:.1f} s ({100 * p[phase] / p['total']:.0f} %)" for p in profiles.values()]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
