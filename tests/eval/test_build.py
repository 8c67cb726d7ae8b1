"""build-set writes clip-benchmark's wds layout from folders, CSVs, the OpenMoji demo CSV and
Fashion-MNIST."""

from __future__ import annotations

import csv
import tarfile
from pathlib import Path

import pytest
import torch
from evalkit import build_set, make_folder, solid_png

from toolkit.core.config import ConfigError, build
from toolkit.eval.build import BuildSetConfig
from toolkit.eval.datasets import DatasetError, open_eval_set
from toolkit.eval.sources import FASHION_MNIST_DIR, FASHION_MNIST_FILES


def _keys(shard: Path) -> list[str]:
    with tarfile.open(shard) as tar:
        return sorted(m.name for m in tar)


def test_folder_classification_layout(tmp_path):
    make_folder(tmp_path / "in", [2, 1, 3])
    (tmp_path / "in" / "object_#1" / "notes.txt").write_text("not an image")
    result = build_set("folder", tmp_path / "in", tmp_path / "sets" / "three", max_per_shard=4)
    out = tmp_path / "sets" / "three"
    assert (out / "test" / "nshards.txt").read_text().strip() == "2"
    assert _keys(out / "test" / "1.tar") == ["s0000004.cls", "s0000004.png", "s0000005.cls", "s0000005.png"]
    assert (out / "classnames.txt").read_text().splitlines() == ["object #0", "object #1", "object #2"]
    assert "{c}" in (out / "zeroshot_classification_templates.txt").read_text()
    assert not (out / "dataset_type.txt").exists()
    assert result.counts["num_samples"] == 6 and result.counts["left_out"] == {"not an image file": 1}
    assert result.details["per_class"] == {"object #0": 2, "object #1": 1, "object #2": 3}
    assert open_eval_set(tmp_path / "sets", "three").num_samples == 6


def test_csv_classification_with_classnames_and_templates(tmp_path):
    for k in range(3):
        solid_png(tmp_path / f"{k}.png", k)
    (tmp_path / "data.csv").write_text("file,kind\n0.png,cat\n1.png,dog\n2.png,cat\n")
    (tmp_path / "names.txt").write_text("dog\ncat\nbird\n")
    (tmp_path / "tpl.txt").write_text("a drawing of a {c}.\n")
    build_set(
        "csv",
        tmp_path / "data.csv",
        tmp_path / "s" / "pets",
        image_column="file",
        label_column="kind",
        classnames=str(tmp_path / "names.txt"),
        templates=str(tmp_path / "tpl.txt"),
    )
    s = open_eval_set(tmp_path / "s", "pets")
    assert s.classnames == ("dog", "cat", "bird") and s.templates == ("a drawing of a {c}.",)
    with tarfile.open(s.shards[0]) as tar:
        assert [tar.extractfile(f"s000000{i}.cls").read() for i in range(3)] == [b"1", b"0", b"1"]


def test_csv_errors_name_row_and_column(tmp_path):
    (tmp_path / "a.csv").write_text("image,label\nmissing.png,cat\n")
    with pytest.raises(DatasetError, match=r"a.csv: row 2: image file not found: .*missing.png"):
        build_set("csv", tmp_path / "a.csv", tmp_path / "o")
    with pytest.raises(DatasetError, match=r"a.csv: missing column\(s\) caption"):
        build_set("csv", tmp_path / "a.csv", tmp_path / "o", task="retrieval")
    with pytest.raises(ConfigError, match="source 'folder' gives classification sets only"):
        build(BuildSetConfig, {"source": "folder", "input": "x", "out": "y", "task": "retrieval"})


