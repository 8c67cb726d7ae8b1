"""``toolkit data``: from URL lists and local folders to training-ready shards.

Every option that sets a stage's config field is generated from the field (cli/options.ConfigOptions): the
flags below only name the fields whose flag is not ``--field-name``.
"""

from pathlib import Path
from typing import Annotated

import typer

from toolkit.cli.common import ConfigFile, SetOverrides, fail, load_cli_config, run_stage
from toolkit.cli.options import ConfigOptions, config_command

app = typer.Typer(help="Fetch, shard, precompute and inspect image-text data.", no_args_is_help=True)

FETCH = ConfigOptions(
    "toolkit.data.acquire.fetch_config:FetchConfig",
    flags={
        "num_processes": ("--processes",),
        "num_threads": ("--threads",),
        "timeout_s": ("--timeout",),
        "run_timeout_s": ("--run-timeout",),
        "overwrite": ("--overwrite/--resume",),
        "keep_duplicates": ("--keep-duplicates/--skip-duplicates",),
    },
)
SHARD = ConfigOptions("toolkit.data.acquire.shard:ShardConfig", flags={"num_threads": ("--threads",)})
DEMO = ConfigOptions("toolkit.data.acquire.demo:DemoConfig")
GLYPHS = ConfigOptions("toolkit.data.acquire.glyphs:GlyphsConfig")
PRECOMPUTE = ConfigOptions(
    "toolkit.data.trainset.precompute.stage:PrecomputeConfig",
    flags={
        "input": ("--in",),
        "num_workers": ("--workers",),
        # launched by torchrun as `toolkit train` is: the same flags (docs/data-format.md, distributed
        # precompute)
        "launch.nproc_per_node": ("--nproc-per-node",),
        "launch.nodes": ("--nodes",),
        "launch.node_rank": ("--node-rank",),
        "launch.master_addr": ("--master-addr",),
        "launch.master_port": ("--master-port",),
    },
)
# the folder is an argument; inspect's report folder defaults to one beside it (the command decides that)
INSPECT = ConfigOptions("toolkit.data.inspect:InspectConfig", exclude=("input", "out"))
VERIFY = ConfigOptions("toolkit.data.trainset.verify:VerifyConfig", exclude=("input",))
COMMANDS = {
    "fetch": FETCH,
    "shard": SHARD,
    "demo": DEMO,
    "glyphs": GLYPHS,
    "precompute": PRECOMPUTE,
    "inspect": INSPECT,
    "verify": VERIFY,
}


def _reasons(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.get("failed_by_reason", {}).items()) or "none"


@app.command("fetch", cls=config_command(FETCH))
def fetch_cmd(ctx: typer.Context, config: ConfigFile = None, overrides: SetOverrides = None) -> None:
    """Download a URL list into raw webdataset shards with img2dataset; rerun to resume."""
    from toolkit.data.acquire.fetch import run
    from toolkit.data.acquire.fetch_config import FetchConfig
    from toolkit.data.acquire.fetch_summary import summary_lines

    cfg = load_cli_config(ctx, FetchConfig, config, overrides, **FETCH.values(ctx))
    result = run_stage(run, cfg)
    for line in summary_lines({**result.counts, **result.details}):
        typer.echo(line)
    typer.echo(f"shards in {result.outputs['shards']}")


@app.command("shard", cls=config_command(SHARD))
def shard_cmd(ctx: typer.Context, config: ConfigFile = None, overrides: SetOverrides = None) -> None:
    """Write local images and captions into the same raw shard layout as `fetch`, without downloading."""
    from toolkit.data.acquire.shard import ShardConfig, run

    cfg = load_cli_config(ctx, ShardConfig, config, overrides, **SHARD.values(ctx))
    result = run_stage(run, cfg)
    c = result.counts
    typer.echo(
        f"{c['num_inputs']} inputs: {c['num_success']} ok, {c['num_failed']} failed ({_reasons(c)}); "
        f"{c['num_shards']} shards in {result.outputs['shards']}"
    )


