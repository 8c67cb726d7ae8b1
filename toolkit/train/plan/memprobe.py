"""Measured activation memory of a model's tower passes: the constants behind ``toolkit plan`` and
``--micro-batch-size auto``.

``activations(m) = fixed + per_sample · m`` is fitted from the peak memory of one training-mode forward +
backward of both towers (``TrainModel``: uint8 pixels and token ids in, normalised features out, the
backward of a sum of the features) at two micro-batch sizes:

- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus what was allocated
  before (the caching allocator counts every tensor, so this is exact and can run in-process).
- CPU: torch has no public CPU allocator statistics and tracemalloc does not see its allocations, so
  each size runs in a **fresh subprocess** (``python -m toolkit.train.plan.memprobe``) that reads the
  kernel's peak resident set (``VmHWM`` in /proc/self/status, reset by writing 5 to
  /proc/self/clear_refs just before the pass) minus the resident set before it. A fresh process per size
  keeps the C allocator's retained free memory of one size out of the other's measurement. Before the
  measured pass the child runs one warm-up pass at one sample and keeps its gradients, as in training
  from the second step on (gradients and one-time buffers such as oneDNN's are then already resident).

Both are real allocator peaks, so the fit includes the backward's transient buffers (e.g. the token
embedding's dense gradient before it is accumulated), not only the tensors autograd saves.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from toolkit.core.log import get_logger

log = get_logger("plan")

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int:
    with open(_STATUS) as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{_STATUS} has no {field} (not Linux?)")


def rss_bytes() -> int:
    """This process's resident set now (Linux)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """This process's peak resident set since the last ``reset_peak_rss`` (Linux)."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0: 5 > /proc/PID/clear_refs)."""
    with open(_CLEAR_REFS, "w") as fh:
        fh.write("5")


@dataclass(frozen=True)
class ActivationFit:
    """activations(m) = fixed_bytes + per_sample_bytes · m for one model, precision and device."""

    model: str
    precision: str
    device: str
    fixed_bytes: float
    per_sample_bytes: float
    overhead_bytes: float  # CPU: resident memory the model build and first pass add beyond weights and grads
    points: tuple[tuple[int, int], ...]  # (micro-batch, measured bytes)

    def at(self, micro: int) -> float:
        return self.fixed_bytes + self.per_sample_bytes * micro


def tower_inputs(model: Any, micro: int, device: Any, text_tokens: int = 0) -> tuple[Any, Any]:
    """Random uint8 pixels [m, S, S, 3] and token ids [m, L] for a ``TrainModel`` of raw towers, or
    float16 features [m, D] where it takes frozen-tower features. ``text_tokens`` > 0: L = that many, the
    length the trainer cuts a batch to when its longest caption has that many tokens (0: the context)."""
    import torch

    from toolkit.models.registry import config_context_length, config_image_size

    gen = torch.Generator().manual_seed(0)
    cfg = model.model_cfg
    if model.image_role == "image_features":
        image = torch.randn(micro, model.feature_dims[0], generator=gen).half()
    else:
        size = config_image_size(cfg)
        image = torch.randint(0, 256, (micro, size, size, 3), dtype=torch.uint8, generator=gen)
    if model.text_role == "text_features":
        text = torch.randn(micro, model.feature_dims[1], generator=gen).half()
    else:
        vocab = int(cfg.get("text_cfg", {}).get("vocab_size", 49408))
        length = min(text_tokens, config_context_length(cfg)) if text_tokens else config_context_length(cfg)
        text = torch.randint(0, vocab, (micro, length), generator=gen)
    return image.to(device), text.to(device)


def tower_pass(model: Any, micro: int, autocast: Any, device: Any, text_tokens: int = 0) -> None:
    """One training-mode forward of both towers and the backward of their features (gradients accumulate
    into ``.grad`` as the trainer's do); a model with patch dropout keeps its share of the patches (masks of
    seed 0: only their number matters here)."""
    import torch

    from toolkit.models.patch_dropout import keyed

    image, text = tower_inputs(model, micro, device, text_tokens)
    with autocast(), keyed(model, 0, torch.arange(micro, device=device)):
        x, y, a, _ = model(image, text)  # Towers(x, y, a, bias)
    (x.float().sum() + y.float().sum() + a.float().sum()).backward()


