"""A researcher's own webdataset shards, made the way other tools make them (not by our fetch): captions only
inside ``.json``, dotted file names, members apart, BOMs, globs over img2dataset folders, same-named shards in
two folders, shards on a web server, keys in sub-folders, odd image extensions and modes. Real tars, real
precompute runs, real HTTP on 127.0.0.1."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from datakit import encode, good_samples, random_image, read_meta, write_raw_shard
from PIL import Image
from typer.testing import CliRunner

from toolkit.cli.main import app
from toolkit.core.config import build
from toolkit.data.trainset.precompute.stage import PrecomputeConfig, run


def _tar(path, members: list[tuple[str, bytes | None]]) -> None:
    """A plain tar of (name, bytes) members; bytes None adds a directory entry."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _precompute(raw, out, **overrides):
    cfg = build(
        PrecomputeConfig,
        {
            "input": str(raw),
            "out": str(out),
            "model": "cliptk-tiny",
            "crop_scale_min": 1.0,
            "num_workers": 1,
            **overrides,
        },
    )
    return run(cfg)


def _skipped(out) -> list[dict]:
    return [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]


def test_captions_only_in_json(tmp_path):
    """img2dataset writes the caption into .json as well; a set that carries it only there is read with
    --caption-ext json (the caption string, not the JSON text), and the default names the way out."""
    rng = np.random.default_rng(0)
    members = []
    for i in range(6):
        members.append((f"{i:04d}.jpg", encode(random_image(rng, 40, 30), "JPEG")))
        meta = {"key": f"{i:04d}", "caption": f"caption {i} ünïcode", "url": "http://x"}
        if i == 4:
            meta = {"key": "0004", "caption": 17}
        if i == 5:
            meta = {"key": "0005"}
        members.append((f"{i:04d}.json", json.dumps(meta).encode()))
    members.append(("0006.jpg", encode(random_image(rng, 40, 30), "JPEG")))
    members.append(("0006.json", b"{not json"))
    raw = tmp_path / "raw"
    raw.mkdir()
    _tar(raw / "00000.tar", members)

    out = tmp_path / "json"
    result = _precompute(raw, out, caption_ext="json")
    assert [m["caption"] for m in read_meta(out)] == [f"caption {i} ünïcode" for i in range(4)]
    assert result.counts["skipped"] == {"bad_caption_json": 2, "missing_caption": 1}
    by_key = {s["key"]: s for s in _skipped(out)}
    assert "'caption' of the .json member is a int" in by_key["0004"]["message"]
    assert by_key["0005"]["message"] == "the .json member has no 'caption' key"
    assert "not valid JSON" in by_key["0006"]["message"]

    custom = tmp_path / "custom"
    members = [("a.jpg", encode(random_image(rng, 40, 30), "JPEG")), ("a.json", b'{"TEXT": " hello "}')]
    _tar(raw / "00000.tar", members)
    _precompute(raw, custom, caption_ext="json:TEXT")
    assert [m["caption"] for m in read_meta(custom)] == ["hello"]

    with_txt = tmp_path / "txt"
    _tar(
        raw / "00000.tar",
        [
            ("a.jpg", members[0][1]),
            ("a.json", b'{"caption": "x"}'),
            ("b.jpg", members[0][1]),
            ("b.txt", b"b caption"),
        ],
    )
    result = CliRunner().invoke(
        app,
        [
            "data",
            "precompute",
            "--in",
            str(raw),
            "--out",
            str(with_txt),
            "--model",
            "cliptk-tiny",
            "--workers",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert _skipped(with_txt)[0]["message"] == (
        "no .txt member (its .json member has a 'caption': --caption-ext json reads it)"
    )
    # the summary quotes it: the way out is on the screen, not only in skipped.jsonl
    assert (
        "skipped: missing_caption 1\n  missing_caption, e.g. 00000.tar key 'a': no .txt member (its .json "
        "member has a 'caption': --caption-ext json reads it)\n"
    ) in result.output


def test_dotted_file_names_are_explained(tmp_path):
    """Files named photo.0001.jpg / photo.0001.txt all share webdataset's key 'photo' (a key ends at the first
    dot): the set collapses into one sample, and the error says why instead of a bare 'missing_caption: 1'."""
    rng = np.random.default_rng(1)
    raw = tmp_path / "raw"
    raw.mkdir()
    members = []
    for i in range(8):
        members += [
            (f"photo.{i:04d}.jpg", encode(random_image(rng, 20, 20), "JPEG")),
            (f"photo.{i:04d}.txt", b"a caption"),
        ]
    _tar(raw / "00000.tar", members)
    with pytest.raises(ValueError) as err:
        _precompute(raw, tmp_path / "out")
    message = str(err.value)
    assert (
        "no valid sample in 1 raw shard(s) (missing_caption: 1); e.g. 00000.tar key 'photo': no .txt member"
        in message
    )
    assert "(16 in all); a key ends at the first dot of the file name" in message


def test_index_over_http_shards(tmp_path):
    """Raw shards on a web server (127.0.0.1, real HTTP through fsspec + aiohttp): pixels mode streams them,
    an index reads every image as a byte range at training time and gives the local index's exact batches; a
    server that answers ranges with the whole file (python -m http.server) is refused, naming why."""
    import subprocess
    import sys
    import time
    import urllib.request

    from toolkit.data.acquire.serve import serve
    from toolkit.data.trainset.loader import make_loader

    rng = np.random.default_rng(2)
    raw = tmp_path / "raw"
    raw.mkdir()
    for shard in range(2):
        _tar(
            raw / f"{shard:05d}.tar",
            [
                m
                for i in range(5)
                for m in [
                    (f"{shard}{i:03d}.webp", encode(random_image(rng, 30, 20), "WEBP")),
                    (f"{shard}{i:03d}.txt", f"caption {shard} {i}".encode()),
                ]
            ],
        )
    local = tmp_path / "local"
    _precompute(raw, local, storage="index")
    with serve(str(tmp_path)) as server:
        remote = tmp_path / "remote"
        _precompute(f"{server.url}raw/{{00000..00001}}.tar", remote, storage="index")
        assert json.loads((remote / "dataset.json").read_text())["data_root"] == f"{server.url}raw"
        batches = [
            next(iter(make_loader(str(out), batch_size=10, shuffle=False, num_workers=0)))
            for out in (local, remote)
        ]
        assert server.request_counts["/raw/00001.tar"] > 1  # streamed once, then read back by range
        assert np.array_equal(batches[0]["image"], batches[1]["image"])
        assert np.array_equal(batches[0]["tokens"], batches[1]["tokens"])
        _precompute(f"{server.url}raw/", tmp_path / "pixels")
        assert len(read_meta(tmp_path / "pixels")) == 10

    port_file = tmp_path / "port"
    plain = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import http.server as h, sys; s = h.ThreadingHTTPServer(("
            "'127.0.0.1', 0), h.SimpleHTTPRequestHandler); open(sys.argv[1], 'w').write("
            "str(s.server_port)); s.serve_forever()",
            str(port_file),
        ],
        cwd=tmp_path,
    )
    try:
        for _ in range(100):
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text()}/raw/00000.tar"
        urllib.request.urlopen(url).read()  # the server is up
        with pytest.raises(RuntimeError, match="does not answer HTTP Range requests"):
            _precompute(url, tmp_path / "plain", storage="index")
    finally:
        plain.kill()
        plain.wait()


def test_glob_over_an_img2dataset_folder_reads_only_the_tars(tmp_path, caplog):
    """`raw/*` also matches img2dataset's 00000_stats.json and 00000.parquet; they are no shards and must not
    be read as damaged tars (they were: 'unreadable_tar' skips, 'damaged' lines, read counts too high)."""
    rng = np.random.default_rng(3)
    raw = tmp_path / "raw"
    raw.mkdir()
    for shard in range(2):
        write_raw_shard(raw / f"{shard:05d}.tar", good_samples(rng, f"g{shard}_", 4))
    by_folder, by_glob = tmp_path / "folder", tmp_path / "glob"
    _precompute(raw, by_folder)
    result = _precompute(f"{raw}/*", by_glob)
    assert result.counts["num_read"] == 8 and result.counts["skipped"] == {}
    assert result.counts["num_raw_shards"] == 2 and result.counts["num_damaged_tars"] == 0
    assert (by_glob / "00000.tar").read_bytes() == (by_folder / "00000.tar").read_bytes()
    assert (
        "4 matched file(s) that are not .tar ignored (00000.parquet, 00000_stats.json, 00001.parquet, ...)"
        in caplog.text
    )


def test_training_on_raw_shards_says_to_precompute_them(tmp_path):
    """`toolkit train --data RAW` (the raw shards themselves): the error gives the precompute step to run; on
    the output of a precompute that failed, it quotes why that failed."""
    from toolkit.data.trainset.format import TrainDataset

    write_raw_shard(tmp_path / "00000.tar", good_samples(np.random.default_rng(4), "r", 2))
    with pytest.raises(
        FileNotFoundError,
        match=r"a precompute output directory\? It holds \.tar files: raw shards "
        r"are read by `toolkit data precompute --in ",
    ):
        TrainDataset.open(str(tmp_path))
    (tmp_path / "00000.tar").unlink()
    with pytest.raises(FileNotFoundError, match=r"a precompute output directory\?$"):
        TrainDataset.open(str(tmp_path))
    failed = tmp_path / "failed"  # a precompute that failed there: its manifest says why
    (tmp_path / "raw").mkdir()
    _tar(tmp_path / "raw" / "00000.tar", [("a.jpg", b"not an image"), ("a.txt", b"caption")])
    with pytest.raises(ValueError, match="no valid sample"):
        _precompute(tmp_path / "raw", failed)
    with pytest.raises(
        FileNotFoundError,
        match=r"directory\? Its precompute ended 'failed': ValueError: .*raw: no "
        r"valid sample in 1 raw shard\(s\) \(corrupt_image: 1\).*; fix that",
    ):
        TrainDataset.open(str(failed))


def test_captions_longer_than_the_context_are_counted(tmp_path):
    """cliptk-tiny's context is 32 tokens: a 30-word caption (32 with start and end) fits exactly, a 31-word
    one is cut. The cut is counted in the manifest instead of happening unseen."""
    rng = np.random.default_rng(5)
    samples = [
        (f"k{i}", {"jpg": encode(random_image(rng, 20, 20), "JPEG"), "txt": " ".join(["a"] * words).encode()})
        for i, words in enumerate([3, 30, 31, 200])
    ]
    raw = tmp_path / "raw"
    raw.mkdir()
    write_raw_shard(raw / "00000.tar", samples)
    result = _precompute(raw, tmp_path / "out")
    assert result.counts["num_samples"] == 4 and result.counts["num_captions_cut"] == 2
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["counts"]["num_captions_cut"] == 2

    (raw / "00001.tar").write_bytes(
        b"not a tar"
    )  # 1 of 5 samples lost: the first run fails, keeping its work
    with pytest.raises(ValueError, match="max_truncated_share"):
        _precompute(raw, tmp_path / "resumed")
    resumed = _precompute(raw, tmp_path / "resumed", max_truncated_share=1)
    assert resumed.details["throughput"]["num_resumed_raw_shards"] == 2
    assert resumed.counts["num_captions_cut"] == 2  # carried by the finished shards' records


def test_members_listed_apart_in_the_tar_are_explained(tmp_path):
    """`tar cf s.tar *.jpg *.txt` lists every image before every caption; webdataset groups only consecutive
    members, so each key is read twice (image only, then caption only). The error says so."""
    rng = np.random.default_rng(6)
    raw = tmp_path / "raw"
    raw.mkdir()
    _tar(
        raw / "00000.tar",
        [(f"{i:04d}.jpg", encode(random_image(rng, 20, 20), "JPEG")) for i in range(4)]
        + [(f"{i:04d}.txt", f"caption {i}".encode()) for i in range(4)],
    )
    with pytest.raises(ValueError) as err:
        _precompute(raw, tmp_path / "out")
    message = str(err.value)
    assert (
        "(missing_caption: 4, duplicate_key: 4); e.g. 00000.tar key '0000': no .txt member (members: jpg); "
        "00000.tar key '0000': key repeats within 00000.tar (this time with txt; its earlier members lacked "
        "them): "
        "a sample's files must follow each other in the tar" in message
    )


def test_json_captions_in_a_cut_tar_keep_the_last_whole_sample(tmp_path):
    """A tar cut right after a sample's .json: with --caption-ext json that sample is whole (image + caption)
    and kept, as a .txt sample is with the default; only the samples past the cut are lost."""
    rng = np.random.default_rng(7)
    raw = tmp_path / "raw"
    raw.mkdir()
    _tar(
        raw / "00000.tar",
        [
            m
            for i in range(3)
            for m in [
                (f"{i:04d}.jpg", encode(random_image(rng, 20, 20), "JPEG")),
                (f"{i:04d}.json", json.dumps({"caption": f"caption {i}"}).encode()),
            ]
        ],
    )
    data = (raw / "00000.tar").read_bytes()
    with tarfile.open(raw / "00000.tar") as tar:
        cut = next(m for m in tar.getmembers() if m.name == "0002.jpg").offset  # at 0002.jpg's header
    (raw / "00000.tar").write_bytes(data[:cut])
    result = _precompute(raw, tmp_path / "out", caption_ext="json", max_truncated_share=1)
    assert [m["caption"] for m in read_meta(tmp_path / "out")] == ["caption 0", "caption 1"]
    assert result.counts["num_damaged_tars"] == 1


def test_shards_of_the_same_name_in_two_folders_are_told_apart(tmp_path):
    """`raw/*/*.tar` over raw/a/00000.tar and raw/b/00000.tar: meta lines, skip records and the manifest's tar
    errors name each shard by its path below the common folder; by file name alone one shard's damage
    overwrote the other's in the manifest and every sample's source was ambiguous."""
    rng = np.random.default_rng(8)
    for folder in ("a", "b"):
        (tmp_path / "raw" / folder).mkdir(parents=True)
        samples = good_samples(rng, f"{folder}_", 3)
        samples[1][1].pop("txt")
        write_raw_shard(tmp_path / "raw" / folder / "00000.tar", samples)
        path = tmp_path / "raw" / folder / "00000.tar"
        with tarfile.open(path) as tar:
            cut = tar.getmembers()[-1].offset_data + 10  # inside the last .json: damaged, samples whole
        path.write_bytes(path.read_bytes()[:cut])
    out = tmp_path / "out"
    result = _precompute(f"{tmp_path}/raw/*/*.tar", out, storage="index")
    assert sorted(result.details["tar_errors"]) == ["a/00000.tar", "b/00000.tar"]
    assert {(m["source"], m["key"][0]) for m in read_meta(out)} == {
        ("a/00000.tar", "a"),
        ("b/00000.tar", "b"),
    }
    assert sorted((s["shard"], s["key"], s["reason"]) for s in _skipped(out)) == [
        ("a/00000.tar", "a_0001", "missing_caption"),
        ("b/00000.tar", "b_0001", "missing_caption"),
    ]


def test_byte_order_marks_and_control_only_captions(tmp_path):
    """A .txt saved by a Windows editor starts with a UTF-8 byte-order mark: it is no part of the caption (and
    a BOM-only file is an empty caption); a caption of NULs tokenizes to nothing and is empty too, instead of
    training an image against a blank caption."""
    rng = np.random.default_rng(9)
    raw = tmp_path / "raw"
    raw.mkdir()
    captions = [b"\xef\xbb\xbf", b"\xef\xbb\xbfhello world\r\n", b"\x00\x00", b"ok"]
    _tar(
        raw / "00000.tar",
        [
            m
            for i, cap in enumerate(captions)
            for m in [(f"{i:04d}.png", encode(random_image(rng, 20, 20), "PNG")), (f"{i:04d}.txt", cap)]
        ],
    )
    out = tmp_path / "out"
    result = _precompute(raw, out)
    assert [m["caption"] for m in read_meta(out)] == ["hello world", "ok"]
    assert result.counts["skipped"] == {"empty_caption": 2}
    assert [s["message"] for s in _skipped(out)] == [
        "caption is empty or whitespace only",
        "caption has no printable character ('\\x00\\x00')",
    ]


def _counting_handler():
    """([bytes of file bodies sent so far], a serve handler class that counts them): what a reader
    transferred."""
    from toolkit.data.acquire import serve as serving

    sent = [0]

    class Counting(serving.QuietHandler):
        def copyfile(self, source, outputfile):
            class Out:
                def write(self, data):
                    sent[0] += len(data)
                    outputfile.write(data)

            super().copyfile(source, Out())

    return sent, Counting


def test_remote_index_reads_only_the_images_it_needs(tmp_path):
    """Training from an index over HTTP transfers each image's bytes and nothing more: fsspec's default
    read-ahead fetched a 5 MB block (50 MB on S3) for every randomly placed image, so 16 images of 25 kB cost
    19 MB. Counted on the server, exactly, for a shuffled batch."""
    from toolkit.data.acquire import serve as serving
    from toolkit.data.trainset.loader import make_loader

    sent, Counting = _counting_handler()

    rng = np.random.default_rng(10)
    raw = tmp_path / "raw"
    raw.mkdir()
    _tar(
        raw / "00000.tar",
        [
            m
            for i in range(40)
            for m in [
                (f"{i:04d}.jpg", encode(random_image(rng, 64, 48), "JPEG", quality=95)),
                (f"{i:04d}.txt", f"caption {i}".encode()),
            ]
        ],
    )
    with tarfile.open(raw / "00000.tar") as tar:
        sizes = {m.name.split(".")[0]: m.size for m in tar.getmembers() if m.name.endswith(".jpg")}
    with serving.serve(str(tmp_path), handler_cls=Counting) as server:
        out = tmp_path / "index"
        _precompute(f"{server.url}raw/00000.tar", out, storage="index")
        keys = {m["id"]: m["key"] for m in read_meta(out)}
        sent[0] = 0
        batch = next(iter(make_loader(str(out), batch_size=8, shuffle=True, num_workers=0)))
        assert sent[0] == sum(sizes[keys[int(i)]] for i in batch["index"])


def test_remote_pixels_set_reads_only_the_samples_it_needs(tmp_path):
    """A pixels training set on a web server: a shuffled batch transfers its samples' bytes (plus dataset.json
    and the checksum sidecar once), not a 5 MB read-ahead block per run of samples."""
    from toolkit.data.acquire import serve as serving
    from toolkit.data.trainset.format import TrainDataset
    from toolkit.data.trainset.loader import make_loader

    sent, Counting = _counting_handler()

    raw = tmp_path / "raw"
    raw.mkdir()
    write_raw_shard(raw / "00000.tar", good_samples(np.random.default_rng(11), "p", 300))
    _precompute(raw, tmp_path / "train", samples_per_shard=300)
    local = TrainDataset.open(str(tmp_path / "train"))
    overhead = sum(p.stat().st_size for p in (tmp_path / "train").glob("*") if p.suffix in (".json", ".xxh3"))
    with serving.serve(str(tmp_path), handler_cls=Counting) as server:
        batch = next(iter(make_loader(f"{server.url}train", batch_size=4, shuffle=True, num_workers=0)))
        assert len(batch["index"]) == 4
        assert sent[0] <= 4 * local.sample_bytes + overhead  # was ~300 samples: the whole shard, read ahead


def test_a_mixed_own_tar_trains_alike_in_every_storage_mode(tmp_path):
    """Directory entries, keys in sub-folders, .JPG/.jpeg/.webp/.png members, grey/CMYK/palette+alpha/16-bit
    images, extra .npy members and a brace pattern: every sample is kept, and pixels, jpeg and index sets give
    the same ids, keys and tokens, and pixels and index the same pixels."""
    from toolkit.data.trainset.loader import make_loader

    rng = np.random.default_rng(12)
    deep = Image.fromarray(rng.integers(0, 65535, (20, 24), dtype=np.uint16))
    palette = random_image(rng, 24, 20).convert("P")
    palette.info["transparency"] = 0
    images = [
        ("JPG", encode(random_image(rng, 30, 20), "JPEG")),
        ("jpeg", encode(random_image(rng, 20, 30, "L"), "JPEG")),
        ("webp", encode(random_image(rng, 24, 24), "WEBP")),
        ("png", encode(palette, "PNG", transparency=0)),
        ("png", encode(deep, "PNG")),
        ("jpg", encode(random_image(rng, 40, 30, "CMYK"), "JPEG")),
    ]
    raw = tmp_path / "raw"
    raw.mkdir()
    for shard in range(2):
        members = [("photos", None), ("photos/set.v2", None)]
        for i, (ext, data) in enumerate(images):
            key = f"photos/set.v2/{shard}_{i:03d}"
            members += [
                (f"{key}.{ext}", data),
                (f"{key}.txt", f"photo {shard} {i}".encode()),
                (f"{key}.npy", b"\x93NUMPY"),
                (f"{key}.json", b'{"caption": "other"}'),
            ]
        _tar(raw / f"{shard:05d}.tar", members)
    batches = {}
    for mode in ("pixels", "jpeg", "index"):
        result = _precompute(f"{raw}/{{00000..00001}}.tar", tmp_path / mode, storage=mode)
        assert result.counts["num_samples"] == 12 and result.counts["skipped"] == {}
        batches[mode] = next(
            iter(make_loader(str(tmp_path / mode), batch_size=12, shuffle=False, num_workers=0))
        )
    assert read_meta(tmp_path / "index")[7]["key"] == "photos/set.v2/1_001"
    for mode in ("jpeg", "index"):
        assert np.array_equal(batches[mode]["tokens"], batches["pixels"]["tokens"])
    assert np.array_equal(batches["index"]["image"], batches["pixels"]["image"])
    assert (
        batches["jpeg"]["image"].shape == batches["pixels"]["image"].shape
    )  # its re-encoding: test_storage_modes


def test_inspect_reads_captions_the_way_precompute_will(tmp_path):
    """`toolkit data inspect RAW` before precompute: samples without a caption are counted by reason (they
    were 0-word captions in the histogram), and --caption-ext json measures the .json captions."""
    rng = np.random.default_rng(13)
    raw = tmp_path / "raw"
    raw.mkdir()
    _tar(
        raw / "00000.tar",
        [
            m
            for i in range(4)
            for m in [
                (f"{i:04d}.jpg", encode(random_image(rng, 20, 20), "JPEG")),
                (f"{i:04d}.json", json.dumps({"caption": "two words"}).encode()),
            ]
        ]
        + [("0009.jpg", encode(random_image(rng, 20, 20), "JPEG")), ("0009.txt", b"three words here")],
    )
    by_txt = CliRunner().invoke(app, ["data", "inspect", str(raw), "--out", str(tmp_path / "a")])
    assert by_txt.exit_code == 0, by_txt.output
    assert "no caption (--caption-ext txt): missing_caption 4\n" in by_txt.output
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert [b["count"] for b in report["caption_words"]][:4] == [0, 0, 0, 1]  # 0, 1, 2, 3-4 words
    by_json = CliRunner().invoke(
        app, ["data", "inspect", str(raw), "--out", str(tmp_path / "b"), "--caption-ext", "json"]
    )
    assert "no caption (--caption-ext json): missing_caption 1\n" in by_json.output
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert [b["count"] for b in report["caption_words"]][:4] == [0, 0, 4, 0]


def test_a_folder_of_shard_folders_names_the_glob(tmp_path):
    """`--in dataset/` where the tars are one level down (dataset/part-0/00000.tar): the error says the
    sub-folders are not searched and gives the glob that reads them."""
    for part in ("part-0", "part-1"):
        (tmp_path / "dataset" / part).mkdir(parents=True)
        write_raw_shard(
            tmp_path / "dataset" / part / "00000.tar", good_samples(np.random.default_rng(14), part, 2)
        )
    with pytest.raises(
        FileNotFoundError,
        match=r"dataset: no \.tar shards found; its sub-folders \(part-0, part-1\) "
        r"are not searched: give a glob such as .*/dataset/\*/\*\.tar$",
    ):
        _precompute(tmp_path / "dataset", tmp_path / "out")
    assert _precompute(f"{tmp_path}/dataset/*/*.tar", tmp_path / "out").counts["num_samples"] == 4


@pytest.mark.parametrize("value", [".txt", "TXT", "txt:caption", "json:"])
def test_a_caption_ext_that_matches_no_member_is_refused(value):
    """'--caption-ext .txt' (or TXT) matched no member, since the reader keys extensions in lower case without
    the dot: every sample was skipped as missing_caption. It is an option error now, in precompute and
    inspect."""
    from toolkit.data.inspect import InspectConfig

    for config, extra in ((PrecomputeConfig, {"model": "cliptk-tiny"}), (InspectConfig, {})):
        with pytest.raises(
            ValueError,
            match=rf"caption_ext: {value!r} is not a caption member: give its extension in "
            "lower case without the dot",
        ):
            build(config, {"input": "raw", "out": "out", "caption_ext": value, **extra})


def test_filtered_tars_with_stale_sidecars_are_explained(tmp_path):
    """img2dataset shards the user filtered (tars rewritten without some samples, parquet and _stats.json
    kept): the tars end cleanly, the sidecars promise more. The refusal says so and names the fix, which
    works."""
    raw = tmp_path / "raw"
    raw.mkdir()
    samples = good_samples(np.random.default_rng(15), "f", 20)
    write_raw_shard(raw / "00000.tar", samples[:12], parquet_keys=[k for k, _ in samples])
    with pytest.raises(
        ValueError,
        match=r"8 of 20 samples .* lost .*; 8 of them are listed in a shard's \.parquet or "
        r"_stats\.json but absent from a tar that ends cleanly: if those tars were "
        r"filtered or rewritten on purpose, delete their stale \.parquet and ",
    ):
        _precompute(raw, tmp_path / "out")
    (raw / "00000.parquet").unlink()
    (raw / "00000_stats.json").unlink()
    assert _precompute(raw, tmp_path / "out").counts["num_samples"] == 12
