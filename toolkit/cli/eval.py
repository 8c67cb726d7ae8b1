"""``toolkit eval``: zero-shot classification and retrieval."""

import typer

app = typer.Typer(help="Evaluate CLIP models zero-shot (clip-benchmark metrics).", no_args_is_help=True)
