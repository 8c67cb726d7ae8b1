"""A missing or malformed evaluation set gives an error naming what is missing."""

from __future__ import annotations

import io
import shutil
import tarfile

import pytest

from toolkit.eval.datasets import DatasetError, open_eval_set
from toolkit.eval.score import evaluate_set


@pytest.fixture
def copy_set(sets_root, tmp_path):
    def copy(name: str):
        shutil.copytree(sets_root / name, tmp_path / name)
        return tmp_path / name

    return copy


def test_missing_directory_names_it_and_lists_sets(sets_root):
    with pytest.raises(DatasetError, match=r"nope: dataset directory not found; sets under .*cls7"):
        open_eval_set(sets_root, "nope")


@pytest.mark.parametrize(
    "victim, message",
    [
        ("test/nshards.txt", r"test/nshards.txt: missing"),
        ("test/0.tar", r"test/0.tar: missing \(1 of 1 shards"),
        ("classnames.txt", r"classnames.txt: missing"),
        ("zeroshot_classification_templates.txt", r"zeroshot_classification_templates.txt: missing"),
    ],
)
def test_missing_file_is_named(copy_set, victim, message):
    path = copy_set("cls7")
    (path / victim).unlink()
    with pytest.raises(DatasetError, match=message):
        open_eval_set(path.parent, path.name)


@pytest.mark.parametrize(
    "file, text, message",
    [
        ("test/nshards.txt", "two\n", r"nshards.txt: expected a positive integer, got 'two'"),
        ("test/nshards.txt", "2\n", r"test/1.tar: missing \(1 of 2 shards"),
        (
            "zeroshot_classification_templates.txt",
            "a photo of a {c}.\na photo.\n",
            r"template 'a photo.' has no \{c\}",
        ),
        ("classnames.txt", "", r"classnames.txt: empty"),
        ("dataset_type.txt", "segmentation\n", r"unsupported dataset type 'segmentation'"),
        ("test/0.tar", "not a tar", r"0.tar: not a readable tar file"),
    ],
)
def test_malformed_file_is_named(copy_set, file, text, message):
    path = copy_set("cls7")
    (path / file).write_text(text)
    with pytest.raises(DatasetError, match=message):
        open_eval_set(path.parent, path.name)


def _write_tar(path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_bad_sample_is_named_when_read(copy_set, sets_root):
    from evalkit import TiedModel, tied_tokenizer, to_tensor

    path = copy_set("cls7")
    png = (sets_root.parent / "folder" / "object_#0" / "0.png").read_bytes()
    _write_tar(path / "test/0.tar", {"a.png": png, "a.cls": b"0", "b.png": png, "b.cls": b"12"})
    eval_set = open_eval_set(path.parent, path.name)
    with pytest.raises(DatasetError, match=r"0.tar: sample 'b': label '12' is not an index into the 7 lines"):
        evaluate_set(TiedModel(7), tied_tokenizer, to_tensor, eval_set)
    _write_tar(path / "test/0.tar", {"a.png": png, "b.png": png, "b.cls": b"1"})
    with pytest.raises(DatasetError, match=r"sample 'a': no label \(.cls\)"):
        evaluate_set(TiedModel(7), tied_tokenizer, to_tensor, open_eval_set(path.parent, path.name))


def test_retrieval_sample_without_captions(copy_set, sets_root):
    from evalkit import TiedModel, tied_tokenizer, to_tensor

    path = copy_set("ret9")
    png = (sets_root.parent / "csv9" / "img" / "0.png").read_bytes()
    _write_tar(path / "test/0.tar", {"a.png": png, "a.txt": b"#0", "b.png": png})
    with pytest.raises(DatasetError, match=r"sample 'b': no captions \(.txt\)"):
        evaluate_set(TiedModel(9), tied_tokenizer, to_tensor, open_eval_set(path.parent, path.name))


@pytest.mark.parametrize(
    "template, message",
    [
        ("a {c} emoji :-}", r"line 2: template 'a \{c\} emoji :-\}' cannot be filled in .*Single '\}'"),
        ("a {c} in {place}", r"line 2: template 'a \{c\} in \{place\}' cannot be filled in .*KeyError"),
        ("a {c} {}", r"line 2: .*IndexError"),
        ("a {c} and {{c}}", None),  # a literal brace written as {{ }} is fine beside a real {c}
        ("a {{c}}", r"line 2: template 'a \{\{c\}\}' never inserts the class name"),
    ],
)
def test_template_that_cannot_be_filled_in_is_named(copy_set, template, message):
    """clip-benchmark fills templates with str.format(c=name): a stray brace failed mid-evaluation with
    'ValueError: Single '}' encountered in format string', naming neither the file nor the template."""
    path = copy_set("cls7")
    (path / "zeroshot_classification_templates.txt").write_text(f"a photo of a {{c}}.\n{template}\n")
    if message is None:
        assert open_eval_set(path.parent, path.name).templates[1] == template
        return
    with pytest.raises(DatasetError, match=rf"zeroshot_classification_templates.txt: {message}"):
        open_eval_set(path.parent, path.name)


def test_build_set_refuses_template_that_cannot_be_filled_in(tmp_path):
    from evalkit import build_set, make_folder

    make_folder(tmp_path / "in", [1, 1])
    (tmp_path / "tpl.txt").write_text("a photo of a {c}.\na {c} emoji :-}\n")
    with pytest.raises(
        DatasetError, match=r"tpl.txt: line 2: template 'a \{c\} emoji :-\}' cannot be filled in"
    ):
        build_set("folder", tmp_path / "in", tmp_path / "sets" / "s", templates=str(tmp_path / "tpl.txt"))
