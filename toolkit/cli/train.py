"""``toolkit train``: the FastCLIP trainer (``toolkit train --data D --out R``) and its presets."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from toolkit.cli.common import ConfigFile, SetOverrides, fail, load_cli_config, score_lines
from toolkit.cli.options import config_parameters, nested_keys_help, with_parameters
from toolkit.train.config import TrainConfig


def objectives() -> str:
    """Every registered objective by its spec's title, in the registry's order: 'A, B or C'."""
    from toolkit.train.losses.registry import specs

    titles = [spec.title or spec.kind for spec in specs().values()]
    return ", ".join(titles[:-1]) + (" or " if len(titles) > 1 else "") + titles[-1]


HELP = "Train CLIP models ({objectives}); `toolkit train presets` lists the published settings."


class _TrainGroup(TyperGroup):
    """``toolkit train``'s command: its help names the objectives registered when Typer builds it (at each
    invocation), so one registered after import is listed too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["help"] = HELP.format(objectives=objectives())
        super().__init__(*args, **kwargs)


app = typer.Typer(cls=_TrainGroup, help=HELP, no_args_is_help=True)

# Every option that sets one config field: {field (dotted for nested ones): its flags}. Type, default and help
# come from the field itself (``config_parameters``), so they live in one place: train/config.py and the
# configs it composes (losses/config.py, optim.py). tests/cli/test_train_flags.py keeps this table honest.
FLAGS: dict[str, tuple[str, ...]] = {
    "data": ("--data",),
    "out": ("--out", "-o"),
    "model": ("--model", "-m"),
    "init": ("--init",),
    "loss.mode": ("--mode",),
    "preset": ("--preset",),
    "batch_size": ("--batch-size", "-b"),
    "epochs": ("--epochs",),
    "steps": ("--steps",),
    "optim.lr": ("--lr",),
    "seed": ("--seed",),
    "precision": ("--precision",),
    "device": ("--device",),
    "micro_batch_size": ("--micro-batch-size",),
    "memory_budget_gb": ("--memory-budget-gb",),
    "checkpoint.resume": ("--resume",),
    "launch.nproc_per_node": ("--nproc-per-node",),
    "launch.nodes": ("--nodes",),
    "launch.node_rank": ("--node-rank",),
    "launch.master_addr": ("--master-addr",),
    "launch.master_port": ("--master-port",),
    "launch.max_restarts": ("--max-restarts",),
    "checkpoint.every_steps": ("--checkpoint-every",),
    "checkpoint.keep": ("--keep-checkpoints",),
    "log_every": ("--log-every",),
    "eval.every_steps": ("--eval-every",),
    "eval.root": ("--eval-root",),
    "eval.datasets": ("--eval-datasets",),
    "loader.num_workers": ("--workers",),
    "grad_checkpointing": ("--grad-checkpointing",),
    "compile": ("--compile",),
    "fsdp": ("--fsdp",),
    "fsdp_cpu_offload": ("--fsdp-cpu-offload",),
    "fsdp_reshard_after_forward": ("--fsdp-reshard-after-forward/--no-fsdp-reshard-after-forward",),
    "report_to": ("--report-to",),
    "lock_image": ("--lock-image",),
    "lock_image_unlocked_groups": ("--lock-image-unlocked-groups",),
    "lock_text": ("--lock-text",),
    "lock_text_unlocked_layers": ("--lock-text-unlocked-layers",),
    "ema_decay": ("--ema-decay",),
    "patch_dropout": ("--patch-dropout",),
    "stages": ("--stages",),
}


def _loss_help() -> str:
    from toolkit.train.losses.choice import describe
    from toolkit.train.losses.registry import loss_names

    return (
        f"The objective: {', '.join(loss_names())} (sets loss.kind and its variant; docs/objectives.md says "
        f"which to pick). (default: {describe()}; a run set by --steps keeps "
        f"loss.fastclip.gamma_decay_epochs' own default)"
    )


@app.callback(invoke_without_command=True, epilog=nested_keys_help(TrainConfig, FLAGS))
@with_parameters(config_parameters(TrainConfig, FLAGS))
def train(
    ctx: typer.Context,
    loss: Annotated[str | None, typer.Option("--loss", help=_loss_help(), show_default=False)] = None,
    config: ConfigFile = None,
    overrides: SetOverrides = None,
    **options: Any,
) -> None:
    """Train on training shards: `toolkit train --data TRAIN_DIR --out RUN_DIR [options]`.

    Every key of the config (`toolkit pipeline kinds train` lists them) can be set with --set KEY=VALUE
    or in --config FILE.yaml. See docs/training.md.
    """
    if ctx.invoked_subcommand is not None:
        return
    from toolkit.train.losses.config import dotted, loss_fields

    split = {}
    if loss is not None:
        try:
            split = dotted(loss_fields(loss), "loss.")
        except ValueError as err:
            fail(f"option --loss: {err}")
    explicit = {key: options[key.replace(".", "_")] for key in FLAGS}
    explicit["micro_batch_size"] = _micro(explicit["micro_batch_size"])
    for key in ("eval.datasets", "report_to"):
        if explicit[key] is not None:
            explicit[key] = [n.strip() for n in explicit[key].split(",") if n.strip()]
    cfg = load_cli_config(
        ctx, TrainConfig, config, overrides, labels={k: "option --loss" for k in split}, **split, **explicit
    )
    result = _run(cfg)
    c = result.counts
    typer.echo(
        f"{cfg.out}: {c.get('step')} steps, {c.get('samples_seen')} samples on {c.get('world_size')} "
        f"rank(s), {c.get('skipped_steps')} skipped"
    )
    if "model" in result.outputs:
        typer.echo(
            f"model: {result.outputs['model']}  (toolkit eval zeroshot --model {result.outputs['model']} ...)"
        )
    for line in score_lines(cfg.out):
        typer.echo(line)


def _micro(value: str | None) -> int | str | None:
    """--micro-batch-size's text as the config's int | 'auto' (anything else is refused by the config)."""
    return int(value) if value is not None and value.strip().isdigit() else value


def _run(cfg):
    """Run the stage (errors exit 1 naming the cause); a run preempted after its checkpoint exits 0."""
    from toolkit.cli.common import run_stage
    from toolkit.train.run import PREEMPTED, preempted_message
    from toolkit.trainval.zeroshot import run

    result = run_stage(run, cfg)
    if result.status == PREEMPTED:
        typer.echo(preempted_message(result.details), err=True)
        raise typer.Exit(0)
    return result


@app.command("presets")
def presets(
    name: str = typer.Argument(None, help="Preset to print in full as YAML (omit to list all presets)."),
) -> None:
    """List the reference's published FastCLIP settings (CC3M, CC12M, LAION), or print one as YAML."""
    from toolkit.core.config import dump_yaml
    from toolkit.train.presets import presets as gathered

    PRESETS = gathered()
    if name is None:
        width = max(len(n) for n in PRESETS)
        for key, p in PRESETS.items():
            typer.echo(
                f"{key:<{width}}  {p.loss.name:<12} {p.model:<9} batch {p.batch_size:<5}  {p.description}"
            )
        return
    if name not in PRESETS:
        fail(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    typer.echo(dump_yaml(PRESETS[name]), nl=False)
