"""Issue 39: `peagle jobs logs JOB --follow` says where the job is at once (status, phase since when,
progress with the time left), then shows its events (phase changes once, checkpoints, attempts) between
the log lines until the job ends; a real uvicorn server, the CLI as a user runs it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

import peagle.cli.jobs as jobs_cli
from api.main import create_app
from peagle.cli import app as cli_app
from peagle.client import PeagleClient
from service.db.events import add_event
from service.db.models import Job, JobLog
from service.db.session import session_scope


def _log(sim: Any, job_id: str, message: str) -> None:
    with session_scope(sim.sessions) as s:
        seq = s.scalar(sa.update(Job).where(Job.id == job_id).values(log_seq=Job.log_seq + 1).returning(Job.log_seq))
        s.add(JobLog(job_id=job_id, seq=seq, level="info", message=message))


def _event(sim: Any, job_id: str, kind: str, message: str, phase: str | None = None, **job_values: Any) -> None:
    with session_scope(sim.sessions) as s:
        add_event(s, job_id, kind=kind, message=message, attempt=0, phase=phase, job_values=job_values or None)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_follow_says_status_and_phase_first_and_shows_events(settings_factory: Any, sim: Any, live_server: Any,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    key = sim.key("ivy", "write")
    with live_server(create_app(settings_factory())) as srv, PeagleClient(srv.url, key) as c:
        jid = c.submit(preset="tiny")["id"]
        regen = "regenerating the answers of 1920 conversations with the target (vllm)"
        _event(sim, jid, "started", "attempt 0 started")
        _event(sim, jid, "phase", "phase: preparing_data", phase="preparing_data")
        _event(sim, jid, "phase", regen, phase="regenerating")
        _log(sim, jid, f"phase regenerating: {regen}")
        sim.set(jid, status="running", phase="regenerating",
                progress={"phase": "regenerating", "step": 12, "total_steps": 320, "percent": 3.75,
                          "seconds_remaining": 7500.0})
        following = threading.Event()
        real_follow = jobs_cli._follow

        def spy(*args: Any, **kw: Any) -> Any:
            following.set()  # the cursors are taken: what comes now is live
            yield from real_follow(*args, **kw)

        monkeypatch.setattr(jobs_cli, "_follow", spy)

        def worker() -> None:
            assert following.wait(60)
            _log(sim, jid, "regenerating 320/320 conversations (100%) tokens/s 21")
            _event(sim, jid, "phase", "training 240 steps from step 0", phase="training")
            _log(sim, jid, "phase training: training 240 steps from step 0")  # ProgressLog's line of that event
            _event(sim, jid, "checkpoint", "checkpoint saved at step 100 (best so far)", phase="training")
            sim.set(jid, status="succeeded", phase="done")

        feeder = threading.Thread(target=worker)
        feeder.start()
        r = CliRunner().invoke(cli_app, ["jobs", "logs", jid, "--follow"],
                               env={"PEAGLE_URL": srv.url, "PEAGLE_API_KEY": key})
        feeder.join()
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    # at once: where the job is, before any log line
    assert lines[0].startswith(f"job {jid}: running, phase regenerating since "), lines
    assert lines[0].endswith(f"({regen}); 12/320 conversations regenerated (3%), eta 2h05m"), lines
    assert lines[1].endswith(f"info    phase regenerating: {regen}")
    live = lines[2:]
    assert sum(ln.endswith("phase training: training 240 steps from step 0") for ln in live) == 1, live  # once: the log line
    assert any(ln.endswith("event   checkpoint: checkpoint saved at step 100 (best so far)") for ln in live), live
    assert any(ln.endswith("regenerating 320/320 conversations (100%) tokens/s 21") for ln in live), live
    assert live[-1].startswith(f"job {jid}: succeeded, phase done")  # and, at the end, where it ended
