"""The fetch worker's event protocol survives a stdout shared by img2dataset's processes and threads."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import types

from toolkit.data.acquire.fetch_process import WorkerRun
from toolkit.data.acquire.fetch_worker import EVENT_PREFIX


def _events_from(text: str) -> tuple[list[dict], list[str]]:
    run = object.__new__(WorkerRun)  # no worker process: only the stdout parser is under test
    run.proc = types.SimpleNamespace(stdout=io.StringIO(text))
    run.tail = []
    return list(run.events()), list(run.tail)


def test_two_events_on_one_line_and_text_around_them_are_split():
    # CI once saw '{"urls": 123}@@cliptk-fetch {...}' on one line: json.loads failed with 'Extra data'
    text = (
        f'{EVENT_PREFIX}{{"urls": 123}}{EVENT_PREFIX}{{"urls": 2}}\n'
        f'50%|###  |\r{EVENT_PREFIX}{{"shard": 0, "ok": true, "urls": 1}} trailing\n'
        f'img2dataset says hi {EVENT_PREFIX}{{"done": true}}\n{EVENT_PREFIX}{{broken\n'
    )
    events, tail = _events_from(text)
    assert events == [{"urls": 123}, {"urls": 2}, {"shard": 0, "ok": True, "urls": 1}, {"done": True}]
    assert tail == ["50%|###  |", " trailing", "img2dataset says hi ", EVENT_PREFIX + "{broken"]


def test_emit_writes_each_event_as_one_line():
    code = (
        "from toolkit.data.acquire.fetch_worker import emit\n"
        "import threading\n"
        "ts = [threading.Thread(target=lambda i=i: [emit({'urls': i}) for _ in range(200)]) for i in "
        "range(4)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONUNBUFFERED": "1", "PATH": "/usr/bin:/bin"},
    ).stdout
    lines = out.splitlines()
    assert len(lines) == 800
    assert all(line.startswith(EVENT_PREFIX) and json.loads(line[len(EVENT_PREFIX) :]) for line in lines)
