"""What evaluation tells the user (issue 25 item 5): sklearn's warnings come through the toolkit's log named
after the set (not as raw UserWarning text that --quiet still printed), and an empty shard is warned about."""

from __future__ import annotations

import logging
import shutil
import tarfile
import warnings

from evalkit import TiedModel, tied_tokenizer, to_tensor

from toolkit.eval.datasets import open_eval_set
from toolkit.eval.score import evaluate_set


def test_a_predicted_class_without_samples_is_logged_not_warned(sets_root, tmp_path, caplog):
    root = tmp_path / "sets"
    shutil.copytree(sets_root / "cls7", root / "cls8")
    with (root / "cls8" / "classnames.txt").open("a") as fh:
        fh.write("object #7\n")  # listed, but no image of it in the set
    eval_set = open_eval_set(root, "cls8")
    # class-0 images match the text of class 7, so the model predicts a class with no sample
    model = TiedModel(8, perm=[7, 1, 2, 3, 4, 5, 6, 0])
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="toolkit"):
        warnings.simplefilter("always")
        metrics = evaluate_set(model, tied_tokenizer, to_tensor, eval_set, batch_size=4)
    assert [str(w.message) for w in caught] == []
    assert metrics["acc1"] < 1
    records = [r for r in caplog.records if "no sample in the set" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.INFO  # --quiet (warnings only) hides it
    assert records[0].getMessage().startswith("cls8: the model predicted classes that have no sample")


def test_an_empty_shard_is_warned_about_naming_it(sets_root, tmp_path, caplog):
    root = tmp_path / "sets"
    shutil.copytree(sets_root / "cls7", root / "cls7")
    (root / "cls7" / "test" / "nshards.txt").write_text("2\n")
    with tarfile.open(root / "cls7" / "test" / "1.tar", "w"):
        pass  # a valid tar holding nothing
    with caplog.at_level(logging.WARNING, logger="toolkit"):
        eval_set = open_eval_set(root, "cls7")
    assert eval_set.num_samples == 14 and len(eval_set.shards) == 2
    assert "1 of 2 shards hold no sample with an image (1.tar); evaluating the 14 samples" in caplog.text
