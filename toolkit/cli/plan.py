"""``toolkit plan``: what can I train on what I have? Predicted memory per device and traffic per rank."""

from __future__ import annotations

import typer

from toolkit.cli.common import ConfigFile, SetOverrides, fail, load_cli_config
from toolkit.cli.options import ConfigOptions, config_command

# every PlanConfig field is an option (cli/options.ConfigOptions); these keep their short aliases
PLAN = ConfigOptions(
    "toolkit.train.plan.config:PlanConfig",
    flags={
        "model": ("--model", "-m"),
        "batch_size": ("--batch-size", "-b"),
        "measure": ("--measure/--no-measure",),
    },
)
app = typer.Typer(
    help="Predict per-device memory and per-rank traffic of a training setup, and the largest "
    "batches that fit a device (docs/training.md).",
    cls=config_command(PLAN, group=True),
)
COMMANDS = {"plan": PLAN}


@app.callback(invoke_without_command=True)
def plan(ctx: typer.Context, config: ConfigFile = None, overrides: SetOverrides = None) -> None:
    """Print the predicted memory per device (parameters, gradients, optimizer state, activations of one
    micro-batch, cached features, loss, FastCLIP tables) and bytes each rank sends per step in every mode.

    Example: `toolkit plan --model cliptk-tiny -b 65536 --nodes 2 --nproc-per-node 8 --micro-batch-size 128
    --device-memory-gb 24`. Every key can also be set with --set KEY=VALUE or --config FILE.yaml.
    """
    if ctx.invoked_subcommand is not None:
        return
    from toolkit.train.plan.config import PlanConfig
    from toolkit.train.plan.planner import run
    from toolkit.train.plan.report import format_plan

    cfg = load_cli_config(ctx, PlanConfig, config, overrides, **PLAN.values(ctx))
    try:
        typer.echo(format_plan(run(cfg)))
    except (OSError, RuntimeError, ValueError) as err:
        fail(f"{type(err).__name__}: {err}", code=1)
