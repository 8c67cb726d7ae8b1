"""``toolkit train``: the FastCLIP trainer and its presets."""

import typer

app = typer.Typer(help="Train CLIP models (FastCLIP, DisCo, ring, gather modes).", no_args_is_help=True)
