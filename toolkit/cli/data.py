"""``toolkit data``: from URL lists and local folders to training-ready shards."""

import typer

app = typer.Typer(help="Fetch, shard, precompute and inspect image-text data.", no_args_is_help=True)


# ---------------------------------------------------------------- precompute and inspect

from pathlib import Path  # noqa: E402
from typing import Annotated  # noqa: E402

from toolkit.cli.common import ConfigFile, SetOverrides, load_cli_config, run_stage  # noqa: E402


def _echo_counts(title: str, counts: dict) -> None:
    if counts:
        typer.echo(f"{title}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


@app.command("precompute")
def precompute_cmd(
    input_: Annotated[str | None, typer.Option("--in", help="Raw shards: folder of .tar files, one .tar, glob or "
                                                            "brace pattern; local or fsspec URL.")] = None,
    out: Annotated[str | None, typer.Option("--out", help="Output folder for training shards (local or fsspec).")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model name or config JSON: sets image size and "
                                                              "tokenizer, e.g. cliptk-tiny.")] = None,
    image_size: Annotated[int | None, typer.Option("--image-size", help="Image side in pixels (default: the "
                                                                        "model's).")] = None,
    resize_mode: Annotated[str | None, typer.Option("--resize-mode", help="center_crop or pad (white).")] = None,
    samples_per_shard: Annotated[int | None, typer.Option("--samples-per-shard", help="Samples per training "
                                                                                      "shard.")] = None,
    workers: Annotated[int | None, typer.Option("--workers", help="Worker processes (0: one per core).")] = None,
    image_tower: Annotated[str | None, typer.Option("--image-tower", help="Store frozen image features instead "
                                                    "of pixels: none, open_clip or efficientnet_lite0.")] = None,
    image_tower_model: Annotated[str | None, typer.Option("--image-tower-model", help="open_clip model of the "
                                                                                      "image tower.")] = None,
    image_tower_weights: Annotated[str | None, typer.Option("--image-tower-weights", help="Local weights file "
                                                                                          "of the image tower.")] = None,
    text_tower: Annotated[str | None, typer.Option("--text-tower", help="Store frozen text features instead of "
                                                                        "tokens: none or open_clip.")] = None,
    text_tower_model: Annotated[str | None, typer.Option("--text-tower-model", help="open_clip model of the "
                                                                                    "text tower.")] = None,
    text_tower_weights: Annotated[str | None, typer.Option("--text-tower-weights", help="Local weights file of "
                                                                                        "the text tower.")] = None,
    config: ConfigFile = None,
    overrides: SetOverrides = None,
) -> None:
    """Decode, resize and tokenize raw shards into fixed-size training shards with dense sample ids."""
    from toolkit.data.precompute import PrecomputeConfig, run

    cfg = load_cli_config(PrecomputeConfig, config, overrides, input=input_, out=out, model=model,
                          image_size=image_size, resize_mode=resize_mode, samples_per_shard=samples_per_shard,
                          num_workers=workers, image_tower=image_tower, image_tower_model=image_tower_model,
                          image_tower_weights=image_tower_weights, text_tower=text_tower,
                          text_tower_model=text_tower_model, text_tower_weights=text_tower_weights)
    result = run_stage(run, cfg)
    c = result.counts
    typer.echo(f"{result.out}: {c['num_samples']} samples in {c['num_shards']} shards from {c['num_read']} read "
               f"({c['num_skipped']} skipped), {c['samples_per_s']} samples/s")
    _echo_counts("skipped", c["skipped"])
    _echo_counts("converted", c["converted"])


@app.command("inspect")
def inspect_cmd(
    directory: Annotated[str, typer.Argument(help="Folder of raw shards or training shards (local or fsspec).")],
    out: Annotated[str | None, typer.Option("--out", help="Report folder (default: DIRECTORY-inspect beside "
                                                          "it).")] = None,
    num_contact: Annotated[int | None, typer.Option("--num-contact", help="Samples on the contact sheet.")] = None,
    thumb_size: Annotated[int | None, typer.Option("--thumb-size", help="Contact-sheet tile side, pixels.")] = None,
    max_samples: Annotated[int | None, typer.Option("--max-samples", help="Read at most this many samples "
                                                                          "(0: all).")] = None,
    config: ConfigFile = None,
    overrides: SetOverrides = None,
) -> None:
    """Counts, skip reasons, a caption-length histogram and a contact sheet PNG of a shard folder."""
    from toolkit.data.inspect import InspectConfig, run

    cfg = load_cli_config(InspectConfig, config, overrides, input=directory,
                          out=out or directory.rstrip("/") + "-inspect", num_contact=num_contact,
                          thumb_size=thumb_size, max_samples=max_samples)
    d = run_stage(run, cfg).details
    typer.echo(f"{directory}: {d['kind']} shards, {d['num_samples']} samples in {d['num_shards']} shards")
    for source, counts in (d.get("skipped") or {}).items():
        _echo_counts(f"skipped ({source})", {k: v for k, v in counts.items() if not isinstance(v, dict)})
    _echo_counts("converted", d.get("converted") or {})
    for shard, error in (d.get("tar_errors") or {}).items():
        typer.echo(f"damaged: {shard}: {error}")
    peak = max([b["count"] for b in d["caption_words"]] + [1])
    typer.echo("caption length (words):")
    for b in d["caption_words"]:
        typer.echo(f"  {b['words']:>6} {b['count']:>8} {'#' * round(40 * b['count'] / peak)}")
    typer.echo(f"report: {Path(cfg.out) / 'report.json'}" if "://" not in cfg.out else f"report: {cfg.out}")
