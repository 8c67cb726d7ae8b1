"""``toolkit data glyphs``: Unicode characters drawn by many fonts, captioned with their Unicode names.

Each pair is one character in one font style ("GREEK CAPITAL LETTER OMEGA WITH DASIA" drawn by DejaVu
Serif Bold). Nothing is downloaded: the fonts are those matplotlib ships (DejaVu Sans, Sans Mono and Serif
in four styles each, STIX General in four weights: each has 1,000-5,900 named characters) plus any
TrueType/OpenType files given with ``fonts``; the names come from Python's ``unicodedata``.

What is drawn: only characters a font's cmap really maps to a glyph (never a missing-glyph box), that have a
Unicode name, and that are not control, format, private-use, surrogate, unassigned, separator or combining
characters, CJK ideographs, Hangul syllables, tags or variation selectors. A drawing with no ink is left
out (counted). Two code points drawn pixel-identically by one font are one drawing: the lowest code point
keeps it, the others are left out of that style (counted) and every such group is recorded in
``lookalikes.json`` (code points, names, the styles where they coincide), so a benchmark can score a second
set without them.

Output layout::

    DIR/<style>/<codepoint hex>.png   grayscale, SIZE x SIZE, black on white
    DIR/<style>.csv                    path,caption,codepoint (path relative to DIR: `toolkit data shard
                                       --source DIR/<style>.csv`; `toolkit eval build-set --source csv
                                       --image-column path`)
    DIR/styles.json                    per style: name, font file, sha256, character count, left-out counts
    DIR/characters.csv                 codepoint,name,num_styles,lookalike (every character written)
    DIR/lookalikes.json                groups of code points drawn identically by at least one style

Deterministic: the same fonts and options give byte-identical files (PNG encoding has no time stamps).
"""

from __future__ import annotations

import csv
import hashlib
import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from toolkit.core import files
from toolkit.core.config import option
from toolkit.core.log import get_logger, progress
from toolkit.core.stage import StageResult, stage_run

KIND = "data.glyphs"
log = get_logger("data.glyphs")
# matplotlib/mpl-data/fonts/ttf files with thousands of named characters (DejaVu*Display: 20-47 characters,
# STIXNonUni*: private use, STIXSiz*: 17-110 size variants, cm*10: 130 each, LastResort: one box per block)
BUILTIN_FONTS = (
    tuple(
        f"DejaVu{family}{style}.ttf"
        for family in ("Sans", "SansMono")
        for style in ("", "-Bold", "-Oblique", "-BoldOblique")
    )
    + tuple(f"DejaVuSerif{style}.ttf" for style in ("", "-Bold", "-Italic", "-BoldItalic"))
    + tuple(f"STIXGeneral{style}.ttf" for style in ("", "Bol", "Italic", "BolIta"))
)
EXCLUDED_CATEGORIES = frozenset({"Cc", "Cf", "Co", "Cs", "Cn", "Mn", "Mc", "Me", "Zs", "Zl", "Zp"})
EXCLUDED_PREFIXES = (
    "CJK UNIFIED IDEOGRAPH",
    "CJK COMPATIBILITY IDEOGRAPH",
    "HANGUL SYLLABLE",
    "TAG ",
    "VARIATION SELECTOR",
)
# the em size as a share of the canvas: DejaVu's ascender + descender span 1.16 em, so 0.8 em leaves the
# tallest ordinary glyphs (accented capitals) inside the canvas; larger ink is scaled down to fit
EM_FRACTION = 0.8


@dataclass(frozen=True)
class GlyphsConfig:
    out: str = option(doc="Output folder (local) for the PNGs, one CSV per font style and styles.json.")
    fonts: list[str] = option(
        factory=list,
        is_input=True,
        doc="More TrueType/OpenType font files; each is a style named after its file (DIR/<file stem>.csv).",
    )
    builtin_fonts: bool = option(
        True,
        doc="Include the 16 font styles matplotlib ships (DejaVu Sans, Sans "
        "Mono, Serif x 4 styles; STIX General x 4 weights).",
    )
    size: int = option(32, ge=8, le=512, doc="Image side in pixels.")
    min_fonts: int = option(
        1,
        ge=1,
        doc="Keep characters that at least this many styles draw (after duplicate drawings are left out).",
    )
    scripts: list[str] = option(
        factory=list,
        doc="Keep only characters whose Unicode name starts with one "
        "of these words (LATIN, GREEK, 'BOX DRAWINGS') or whose code point lies in "
        "one of these ranges (a block: 0370-03FF). Default: all.",
    )
    limit: int | None = option(
        None,
        ge=1,
        doc="Keep at most this many characters, evenly spaced over the "
        "code point order (chosen before drawing: fast small sets).",
    )


@dataclass(frozen=True)
class Style:
    name: str
    path: Path
    label: str  # what styles.json calls the font file: 'matplotlib:<file>' or the path given


