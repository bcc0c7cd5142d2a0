"""The worker's announcer thread and the pool's forks (the "received, never ran" flake).

The Celery prefork pool forks a new child for every job (`worker_max_tasks_per_child: 1`) while the
announcer thread of the worker's main process beats into the database. A fork in the middle of a beat
copies SQLite's per-process lock table, with the beat's write lock in it, into the child: the child's own
connection then finds the database locked until its busy timeout, the job's claim fails and the job sits
queued. Reproduced with a real SQLite database and a real `os.fork` taken while a beat holds its write.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from service.db import upgrade
from service.settings import Settings


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_fork_during_a_beat_leaves_the_child_a_usable_database(tmp_path: Path, monkeypatch: Any) -> None:
    import worker.announce as announce_mod

    db = tmp_path / "db.sqlite"
    upgrade(f"sqlite:///{db}")
    inside, go_on = threading.Event(), threading.Event()
    real = announce_mod.announce

    def slow_announce(session: Any, **kw: Any) -> None:  # a beat that holds its write lock until told
        real(session, **kw)
        session.flush()  # the INSERT is sent: this connection holds SQLite's write lock
        inside.set()
        go_on.wait(5)

    monkeypatch.setattr(announce_mod, "announce", slow_announce)
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{db}", heartbeat_seconds=60)
    announcer = announce_mod.Announcer(settings, name="w@h", queues=["q"])
    announcer.start()
    try:
        assert inside.wait(10), "the beat did not start"
        threading.Timer(0.5, go_on.set).start()  # the beat ends half a second after the fork is asked for
        pid = os.fork()
        if pid == 0:  # the child, as a pool child claiming its job: a write on a connection of its own
            code = 1
            try:
                con = sqlite3.connect(str(db), timeout=3)
                con.execute("UPDATE worker SET gpus = 7")
                con.commit()
                con.close()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the forked child found the database locked"
    finally:
        go_on.set()
        announcer.stop()
