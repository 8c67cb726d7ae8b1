"""The from-scratch benchmark's data: the glyph set split by font style, as the trainer and evaluator read it.

Built once per ``--cache`` (and rebuilt when its options change) by the project's own stages:
``toolkit data glyphs`` (``--min-fonts``, ``--size``), then the training styles' rows through
``data shard`` and ``data precompute`` for ``--model`` (the training shards), and three retrieval sets
through ``eval build-set``: ``val`` (the validation style: tuning only), ``held`` (the held-out style: the
figures) and ``held_distinct`` (the held-out style without the characters that some style draws
pixel-identically to another: lookalikes.json).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
from pathlib import Path

EVAL_SETS = ("val", "held", "held_distinct")


def add_set_arguments(p: argparse.ArgumentParser) -> None:
    """The options that define the glyph set and the model trained on it (every script of the package)."""
    p.add_argument("--min-fonts", type=int, default=13, help="characters that at least this many styles draw")
    p.add_argument("--size", type=int, default=32, help="glyph image side in pixels (the model's image size)")
    p.add_argument("--scripts", nargs="*", default=[], help="`toolkit data glyphs --scripts` (default: all)")
    p.add_argument("--limit", type=int, default=None, help="at most this many characters (smaller, cheaper)")
    p.add_argument("--val-style", default="DejaVuSerif-BoldItalic", help="the style scored for tuning")
    p.add_argument("--heldout-style", default="STIXGeneral", help="the style never trained or tuned on")
    p.add_argument("--model", default="cliptk-glyph", help="model config trained from random init")


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _write_csv(path: Path, rows: list[tuple[str, str]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(("path", "caption"))
        writer.writerows(rows)


def fingerprint(glyphs: Path) -> dict[str, str]:
    """What makes two builds of the set the same pixels: a SHA-1 over every drawing's decoded pixels (path,
    mode, size and bytes, in path order: a PNG encoder's choices do not count) and the versions of the
    libraries that draw them (Pillow bundles its FreeType). A rebuild of the same options on a fresh install
    once gave other runs (a recorded held-out R@1 of 13.26 % came out 13.54 %; the old set was gone, so
    whether the pixels or the arithmetic moved is unknown): a page records this, and a comparison with
    recorded runs checks it first, so the next such case says which."""
    import matplotlib
    import PIL
    from PIL import Image, features

    digest = hashlib.sha1()
    for path in sorted(glyphs.rglob("*.png")):
        with Image.open(path) as img:
            digest.update(f"{path.relative_to(glyphs)} {img.mode} {img.size}".encode())
            digest.update(img.tobytes())
    return {
        "pixels_sha1": digest.hexdigest(),
        "drawn_with": f"Pillow {PIL.__version__} (FreeType {features.version('freetype2')}), "
        f"matplotlib {matplotlib.__version__}",
    }


class GlyphSet:
    """Paths of the built set: ``train`` (precompute output), ``evalsets`` (root of val/held/held_distinct),
    ``counts`` (pairs per split, characters, styles)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        spec = {
            "min_fonts": args.min_fonts,
            "size": args.size,
            "scripts": args.scripts,
            "limit": args.limit,
            "val": args.val_style,
            "held": args.heldout_style,
            "model": args.model,
            "version": 1,
        }
        self.signature = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
        self.root = Path(args.cache).resolve() / f"set-{self.signature}"
        self.glyphs, self.train, self.evalsets = (
            self.root / "glyphs",
            self.root / "train",
            self.root / "evalsets",
        )
        done = self.root / "counts.json"
        if not done.is_file():
            self._build(spec)
            done.write_text(json.dumps(self._counts, indent=1) + "\n")
        self.counts = json.loads(done.read_text())
        if "pixels_sha1" not in self.counts:  # a set built before the fingerprint: add it once
            self.counts.update(fingerprint(self.glyphs))
            done.write_text(json.dumps(self.counts, indent=1) + "\n")

    def _build(self, spec: dict) -> None:
        from toolkit.data.acquire.glyphs import GlyphsConfig
        from toolkit.data.acquire.glyphs import run as glyphs
        from toolkit.data.acquire.shard import ShardConfig
        from toolkit.data.acquire.shard import run as shard
        from toolkit.data.trainset.precompute.stage import PrecomputeConfig
        from toolkit.data.trainset.precompute.stage import run as precompute
        from toolkit.eval.build import BuildSetConfig
        from toolkit.eval.build import run as build_set

        a = self.args
        self.root.mkdir(parents=True, exist_ok=True)
        glyphs(
            GlyphsConfig(
                out=str(self.glyphs),
                size=a.size,
                min_fonts=a.min_fonts,
                scripts=list(a.scripts),
                limit=a.limit,
            )
        )
        styles = [s["name"] for s in json.loads((self.glyphs / "styles.json").read_text())["styles"]]
        for role, style in (("--val-style", a.val_style), ("--heldout-style", a.heldout_style)):
            if style not in styles:
                raise SystemExit(f"{role} {style!r}: not a style of the set; styles: {', '.join(styles)}")
        if a.val_style == a.heldout_style:
            raise SystemExit("--val-style and --heldout-style must differ")
        alike = {r["codepoint"] for r in _rows(self.glyphs / "characters.csv") if r["lookalike"] == "1"}

        def pairs(style: str, distinct: bool = False) -> list[tuple[str, str]]:
            return [
                (str(self.glyphs / r["path"]), r["caption"])
                for r in _rows(self.glyphs / f"{style}.csv")
                if not (distinct and r["codepoint"] in alike)
            ]

        train_styles = [s for s in styles if s not in (a.val_style, a.heldout_style)]
        lists = {
            "train": [p for s in train_styles for p in pairs(s)],
            "val": pairs(a.val_style),
            "held": pairs(a.heldout_style),
            "held_distinct": pairs(a.heldout_style, distinct=True),
        }
        for name, rows in lists.items():
            _write_csv(self.root / f"{name}.csv", rows)
        shard(
            ShardConfig(
                source=str(self.root / "train.csv"),
                out=str(self.root / "raw"),
                image_size=a.size,
                resize_mode="no",
                num_threads=1,
            )
        )
        precompute(PrecomputeConfig(input=str(self.root / "raw"), out=str(self.train), model=a.model))
        for name in EVAL_SETS:
            build_set(
                BuildSetConfig(
                    source="csv",
                    task="retrieval",
                    input=str(self.root / f"{name}.csv"),
                    image_column="path",
                    out=str(self.evalsets / name),
                )
            )
        self._counts = {
            "num_characters": len(_rows(self.glyphs / "characters.csv")),
            "train_styles": train_styles,
            "val_style": a.val_style,
            "heldout_style": a.heldout_style,
            **{f"num_{k}_pairs": len(v) for k, v in lists.items()},
            **fingerprint(self.glyphs),
            "spec": spec,
        }
