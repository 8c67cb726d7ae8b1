"""``toolkit train``: the FastCLIP trainer (``toolkit train --data D --out R``) and its presets."""

from __future__ import annotations

from typing import Annotated

import typer

from toolkit.cli.common import ConfigFile, SetOverrides, fail, load_cli_config

app = typer.Typer(help="Train CLIP models (FastCLIP or the OpenCLIP baseline); `toolkit train presets` lists the "
                       "published settings.", no_args_is_help=True)

Opt = typer.Option


@app.callback(invoke_without_command=True)
def train(
    ctx: typer.Context,
    data: Annotated[str | None, Opt("--data", help="Training shards (`toolkit data precompute` output).")] = None,
    out: Annotated[str | None, Opt("--out", "-o", help="Run directory: metrics, checkpoints/, model/, plots/.")] = None,
    model: Annotated[str | None, Opt("--model", "-m", help="open_clip model name (cliptk-tiny default, RN50, "
                                     "ViT-B-32, ...), config JSON or checkpoint directory.")] = None,
    init: Annotated[str | None, Opt("--init", help="Initial weights: open_clip checkpoint directory or "
                                    ".safetensors/.pt file (local).")] = None,
    loss: Annotated[str | None, Opt("--loss", help="openclip, fastclip-v0, fastclip-v1, fastclip-v2, "
                                    "fastclip-v3 (default) or neuclip (docs/neuclip.md).")] = None,
    loss_mode: Annotated[str | None, Opt("--mode", help="Distributed mode: gather, disco, ring or fastclip "
                                         "(default; FastCLIP's only mode).")] = None,
    preset: Annotated[str | None, Opt("--preset", help="Start from a published setting (`toolkit train "
                                      "presets`); every other option overrides it.")] = None,
    batch_size: Annotated[int | None, Opt("--batch-size", "-b", help="GLOBAL batch over all ranks "
                                          "(default 64).")] = None,
    epochs: Annotated[int | None, Opt("--epochs", help="Epochs (default 1).")] = None,
    steps: Annotated[int | None, Opt("--steps", help="Total optimiser steps (overrides --epochs).")] = None,
    optim_lr: Annotated[float | None, Opt("--lr", help="Peak learning rate (default 1e-3).")] = None,
    seed: Annotated[int | None, Opt("--seed", help="Seed of init, data order and random streams (default 0).")] = None,
    precision: Annotated[str | None, Opt("--precision", help="fp32 (default), bf16 (autocast) or fp16 "
                                         "(autocast + GradScaler, CUDA).")] = None,
    device: Annotated[str | None, Opt("--device", help="auto (default), cpu or cuda.")] = None,
    micro_batch_size: Annotated[str | None, Opt("--micro-batch-size", help="Gradient cache: tower passes of "
                                                "this many samples per rank (0: whole local batch; auto: the "
                                                "largest that fits --memory-budget-gb, chosen at start-up).")] = None,
    memory_budget_gb: Annotated[float | None, Opt("--memory-budget-gb", help="Memory per rank for "
                                                  "--micro-batch-size auto, GiB (0 default: CPU 90% of available "
                                                  "host memory over the node's ranks; CUDA the device's).")] = None,
    checkpoint_resume: Annotated[str | None, Opt("--resume", help="auto (default: newest checkpoint of --out if "
                                                 "any), latest (must exist), none, or a checkpoint dir.")] = None,
    launch_nproc_per_node: Annotated[int | None, Opt("--nproc-per-node", help="Processes on this node "
                                                     "(torchrun).")] = None,
    launch_nodes: Annotated[str | None, Opt("--nodes", help="Nodes N, or MIN:MAX for an elastic job.")] = None,
    launch_node_rank: Annotated[int | None, Opt("--node-rank", help="This node's rank (fixed N).")] = None,
    launch_master_addr: Annotated[str | None, Opt("--master-addr", help="Node 0's address.")] = None,
    launch_master_port: Annotated[int | None, Opt("--master-port", help="Rendezvous port.")] = None,
    launch_max_restarts: Annotated[int | None, Opt("--max-restarts", help="Worker restarts after a failure "
                                                   "(resume from the latest checkpoint).")] = None,
    checkpoint_every_steps: Annotated[int | None, Opt("--checkpoint-every", help="Checkpoint every N steps "
                                                      "(0: at the end only).")] = None,
    checkpoint_keep: Annotated[int | None, Opt("--keep-checkpoints", help="Newest checkpoints kept (default "
                                               "3).")] = None,
    log_every: Annotated[int | None, Opt("--log-every", help="Metrics every N steps (default 10).")] = None,
    eval_every_steps: Annotated[int | None, Opt("--eval-every", help="Zero-shot evaluation every N steps and "
                                                "at the end (0: never).")] = None,
    eval_root: Annotated[str | None, Opt("--eval-root", help="Folder of evaluation sets (`toolkit eval "
                                         "build-set`).")] = None,
    eval_datasets: Annotated[str | None, Opt("--eval-datasets", help="Comma-separated set names under "
                                             "--eval-root.")] = None,
    loader_num_workers: Annotated[int | None, Opt("--workers", help="Data-loading processes per rank "
                                                  "(default 2).")] = None,
    config: ConfigFile = None,
    overrides: SetOverrides = None,
) -> None:
    """Train on training shards: `toolkit train --data TRAIN_DIR --out RUN_DIR [options]`.

    Every key of the config (`toolkit pipeline kinds train` lists them) can be set with --set KEY=VALUE
    or in --config FILE.yaml. See docs/training.md.
    """
    if ctx.invoked_subcommand is not None:
        return
    from toolkit.train.config import TrainConfig
    from toolkit.train.losses.config import loss_fields

    split = {}
    if loss is not None:
        try:
            split = {f"loss.{k}": v for k, v in loss_fields(loss).items()}
        except ValueError as err:
            fail(f"option --loss: {err}")
    names = [n.strip() for n in eval_datasets.split(",") if n.strip()] if eval_datasets is not None else None
    cfg = load_cli_config(
        ctx, TrainConfig, config, overrides, labels={k: "option --loss" for k in split}, **split, data=data,
        out=out, model=model, init=init, preset=preset, batch_size=batch_size, epochs=epochs, steps=steps,
        seed=seed, precision=precision, device=device, micro_batch_size=_micro(micro_batch_size),
        memory_budget_gb=memory_budget_gb, log_every=log_every,
        **{"loss.mode": loss_mode, "optim.lr": optim_lr, "checkpoint.resume": checkpoint_resume,
           "launch.nproc_per_node": launch_nproc_per_node, "launch.nodes": launch_nodes,
           "launch.node_rank": launch_node_rank, "launch.master_addr": launch_master_addr,
           "launch.master_port": launch_master_port, "launch.max_restarts": launch_max_restarts,
           "checkpoint.every_steps": checkpoint_every_steps, "checkpoint.keep": checkpoint_keep,
           "eval.every_steps": eval_every_steps, "eval.root": eval_root, "eval.datasets": names,
           "loader.num_workers": loader_num_workers})
    result = _run(cfg)
    c = result.counts
    typer.echo(f"{cfg.out}: {c.get('step')} steps, {c.get('samples_seen')} samples on {c.get('world_size')} "
               f"rank(s), {c.get('skipped_steps')} skipped")
    if "model" in result.outputs:
        typer.echo(f"model: {result.outputs['model']}  (toolkit eval zeroshot --model {result.outputs['model']} ...)")


