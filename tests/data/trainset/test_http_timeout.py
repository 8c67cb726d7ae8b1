"""An index set served over HTTP by a server that stops answering: the read fails after the bounded wait
(files.HTTP_TIMEOUT_S), naming the URL and the sample (issue 43 item 6; before: ~296 s of silence, then an
empty FSTimeoutError)."""

from __future__ import annotations

import threading
import time
from http.server import ThreadingHTTPServer

import numpy as np
import pytest
from datakit import good_samples, precompute, write_raw_shard

from toolkit.core import files
from toolkit.data.acquire.serve import QuietHandler
from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.storage import tables as refs


class StallingHandler(QuietHandler):
    """Answers nothing while ``server.stalled`` is set (as a SIGSTOPped server: the connection is
    accepted)."""

    def send_head(self):
        while self.server.stalled.is_set() and not self.server.closing.is_set():
            time.sleep(0.05)
        return super().send_head()


@pytest.fixture
def served_index(tmp_path):
    site = tmp_path / "site"
    (site / "raw").mkdir(parents=True)
    write_raw_shard(site / "raw" / "00000.tar", good_samples(np.random.default_rng(0), "a", 4))
    precompute(site / "raw", site / "index", storage="index")
    handler = type("H", (StallingHandler,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(site)))
    server.stalled, server.closing, server.root = threading.Event(), threading.Event(), str(site)
    server.count_lock, server.request_counts = threading.Lock(), __import__("collections").Counter()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}/index"
    server.closing.set()
    server.shutdown()
    server.server_close()


def test_a_server_that_stops_answering_is_named_with_the_sample(served_index, monkeypatch):
    server, url = served_index
    monkeypatch.setattr(files, "HTTP_TIMEOUT_S", 1.0)
    ds = TrainDataset.open(url)
    reader = refs.RefReader(ds, None)
    try:
        table = reader.table(0)
        assert len(reader.image_bytes(0, 0, table[0])) == int(table[0]["length"])  # a live server answers
        server.stalled.set()
        start = time.monotonic()
        with pytest.raises(
            TimeoutError,
            match=rf"{url[: -len('index')]}raw/00000.tar: no answer within 1 s "
            r"\(CLIPTK_HTTP_TIMEOUT_S\) while reading sample 2 of 00000.idx \(id 2\)",
        ):
            reader.image_bytes(0, 2, table[2])
        assert time.monotonic() - start < 20
    finally:
        reader.close()
