"""``toolkit data``: from URL lists and local folders to training-ready shards."""

from pathlib import Path
from typing import Annotated

import typer

from toolkit.cli.common import ConfigFile, SetOverrides, fail, load_cli_config, run_stage

app = typer.Typer(help="Fetch, shard, precompute and inspect image-text data.", no_args_is_help=True)

# Options shared by fetch and shard (both write raw shards through img2dataset's resizer).
RawOut = Annotated[str | None, typer.Option("--out", help="Output folder (local or fsspec URL) for the raw shards.")]
CaptionCol = Annotated[str | None, typer.Option(
    "--caption-col", help="Column with the captions; '' for none (default caption).")]
RawImageSize = Annotated[int | None, typer.Option("--image-size", help="Target image side in pixels (default 256).")]
RawResizeMode = Annotated[str | None, typer.Option(
    "--resize-mode", help="border, center_crop, keep_ratio, keep_ratio_largest or no (default border).")]


def _split(text: str | None) -> list[str] | None:
    """'file, ftp' -> ['file', 'ftp'] (None stays None: option not given)."""
    return None if text is None else [part.strip() for part in text.split(",") if part.strip()]


def _reasons(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.get("failed_by_reason", {}).items()) or "none"


@app.command("fetch")
def fetch_cmd(
    ctx: typer.Context,
    urls: Annotated[str | None, typer.Option(
        "--urls", help="URL list: csv, tsv, parquet, jsonl, json or txt (optionally .gz), local or fsspec "
                       "URL, or a folder of them.")] = None,
    out: RawOut = None,
    input_format: Annotated[str | None, typer.Option(
        "--input-format", help="URL list format (default: from the extension).")] = None,
    url_col: Annotated[str | None, typer.Option(
        "--url-col", help="Column with the image URLs (default url).")] = None,
    caption_col: CaptionCol = None,
    image_size: RawImageSize = None,
    resize_mode: RawResizeMode = None,
    samples_per_shard: Annotated[int | None, typer.Option(
        "--samples-per-shard", help="URLs per shard, the unit of resume (default 10000).")] = None,
    num_processes: Annotated[int | None, typer.Option(
        "--processes", help="Download processes (default 1).")] = None,
    num_threads: Annotated[int | None, typer.Option(
        "--threads", help="Download threads per process (default 32).")] = None,
    timeout_s: Annotated[float | None, typer.Option(
        "--timeout", help="Per-request socket timeout in seconds; dead hosts fail as 'timeout' (default "
                          "10).")] = None,
    retries: Annotated[int | None, typer.Option(
        "--retries", help="Extra attempts per failed URL (default 0).")] = None,
    distributor: Annotated[str | None, typer.Option(
        "--distributor", help="multiprocessing, pyspark or ray (default multiprocessing).")] = None,
    run_timeout_s: Annotated[float | None, typer.Option(
        "--run-timeout", help="Stop the whole run after this many seconds; rerun to resume.")] = None,
    overwrite: Annotated[bool | None, typer.Option(
        "--overwrite/--resume", help="Delete the shards already in --out first, or resume them (default "
                                     "resume).")] = None,
    max_bytes: Annotated[int | None, typer.Option(
        "--max-bytes", help="Abort a download larger than this many bytes, counted as too_large (default "
                            "52428800 = 50 MiB).")] = None,
    allow_schemes: Annotated[str | None, typer.Option(
        "--allow-schemes", help="Comma-separated URL schemes to download besides http and https: file, ftp, "
                                "data (default none: such URLs fail as disallowed_scheme).")] = None,
    keep_duplicates: Annotated[bool | None, typer.Option(
        "--keep-duplicates/--skip-duplicates", help="Download every occurrence of a URL, or only the first "
                                                    "(default: skip, counted as duplicate_url).")] = None,
    retry_failed: Annotated[bool | None, typer.Option(
        "--retry-failed", help="Then fetch again the URLs that failed transiently (timeouts, HTTP 5xx/408/429, "
                               "connection errors; not 404s or bad images) into new shards of --out, printing "
                               "the failure counts before and after; rerun to retry what fails again.")] = None,
    config: ConfigFile = None,
    overrides: SetOverrides = None,
) -> None:
    """Download a URL list into raw webdataset shards with img2dataset; rerun to resume.

    More keys (min_image_size, max_aspect_ratio, strict_decode, ...): `toolkit pipeline kinds data.fetch`,
    set them with --set KEY=VALUE.
    """
    from toolkit.data.acquire.fetch import FetchConfig, run, summary_lines

    cfg = load_cli_config(ctx, FetchConfig, config, overrides, urls=urls, out=out, input_format=input_format,
                          url_col=url_col, caption_col=caption_col, image_size=image_size, resize_mode=resize_mode,
                          samples_per_shard=samples_per_shard, num_processes=num_processes, num_threads=num_threads,
                          timeout_s=timeout_s, retries=retries, distributor=distributor,
                          run_timeout_s=run_timeout_s, overwrite=overwrite, max_bytes=max_bytes,
                          allow_schemes=_split(allow_schemes), keep_duplicates=keep_duplicates,
                          retry_failed=retry_failed)
    result = run_stage(run, cfg)
    for line in summary_lines({**result.counts, **result.details}):
        typer.echo(line)
    typer.echo(f"shards in {result.outputs['shards']}")


