"""``toolkit data``: from URL lists and local folders to training-ready shards."""

import typer

app = typer.Typer(help="Fetch, shard, precompute and inspect image-text data.", no_args_is_help=True)
