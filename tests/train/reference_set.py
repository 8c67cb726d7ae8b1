"""A real training set with a reference model's embeddings per sample, for the objectives that read them
(distill). Imported by bare name (tests/train).

``add_reference(src, dst)`` copies the precomputed set at ``src`` sample for sample into ``dst`` with two more
fields, ``ref_image`` and ``ref_text`` (float16 [d_ref], L2-normalised): what a second cliptk-tiny (its own
random init, seed 1) makes of each sample's pixels and token ids, through the trainer's own model code. The
shards are written by the precompute's ``TrainShardWriter`` (per-sample checksums included), so the loader
reads and verifies them as any other set. It stands in for ``toolkit data precompute --reference-model``
(another branch) in these tests; the batch keys and the fields' roles are that command's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

REFERENCE_MODEL = "cliptk-tiny"


def add_reference(src: Path, dst: Path, seed: int = 1) -> Path:
    """``src``'s samples plus a reference model's embeddings, as a training set in ``dst`` (returned)."""
    from toolkit.core import files
    from toolkit.data.augment import PixelTransform
    from toolkit.data.trainset.format import DATASET_JSON, Field, TrainDataset
    from toolkit.data.trainset.loader import make_reader
    from toolkit.data.trainset.writer import TrainShardWriter
    from toolkit.train import model as model_lib

    ds = TrainDataset.open(str(src))
    reader = make_reader(ds)
    rows = reader.read(np.arange(ds.num_samples, dtype=np.int64))
    reader.close()
    built = model_lib.build(REFERENCE_MODEL, "", ds, 0.07, True, seed)
    # the stored pixels carry the crop margin: the whole image resized to the model's side, no random crop
    size = ds.extra.get("image_size") or rows["image"].shape[1]
    images = PixelTransform(size)(rows["image"], np.arange(ds.num_samples), 0)
    with torch.no_grad():
        towers = built.model.eval()(
            torch.as_tensor(np.ascontiguousarray(images)), torch.from_numpy(rows["tokens"].astype(np.int64))
        )
    ref_image = towers.image_features.to(torch.float16).numpy()
    ref_text = towers.text_features.to(torch.float16).numpy()
    d_ref = ref_image.shape[1]
    fields = [
        *ds.fields,
        Field("ref_image", "ref_img.f16", "float16", (d_ref,)),
        Field("ref_text", "ref_txt.f16", "float16", (d_ref,)),
    ]
    dst.mkdir(parents=True)
    writer = TrainShardWriter(str(dst), fields, ds.samples_per_shard)
    for i in range(ds.num_samples):
        payloads = [np.ascontiguousarray(rows[f.role][i]).astype(f.dtype).tobytes() for f in ds.fields]
        writer.add(i, [*payloads, ref_image[i].tobytes(), ref_text[i].tobytes()], {})
    extra = {
        **ds.extra,
        "reference": {"model": f"{REFERENCE_MODEL} (random init, seed {seed})", "dim": d_ref},
    }
    out = dataclasses.replace(ds, fields=fields, shards=writer.close(), extra=extra, root=str(dst))
    files.write_json_atomic(str(dst / DATASET_JSON), out.to_json())
    return dst
