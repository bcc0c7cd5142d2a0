"""The embedded broker's transport (service/fsbroker.py): a consumer polling while a message is being
written never reads it half-written, and a damaged message never stops a worker."""

from __future__ import annotations

import builtins
import io
import logging
from pathlib import Path
from queue import Empty
from typing import Any

import pytest

from service.queue import FILESYSTEM_TRANSPORT, broker_folders, celery_config, make_producer
from service.settings import get_settings


def _channel(folder: Path) -> Any:
    from kombu import Connection

    conn = Connection("filesystem://", transport=FILESYSTEM_TRANSPORT,
                      transport_options={"data_folder_in": str(folder), "data_folder_out": str(folder)})
    return conn, conn.default_channel


def test_a_consumer_polling_mid_write_never_reads_a_partial_message(tmp_path, monkeypatch) -> None:
    """The CI failure of 2026-11-28: a worker took a message file between its creation and its write, read
    it empty, and died of the JSONDecodeError. Here a second channel polls the queue at the moment the
    producer writes into any file of the queue folder."""
    conn, producer = _channel(tmp_path)
    conn2, consumer = _channel(tmp_path)
    seen: list[Any] = []
    real_open = builtins.open

    class Hooked:
        def __init__(self, f: Any) -> None:
            self._f = f

        def write(self, data: Any) -> Any:
            try:
                seen.append(consumer._get("q"))
            except Empty:
                seen.append("empty")
            return self._f.write(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._f, name)

        def __enter__(self) -> Hooked:
            self._f.__enter__()
            return self

        def __exit__(self, *exc: Any) -> Any:
            return self._f.__exit__(*exc)

    def hooked_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, mode, *args, **kwargs)
        return Hooked(f) if set(mode) & set("wxa") and Path(file).parent == tmp_path else f

    try:
        monkeypatch.setattr(builtins, "open", hooked_open)
        monkeypatch.setattr(io, "open", hooked_open)  # what Path.open calls
        producer._put("q", {"n": 1})
        monkeypatch.undo()
        assert seen == ["empty"]  # nothing of the message was visible while it was written
        assert consumer._get("q") == {"n": 1}
        with pytest.raises(Empty):
            consumer._get("q")
        assert list(tmp_path.iterdir()) == []  # no claimed or partial file left behind
    finally:
        conn.release()
        conn2.release()


def test_two_consumers_take_each_message_once(tmp_path) -> None:
    conn, a = _channel(tmp_path)
    conn2, b = _channel(tmp_path)
    try:
        for n in range(20):
            a._put("q", {"n": n})
        got = [(a if i % 2 else b)._get("q")["n"] for i in range(20)]
        assert sorted(got) == list(range(20))  # each once (kombu orders by millisecond, not within one)
        for ch in (a, b):
            with pytest.raises(Empty):
                ch._get("q")
    finally:
        conn.release()
        conn2.release()


def test_a_damaged_message_is_dropped_with_a_warning_not_raised(tmp_path, caplog) -> None:
    conn, ch = _channel(tmp_path)
    try:
        (tmp_path / "0_aaaa.q.msg").write_bytes(b"")  # damaged outside the service; "0_" sorts first
        ch._put("q", {"n": 2})
        with caplog.at_level(logging.WARNING, logger="service.fsbroker"):
            assert ch._get("q") == {"n": 2}
        assert "dropped message 0_aaaa.q.msg of queue q" in caplog.text
        assert list(tmp_path.iterdir()) == []
    finally:
        conn.release()


def test_the_api_and_the_worker_use_it(tmp_path) -> None:
    from celery import Celery

    from service.fsbroker import Transport

    s = get_settings(home=tmp_path, embedded=False)
    assert celery_config(s)["broker_transport"] == FILESYSTEM_TRANSPORT
    app = Celery("t", set_as_current=False)
    app.conf.update(celery_config(s))
    with app.connection_for_write() as conn:
        assert isinstance(conn.transport, Transport)
    p = make_producer(s)
    try:
        p.send_train("job_Z", "cpu")
        assert len(p.waiting_task_ids("cpu") or ()) == 1
    finally:
        p.close()
    assert [f.name.endswith(".cpu.msg") for f in broker_folders(s)["queue"].iterdir()] == [True]
