"""Issue 20: a real job's log shows it alive: phase changes and step lines (step/total, loss), stored by the
worker and printed by `peagle jobs logs JOB --follow` while the job runs."""

from __future__ import annotations

import re
import socket
import threading
import time
from typing import Any

import pytest

from peagle.spec.phases import PHASES
from service.db.models import JobLog

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OVERRIDES = {"data": {"eval_samples": 0}, "optim": {"max_steps": 6}, "checkpoints": {"every_steps": 3},
             "eval": {"prompt_sets": []}}
STEP_LINE = re.compile(r"step (\d+)/(\d+) \(\d+%\) loss [0-9.e+-]+ tau_sim [0-9.]+ tokens/s \d+")


class _Uvicorn:
    """The API app on a free loopback port, in a thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{s.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]),
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _Uvicorn:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


def test_real_job_logs_phases_and_steps_and_cli_follows_them(make_stack: Any, tiny_target_path: Any) -> None:
    from typer.testing import CliRunner

    from api.main import create_app
    from peagle.cli import app as cli_app
    from peagle.client import PeagleClient
    from service.db import repo
    from service.db.session import session_scope

    stack = make_stack("embedded", fake_trainer=False)
    with session_scope(stack.factory) as s:
        _row, key = repo.create_key(s, "tests", ["read", "write"])
    with _Uvicorn(create_app(stack.settings)) as srv:
        with PeagleClient(srv.url, key) as c:
            job_id = c.submit(preset="tiny", overrides=OVERRIDES)["id"]
        stack.start_worker()
        # follows from the start (queued) to the end, as a user who just submitted
        r = CliRunner().invoke(cli_app, ["jobs", "logs", job_id, "--follow", "--url", srv.url, "--api-key", key])
    job = stack.job(job_id)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs())
    assert r.exit_code == 0, r.output

    stored = [g.message for g in stack.rows(JobLog, job_id)]
    phases = [m.split()[1].rstrip(":") for m in stored if m.startswith("phase ")]
    # every phase change, once, in order (the tiny preset neither regenerates, runs a preview nor the serve check)
    assert phases == [p for p in PHASES if p not in ("preview", "regenerating", "serve_check")], stored
    steps = [(int(m.group(1)), int(m.group(2))) for m in map(STEP_LINE.match, stored) if m]
    assert steps and steps[0][0] == 1 and steps[-1] == (6, 6), stored  # the first and the last step at least
    assert len(steps) <= 6
    # the CLI printed the same lines, in order (`TIME LEVEL MESSAGE`)
    printed = [ln.split(None, 2)[2] for ln in r.output.splitlines() if len(ln.split(None, 2)) == 3]
    assert [m for m in printed if m in stored] == stored, r.output
