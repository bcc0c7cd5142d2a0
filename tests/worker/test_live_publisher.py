"""The live-channel publisher: best effort while Redis is down, and a status change is never swallowed."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time

import pytest

from worker.live import Publisher

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(port: int, tmp) -> subprocess.Popen:
    import redis

    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    client = redis.Redis(port=port)
    for _ in range(200):
        with contextlib.suppress(redis.ConnectionError):
            if client.ping():
                break
        time.sleep(0.05)
    client.close()
    return proc


def _received(pubsub, timeout: float = 3.0) -> list[dict]:
    out, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        msg = pubsub.get_message(timeout=0.2)
        if msg and msg["type"] == "message":
            out.append(json.loads(msg["data"]))
    return out


def test_status_change_is_sent_even_during_backoff(tmp_path) -> None:
    import redis

    port = _free_port()
    proc = _start(port, tmp_path)
    pub = Publisher(f"redis://127.0.0.1:{port}/0", backoff_seconds=60.0)
    try:
        assert pub.publish("job_x", (1, 2, 3), "running")
        proc.kill()
        proc.wait(timeout=10)
        assert not pub.publish("job_x", (2, 3, 4), "running")  # Redis down: the publisher backs off
        assert pub.failures == 1
        proc = _start(port, tmp_path)
        listener = redis.Redis(port=port)
        pubsub = listener.pubsub()
        pubsub.subscribe("peagle:job:job_x")
        _received(pubsub, 0.5)  # subscription confirmation
        assert not pub.publish("job_x", (3, 4, 5), "running")  # still inside the 60 s back-off: skipped
        assert pub.publish_status("job_x", "succeeded")  # a status change is always attempted
        got = _received(pubsub)
        assert got == [{"job_id": "job_x", "event_seq": 3, "metric_seq": 4, "log_seq": 5, "status": "succeeded"}]
        pubsub.close()
        listener.close()
    finally:
        pub.close()
        proc.kill()
        proc.wait(timeout=10)
