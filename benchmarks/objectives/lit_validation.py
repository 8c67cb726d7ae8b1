"""How the quickstart's LiT recipe was chosen without looking at the held-out artist (OpenMoji).

Inputs are `toolkit data precompute` outputs of frozen-tower features, one per training-side artist (the
demo's Twemoji, npm emoji-datasource-google's Noto, and a validation-only artist such as
emoji-datasource-apple, which is never trained on nor shipped). Two protocols, both on features only:

- ``concepts``: 20 % of one artist's concepts held out; heads trained on the other 80 %; R@1 among the
  held-out concepts (generalisation to unseen captions);
- ``artist``: heads trained on some artists' drawings, R@1 on another artist's drawings of the same concepts:
  the cross-artist transfer the quickstart's test measures, but on a validation artist.

The heads are trained here by a fast proxy of ``toolkit train`` on features (linear image head without bias,
linear text head with bias, symmetric InfoNCE with a learned logit scale clamped at 100, AdamW betas
(0.9, 0.98), linear warm-up then cosine): it ranks settings, the real trainer (FastCLIP-v3) makes the model.

    python -m benchmarks.objectives.lit_validation --artist twemoji=runs/exp/train \\
        --artist google=runs/exp2/feat_google --artist apple=runs/exp2/feat_apple \\
        --grid '[{"train": ["twemoji"], "val": "apple"}, {"train": ["twemoji", "google"], "val": "apple"}]'
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def load(root: str):
    """(image features [n, 1280], text features [n, 384], captions) of a precompute output, in id order."""
    import torch

    from toolkit.data.trainset.loader import make_loader

    images, texts = [], []
    for batch in make_loader(root, batch_size=512, shuffle=False):
        images.append(batch["image_features"].float())
        texts.append(batch["text_features"].float())
    captions = [
        json.loads(line)["caption"]
        for p in sorted(Path(root).glob("*.meta.jsonl"))
        for line in p.read_text().splitlines()
    ]
    return torch.cat(images), torch.cat(texts), captions


def recall_at_1(image_emb, text_emb) -> tuple[float, float]:
    """(I->T, T->I) R@1 in percent for paired rows."""
    import torch

    a = torch.nn.functional.normalize(image_emb, dim=1)
    b = torch.nn.functional.normalize(text_emb, dim=1)
    sims, target = a @ b.T, torch.arange(len(a))
    return (
        100 * (sims.argmax(1) == target).float().mean().item(),
        100 * (sims.argmax(0) == target).float().mean().item(),
    )


def train_heads(images, texts, steps: int, lr: float, wd: float, batch: int, warmup: int, seed: int):
    """The proxy trainer (module docstring); returns (image head, text head)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    image_head = torch.nn.Linear(images.shape[1], 512, bias=False)
    text_head = torch.nn.Linear(texts.shape[1], 512)
    scale = torch.nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    opt = torch.optim.AdamW(
        [*image_head.parameters(), *text_head.parameters(), scale],
        lr=lr,
        weight_decay=wd,
        betas=(0.9, 0.98),
        eps=1e-6,
    )
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        rows = torch.randperm(len(images), generator=gen)[:batch]
        a = torch.nn.functional.normalize(image_head(images[rows]), dim=1)
        b = torch.nn.functional.normalize(text_head(texts[rows]), dim=1)
        logits = scale.exp().clamp(max=100) * a @ b.T
        target = torch.arange(len(rows))
        loss = (
            torch.nn.functional.cross_entropy(logits, target)
            + torch.nn.functional.cross_entropy(logits.T, target)
        ) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
    return image_head, text_head


def evaluate(data: dict, setting: dict) -> dict:
    """One grid point: {'train': [artists], 'val': artist | None (concept split), steps, lr, wd, batch,
    ...}."""
    import torch

    s = {"steps": 300, "lr": 1e-3, "wd": 0.1, "batch": 256, "warmup": 25, "seed": 0, "val": None} | setting
    if s["val"] is None:  # concepts protocol on the first training artist
        images, texts, _ = data[s["train"][0]]
        perm = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
        held, kept = perm[: len(images) // 5], perm[len(images) // 5 :]
        train_i, train_t, val_i, val_t = images[kept], texts[kept], images[held], texts[held]
    else:
        train_i = torch.cat([data[a][0] for a in s["train"]])
        train_t = torch.cat([data[a][1] for a in s["train"]])
        val_i, val_t, _ = data[s["val"]]
    heads = train_heads(train_i, train_t, s["steps"], s["lr"], s["wd"], s["batch"], s["warmup"], s["seed"])
    with torch.no_grad():
        i2t, t2i = recall_at_1(heads[0](val_i), heads[1](val_t))
    return s | {"num_train": len(train_i), "num_val": len(val_i), "i2t_r1": i2t, "t2i_r1": t2i}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artist", action="append", required=True, metavar="NAME=DIR", help="a precompute output")
    p.add_argument("--grid", required=True, help="JSON list of settings (see evaluate())")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    data = {name: load(root) for name, root in (x.split("=", 1) for x in a.artist)}
    rows = []
    for setting in json.loads(a.grid):
        start = time.monotonic()
        rows.append(evaluate(data, setting))
        print(json.dumps(rows[-1] | {"seconds": round(time.monotonic() - start, 1)}), flush=True)
    if a.out:
        a.out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
