"""The registry of stage kinds a pipeline may use: kind name -> where its config class and ``run`` live.

Entries name modules by path ('module:attr') and are imported only when a stage of that kind is
validated or run, so listing kinds (``toolkit pipeline kinds``) imports no stage module. A new stage
registers here with its output keys, which later stages reference as ``${stages.NAME.outputs.KEY}``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StageKind:
    """A registered stage: its config class and run function as 'module:attr' (imported lazily)."""

    config: str
    run: str
    outputs: tuple[str, ...]
    doc: str

    def load(self, attr: str) -> Any:
        module, name = getattr(self, attr).split(":")
        return getattr(importlib.import_module(module), name)


KINDS: dict[str, StageKind] = {
    "shell": StageKind(
        "toolkit.pipeline.shell:ShellConfig",
        "toolkit.pipeline.shell:run",
        ("out",),
        "Any command line (bash -c); outputs are the keys of its `outputs` mapping.",
    ),
    "eval.zeroshot": StageKind(
        "toolkit.eval.zeroshot:ZeroShotConfig",
        "toolkit.eval.zeroshot:run",
        ("results", "report", "chart", "per_dataset"),
        "Zero-shot classification and retrieval of a model on clip-benchmark wds sets.",
    ),
    "eval.build-set": StageKind(
        "toolkit.eval.build:BuildSetConfig",
        "toolkit.eval.build:run",
        ("dataset", "root", "name"),
        "Build an evaluation set (clip-benchmark wds layout) from a folder, CSV, "
        "Fashion-MNIST or the OpenMoji demo.",
    ),
    "data.precompute": StageKind(
        "toolkit.data.trainset.precompute.stage:PrecomputeConfig",
        "toolkit.data.trainset.precompute.stage:run",
        ("train",),
        "Raw shards -> fixed-size training shards with dense sample ids.",
    ),
    "data.inspect": StageKind(
        "toolkit.data.inspect:InspectConfig",
        "toolkit.data.inspect:run",
        ("out", "report", "contact_sheet"),
        "Counts, skip reasons, caption lengths and a contact sheet of a shard folder.",
    ),
    "data.fetch": StageKind(
        "toolkit.data.acquire.fetch_config:FetchConfig",
        "toolkit.data.acquire.fetch:run",
        ("shards",),
        "Download a URL list into raw webdataset shards (img2dataset); resumes.",
    ),
    "data.shard": StageKind(
        "toolkit.data.acquire.shard:ShardConfig",
        "toolkit.data.acquire.shard:run",
        ("shards",),
        "Local images + captions (folder or CSV) into raw shards, no download.",
    ),
    "train": StageKind(
        "toolkit.train.config:TrainConfig",
        "toolkit.trainval.zeroshot:run",
        ("run_dir", "model", "metrics", "checkpoints"),
        "Train a CLIP model (FastCLIP or OpenCLIP loss) on training shards; one process, "
        "several (launch.nproc_per_node) or several nodes.",
    ),
    "data.serve": StageKind(
        "toolkit.data.acquire.serve:ServeConfig",
        "toolkit.data.acquire.serve:run",
        ("url",),
        "Serve a folder on 127.0.0.1 for the rest of the pipeline (fetch over real HTTP); "
        "runs on every pipeline run, writes no manifest.",
    ),
    "data.demo": StageKind(
        "toolkit.data.acquire.demo:DemoConfig",
        "toolkit.data.acquire.demo:run",
        ("train_urls", "eval_urls", "train_csv", "eval_csv", "root"),
        "Emoji demo set: Twemoji (train) and OpenMoji (held-out artist), URL lists and CSVs.",
    ),
    "data.glyphs": StageKind(
        "toolkit.data.acquire.glyphs:GlyphsConfig",
        "toolkit.data.acquire.glyphs:run",
        ("root", "styles", "lookalikes", "characters"),
        "Unicode characters drawn by many fonts (PNGs + one path,caption CSV per style).",
    ),
}
