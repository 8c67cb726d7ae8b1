"""A retrieval gallery: a few of a retrieval set's captions, the 5 images the model ranks first for each,
the right image framed in green (or shown at the end of the row with its rank when it is not among them).

:class:`Recorder` wraps the model and loader clip-benchmark drives, keeping the embeddings it computes, so
the gallery costs no second pass over the set. Called by ``eval.zeroshot`` on the process that evaluates.
"""

from __future__ import annotations

import io
import textwrap
from typing import Any

import numpy as np

from toolkit.core import files

THUMB_PX = 96
CAPTION_PX = 260
GREEN, GREY = (26, 152, 80), (200, 200, 200)


class Recorder:
    """Passes ``encode_image``/``encode_text`` through to ``model`` and keeps their outputs ([n, E] float32,
    in call order), and keeps each batch's caption lists (and image SHA-1 digests, when the loader yields
    them) when iterating :meth:`loader`."""

    def __init__(self, model: Any):
        self.model, self.images, self.texts, self.captions = model, [], [], []
        self.digests: list[str] = []

    def encode_image(self, x: Any) -> Any:
        out = self.model.encode_image(x)
        self.images.append(out.detach().float().cpu().numpy())
        return out

    def encode_text(self, tokens: Any) -> Any:
        out = self.model.encode_text(tokens)
        self.texts.append(out.detach().float().cpu().numpy())
        return out

    def loader(self, loader: Any) -> Any:
        recorder = self

        class _View:
            dataset = loader.dataset

            def __iter__(self):
                # Several DataLoader workers interleave their shards' batches: the read order is not the
                # shards' order, so each image is identified by its digest (from the batch, or from a
                # loader that recorded them, as the tower cache's does), not by its position in the tars.
                for images, captions, *digests in loader:
                    recorder.captions.extend(captions)
                    recorder.digests.extend(digests[0] if digests else [])
                    yield images, captions
                if not recorder.digests and getattr(loader, "digests", None):
                    recorder.digests = list(loader.digests)

        return _View()


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def rank_queries(
    image_emb: np.ndarray, text_emb: np.ndarray, caption_owner: np.ndarray, queries: list[int], k: int
) -> list[tuple[list[int], int]]:
    """For each query caption index: (the k best image indices, the rank of its own image, 1-based)."""
    sims = _unit(text_emb[queries]) @ _unit(image_emb).T  # [q, N]
    out = []
    for row, q in zip(sims, queries, strict=True):
        order = np.argsort(-row, kind="stable")
        out.append((order[:k].tolist(), int(np.nonzero(order == caption_owner[q])[0][0]) + 1))
    return out


def recorded_images(recorder: Recorder, shards: tuple[str, ...], wanted: set[int]) -> dict[int, bytes]:
    """Image bytes of the images the evaluation read at positions ``wanted``: found by SHA-1 digest when the
    recorder has them (any read order), else by position in the shards (a single-worker, in-order read)."""
    import hashlib

    import webdataset as wds

    from toolkit.eval.datasets import SET_IMAGE_EXTS

    by_digest: dict[str, list[int]] | None = {} if recorder.digests else None
    for i in sorted(wanted) if by_digest is not None else ():
        by_digest.setdefault(recorder.digests[i], []).append(i)  # the same bytes may be several samples
    found: dict[int, bytes] = {}
    for i, sample in enumerate(wds.WebDataset(list(shards), shardshuffle=False, empty_check=False)):
        data = next((sample[e] for e in SET_IMAGE_EXTS if e in sample), None)
        if by_digest is None:
            found.update({i: data} if i in wanted and data is not None else {})
        elif data is not None:
            found.update({at: data for at in by_digest.pop(hashlib.sha1(data).hexdigest(), [])})
        if len(found) == len(wanted):
            break
    return found


def _thumb(data: bytes) -> Any:
    from PIL import Image

    from toolkit.data.images import open_rgb

    return open_rgb(data).resize((THUMB_PX, THUMB_PX), Image.Resampling.LANCZOS)


def draw(rows: list[tuple[str, list[int], int, int]], pictures: dict[int, bytes], title: str) -> bytes:
    """PNG bytes: one row per (caption, top-k image ids, rank of the right image, right image id)."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    k = max(len(r[1]) for r in rows)
    pad, cell = 8, THUMB_PX + 12
    width, height = CAPTION_PX + (k + 1) * cell + pad * 2, 30 + len(rows) * (cell + 14) + pad
    img = Image.new("RGB", (width, height), "white")
    pen = ImageDraw.Draw(img)
    pen.text((pad, pad), title[:150], fill="black", font=font)
    for r, (caption, top, rank, right) in enumerate(rows):
        y = 30 + r * (cell + 14)
        pen.text((pad, y + 6), "\n".join(textwrap.wrap(caption, 40)[:5]), fill="black", font=font)
        pen.text(
            (pad, y + cell - 14), f"right image: rank {rank}", fill=GREEN if rank <= k else "black", font=font
        )
        for j, idx in enumerate(top):
            x = CAPTION_PX + j * cell
            pen.rectangle(
                [x, y, x + cell - 4, y + cell - 4],
                outline=GREEN if idx == right else GREY,
                width=5 if idx == right else 1,
            )
            img.paste(_thumb(pictures[idx]), (x + 4, y + 4))
        if rank > k:  # the right image, after a gap, so the reader sees what was missed
            x = CAPTION_PX + k * cell + 4
            pen.rectangle([x, y, x + cell - 4, y + cell - 4], outline=GREEN, width=2)
            img.paste(_thumb(pictures[right]), (x + 4, y + 4))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def write_gallery(
    recorder: Recorder, eval_set: Any, path: str, num_queries: int = 5, k: int = 5, title: str = ""
) -> dict[str, Any]:
    """Draw the gallery of ``num_queries`` captions spread evenly over the set to ``path`` (PNG); returns
    the queries and ranks (for the report). Needs the recorder of a whole retrieval evaluation."""
    image_emb, text_emb = np.concatenate(recorder.images), np.concatenate(recorder.texts)
    captions = [c for caps in recorder.captions for c in caps]
    owner = np.repeat(np.arange(len(recorder.captions)), [len(c) for c in recorder.captions])
    if not (len(image_emb) == len(recorder.captions) and len(text_emb) == len(captions) == len(owner)):
        raise RuntimeError(
            f"gallery of {eval_set.name}: recorded {len(image_emb)} images, {len(text_emb)} text "
            f"embeddings for {len(captions)} captions"
        )
    n = min(num_queries, len(captions))
    queries = [i * len(captions) // n for i in range(n)]
    ranked = rank_queries(image_emb, text_emb, owner, queries, min(k, len(image_emb)))
    rows = [(captions[q], top, rank, int(owner[q])) for q, (top, rank) in zip(queries, ranked, strict=True)]
    pictures = recorded_images(
        recorder, eval_set.shards, {i for _, top, _, right in rows for i in (*top, right)}
    )
    files.write_bytes_atomic(path, draw(rows, pictures, title or f"{eval_set.name}: text -> image, top {k}"))
    return {
        "queries": [{"caption": c, "rank": rank, "top": top, "right": right} for c, top, rank, right in rows]
    }