def font_styles(cfg: GlyphsConfig) -> list[Style]:
    """The styles to draw, built-in first; a missing or duplicate style name is an error naming the file."""
    import matplotlib

    styles = []
    if cfg.builtin_fonts:
        root = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
        styles += [Style(Path(f).stem, root / f, f"matplotlib:{f}") for f in BUILTIN_FONTS]
    for given in cfg.fonts:
        path = Path(given)
        if not path.is_file():
            raise ValueError(f"fonts: {given}: no such font file")
        styles.append(Style(path.stem, path, given))
    names = [s.name for s in styles]
    for s in styles:
        if names.count(s.name) > 1:
            raise ValueError(
                f"fonts: {s.label}: style name {s.name!r} is taken by another font file; rename it"
            )
    if not styles:
        raise ValueError("fonts: no font styles (builtin_fonts is off and no fonts were given)")
    return styles


def read_cmap(style: Style) -> set[int]:
    """Code points the font maps to a real glyph (glyph 0 is .notdef, the missing-glyph box)."""
    from matplotlib import ft2font

    try:
        font = ft2font.FT2Font(str(style.path))
        cmap = font.get_charmap()
    except (OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"fonts: {style.label}: not a readable TrueType/OpenType font: {err}") from err
    return {code for code, glyph in cmap.items() if glyph != 0}


def is_candidate(code: int, scripts: list[str]) -> bool:
    """A named, drawable character (see the module doc) inside ``scripts`` (empty: any)."""
    if code > 0x10FFFF:
        return False
    ch = chr(code)
    name = unicodedata.name(ch, "")
    if not name or unicodedata.category(ch) in EXCLUDED_CATEGORIES or name.startswith(EXCLUDED_PREFIXES):
        return False
    return not scripts or any(_in_script(code, name, s) for s in scripts)


def _in_script(code: int, name: str, script: str) -> bool:
    lo, sep, hi = script.partition("-")
    if sep and all(len(p) >= 4 and all(c in "0123456789abcdefABCDEF" for c in p) for p in (lo, hi)):
        return int(lo, 16) <= code <= int(hi, 16)
    word = script.upper()
    return name == word or name.startswith(word + " ")


def check_scripts(scripts: list[str]) -> None:
    for s in scripts:
        if not s.strip():
            raise ValueError("scripts: an empty entry (e.g. a trailing comma)")


