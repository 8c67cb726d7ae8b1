"""``toolkit eval``: zero-shot classification and retrieval."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from toolkit.cli.common import ConfigFile, SetOverrides, load_cli_config, run_stage

app = typer.Typer(help="Evaluate CLIP models zero-shot (clip-benchmark metrics).", no_args_is_help=True)


@app.command("zeroshot")
def zeroshot(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option("--model", "-m", help="Checkpoint directory (open_clip_config.json "
                                              "+ weights), open_clip model name (cliptk-tiny, ViT-B-32) or "
                                              "config JSON.")] = None,
    datasets: Annotated[str | None, typer.Option("--datasets", "-d", help="Comma-separated set names under "
                                                 "--root, e.g. fashion-mnist,openmoji-retrieval.")] = None,
    root: Annotated[Path | None, typer.Option("--root", help="Folder holding the sets (clip-benchmark wds "
                                              "layout: NAME/test/nshards.txt, NAME/test/0.tar, ...).")] = None,
    out: Annotated[str | None, typer.Option(
        "--out", "-o", help="Output folder (local or fsspec URL) for results.json, report.md, results.png and "
                            "the manifest.")] = None,
    weights: Annotated[Path | None, typer.Option("--weights", help="Local weights file (.safetensors/.pt/.bin) "
                                                 "for a model name or config JSON; none: random init.")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", "-b", help="Images per batch (default 64).")] = None,
    num_workers: Annotated[int | None, typer.Option("--workers", help="DataLoader worker processes (default 0).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="auto (default), cpu, cuda or cuda:N.")] = None,
    amp: Annotated[bool | None, typer.Option("--amp/--no-amp", help="Autocast forward passes (default off).")] = None,
    precision: Annotated[str | None, typer.Option("--precision", help="fp32 (default), bf16, fp16, pure_bf16, "
                                                  "pure_fp16.")] = None,
    skip_missing: Annotated[bool | None, typer.Option("--skip-missing", help="Report sets with no folder under "
                                                      "--root as not evaluated instead of failing.")] = None,
    config: ConfigFile = None,
    overrides: SetOverrides = None,
) -> None:
    """Evaluate a model on one or more sets; prints the metrics table and writes results.json/report.md/PNG."""
    from toolkit.eval.zeroshot import ZeroShotConfig, run

    names = [n.strip() for n in datasets.split(",") if n.strip()] if datasets is not None else None
    cfg = load_cli_config(ctx, ZeroShotConfig, config, overrides, model=model, datasets=names,
                          root=str(root) if root else None, out=out,
                          weights=str(weights) if weights else None, batch_size=batch_size, num_workers=num_workers,
                          device=device, amp=amp, precision=precision, skip_missing=skip_missing)
    result = run_stage(run, cfg)
    from toolkit.core import files

    with files.open_file(result.outputs["report"], "r") as fh:  # out may be an fsspec URL
        typer.echo(fh.read())
    typer.echo(f"results: {result.outputs['results']}\nchart:   {result.outputs['chart']}")


@app.command("build-set")
def build_set(
    ctx: typer.Context,
    source: Annotated[str | None, typer.Option("--source", help="folder, csv, fashion-mnist or openmoji.")] = None,
    out: Annotated[str | None, typer.Option("--out", "-o", help="Folder of the new set (ROOT/NAME).")] = None,
    input: Annotated[Path | None, typer.Option("--input", "-i", help="Class-per-subfolder folder, CSV file, "
                                               "Fashion-MNIST folder, or `toolkit data demo` output folder.")] = None,
    task: Annotated[str | None, typer.Option("--task", help="classification (default) or retrieval.")] = None,
    classnames: Annotated[Path | None, typer.Option("--classnames", help="File: one class name per line.")] = None,
    templates: Annotated[Path | None, typer.Option("--templates", help="File: prompt templates with {c}, one "
                                                   "per line.")] = None,
    image_column: Annotated[str | None, typer.Option("--image-column", help="CSV image path column "
                                                     "(default image).")] = None,
    label_column: Annotated[str | None, typer.Option("--label-column", help="CSV label column "
                                                     "(default label).")] = None,
    caption_column: Annotated[str | None, typer.Option("--caption-column", help="CSV caption column "
                                                       "(default caption).")] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Keep the first N samples (default all).")] = None,
    missing_ok: Annotated[bool | None, typer.Option("--missing-ok", help="A missing --input is not an error: "
                                                    "no set is built (for optional sets like Fashion-MNIST).")] = None,
    config: ConfigFile = None,
    overrides: SetOverrides = None,
) -> None:
    """Write an evaluation set in clip-benchmark's local wds layout from a folder, CSV or packaged data."""
    from toolkit.eval.build import BuildSetConfig, run

    cfg = load_cli_config(ctx, BuildSetConfig, config, overrides, source=source, out=out,
                          input=str(input) if input else None, task=task,
                          classnames=str(classnames) if classnames else None,
                          templates=str(templates) if templates else None, image_column=image_column,
                          label_column=label_column, caption_column=caption_column, limit=limit,
                          missing_ok=missing_ok)
    result = run_stage(run, cfg)
    counts = result.counts
    if counts.get("missing_input"):
        typer.echo(f"{cfg.input or cfg.source}: not found: no set built (--missing-ok)")
        return
    kind = "retrieval pairs" if result.details.get("task") == "retrieval" else f"samples in {counts['num_classes']} classes"
    typer.echo(f"{result.outputs['dataset']}: {counts['num_samples']} {kind}, {counts['num_shards']} shard(s)")
    for reason, num in counts["left_out"].items():
        typer.echo(f"left out {num} row(s): {reason}")
    typer.echo(f"evaluate with: toolkit eval zeroshot --root {result.outputs['root']} "
               f"--datasets {result.outputs['name']} --model MODEL --out DIR")