@app.command("shard")
def shard_cmd(
    ctx: typer.Context,
    source: Annotated[str | None, typer.Option(
        "--source", help="Folder of images with sidecar .txt captions, or a CSV/TSV of "
                         "path,caption.")] = None,
    out: RawOut = None,
    path_col: Annotated[str | None, typer.Option(
        "--path-col", help="CSV column with image paths (default path).")] = None,
    caption_col: CaptionCol = None,
    image_size: RawImageSize = None,
    resize_mode: RawResizeMode = None,
    samples_per_shard: Annotated[int | None, typer.Option(
        "--samples-per-shard", help="Inputs per shard (default 10000).")] = None,
    num_threads: Annotated[int | None, typer.Option(
        "--threads", help="Threads reading and checking images (default 4).")] = None,
    config: ConfigFile = None,
    overrides: SetOverrides = None,
) -> None:
    """Write local images and captions into the same raw shard layout as `fetch`, without downloading."""
    from toolkit.data.acquire.shard import ShardConfig, run

    cfg = load_cli_config(ctx, ShardConfig, config, overrides, source=source, out=out, path_col=path_col,
                          caption_col=caption_col, image_size=image_size, resize_mode=resize_mode,
                          samples_per_shard=samples_per_shard, num_threads=num_threads)
    result = run_stage(run, cfg)
    c = result.counts
    typer.echo(f"{c['num_inputs']} inputs: {c['num_success']} ok, {c['num_failed']} failed ({_reasons(c)}); "
               f"{c['num_shards']} shards in {result.outputs['shards']}")


@app.command("demo")
def demo_cmd(
    ctx: typer.Context,
    out: Annotated[str | None, typer.Option(
        "--out", help="Output folder for the demo set.")] = None,
    limit: Annotated[int | None, typer.Option(
        "--limit", help="Keep this many concepts, spread over all 9 emoji groups (default: all, about "
                        "1,900).")] = None,
    base_url: Annotated[str | None, typer.Option(
        "--base-url", help="URL prefix for *_urls.csv, e.g. http://127.0.0.1:8000/ (default "
                           "file://<OUT>/, which fetch downloads only with --allow-schemes file).")] = None,
    config: ConfigFile = None,
    overrides: SetOverrides = None,
) -> None:
    """Build the emoji demo set: Twemoji (training) and OpenMoji (held-out artist) with Unicode names."""
    from toolkit.data.acquire.demo import DemoConfig, run

    cfg = load_cli_config(ctx, DemoConfig, config, overrides, out=out, limit=limit, base_url=base_url)
    result = run_stage(run, cfg)
    typer.echo(f"{result.counts['num_concepts']} concepts in {result.counts['num_groups']} groups: "
               f"{result.outputs['root']}")
    for key in ("train_urls", "eval_urls", "train_csv", "eval_csv"):
        typer.echo(f"  {key}: {result.outputs[key]}")