def _micro(value: str | None) -> int | str | None:
    """--micro-batch-size's text as the config's int | 'auto' (anything else is refused by the config)."""
    return int(value) if value is not None and value.strip().isdigit() else value


def _run(cfg):
    """Run the stage (errors exit 1 naming the cause); a preemption after its checkpoint exits 0."""
    from toolkit.cli.common import run_stage
    from toolkit.pipeline.train_stage import run
    from toolkit.train.run import Preempted

    def run_unless_preempted(c):
        try:
            return run(c)
        except Preempted as err:
            return err

    result = run_stage(run_unless_preempted, cfg)
    if isinstance(result, Preempted):
        typer.echo(str(result), err=True)
        raise typer.Exit(0)
    return result


@app.command("presets")
def presets(
    name: str = typer.Argument(None, help="Preset to print in full as YAML (omit to list all presets)."),
) -> None:
    """List the reference's published FastCLIP settings (CC3M, CC12M, LAION), or print one as YAML."""
    from toolkit.core.config import dump_yaml
    from toolkit.train.presets import PRESETS

    if name is None:
        width = max(len(n) for n in PRESETS)
        for key, p in PRESETS.items():
            typer.echo(f"{key:<{width}}  {p.loss.name:<12} {p.model:<9} batch {p.batch_size:<5}  {p.description}")
        return
    if name not in PRESETS:
        fail(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    typer.echo(dump_yaml(PRESETS[name]), nl=False)

