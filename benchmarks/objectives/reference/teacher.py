"""The reference (teacher) model: LiT heads trained by cliptk on a subset of the training artists, and the
"reference pass" that embeds every training pair with it (timed: its cost is reported beside the gain).

DRRho-CLIP's setting is a reference that saw less data than the student: here the reference trains on the
training pairs of ``--reference-artists`` only (default: Twemoji, one of the three training artists; never
the held-out artist, never the validation drawings), with the best-tuned OpenCLIP knobs of the convergence
benchmark's short-regime cell of its batch (``--reference-batch``), for ``--reference-epochs`` (default 30,
the long regime's: trained out on its subset, as a model a user already has) over its own subset.

The reference pass runs its heads over the frozen towers' features of every training pair (the LiT
students share those features, so this is all a LiT reference costs at data-prep time). A reference for a
from-scratch student needs the towers too: ``time_towers`` measures EfficientNet-Lite0 and MiniLM on a
sample of drawings and captions, so the report can give both costs in s per 1,000 pairs.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.objectives.convergence import methods as cm
from benchmarks.objectives.convergence.emoji_artists import ENCODE_BATCH
from benchmarks.objectives.convergence.runs import Bench

REFERENCE_SEED = 1000  # the reference's own seed: not one of the students' paired seeds 0..N-1


@dataclass
class Reference:
    """Embeddings float16 [num_train_pairs, d_ref] of every training pair (L2-normalised rows, in the
    training set's row order) and what made them (``meta``: artists, knobs, run curve, costs)."""

    image: np.ndarray
    text: np.ndarray
    meta: dict

    @property
    def signature(self) -> str:
        """A short hash of the embeddings: part of a run-cache key of every run that reads them."""
        return hashlib.sha1(self.image.tobytes() + self.text.tobytes()).hexdigest()[:16]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()  # write whole, then rename: an interrupted run leaves no half file
        np.savez(buf, image=self.image, text=self.text, meta=np.asarray(json.dumps(self.meta)))
        path.with_suffix(".tmp").write_bytes(buf.getvalue())
        path.with_suffix(".tmp").replace(path)

    @classmethod
    def load(cls, path: Path) -> Reference:
        data = np.load(path)
        return cls(data["image"], data["text"], json.loads(str(data["meta"])))


def restrict_training_set(bench: Bench, artists: list[str]) -> int:
    """Keep only the training pairs drawn by ``artists`` in ``bench`` (every mode); returns their number.
    Validation and held-out pairs are untouched (the reference is scored on them, never tuned)."""
    keep = np.asarray([i for i, (a, _, _) in enumerate(bench.data.pairs["train"]) if a in artists])
    if len(keep) == 0:
        raise SystemExit(
            f"--reference-artists {artists}: none of them is a training artist "
            f"({sorted({a for a, _, _ in bench.data.pairs['train']})})"
        )
    for mode, sets in bench.data.sets.items():
        image, text = sets["train"]
        sets["train"] = (image[keep], text[keep])
        bench.tensors[mode]["train"] = tuple(t[keep] for t in bench.tensors[mode]["train"])
    bench.data.pairs["train"] = [bench.data.pairs["train"][i] for i in keep]
    return len(keep)


def embed(model, image, text, chunk: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """L2-normalised embeddings float16 ([n, d_ref], [n, d_ref]) of paired inputs through ``model``'s
    towers."""
    import torch
    from torch.nn.functional import normalize

    model.eval()
    with torch.no_grad():
        x = torch.cat([normalize(model.encode_image(c).float(), dim=-1) for c in image.split(chunk)])
        y = torch.cat([normalize(model.encode_text(c).float(), dim=-1) for c in text.split(chunk)])
    model.train()
    return x.half().numpy(), y.half().numpy()


def train_reference(args: argparse.Namespace, openclip: dict) -> Reference:
    """Train the reference on ``args.reference_artists``' training pairs with ``openclip`` ({"method",
    "fields"}: the best OpenCLIP of the reference batch's cell, its tuned knobs), then run and time the
    reference pass over every training pair (all training artists)."""
    full = Bench(args)  # the students' training set, for the pass (row order = the students' rows)
    bench = Bench(args)
    num_pairs = restrict_training_set(bench, args.reference_artists)
    batch = args.reference_batch
    steps = args.reference_epochs * max(1, num_pairs // batch)
    cfg = cm.loss_config(openclip["fields"], f"reference ({openclip['method']})")
    curve = bench.run("lit", cfg, batch, steps, REFERENCE_SEED)
    model = bench.models[("lit", REFERENCE_SEED, cfg.init_logit_bias is not None)][0].model
    image, text = full.tensors["lit"]["train"]
    embed(model, image[:64], text[:64])  # warm-up, not timed (first-call allocations)
    start = time.perf_counter()
    ref_image, ref_text = embed(model, image, text)
    pass_s = time.perf_counter() - start
    meta = {
        "artists": list(args.reference_artists),
        "num_train_pairs": num_pairs,
        "batch": batch,
        "epochs": args.reference_epochs,
        "steps": steps,
        "seed": REFERENCE_SEED,
        "method": openclip["method"],
        "fields": openclip["fields"],
        "d_ref": int(ref_image.shape[1]),
        "curve": curve,
        "train_wall_s": curve["wall_s"],
        "num_pass_pairs": len(image),
        "heads_pass_s": pass_s,
    }
    return Reference(ref_image, ref_text, meta)


def time_towers(cache: Path, num: int) -> dict:
    """Seconds of the frozen towers (EfficientNet-Lite0 on ``num`` Twemoji drawings decoded to 224 px, MiniLM
    on ``num`` captions), as s per 1,000 pairs: what a reference pass costs beyond the heads when its
    features are not shared with the student's (the from-scratch cell). {} with the reason if a tower is
    missing here (offline)."""
    import torch

    from benchmarks.objectives.convergence import emoji_artists
    from toolkit.data.acquire.demo import load_concepts
    from toolkit.models import frozen

    concepts, _ = load_concepts()
    _, pngs = emoji_artists.drawings("twemoji", concepts[:num], cache)
    captions = [c.caption for c in concepts[:num]]
    try:  # the towers load first, untimed: a data-prep pass loads them once for all pairs
        image_tower, text_tower = (
            frozen.load_image_tower("efficientnet_lite0"),
            frozen.load_text_tower("minilm"),
        )
        start = time.perf_counter()
        _encode(image_tower, pngs)
        image_s = time.perf_counter() - start
        start = time.perf_counter()
        text_tower.encode(captions)
        text_s = time.perf_counter() - start
    except (OSError, RuntimeError) as err:
        return {"error": f"{type(err).__name__}: {err}"[:300]}
    return {
        "num_pairs": len(pngs),
        "image_tower_s": image_s,
        "text_tower_s": text_s,
        "torch_threads": torch.get_num_threads(),
        "towers_s_per_1000_pairs": 1000 * (image_s + text_s) / len(pngs),
    }


def _encode(tower, pngs: list[bytes]) -> None:
    """EfficientNet-Lite0 features of PNG drawings, as ``emoji_artists`` computes the benchmark's (decoded to
    the tower's resolution, normalised, channels-last), with an already loaded tower."""
    import torch

    from toolkit.data.images import decode_rgb

    mean, std = torch.tensor(tower.mean).view(1, 3, 1, 1), torch.tensor(tower.std).view(1, 3, 1, 1)
    for start in range(0, len(pngs), ENCODE_BATCH):
        chunk = pngs[start : start + ENCODE_BATCH]
        pixels = np.stack([decode_rgb(p, tower.image_size)[0] for p in chunk])
        x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float().div_(255)
        x = ((x - mean) / std).contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            tower.forward(x)


def fit_by_artist(
    ref: Reference, pairs: list[tuple[str, int, int]], batch: int, num_batches: int = 200
) -> dict:
    """How well the reference fits each training artist's pairs: {artist: {"num_pairs", "mean_r_ii" (the
    cosine of a pair's own image and text embeddings), "in_batch_i2t_r1" (image→text top-1 among ``batch``
    random training pairs, over ``num_batches`` draws; fixed seed)}}. The reference's own artists against
    the ones it never saw: what its excess loss subtracts."""
    x, y = ref.image.astype(np.float32), ref.text.astype(np.float32)
    artists = np.asarray([a for a, _, _ in pairs])
    rng = np.random.default_rng(0)
    hits: dict[str, list[bool]] = {a: [] for a in dict.fromkeys(artists.tolist())}
    for _ in range(num_batches):
        rows = rng.choice(len(x), min(batch, len(x)), replace=False)
        correct = (x[rows] @ y[rows].T).argmax(1) == np.arange(len(rows))
        for a, ok in zip(artists[rows], correct, strict=True):
            hits[a].append(bool(ok))
    diag = (x * y).sum(1)
    return {
        a: {
            "num_pairs": int((artists == a).sum()),
            "mean_r_ii": float(diag[artists == a].mean()),
            "in_batch_i2t_r1": float(np.mean(h)) if h else None,
        }
        for a, h in hits.items()
    }
