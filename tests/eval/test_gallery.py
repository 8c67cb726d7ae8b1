"""The retrieval gallery shows the images the evaluation scored, whatever order its loader read them in."""

from __future__ import annotations

import io
import re

from evalkit import STEP, TiedModel, build_set, make_caption_csv, tied_tokenizer, to_tensor

from toolkit.eval.datasets import make_eval_loader, open_eval_set
from toolkit.eval.gallery import Recorder, recorded_images, write_gallery
from toolkit.eval.score import evaluate_set


def _drawn_index(data: bytes) -> int:
    """k of a solid evalkit image (red channel k * STEP)."""
    from PIL import Image

    return round(Image.open(io.BytesIO(data)).convert("RGB").getpixel((0, 0))[0] / STEP)


def test_gallery_images_match_their_captions_with_several_loader_workers(tmp_path):
    """Two DataLoader workers interleave their shards' batches; the gallery fetched thumbnails by position
    in the tars, so with several workers and shards it drew other images than the ones the model ranked
    (the green 'right image' was a wrong one)."""
    build_set(
        "csv",
        make_caption_csv(tmp_path / "csv", 9),
        tmp_path / "sets" / "ret",
        task="retrieval",
        max_per_shard=2,
    )
    eval_set = open_eval_set(tmp_path / "sets", "ret")
    assert len(eval_set.shards) == 5
    recorder = Recorder(TiedModel(9))
    loader = recorder.loader(make_eval_loader(eval_set, to_tensor, 3, num_workers=2, with_digest=True))
    metrics = evaluate_set(recorder, tied_tokenizer, to_tensor, eval_set, batch_size=3, loader=loader)
    assert metrics["image_retrieval_recall@1"] == metrics["text_retrieval_recall@1"] == 1.0
    drawn = [int(re.search(r"#(\d+)", caps[0]).group(1)) for caps in recorder.captions]
    assert drawn != sorted(drawn)  # the workers did interleave the shards
    pictures = recorded_images(recorder, eval_set.shards, set(range(9)))
    assert [_drawn_index(pictures[i]) for i in range(9)] == drawn
    gallery = write_gallery(recorder, eval_set, str(tmp_path / "gallery.png"), num_queries=4)
    assert all(q["rank"] == 1 and q["top"][0] == q["right"] for q in gallery["queries"])
    for q in gallery["queries"]:
        assert _drawn_index(pictures[q["right"]]) == int(re.search(r"#(\d+)", q["caption"]).group(1))
