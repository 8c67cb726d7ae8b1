"""``toolkit export RUN --out DIR``: a finished training run as an open_clip folder with a model card."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from toolkit.cli.common import fail


def export(
    ctx: typer.Context,
    run: Annotated[
        Path, typer.Argument(metavar="RUN", help="The training run directory (toolkit train --out).")
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="The folder to write: new, empty or an earlier "
            "export's (replaced); never RUN, a folder holding it or inside it.",
        ),
    ],
    weights: Annotated[
        str,
        typer.Option(
            "--weights", help="raw: RUN/model (default); ema: RUN/model-ema (runs trained with --ema-decay)."
        ),
    ] = "raw",
) -> None:
    """Write open_clip_config.json, the safetensors weights, the tokenizer and a model card (README.md with
    the training config, the data set's size and fingerprint, the evaluation results) into DIR; open_clip
    loads it offline with create_model_and_transforms('local-dir:DIR') and get_tokenizer('local-dir:DIR')."""
    from toolkit.cli.common import load_cli_config, run_stage
    from toolkit.train import export as stage

    cfg = load_cli_config(ctx, stage.ExportConfig, None, None, run=str(run), out=str(out), weights=weights)
    try:
        facts = run_stage(stage.run, cfg)
    except (OSError, ValueError) as err:
        fail(f"{type(err).__name__}: {err}", code=1)
    typer.echo(
        f"{out}: {facts['model']} ({facts['weights']} weights), tokenizer: {facts['tokenizer']}; "
        f"open_clip.create_model_and_transforms('local-dir:{out}')"
    )