def _openmoji_demo(root: Path) -> Path:
    """A small DIR/openmoji.csv like `toolkit data demo` writes (path,caption,group,subgroup,codepoints)."""
    root.mkdir(parents=True, exist_ok=True)
    rows = [
        ("smileys-emotion", "grinning face"),
        ("Animals & Nature", "dog face"),
        ("animals-nature", "cat face"),
        ("Flags", "chequered flag"),
        ("extras-openmoji", "openmoji logo"),
        ("Food & Drink", "red apple"),
    ]
    with (root / "openmoji.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["path", "caption", "group", "subgroup", "codepoints"])
        for k, (group, caption) in enumerate(rows):
            solid_png(root / "openmoji" / f"{k}.png", k, size=72)
            writer.writerow([f"openmoji/{k}.png", caption, group, "sub", f"1F60{k}"])
    return root


def test_openmoji_retrieval_and_group_classification(tmp_path):
    demo = _openmoji_demo(tmp_path / "demo")
    build_set("openmoji", demo, tmp_path / "sets" / "openmoji-retrieval", task="retrieval")
    ret = open_eval_set(tmp_path / "sets", "openmoji-retrieval")
    assert ret.kind == "retrieval" and ret.num_samples == 6
    with tarfile.open(ret.shards[0]) as tar:
        assert tar.extractfile("s0000001.txt").read() == b"dog face"
    result = build_set("openmoji", demo, tmp_path / "sets" / "openmoji-groups")
    cls = open_eval_set(tmp_path / "sets", "openmoji-groups")
    # Unicode order, only groups present; the OpenMoji-only 'extras' row is left out and counted.
    assert cls.classnames == ("smileys and emotion", "animals and nature", "food and drink", "flags")
    assert cls.num_samples == 5
    assert result.counts["left_out"] == {"group 'extras-openmoji' is not a Unicode emoji group": 1}
    assert result.details["per_class"] == {
        "smileys and emotion": 1,
        "animals and nature": 2,
        "food and drink": 1,
        "flags": 1,
    }


def test_openmoji_missing_csv_says_how_to_make_it(tmp_path):
    (tmp_path / "in").mkdir()  # the output beside the input: one inside it is refused (core/pathguard.py)
    with pytest.raises(DatasetError, match=r"openmoji.csv: missing; create it with `toolkit data demo --out"):
        build_set("openmoji", tmp_path / "in", tmp_path / "o")


def test_fashion_mnist_missing_files_error(tmp_path):
    (tmp_path / "in").mkdir()  # the output beside the input: one inside it is refused (core/pathguard.py)
    with pytest.raises(DatasetError, match=r"Fashion-MNIST file not found: .*t10k-images-idx3-ubyte.gz"):
        build_set("fashion-mnist", tmp_path / "in", tmp_path / "o")


@pytest.mark.skipif(
    not all((Path(FASHION_MNIST_DIR) / f).is_file() for f in FASHION_MNIST_FILES["test"]),
    reason="Debian package dataset-fashion-mnist not installed (apt-get install dataset-fashion-mnist)",
)
def test_fashion_mnist_real_files(tmp_path):
    from PIL import Image

    result = build_set("fashion-mnist", "", tmp_path / "fashion-mnist", limit=50)
    s = open_eval_set(tmp_path, "fashion-mnist")
    assert s.num_samples == 50 and len(s.classnames) == 10 and s.classnames[9] == "ankle boot"
    assert sum(result.details["per_class"].values()) == 50 and len(result.details["per_class"]) == 10
    assert result.counts["num_read"] == 50  # only the kept images are decoded and encoded
    with tarfile.open(s.shards[0]) as tar:
        img = Image.open(tar.extractfile("s0000000.png"))
        assert img.size == (28, 28) and img.mode == "L"
        # The first test image of Fashion-MNIST is an ankle boot (label 9).
        assert tar.extractfile("s0000000.cls").read() == b"9"


@pytest.mark.parametrize("side", [10_000, 20_000])  # above cliptk's limit (89M pixels); above PIL's (179M)
def test_decompression_bomb_png_is_named_not_a_traceback(tmp_path, side):
    """Issue 15 item 9: PIL's DecompressionBombError escaped as a traceback naming no file."""
    from PIL import Image
    from typer.testing import CliRunner

    from toolkit.cli.main import app

    make_folder(tmp_path / "in", [1, 1])
    bomb = tmp_path / "in" / "object_#0" / "bomb.png"
    Image.new("1", (side, side)).save(bomb)  # a few kB on disk, side*side pixels decoded
    result = CliRunner().invoke(
        app,
        [
            "--quiet",
            "eval",
            "build-set",
            "--source",
            "folder",
            "--input",
            str(tmp_path / "in"),
            "--out",
            str(tmp_path / "set"),
        ],
    )
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert (
        f"error: DatasetError: {tmp_path / 'in' / 'object_#0'}" in result.output
        and str(bomb) in result.output
    )


def test_alpha_and_16bit_images_read_as_training_reads_them(tmp_path):
    """A transparent PNG was read with PIL's convert('RGB') (transparent pixels black, training mattes them on
    white) and a 16-bit grey PNG saturated to white (training scales 0..65535 to 0..255): the model saw other
    pixels in evaluation than in training. A 16-bit TIFF (re-encoded by build-set) went the same way."""
    import numpy as np
    from evalkit import to_tensor
    from PIL import Image

    from toolkit.data.images import decode_rgb
    from toolkit.eval.datasets import make_eval_loader

    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[2:6, 2:6] = (255, 0, 0, 255)  # an opaque red square, the rest transparent black
    paths = {
        "a_alpha": tmp_path / "in" / "a_alpha" / "a.png",
        "b_grey16": tmp_path / "in" / "b_grey16" / "g.png",
        "c_tiff16": tmp_path / "in" / "c_tiff16" / "t.tif",
    }
    for p in paths.values():
        p.parent.mkdir(parents=True)
    Image.fromarray(rgba, "RGBA").save(paths["a_alpha"])
    Image.fromarray(np.full((8, 8), 30000, np.uint16)).save(paths["b_grey16"])  # I;16, mid grey
    Image.fromarray(np.full((8, 8), 50000, np.uint16)).save(paths["c_tiff16"])
    build_set("folder", tmp_path / "in", tmp_path / "sets" / "deep")
    eval_set = open_eval_set(tmp_path / "sets", "deep")
    images, labels = next(iter(make_eval_loader(eval_set, to_tensor, 8)))
    assert labels.tolist() == [0, 1, 2]
    got = (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for i, p in enumerate(paths.values()):
        want, _ = decode_rgb(p.read_bytes(), 8)  # what precompute stores for the same file
        np.testing.assert_array_equal(got[i], want, err_msg=str(p))
    assert got[0, 0, 0].tolist() == [255, 255, 255] and got[1, 0, 0].tolist() == [117, 117, 117]


def test_folder_hidden_folders_are_not_classes_and_stray_files_are_counted(tmp_path):
    """A Jupyter `.ipynb_checkpoints` folder beside the class folders became a class (".ipynb checkpoints",
    with its images as samples) and an image beside the class folders was dropped without a word."""
    make_folder(tmp_path / "in", [2, 1])
    solid_png(tmp_path / "in" / ".ipynb_checkpoints" / "0.png", 3)
    solid_png(tmp_path / "in" / "object_#1" / ".thumbs" / "0.png", 4)  # hidden inside a class folder
    solid_png(tmp_path / "in" / "stray.png", 5)
    result = build_set("folder", tmp_path / "in", tmp_path / "sets" / "s")
    assert (tmp_path / "sets" / "s" / "classnames.txt").read_text().splitlines() == ["object #0", "object #1"]
    assert result.counts["num_samples"] == 3
    assert result.counts["left_out"] == {
        "hidden folder": 1,
        f"file outside the class folders of {tmp_path / 'in'}": 1,
    }


def test_retrieval_csv_rows_naming_one_image_by_different_paths_are_one_sample(tmp_path):
    """'img/0.png' and './img/0.png' became two samples with the same pixels: each of their captions then had
    two equally right images, and R@1 depended on the order of ties."""
    for k in range(2):
        solid_png(tmp_path / "img" / f"{k}.png", k)
    (tmp_path / "pairs.csv").write_text(
        "image,caption\nimg/0.png,a zero\n./img/0.png,another zero\n"
        f"{tmp_path / 'img' / '0.png'},zero again\nimg/../img/1.png,a one\n"
    )
    result = build_set("csv", tmp_path / "pairs.csv", tmp_path / "sets" / "r", task="retrieval")
    assert result.counts["num_samples"] == 2
    with tarfile.open(tmp_path / "sets" / "r" / "test" / "0.tar") as tar:
        texts = [tar.extractfile(m).read().decode() for m in tar if m.name.endswith(".txt")]
    assert texts == ["a zero\nanother zero\nzero again", "a one"]


def test_empty_class_folder_stays_a_class_with_a_warning(tmp_path, caplog):
    make_folder(tmp_path / "in", [1, 2])
    (tmp_path / "in" / "zz_nothing").mkdir()
    with caplog.at_level("WARNING"):
        result = build_set("folder", tmp_path / "in", tmp_path / "sets" / "s")
    assert result.details["per_class"] == {"object #0": 1, "object #1": 2, "zz nothing": 0}
    assert (
        "1 class(es) without an image: 'zz nothing'; they stay classes the model can predict" in caplog.text
    )


def test_csv_integer_labels_with_classnames_are_line_numbers(tmp_path):
    """Labels written as class indices (clip-benchmark's .cls convention, ImageNet-style CSVs) with a
    --classnames file were refused: "label '0' is not in the class names"."""
    for k in range(3):
        solid_png(tmp_path / f"{k}.png", k)
    (tmp_path / "labels.csv").write_text("image,label\n0.png,2\n1.png,0\n2.png,2\n")
    (tmp_path / "names.txt").write_text("cat\ndog\nbird\n")
    result = build_set(
        "csv", tmp_path / "labels.csv", tmp_path / "sets" / "idx", classnames=str(tmp_path / "names.txt")
    )
    assert result.details["per_class"] == {"cat": 1, "dog": 0, "bird": 2}
    (tmp_path / "labels.csv").write_text("image,label\n0.png,2\n1.png,3\n")
    with pytest.raises(
        DatasetError,
        match=r"row 3: label '3': no label is a class name, so labels are line "
        r"numbers of the class names, which has 3 \(0..2\)",
    ):
        build_set(
            "csv", tmp_path / "labels.csv", tmp_path / "sets" / "bad", classnames=str(tmp_path / "names.txt")
        )
    (tmp_path / "digits.txt").write_text("1\n0\n")  # names that are digits are names, not line numbers
    (tmp_path / "labels.csv").write_text("image,label\n0.png,0\n1.png,1\n")
    result = build_set(
        "csv", tmp_path / "labels.csv", tmp_path / "sets" / "dig", classnames=str(tmp_path / "digits.txt")
    )
    assert result.details["per_class"] == {"1": 1, "0": 1}
    with tarfile.open(tmp_path / "sets" / "dig" / "test" / "0.tar") as tar:
        assert [tar.extractfile(m).read() for m in tar if m.name.endswith(".cls")] == [b"1", b"0"]


def test_spreadsheet_exports_bom_and_utf16_and_bad_bytes_are_handled(tmp_path):
    """Excel's 'CSV UTF-8' starts with a byte order mark: the first column read '\\ufeffimage' ('missing
    column(s) image') and a BOM classnames file made the first class '\\ufeffkitty' without a word; a UTF-16
    or non-UTF-8 file raised a bare UnicodeDecodeError naming no file."""
    for k in range(2):
        solid_png(tmp_path / f"{k}.png", k)
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbfimage,label\n0.png,kitty\n1.png,puppy\n")
    (tmp_path / "names.txt").write_bytes(b"\xef\xbb\xbfkitty\npuppy\n")
    build_set("csv", tmp_path / "bom.csv", tmp_path / "sets" / "bom", classnames=str(tmp_path / "names.txt"))
    assert (tmp_path / "sets" / "bom" / "classnames.txt").read_bytes() == b"kitty\npuppy\n"
    (tmp_path / "u16.csv").write_bytes("image,label\n0.png,kitty\n".encode("utf-16"))
    with pytest.raises(DatasetError, match=r"u16.csv: UTF-16 text \(CSV\); save it as UTF-8"):
        build_set("csv", tmp_path / "u16.csv", tmp_path / "sets" / "u16")
    (tmp_path / "latin1.txt").write_bytes("kitty\npuppé\n".encode("latin-1"))
    with pytest.raises(DatasetError, match=r"latin1.txt: line 2: not UTF-8 \(classnames\)"):
        build_set(
            "csv", tmp_path / "bom.csv", tmp_path / "sets" / "l1", classnames=str(tmp_path / "latin1.txt")
        )