@app.command("demo", cls=config_command(DEMO))
def demo_cmd(ctx: typer.Context, config: ConfigFile = None, overrides: SetOverrides = None) -> None:
    """Build the emoji demo set: Twemoji (training) and OpenMoji (held-out artist) with Unicode names."""
    from toolkit.data.acquire.demo import DemoConfig, run

    cfg = load_cli_config(ctx, DemoConfig, config, overrides, **DEMO.values(ctx))
    result = run_stage(run, cfg)
    typer.echo(
        f"{result.counts['num_concepts']} concepts in {result.counts['num_groups']} groups: "
        f"{result.outputs['root']}"
    )
    for key in ("train_urls", "eval_urls", "train_csv", "eval_csv"):
        typer.echo(f"  {key}: {result.outputs[key]}")


@app.command("glyphs", cls=config_command(GLYPHS))
def glyphs_cmd(ctx: typer.Context, config: ConfigFile = None, overrides: SetOverrides = None) -> None:
    """Draw Unicode characters in many fonts (matplotlib's and --fonts) as PNGs with their Unicode names."""
    from toolkit.data.acquire.glyphs import GlyphsConfig, run

    cfg = load_cli_config(ctx, GlyphsConfig, config, overrides, **GLYPHS.values(ctx))
    result = run_stage(run, cfg)
    c = result.counts
    typer.echo(
        f"{c['num_characters']} characters, {c['num_pairs']} pairs in {c['num_styles']} styles "
        f"({c['num_lookalike_characters']} characters drawn identically to another by some style): "
        f"{result.outputs['root']}"
    )
    for style, n in result.details["styles"].items():
        typer.echo(f"  {style}: {n}")


