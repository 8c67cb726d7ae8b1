"""``toolkit train``: the FastCLIP trainer and its presets."""


import typer

app = typer.Typer(help="Training: FastCLIP presets.", no_args_is_help=True)


@app.command("presets")
def presets(
    name: str = typer.Argument(None, help="Preset to print in full as YAML (omit to list all presets)."),
) -> None:
    """List the reference's published FastCLIP settings (CC3M, CC12M, LAION), or print one as YAML."""
    from toolkit.cli.common import fail
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
