"""--report-to: metrics.jsonl, TensorBoard and wandb (offline without credentials), any subset."""

from __future__ import annotations

import pytest
from trainkit import metrics, train_cfg

from toolkit.train.run import run


def _wandb_history(run_dir) -> list[dict]:
    """Every history row of the offline run folder's ``run-*.wandb`` log. wandb 0.31 ships no Python reader,
    so this reads its documented LevelDB-log framing: a 7-byte file header (":W&B", magic, version), 32 KiB
    blocks of records [crc32 (4), length (2, LE), type (1: full, 2: first, 3: middle, 4: last)] + payload, a
    block tail under 7 bytes zero-padded; each full payload is a ``wandb_internal_pb2.Record``."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    (log,) = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    data, block, pos, payload, rows = log.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:
            pos += left
            continue
        payload, pos = payload + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            payload = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item
                    }
                )
    return rows


def test_wandb_runs_offline_without_credentials_and_holds_the_metrics(demo_train, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the test environment disables wandb
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    out = tmp_path / "run"
    run(train_cfg(demo_train, out, steps=3, report_to=["jsonl", "wandb"]))
    rows = _wandb_history(out)
    logged = metrics(out)
    assert [r["_step"] for r in rows] == [m["step"] for m in logged] == [1, 2, 3]
    for row, m in zip(rows, logged, strict=True):
        assert row["loss"] == pytest.approx(m["loss"])
        assert row["samples_per_s"] == pytest.approx(m["samples_per_s"])
        assert row["samples_per_s_per_device"] == pytest.approx(m["samples_per_s"])  # one device


def test_report_to_chooses_the_sinks(demo_train, tmp_path):
    run(train_cfg(demo_train, tmp_path / "tb", steps=2, tensorboard=True, report_to=["tensorboard"]))
    assert not (tmp_path / "tb" / "metrics.jsonl").exists()
    assert any((tmp_path / "tb" / "tensorboard").glob("events.out.tfevents.*"))
    assert not (tmp_path / "tb" / "wandb").exists()
    with pytest.raises(ValueError, match="unknown sink"):
        train_cfg(demo_train, tmp_path / "bad", report_to=["jsonl", "mlflow"])


def test_wandb_with_credentials_and_no_reachable_server_goes_offline_with_one_warning(
    demo_train, tmp_path, monkeypatch, caplog
):
    """Issue 43 item 14: ~110 s before step 1, then 161 lines with two tracebacks. The server is a closed
    port on 127.0.0.1, so nothing leaves the machine."""
    import logging
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="toolkit"):
        run(train_cfg(demo_train, out, steps=2, report_to=["jsonl", "wandb"]))
    warnings = [r.getMessage() for r in caplog.records if "wandb" in r.getMessage()]
    assert len(warnings) == 1 and f"cannot reach http://127.0.0.1:{port}" in warnings[0], warnings
    assert "logging offline" in warnings[0] and "wandb sync" in warnings[0]
    assert [r["_step"] for r in _wandb_history(out)] == [1, 2]
