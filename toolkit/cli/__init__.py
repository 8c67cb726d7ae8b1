"""Typer apps, one module per command group. Commands stay thin: build the config, call run(), print."""
