"""``toolkit eval``: zero-shot classification and retrieval.

Every option that sets a config field is generated from the field (cli/options.ConfigOptions)."""

from __future__ import annotations

import typer

from toolkit.cli.common import ConfigFile, SetOverrides, load_cli_config, run_stage
from toolkit.cli.options import ConfigOptions, config_command

app = typer.Typer(help="Evaluate CLIP models zero-shot (clip-benchmark metrics).", no_args_is_help=True)

ZEROSHOT = ConfigOptions(
    "toolkit.eval.zeroshot:ZeroShotConfig",
    flags={
        "model": ("--model", "-m"),
        "datasets": ("--datasets", "-d"),
        "out": ("--out", "-o"),
        "batch_size": ("--batch-size", "-b"),
        "num_workers": ("--workers",),
        "amp": ("--amp/--no-amp",),
    },
)
BUILD_SET = ConfigOptions(
    "toolkit.eval.build:BuildSetConfig", flags={"out": ("--out", "-o"), "input": ("--input", "-i")}
)
COMMANDS = {"zeroshot": ZEROSHOT, "build-set": BUILD_SET}


@app.command("zeroshot", cls=config_command(ZEROSHOT))
def zeroshot(ctx: typer.Context, config: ConfigFile = None, overrides: SetOverrides = None) -> None:
    """Evaluate a model on one or more sets; prints the metrics table and writes
    results.json/report.md/PNG."""
    from toolkit.eval.zeroshot import ZeroShotConfig, run

    cfg = load_cli_config(ctx, ZeroShotConfig, config, overrides, **ZEROSHOT.values(ctx))
    result = run_stage(run, cfg)
    from toolkit.core import files

    with files.open_file(result.outputs["report"], "r") as fh:  # out may be an fsspec URL
        typer.echo(fh.read())
    typer.echo(f"results: {result.outputs['results']}\nchart:   {result.outputs['chart']}")


@app.command("build-set", cls=config_command(BUILD_SET))
def build_set(ctx: typer.Context, config: ConfigFile = None, overrides: SetOverrides = None) -> None:
    """Write an evaluation set in clip-benchmark's local wds layout from a folder, CSV or packaged data."""
    from toolkit.eval.build import BuildSetConfig, run

    cfg = load_cli_config(ctx, BuildSetConfig, config, overrides, **BUILD_SET.values(ctx))
    result = run_stage(run, cfg)
    counts = result.counts
    if counts.get("missing_input"):
        typer.echo(f"{cfg.input or cfg.source}: not found: no set built (--missing-ok)")
        return
    kind = (
        "retrieval pairs"
        if result.details.get("task") == "retrieval"
        else f"samples in {counts['num_classes']} classes"
    )
    typer.echo(
        f"{result.outputs['dataset']}: {counts['num_samples']} {kind}, {counts['num_shards']} shard(s)"
    )
    for reason, num in counts["left_out"].items():
        typer.echo(f"left out {num} row(s): {reason}")
    typer.echo(
        f"evaluate with: toolkit eval zeroshot --root {result.outputs['root']} "
        f"--datasets {result.outputs['name']} --model MODEL --out DIR"
    )