def choose(counts: dict[int, int], min_fonts: int, limit: int | None) -> list[int]:
    """Code points drawn by >= min_fonts styles' cmaps, then ``limit`` of them evenly over the order."""
    chosen = sorted(c for c, n in counts.items() if n >= min_fonts)
    if limit is None or limit >= len(chosen):
        return chosen
    return [chosen[i * len(chosen) // limit] for i in range(limit)]


def draw(font_path: Path, code: int, size: int, cache: dict) -> bytes:
    """The character as SIZE x SIZE 8-bit grayscale pixels (black ink on white), centred on the font's own
    middle line (so a comma sits low and an apostrophe high); ink larger than the canvas is scaled to fit."""
    from PIL import Image, ImageDraw, ImageFont

    def font_at(px: int):
        key = (str(font_path), px)
        if key not in cache:
            cache[key] = ImageFont.truetype(str(font_path), px)
        return cache[key]

    px = max(4, round(size * EM_FRACTION))
    font = font_at(px)
    left, top, right, bottom = font.getbbox(chr(code), anchor="mm")
    extent = max(right - left, bottom - top)
    if extent > size:
        px = max(4, px * size // extent)
        font = font_at(px)
    img = Image.new("L", (size, size), 255)
    ImageDraw.Draw(img).text((size / 2, size / 2), chr(code), fill=0, font=font, anchor="mm")
    return img.tobytes()


def draw_style(
    style: Style, codes: list[int], size: int
) -> tuple[dict[int, bytes], dict[str, int], list[list[int]]]:
    """({code: pixels} kept, left-out counts, groups of code points drawn identically (the first kept))."""
    cache: dict = {}
    kept: dict[int, bytes] = {}
    first: dict[bytes, int] = {}
    groups: dict[int, list[int]] = {}
    counts = {"blank": 0, "duplicate": 0}
    for code in codes:
        pixels = draw(style.path, code, size, cache)
        if min(pixels) == 255:  # no ink at this size
            counts["blank"] += 1
            continue
        digest = hashlib.sha256(pixels).digest()
        if digest in first:
            counts["duplicate"] += 1
            groups.setdefault(first[digest], [first[digest]]).append(code)
            continue
        first[digest] = code
        kept[code] = pixels
    return kept, counts, list(groups.values())


def merge_groups(groups_by_style: dict[str, list[list[int]]]) -> list[dict]:
    """Look-alike groups across styles: code points linked by an identical drawing in any style (union-find),
    each with the styles where some of them coincide; sorted by their lowest code point."""
    parent: dict[int, int] = {}

    def root(c: int) -> int:
        while parent.setdefault(c, c) != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    for groups in groups_by_style.values():
        for g in groups:
            for c in g[1:]:
                a, b = root(g[0]), root(c)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    members: dict[int, set[int]] = {}
    for c in parent:
        members.setdefault(root(c), set()).add(c)
    where: dict[int, set[str]] = {}
    for style, groups in groups_by_style.items():
        for g in groups:
            where.setdefault(root(g[0]), set()).add(style)
    return [
        {
            "codepoints": [f"{c:04X}" for c in sorted(m)],
            "names": [unicodedata.name(chr(c)) for c in sorted(m)],
            "styles": sorted(where[r]),
        }
        for r, m in sorted(members.items())
    ]


def write_png(pixels: bytes, size: int, path: Path) -> None:
    from PIL import Image

    Image.frombytes("L", (size, size), pixels).save(path, format="PNG", optimize=False, compress_level=9)


def write_style(root: Path, style: str, kept: dict[int, bytes], codes: list[int], size: int) -> int:
    """The style's PNGs and CSV for the chosen ``codes`` it drew; returns the number of rows."""
    folder = root / style
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.png"):
        stale.unlink()
    rows = []
    for code in codes:
        if code in kept:
            rel = f"{style}/{code:04x}.png"
            write_png(kept[code], size, root / rel)
            rows.append((rel, unicodedata.name(chr(code)), f"{code:04X}"))
    with (root / f"{style}.csv").open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh, lineterminator="\n")
        writer.writerow(("path", "caption", "codepoint"))
        writer.writerows(rows)
    return len(rows)


def run(cfg: GlyphsConfig) -> StageResult:
    """Draw every style's characters into ``cfg.out`` (PNGs of an earlier run there are replaced)."""
    if not files.is_local(cfg.out):
        raise ValueError(f"glyphs output must be a local folder, got {cfg.out}")
    check_scripts(cfg.scripts)
    root = Path(files.local_path(cfg.out)).resolve()
    with stage_run(KIND, cfg, cfg.out) as rec:
        styles = font_styles(cfg)
        cmaps = {s.name: {c for c in read_cmap(s) if is_candidate(c, cfg.scripts)} for s in styles}
        counts: dict[int, int] = {}
        for cmap in cmaps.values():
            for c in cmap:
                counts[c] = counts.get(c, 0) + 1
        candidates = choose(counts, cfg.min_fonts, cfg.limit)
        drawn, left_out, groups = {}, {}, {}
        for s in progress(styles, desc="glyphs", unit="styles"):
            codes = [c for c in candidates if c in cmaps[s.name]]
            drawn[s.name], left_out[s.name], groups[s.name] = draw_style(s, codes, cfg.size)
        per_char = {c: sum(c in d for d in drawn.values()) for c in candidates}
        chosen = [c for c in candidates if per_char[c] >= cfg.min_fonts]
        if not chosen:
            raise ValueError(
                f"no character is drawn by at least {cfg.min_fonts} styles (min_fonts) within "
                f"scripts {cfg.scripts or 'all'}"
            )
        lookalikes = merge_groups(groups)
        alike = {int(c, 16) for g in lookalikes for c in g["codepoints"]}
        root.mkdir(parents=True, exist_ok=True)
        entries = []
        for s in styles:
            n = write_style(root, s.name, drawn[s.name], chosen, cfg.size)
            entries.append(
                {
                    "name": s.name,
                    "font": s.label,
                    "sha256": hashlib.sha256(s.path.read_bytes()).hexdigest(),
                    "num_characters": n,
                    "num_in_cmap": len(cmaps[s.name]),
                    "left_out": left_out[s.name],
                }
            )
        _write_json(
            root / "styles.json",
            {
                "size": cfg.size,
                "unicode_version": unicodedata.unidata_version,
                "num_characters": len(chosen),
                "min_fonts": cfg.min_fonts,
                "styles": entries,
            },
        )
        _write_json(root / "lookalikes.json", {"groups": lookalikes})
        with (root / "characters.csv").open("w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh, lineterminator="\n")
            writer.writerow(("codepoint", "name", "num_styles", "lookalike"))
            writer.writerows(
                (f"{c:04X}", unicodedata.name(chr(c)), per_char[c], int(c in alike)) for c in chosen
            )
        rec.counts.update(
            num_characters=len(chosen),
            num_styles=len(styles),
            num_pairs=sum(e["num_characters"] for e in entries),
            num_lookalike_groups=len(lookalikes),
            num_lookalike_characters=len(alike & set(chosen)),
        )
        rec.details.update(styles={e["name"]: e["num_characters"] for e in entries})
        rec.outputs.update(
            root=str(root),
            styles=str(root / "styles.json"),
            lookalikes=str(root / "lookalikes.json"),
            characters=str(root / "characters.csv"),
        )
        log.info(
            "glyphs: %d characters in %d styles (%d pairs) written to %s",
            len(chosen),
            len(styles),
            rec.counts["num_pairs"],
            root,
        )
    return rec.result()


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