@app.command("serve")
def serve_cmd(
    root: Annotated[Path, typer.Argument(help="Folder to serve.", file_okay=False, exists=True)],
    port: Annotated[
        int, typer.Option("--port", help="Port on 127.0.0.1; 0 picks a free one.", min=0, max=65535)
    ] = 8000,
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
        typer.echo(
            "converted to RGB: " + ", ".join(f"{n} from mode {mode!r}" for mode, n in sorted(counts.items()))
        )


def _reference_line(info: dict, num_bytes: int) -> str:
    """'reference: MODEL, d_ref 512, 224 px, 3,072 bytes per sample' (dataset.json's extra.reference)."""
    size = (info.get("preprocess") or {}).get("size")
    return (
        f"reference: {info.get('model')} (weights sha256 {str(info.get('weights_sha256'))[:12]}), d_ref "
        f"{info.get('dim')}, {size} px, {num_bytes:,} bytes per sample for its embeddings"
    )


@app.command("precompute", cls=config_command(PRECOMPUTE))
def precompute_cmd(ctx: typer.Context, config: ConfigFile = None, overrides: SetOverrides = None) -> None:
    """Decode, resize and tokenize raw shards into fixed-size training shards with dense sample ids.

    A run that is killed or fails keeps the raw shards it finished; rerunning the same command resumes.
    With --nproc-per-node / --nodes, rank r of K processes raw shards r, r+K, ...; the output is the same.
    """
    from toolkit.data.trainset.precompute.stage import PrecomputeConfig, run

    cfg = load_cli_config(ctx, PrecomputeConfig, config, overrides, **PRECOMPUTE.values(ctx))
    result = run_stage(run, cfg)
    c = result.counts
    if not c:  # a node other than node 0 of a multi-node job: node 0 reports
        typer.echo(f"{result.out}: this node's ranks are done; node 0 wrote the output and its manifest")
        return
    typer.echo(
        f"{result.out}: {c['num_samples']} samples in {c['num_shards']} shards from {c['num_read']} read "
        f"({c['num_skipped']} skipped), {c['samples_per_s']} samples/s"
    )
    reference_s = (result.details.get("throughput") or {}).get("reference_s")
    if reference_s is not None:  # what --reference-model cost (summed over the workers)
        typer.echo(
            f"reference pass: {reference_s} s of worker time, "
            f"{1000 * reference_s / max(c['num_read'], 1):.1f} s per 1,000 samples read"
        )
    _echo_counts("skipped", c["skipped"])
    for reason, first in (result.details.get("skipped_first") or {}).items():  # why, in the skip's own words
        typer.echo(f"  {reason}, e.g. {first[:300]}")
    _echo_converted(c["converted"])
    if c.get("num_captions_cut"):  # kept, but the text past the context is not trained on
        typer.echo(
            f"captions cut at the model's context length: {c['num_captions_cut']} of {c['num_samples']} "
            "(only their first tokens are stored; a model with a longer context keeps more)"
        )
    for shard, error in (result.details.get("tar_errors") or {}).items():
        typer.echo(f"damaged: {shard}: {error}")


@app.command("inspect", cls=config_command(INSPECT))
def inspect_cmd(
    ctx: typer.Context,
    input: Annotated[
        str,
        typer.Argument(
            help="Folder of raw shards or training shards (local or fsspec).", metavar="directory"
        ),
    ],
    out: Annotated[
        str | None, typer.Option("--out", help="Report folder (default: DIRECTORY-inspect beside it).")
    ] = None,
    config: ConfigFile = None,
    overrides: SetOverrides = None,
) -> None:
    """Counts, skip reasons, a caption-length histogram and a contact sheet PNG of a shard folder."""
    from toolkit.data.inspect import InspectConfig, run

    cfg = load_cli_config(
        ctx,
        InspectConfig,
        config,
        overrides,
        input=input,
        out=out or input.rstrip("/") + "-inspect",
        **INSPECT.values(ctx),
    )
    d = run_stage(run, cfg).details
    typer.echo(f"{input}: {d['kind']} shards, {d['num_samples']} samples in {d['num_shards']} shards")
    if "storage" in d:
        typer.echo(f"storage: {d['storage']}, {d['bytes_per_sample']:,} bytes per sample on disk")
    if d.get("reference"):
        typer.echo(_reference_line(d["reference"], d["reference_bytes_per_sample"]))
    for source, counts in (d.get("skipped") or {}).items():
        _echo_counts(f"skipped ({source})", {k: v for k, v in counts.items() if not isinstance(v, dict)})
    _echo_converted(d.get("converted") or {})
    for shard, error in (d.get("tar_errors") or {}).items():
        typer.echo(f"damaged: {shard}: {error}")
    _echo_counts(f"no caption (--caption-ext {cfg.caption_ext})", d.get("caption_problems") or {})
    peak = max([b["count"] for b in d["caption_words"]] + [1])
    typer.echo("caption length (words):")
    for b in d["caption_words"]:
        typer.echo(f"  {b['words']:>6} {b['count']:>8} {'#' * round(40 * b['count'] / peak)}")
    typer.echo(f"report: {Path(cfg.out) / 'report.json'}" if "://" not in cfg.out else f"report: {cfg.out}")


@app.command("verify", cls=config_command(VERIFY))
def verify_cmd(
    ctx: typer.Context,
    input: Annotated[
        str,
        typer.Argument(
            help="Training-shard folder (precompute output; local or fsspec).", metavar="directory"
        ),
    ],
    config: ConfigFile = None,
    overrides: SetOverrides = None,
) -> None:
    """Read every sample of a training-shard folder: checksums, layout, token ids; list what is damaged.

    Exit code 0 when every sample is intact; 1 when something is damaged (each problem names the shard
    and the sample) or DIRECTORY holds no readable dataset.json. Writes nothing.
    """
    from toolkit.data.trainset.verify import VerifyConfig, run

    cfg = load_cli_config(ctx, VerifyConfig, config, overrides, input=input, **VERIFY.values(ctx))
    result = run_stage(run, cfg)
    checks = (
        "per-sample xxh3-64 checksums" if result.checksums else "no checksums recorded (older precompute)"
    )
    vocab = f", token ids < {result.vocab_size}" if result.vocab_size else ""
    typer.echo(
        f"{input}: {result.num_samples} samples in {result.num_shards} shards ({checks}, layout{vocab})"
    )
    if result.reference:
        typer.echo(_reference_line(result.reference, result.reference_bytes))
    for line in result.problems:
        typer.echo(f"damaged: {line}")
    if not result.ok:
        fail(
            f"{result.num_damaged_samples} damaged samples in {len(result.damaged_shards)} of "
            f"{result.num_shards} shards: {', '.join(result.damaged_shards[:10])}",
            code=1,
        )
    typer.echo("ok: every sample is intact")
