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

    conn = Connection("filesystem://", transport=FILESYSTEM_TRANSPORT, transport_options={
        "data_folder_in": str(folder), "data_folder_out": str(folder), "control_folder": str(folder / "control")})
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


def test_a_worker_binding_while_another_creates_the_exchange_table_reads_no_bindings(tmp_path) -> None:
    """The CI failure of 2026-11-29: two workers started at once both bind their queues; kombu's binder
    creates the exchange table file, then locks and writes it, and the other one read it empty in between
    and died of the JSONDecodeError ('only 1 of 2 workers became ready'). Here the table file is as that
    first binder leaves it between its create and its write: empty."""
    conn, ch = _channel(tmp_path)
    try:
        table = ch.control_folder / "q.exchange"
        ch.control_folder.mkdir()
        table.write_bytes(b"")
        assert ch.get_table("q") == []
        ch._queue_bind("q", "q", None, "q")
        ch._queue_bind("q", "q", None, "q")  # once only
        assert [t.queue for t in ch.get_table("q")] == ["q"]
    finally:
        conn.release()


def _bind_at_once(folder: str, queue: str, barrier: Any) -> None:
    conn, ch = _channel(Path(folder))
    try:
        barrier.wait(30)
        ch._queue_bind("shared", queue, None, queue)
    finally:
        conn.release()


def test_workers_binding_at_once_all_get_their_binding(tmp_path) -> None:
    """Eight processes bind their own queue to one exchange at the same moment, five times over: none fails
    and the table holds all eight."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    for round_ in range(5):
        folder = tmp_path / str(round_)
        folder.mkdir()
        barrier = ctx.Barrier(8)
        procs = [ctx.Process(target=_bind_at_once, args=(str(folder), f"q{i}", barrier)) for i in range(8)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * 8
        conn, ch = _channel(folder)
        try:
            assert sorted(t.queue for t in ch.get_table("shared")) == [f"q{i}" for i in range(8)]
        finally:
            conn.release()
