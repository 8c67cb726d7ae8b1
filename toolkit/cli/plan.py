"""``toolkit plan``: what can I train on what I have? Predicted memory per device and traffic per rank."""

from __future__ import annotations

from typing import Annotated

import typer

from toolkit.cli.common import ConfigFile, SetOverrides, fail, load_cli_config

app = typer.Typer(help="Predict per-device memory and per-rank traffic of a training setup, and the largest "
                       "batches that fit a device (docs/training.md).")

Opt = typer.Option


@app.callback(invoke_without_command=True)
def plan(
    ctx: typer.Context,
    model: Annotated[str | None, Opt("--model", "-m", help="open_clip model name, config JSON or checkpoint "
                                     "directory (default cliptk-tiny).")] = None,
    batch_size: Annotated[int | None, Opt("--batch-size", "-b", help="GLOBAL batch over all ranks (default "
                                          "4096).")] = None,
    nodes: Annotated[int | None, Opt("--nodes", help="Nodes (default 1).")] = None,
    nproc_per_node: Annotated[int | None, Opt("--nproc-per-node", help="Processes (devices) per node "
                                              "(default 1).")] = None,
    mode: Annotated[str | None, Opt("--mode", help="Distributed mode whose loss memory is tabled: gather, "
                                    "disco, ring or fastclip (default; traffic is printed for every mode).")] = None,
    loss: Annotated[str | None, Opt("--loss", help="openclip, fastclip-v0..v3 (default fastclip-v3), siglip or "
                                    "neuclip (FastCLIP and NeuCLIP run in the fastclip mode).")] = None,
    micro_batch_size: Annotated[int | None, Opt("--micro-batch-size", help="Gradient-cache micro-batch per "
                                                "rank (0 default: off, the whole local batch).")] = None,
    precision: Annotated[str | None, Opt("--precision", help="fp32 (default), bf16 or fp16 autocast.")] = None,
    optimizer: Annotated[str | None, Opt("--optimizer", help="adamw (default; 2 moments), lamb (2), lion (1) "
                                         "or sgd (1, momentum).")] = None,
    grad_dtype: Annotated[str | None, Opt("--grad-dtype", help="DDP gradient all_reduce dtype: fp32 (default) "
                                          "or bf16.")] = None,
    device: Annotated[str | None, Opt("--device", help="cuda (default; the batch is offloaded with the "
                                      "cache) or cpu (FastCLIP tables count).")] = None,
    num_samples: Annotated[int | None, Opt("--num-samples", help="Dataset size N for FastCLIP's per-sample "
                                           "tables (default 3000000).")] = None,
    device_memory_gb: Annotated[float | None, Opt("--device-memory-gb", help="Also print the largest "
                                                  "micro-batch and global batches that fit this many GiB "
                                                  "per device.")] = None,
    measure: Annotated[bool | None, Opt("--measure/--no-measure", help="Measure the model's activation "
                                        "memory now (CPU: two fresh subprocesses) instead of using the "
                                        "shipped table.")] = None,
    text_tokens: Annotated[int | None, Opt("--text-tokens", help="Tokens per caption the text tower runs on: "
                                           "your data's longest caption (the trainer cuts each batch after "
                                           "its longest); needs --measure. Default 0: the full context, the "
                                           "worst case.")] = None,
    grad_checkpointing: Annotated[bool | None, Opt("--grad-checkpointing/--no-grad-checkpointing",
                                                   help="Activations with `toolkit train --grad-checkpointing` "
                                                   "(default off).")] = None,
    config: ConfigFile = None,
    overrides: SetOverrides = None,
) -> None:
    """Print the predicted memory per device (parameters, gradients, optimizer state, activations of one
    micro-batch, cached features, loss, FastCLIP tables) and bytes each rank sends per step in every mode.

    Example: `toolkit plan --model cliptk-tiny -b 65536 --nodes 2 --nproc-per-node 8 --micro-batch-size 128
    --device-memory-gb 24`. Every key can also be set with --set KEY=VALUE or --config FILE.yaml.
    """
    if ctx.invoked_subcommand is not None:
        return
    from toolkit.train.plan import PlanConfig, format_plan, run

    cfg = load_cli_config(ctx, PlanConfig, config, overrides, model=model, batch_size=batch_size, nodes=nodes,
                          nproc_per_node=nproc_per_node, mode=mode, loss=loss, micro_batch_size=micro_batch_size,
                          precision=precision, optimizer=optimizer, grad_dtype=grad_dtype, device=device,
                          num_samples=num_samples, device_memory_gb=device_memory_gb, measure=measure,
                          text_tokens=text_tokens, grad_checkpointing=grad_checkpointing)
    try:
        typer.echo(format_plan(run(cfg)))
    except (OSError, RuntimeError, ValueError) as err:
        fail(f"{type(err).__name__}: {err}", code=1)