def build_tower_model(model_spec: str, grad_checkpointing: bool = False, patch_dropout: float = 0.0) -> Any:
    """A ``TrainModel`` of raw towers for ``model_spec`` (random init, CPU, train mode); ``model_cfg``
    attached; ``grad_checkpointing``: open_clip's activation checkpointing on, as ``--grad-checkpointing``
    trains; ``patch_dropout``: the seeded patch dropout installed, as ``--patch-dropout`` trains."""
    import torch

    from toolkit.models.factory import build_model, resolve_spec
    from toolkit.train.model import TrainModel

    spec = resolve_spec(model_spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        clip = build_model(spec.model_cfg)
    pp = spec.preprocess_cfg
    model = TrainModel(clip, "image", "tokens", tuple(pp["mean"]), tuple(pp["std"])).train()
    model.model_cfg = spec.model_cfg
    if grad_checkpointing:
        clip.set_grad_checkpointing(True)
    if patch_dropout:
        from toolkit.models.patch_dropout import install

        install(clip, patch_dropout)
    return model


def probe_here(
    model_spec: str,
    micro: int,
    precision: str,
    device: str,
    text_tokens: int = 0,
    grad_checkpointing: bool = False,
    patch_dropout: float = 0.0,
) -> tuple[int, int]:
    """(peak bytes of one tower pass of ``micro`` samples above the memory before it, overhead): on the
    CPU the overhead is what building the model and its first pass left resident beyond the weights and
    gradients (Python objects, the allocator's and oneDNN's buffers, autograd's threads: ~36 MiB for
    cliptk-tiny), which a training process holds too; 0 on CUDA."""
    import open_clip  # noqa: F401  (imports are not training memory: loaded before the baseline)
    import torch

    import toolkit.train.model  # noqa: F401
    from toolkit.train.runtime import autocast as runtime_autocast

    cpu = not device.startswith("cuda")
    start = rss_bytes() if cpu else 0
    model = build_tower_model(model_spec, grad_checkpointing, patch_dropout)
    dev = torch.device(device)
    model.to(dev)
    autocast = runtime_autocast(precision, dev.type)
    tower_pass(model, 1, autocast, dev)  # warm-up: gradients and one-time buffers resident, as from step 2 on
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    overhead = rss_bytes() - start - 2 * weights if cpu else 0
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        tower_pass(model, micro, autocast, dev, text_tokens)
        torch.cuda.synchronize(dev)
        return int(torch.cuda.max_memory_allocated(dev) - before), 0
    before = rss_bytes()
    reset_peak_rss()
    tower_pass(model, micro, autocast, dev, text_tokens)
    return peak_rss_bytes() - before, overhead


def probe_subprocess(
    model_spec: str,
    micro: int,
    precision: str,
    threads: int,
    text_tokens: int = 0,
    timeout_s: float = 600,
    grad_checkpointing: bool = False,
    patch_dropout: float = 0.0,
) -> tuple[int, int]:
    """``probe_here`` on the CPU in a fresh Python process (module docstring)."""
    cmd = [
        sys.executable,
        "-m",
        "toolkit.train.plan.memprobe",
        "--model",
        model_spec,
        "--micro",
        str(micro),
        "--precision",
        precision,
        "--threads",
        str(threads),
        "--text-tokens",
        str(text_tokens),
        *(["--grad-checkpointing"] if grad_checkpointing else []),
        "--patch-dropout",
        str(patch_dropout),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise RuntimeError(
            f"memory probe of {model_spec} at micro-batch {micro} failed: {proc.stderr.strip()[-2000:]}"
        )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return int(out["bytes"]), int(out["overhead"])


def measure_activations(
    model_spec: str,
    sizes: tuple[int, int] = (16, 64),
    precision: str = "fp32",
    device: str = "cpu",
    threads: int | None = None,
    text_tokens: int = 0,
    grad_checkpointing: bool = False,
    patch_dropout: float = 0.0,
) -> ActivationFit:
    """Fit activations(m) from tower passes at two micro-batch sizes (module docstring for how), with token
    batches of ``text_tokens`` positions (0: the model's context), with or without ``grad_checkpointing``, at
    ``patch_dropout`` (the image tower's shorter sequence)."""
    import torch

    if len(sizes) != 2 or not 0 < sizes[0] < sizes[1]:
        raise ValueError(f"need two micro-batch sizes 0 < m1 < m2, got {sizes}")
    threads = threads or torch.get_num_threads()
    runs = []
    for i, m in enumerate(sizes):  # on the CPU each takes a minute or more (ViT-B-32: ~1 min): say so
        where = "" if device.startswith("cuda") else " in a fresh process"
        log.info(
            "measuring the activations of %s (%s, %s) at micro-batch %d (%d of %d)%s ...",
            model_spec,
            precision,
            device,
            m,
            i + 1,
            len(sizes),
            where,
        )
        start = time.monotonic()
        if device.startswith("cuda"):
            runs.append(
                probe_here(model_spec, m, precision, device, text_tokens, grad_checkpointing, patch_dropout)
            )
        else:
            runs.append(
                probe_subprocess(
                    model_spec,
                    m,
                    precision,
                    threads,
                    text_tokens,
                    grad_checkpointing=grad_checkpointing,
                    patch_dropout=patch_dropout,
                )
            )
        log.info(
            "micro-batch %d: peak %.1f MiB above the baseline (%.0f s)",
            m,
            runs[-1][0] / 2**20,
            time.monotonic() - start,
        )
    (m1, m2), ((b1, o1), (b2, o2)) = sizes, runs
    per_sample = max((b2 - b1) / (m2 - m1), 0.0)
    return ActivationFit(
        model_spec,
        precision,
        "cuda" if device.startswith("cuda") else "cpu",
        float(b1 - per_sample * m1),
        float(per_sample),
        (o1 + o2) / 2,
        ((m1, b1), (m2, b2)),
    )


def main(argv: list[str] | None = None) -> None:
    """Child entry point: print {"bytes": peak above baseline} as JSON for one CPU tower pass."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--micro", type=int, required=True)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--text-tokens", type=int, default=0)
    parser.add_argument("--grad-checkpointing", action="store_true")
    parser.add_argument("--patch-dropout", type=float, default=0.0)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    nbytes, overhead = probe_here(
        args.model,
        args.micro,
        args.precision,
        args.device,
        args.text_tokens,
        args.grad_checkpointing,
        args.patch_dropout,
    )
    print(json.dumps({"bytes": nbytes, "overhead": overhead, **vars(args)}))


if __name__ == "__main__":
    main()