@app.command("serve")
def serve_cmd(
    root: Annotated[Path, typer.Argument(help="Folder to serve.", file_okay=False, exists=True)],
    port: Annotated[int, typer.Option("--port", help="Port on 127.0.0.1; 0 picks a free one.", min=0,
                                      max=65535)] = 8000,
) -> None:
    """Serve a folder over HTTP on 127.0.0.1 until Ctrl-C (first line printed: the URL)."""
    from toolkit.data.acquire.serve import make_server

    try:
        server = make_server(str(root), port)
    except OSError as err:
        fail(err.strerror or str(err), code=1)
    typer.echo(f"serving {server.root} at {server.url}", nl=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def _echo_counts(title: str, counts: dict) -> None:
    if counts:
        typer.echo(f"{title}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


def _echo_converted(counts: dict) -> None:
    """'converted to RGB: 3 from mode 'L', 1 from mode '1'' (a bare '1 1' hides which number is the mode)."""
    if counts:
        typer.echo("converted to RGB: " + ", ".join(f"{n} from mode {mode!r}" for mode, n in sorted(counts.items())))


@app.command("precompute")
def precompute_cmd(
    ctx: typer.Context,
    input: Annotated[str | None, typer.Option("--in", help="Raw shards: folder of .tar files, one .tar, glob or "
                                                            "brace pattern; local or fsspec URL. Required (here or "
                                                            "in --config).")] = None,
    out: Annotated[str | None, typer.Option("--out", help="Output folder for training shards (local or fsspec). "
                                                          "Required (here or in --config).")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model name or config JSON: sets image size and "
                                                              "tokenizer, e.g. cliptk-tiny. Required (here or in "
                                                              "--config).")] = None,
    image_size: Annotated[int | None, typer.Option("--image-size", help="Image side in pixels (default 0: the "
                                                                        "model's).")] = None,
    resize_mode: Annotated[str | None, typer.Option("--resize-mode", help="center_crop or pad (white) (default "
                                                                          "center_crop).")] = None,
    samples_per_shard: Annotated[int | None, typer.Option("--samples-per-shard", help="Samples per training "
                                                                                      "shard (default 1000).")] = None,
    num_workers: Annotated[int | None, typer.Option("--workers", help="Worker processes (default 0: one per "
                                                                      "core).")] = None,
    image_tower: Annotated[str | None, typer.Option("--image-tower", help="Store frozen image features instead "
                                                    "of pixels: none, open_clip or efficientnet_lite0 (default "
                                                    "none).")] = None,
    image_tower_model: Annotated[str | None, typer.Option("--image-tower-model", help="open_clip model of the "
                                                                                      "image tower.")] = None,
    image_tower_weights: Annotated[str | None, typer.Option("--image-tower-weights", help="Local weights file "
                                                            "of the image tower (default: packaged or seeded "
                                                            "random).")] = None,
    text_tower: Annotated[str | None, typer.Option("--text-tower", help="Store frozen text features instead of "
                                                                        "tokens: none, open_clip or minilm "
                                                                        "(default none).")] = None,
    text_tower_model: Annotated[str | None, typer.Option("--text-tower-model", help="open_clip model of the "
                                                                                    "text tower.")] = None,
    text_tower_weights: Annotated[str | None, typer.Option("--text-tower-weights", help="Local weights file of "
                                                           "the text tower (default: packaged or seeded "
                                                           "random).")] = None,
    launch_nproc_per_node: Annotated[int | None, typer.Option("--nproc-per-node", help="Processes on this node, "
                                                       "launched by torchrun as `toolkit train` (one per GPU for "
                                                       "frozen towers) (default 1).")] = None,
    launch_nodes: Annotated[str | None, typer.Option("--nodes", help="Number of nodes (default 1).")] = None,
    launch_node_rank: Annotated[int | None, typer.Option("--node-rank", help="This node's rank (default 0).")] = None,
    launch_master_addr: Annotated[str | None, typer.Option("--master-addr", help="Address of node 0 (default "
                                                                          "127.0.0.1).")] = None,
    launch_master_port: Annotated[int | None, typer.Option("--master-port", help="Rendezvous port (default 0: any free "
                                                                          "port on one node, 29500 across "
                                                                          "nodes).")] = None,
    config: ConfigFile = None,
    overrides: SetOverrides = None,
) -> None:
    """Decode, resize and tokenize raw shards into fixed-size training shards with dense sample ids.

    A run that is killed or fails keeps the raw shards it finished; rerunning the same command resumes.
    With --nproc-per-node / --nodes, rank r of K processes raw shards r, r+K, ...; the output is the same.
    """
    from toolkit.data.trainset.precompute import PrecomputeConfig, run

    cfg = load_cli_config(ctx, PrecomputeConfig, config, overrides, input=input, out=out, model=model,
                          image_size=image_size, resize_mode=resize_mode, samples_per_shard=samples_per_shard,
                          num_workers=num_workers, image_tower=image_tower, image_tower_model=image_tower_model,
                          image_tower_weights=image_tower_weights, text_tower=text_tower,
                          text_tower_model=text_tower_model, text_tower_weights=text_tower_weights,
                          **{"launch.nproc_per_node": launch_nproc_per_node, "launch.nodes": launch_nodes,
                             "launch.node_rank": launch_node_rank, "launch.master_addr": launch_master_addr,
                             "launch.master_port": launch_master_port})
    result = run_stage(run, cfg)
    c = result.counts
    if not c:  # a node other than node 0 of a multi-node job: node 0 reports
        typer.echo(f"{result.out}: this node's ranks are done; node 0 wrote the output and its manifest")
        return
    typer.echo(f"{result.out}: {c['num_samples']} samples in {c['num_shards']} shards from {c['num_read']} read "
               f"({c['num_skipped']} skipped), {c['samples_per_s']} samples/s")
    _echo_counts("skipped", c["skipped"])
    _echo_converted(c["converted"])
    for shard, error in (result.details.get("tar_errors") or {}).items():
        typer.echo(f"damaged: {shard}: {error}")


@app.command("inspect")
def inspect_cmd(
    ctx: typer.Context,
    input: Annotated[str, typer.Argument(help="Folder of raw shards or training shards (local or fsspec).",
                                         metavar="directory")],
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

    cfg = load_cli_config(ctx, InspectConfig, config, overrides, input=input,
                          out=out or input.rstrip("/") + "-inspect", num_contact=num_contact,
                          thumb_size=thumb_size, max_samples=max_samples)
    d = run_stage(run, cfg).details
    typer.echo(f"{input}: {d['kind']} shards, {d['num_samples']} samples in {d['num_shards']} shards")
    for source, counts in (d.get("skipped") or {}).items():
        _echo_counts(f"skipped ({source})", {k: v for k, v in counts.items() if not isinstance(v, dict)})
    _echo_converted(d.get("converted") or {})
    for shard, error in (d.get("tar_errors") or {}).items():
        typer.echo(f"damaged: {shard}: {error}")
    peak = max([b["count"] for b in d["caption_words"]] + [1])
    typer.echo("caption length (words):")
    for b in d["caption_words"]:
        typer.echo(f"  {b['words']:>6} {b['count']:>8} {'#' * round(40 * b['count'] / peak)}")
    typer.echo(f"report: {Path(cfg.out) / 'report.json'}" if "://" not in cfg.out else f"report: {cfg.out}")


@app.command("verify")
def verify_cmd(
    ctx: typer.Context,
    input: Annotated[str, typer.Argument(help="Training-shard folder (precompute output; local or fsspec).",
                                         metavar="directory")],
    max_listed: Annotated[int | None, typer.Option("--max-listed", help="Damaged samples listed per shard; "
                                                                        "all are counted (default 20).")] = None,
    config: ConfigFile = None,
    overrides: SetOverrides = None,
) -> None:
    """Read every sample of a training-shard folder: checksums, layout, token ids; list what is damaged.

    Exit code 0 when every sample is intact; 1 when something is damaged (each problem names the shard
    and the sample) or DIRECTORY holds no readable dataset.json. Writes nothing.
    """
    from toolkit.data.trainset.verify import VerifyConfig, run

    cfg = load_cli_config(ctx, VerifyConfig, config, overrides, input=input, max_listed=max_listed)
    result = run_stage(run, cfg)
    checks = "per-sample xxh3-64 checksums" if result.checksums else "no checksums recorded (older precompute)"
    vocab = f", token ids < {result.vocab_size}" if result.vocab_size else ""
    typer.echo(f"{input}: {result.num_samples} samples in {result.num_shards} shards ({checks}, layout{vocab})")
    for line in result.problems:
        typer.echo(f"damaged: {line}")
    if not result.ok:
        fail(f"{result.num_damaged_samples} damaged samples in {len(result.damaged_shards)} of "
             f"{result.num_shards} shards: {', '.join(result.damaged_shards[:10])}", code=1)
    typer.echo("ok: every sample is intact")
