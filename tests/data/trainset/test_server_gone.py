"""A training set served over HTTP whose server stops mid-run (issue 43 item 17): the error names the URL and
the batch being read, and says the server is gone; it used to say `FileNotFoundError: .../dataset.json`
(fsspec's http turns a refused connection into "not found") or a bare "Cannot connect to host"."""

from __future__ import annotations

import numpy as np
import pytest

from toolkit.data.acquire.serve import serve
from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.loader import make_loader
from toolkit.data.trainset.storage.pixels import SampleReader


def test_a_dead_server_is_named_not_a_missing_file(small_train):
    root, _ = small_train
    with serve(str(root)) as server:
        url = server.url.rstrip("/")
        ds = TrainDataset.open(url)
        reader = SampleReader(ds)
        assert reader.read(np.array([0, 1], np.int64))["image"].shape[0] == 2
        with pytest.raises(FileNotFoundError, match="not found"):  # a 404 still reads as "not found"
            TrainDataset.open(url + "/nothing-here")
    with pytest.raises(ConnectionError, match=rf"^{url}/dataset.json: cannot read it from its server"):
        TrainDataset.open(url)
    with pytest.raises(ConnectionError) as err:
        next(iter(make_loader(ds, batch_size=4, num_steps=1)))
    text = str(err.value)
    assert text.startswith(f"{url}/0") and "cannot read it from its server" in text, text
    assert "the batch of step 0: samples " in text, text
    reader.close()
