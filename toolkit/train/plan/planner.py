"""``toolkit plan``: predicted per-device memory and per-rank traffic of a training configuration, and the
largest global batch and micro-batch that fit a device: ``run(PlanConfig) -> Plan``.

The parts: ``config`` (PlanConfig, the model's shapes, the Plan), ``memory`` (the bytes per device, with
the arithmetic of every row, and the fit), ``traffic`` (bytes per rank per step by mode: the ledger's own
formula), counted tower FLOPs and the training set's disk here, and ``report`` (the text tables).
"""

from __future__ import annotations

from dataclasses import replace

from toolkit.train.losses.config import MODES
from toolkit.train.plan.config import (
    ModelShape,
    Plan,
    PlanConfig,
    local_batch,
    model_shape,
    objective,
    table_bytes,
)
from toolkit.train.plan.memory import (
    activation_constants,
    largest_fit,
    memory_rows,
    param_bytes,
    stage_totals,
)


def run(cfg: PlanConfig) -> Plan:
    """The plan for ``cfg`` (module docstring); builds the model on the meta device, measures if asked."""
    spec, _ = objective(cfg)
    if cfg.mode not in spec.modes:  # e.g. FastCLIP runs in the fastclip mode only: plan the mode it runs in
        cfg = replace(cfg, mode=spec.modes[0])
    shape = model_shape(cfg.model)
    fixed, per_sample, overhead, source = activation_constants(cfg)
    rows = memory_rows(cfg, shape, fixed, per_sample, overhead)
    if cfg.device == "cpu":
        rows["FastCLIP tables (host, per node)"] = table_bytes(cfg)
    fit = largest_fit(cfg, shape, fixed, per_sample, overhead) if cfg.device_memory_gb else {}
    ddp = (
        sum(memory_rows(replace(cfg, fsdp=False), shape, fixed, per_sample, overhead).values())
        if cfg.fsdp
        else 0.0
    )
    if cfg.fsdp and cfg.device == "cpu":
        ddp += rows["FastCLIP tables (host, per node)"]
    return Plan(
        cfg,
        shape,
        fixed,
        per_sample,
        rows,
        table_bytes(cfg),
        traffic(cfg, shape),
        fit,
        source,
        disk_bytes(cfg),
        tower_flops_rows(cfg),
        ddp,
        stage_totals(cfg, shape, fixed, per_sample, overhead) if cfg.stages else {},
    )


def traffic(cfg: PlanConfig, shape: ModelShape) -> dict[str, dict[str, float]]:
    """Wire bytes per rank per step for every mode of the openclip objective, and for ``cfg.loss`` in its mode
    when it is another objective (``NAME/MODE``)."""
    from toolkit.train.plan.traffic import sent_bytes, step_traffic

    b, feat = local_batch(cfg), 2 if cfg.precision != "fp32" else 4
    grad = 2 if cfg.grad_dtype == "bf16" else 4
    if cfg.world == 1:
        return {}
    out = {
        f"openclip/{mode}": sent_bytes(
            step_traffic(
                mode, cfg.world, b, shape.embed_dim, shape.num_trainable, feature_bytes=feat, grad_bytes=grad
            ),
            cfg.world,
        )
        for mode in MODES
    }
    if cfg.fsdp:  # the parameter traffic FSDP adds (its gradient reduce-scatter replaces DDP's all_reduce)
        from toolkit.train.plan.fsdp_memory import traffic as fsdp_traffic

        m = cfg.micro_batch_size
        out["fsdp (parameters)"] = fsdp_traffic(
            num_params=shape.num_params,
            num_trainable=shape.num_trainable,
            units=shape.units,
            world=cfg.world,
            param_bytes=param_bytes(cfg),
            num_micro=-(-b // m) if 0 < m < b else 0,
            reshard=cfg.fsdp_reshard_after_forward,
        )
    spec, fields = objective(cfg)
    if spec.kind != "openclip":
        variant = {k: v for k, v in fields.items() if k != "kind"}
        mode = cfg.mode if cfg.mode in spec.modes else spec.modes[0]
        table = step_traffic(
            mode,
            cfg.world,
            b,
            shape.embed_dim,
            shape.num_trainable,
            feature_bytes=feat,
            grad_bytes=grad,
            objective=spec.kind,
            **variant,
        )
        out[f"{cfg.loss}/{mode}"] = sent_bytes(table, cfg.world)
    return out


def disk_bytes(cfg: PlanConfig) -> float:
    """Bytes a training sample takes on disk in ``cfg.storage`` (its storage mode's figure), at the side
    precompute stores for the model by default (the crop margin of ``crop_scale_min`` 0.9) and its context."""
    from toolkit.data.images import stored_side
    from toolkit.data.trainset import storage
    from toolkit.models.factory import resolve_spec
    from toolkit.models.registry import config_context_length, config_image_size

    model_cfg = resolve_spec(cfg.model).model_cfg
    side = stored_side(config_image_size(model_cfg), 0.9)
    return float(storage.get(cfg.storage).disk_bytes_per_sample(side, config_context_length(model_cfg)))


def tower_flops_rows(cfg: PlanConfig) -> dict[str, float]:
    """Counted tower FLOPs (models/flops.py) of one training step at cfg's patch dropout and caption length:
    per sample forward, per rank and per global step (forward + backward, the cache's extra forward); {} for
    towers it does not count (ResNets, timm, Hugging Face text)."""
    from toolkit.models.factory import resolve_spec
    from toolkit.models.flops import step_flops, tower_flops

    try:
        per = tower_flops(
            resolve_spec(cfg.model).model_cfg,
            text_tokens=cfg.text_tokens or None,
            patch_dropout=cfg.patch_dropout,
        )
    except ValueError:
        return {}
    b = local_batch(cfg)
    cached = 0 < cfg.micro_batch_size < b
    rows = {
        "image forward per sample": per.image,
        "text forward per sample": per.text,
        "towers per rank per step": step_flops(per, b, cached),
        "towers per global step": step_flops(per, cfg.batch_size, cached),
    }
    return rows | (stage_flops_rows(cfg, cached) if cfg.stages else {})


def stage_flops_rows(cfg: PlanConfig, cached: bool) -> dict[str, float]:
    """Per global step of each stage of ``cfg.stages`` and, given ``cfg.steps``, summed over the run and as a
    share of the same run at full size."""
    from toolkit.models.factory import resolve_spec
    from toolkit.models.flops import step_flops, tower_flops
    from toolkit.train.stages import parse, schedule

    model_cfg = resolve_spec(cfg.model).model_cfg
    rows, total = {}, 0.0
    stages = schedule(parse(cfg.stages), cfg.steps or 1000)
    for i, s in enumerate(stages, 1):
        per = tower_flops(
            model_cfg,
            image_size=s.image_px or None,
            text_tokens=s.text_tokens or cfg.text_tokens or None,
            patch_dropout=cfg.patch_dropout,
        )
        step = step_flops(per, cfg.batch_size, cached)
        rows[f"stage {i} ({s.image_px or 'full'} px, {s.text_tokens or 'full'} tok) per step"] = step
        total += step * (s.stop - s.start)
    if cfg.steps:
        full = step_flops(tower_flops(model_cfg, text_tokens=cfg.text_tokens or None), cfg.batch_size, cached)
        rows[f"run of {cfg.steps} steps ({total / (full * cfg.steps):.2f} x full size)"] = total
    return rows
