"""Helpers for tests/eval: tiny evaluation sets made on the fly and a model whose features are tied to the
labels. (A uniquely named module, not conftest.py, so `from evalkit import ...` cannot pick up another
directory's conftest.)"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch

# Class / caption k is drawn as a solid image with red channel k * STEP, and named with "#k".
STEP = 10


def solid_png(path: Path, index: int, size: int = 8) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), (index * STEP, 128, 255 - index * STEP)).save(path)
    return path


def make_folder(root: Path, counts: list[int]) -> Path:
    """root/<object_#k>/<i>.png with counts[k] images of class k."""
    for k, n in enumerate(counts):
        for i in range(n):
            solid_png(root / f"object_#{k}" / f"{i}.png", k)
    return root


def make_caption_csv(root: Path, num_images: int, captions_per_image: int = 2) -> Path:
    """root/pairs.csv with image,caption rows (several rows per image) and the PNGs beside it."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / "pairs.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["image", "caption"])
        for k in range(num_images):
            solid_png(root / "img" / f"{k}.png", k)
            for j in range(captions_per_image):
                writer.writerow([f"img/{k}.png", f"a picture of #{k}, take {j}"])
    return root / "pairs.csv"


def build_set(source: str, input_path: Path, out: Path, **kw):
    from toolkit.core.config import build
    from toolkit.eval.build import BuildSetConfig, run

    return run(build(BuildSetConfig, {"source": source, "input": str(input_path), "out": str(out), **kw}))


class TiedModel(torch.nn.Module):
    """encode_image: one-hot of the class drawn in the image; encode_text: one-hot of the '#k' in the text,
    passed through ``perm`` (identity: features tied to labels; a derangement: always wrong)."""

    def __init__(self, dim: int, perm: list[int] | None = None):
        super().__init__()
        self.dim = dim
        self.register_buffer("perm", torch.tensor(perm if perm is not None else list(range(dim))))

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        index = (images[:, 0].mean(dim=(1, 2)) * 255 / STEP).round().long()
        return torch.nn.functional.one_hot(index, self.dim).float()

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(self.perm[tokens], self.dim).float()


def tied_tokenizer(texts: list[str]) -> torch.Tensor:
    return torch.tensor([int(re.search(r"#(\d+)", t).group(1)) for t in texts])


def to_tensor(image):
    import torchvision.transforms.functional as F

    return F.to_tensor(image)


@pytest.fixture(scope="module")
def sets_root(tmp_path_factory) -> Path:
    """root/cls7 (7 classes, 1..3 images each, 14 images), root/ret9 (9 images, 2 captions each),
    root/ret3 (3 images: R@5 and R@10 undefined)."""
    tmp = tmp_path_factory.mktemp("evalsets")
    root = tmp / "sets"
    build_set("folder", make_folder(tmp / "folder", [3, 1, 2, 3, 1, 2, 2]), root / "cls7")
    build_set("csv", make_caption_csv(tmp / "csv9", 9), root / "ret9", task="retrieval")
    build_set("csv", make_caption_csv(tmp / "csv3", 3, captions_per_image=1), root / "ret3", task="retrieval")
    return root
