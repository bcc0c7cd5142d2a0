"""How an attempt ends (`worker.outcome.decide_ending`, pure): the table of its module docstring, row by row.
The real supervisor's endings are tests/worker/test_worker_fake.py, test_worker_shutdown.py and
test_engine_restart.py."""

from __future__ import annotations

from typing import Any

from peagle.errors import EXIT_CODES
from service.db import states
from worker.outcome import Ending, decide_ending


def end(rc: int, status: str | None = states.RUNNING, **kw: Any) -> Ending:
    args: dict[str, Any] = {"stopped_cleanly": False, "kill_sent": False, "shutdown": False, "checkpoint_step": None,
                            "stderr_tail": [], "last_error": None, "redact": lambda s: s.replace("/srv", "<run>")}
    return decide_ending(rc=rc, status=status, **{**args, **kw})


def test_requests_and_success() -> None:
    assert end(1, states.CANCELLING).status == states.CANCELLED  # a cancel wins over any exit
    assert end(0) == Ending(states.SUCCEEDED, event=("succeeded", "training finished"))
    assert end(0, states.PAUSING).event == ("succeeded", "training finished (the pause request came after the last step)")
    paused = end(75, states.PAUSING, stopped_cleanly=True, checkpoint_step=40)
    assert paused == Ending(states.PAUSED, event=("paused", "paused; resume continues from checkpoint step 40"))
    assert end(-9, states.PAUSING, kill_sent=True).event == (
        "paused", "paused; resume continues from the last complete checkpoint")


def test_a_stopping_worker_requeues_without_a_message() -> None:
    e = end(75, shutdown=True, stopped_cleanly=True, checkpoint_step=8)
    assert e == Ending(states.QUEUED, event=("interrupted", "worker shut down; requeued, resumes from checkpoint step 8"))


def test_crashes_and_failures() -> None:
    assert end(-9) == Ending(code="host_oom", message="trainer killed by SIGKILL (the kernel OOM killer sends SIGKILL)",
                             crash=True)
    assert end(75) == Ending(code="trainer_killed", message="trainer killed by SIGTERM", crash=True)  # unasked
    assert end(-11).message == "trainer killed by SIGSEGV"
    failed = end(1, stderr_tail=["Traceback (most recent call last):", "ValueError: bad /srv/x"])
    assert failed.status == states.FAILED and failed.code == "training_failed" and not failed.crash
    assert failed.message == "ValueError: bad /srv/x"  # redacted when recorded (`record_ending`)
    assert failed.event == ("error", "training_failed: ValueError: bad /srv/x")
    # a target engine that failed is restarted by the worker: a crash whose reason is redacted now
    engine = end(EXIT_CODES["engine_failed"], last_error={"message": "vLLM died in /srv/run"})
    assert engine == Ending(code="engine_failed", message="engine_failed: vLLM died in <run>/run", crash=True)
    resource = end(EXIT_CODES["resource_unavailable"], last_error={"message": "no GPU"})
    assert (resource.status, resource.code, resource.retryable, resource.crash) == (
        states.FAILED, "resource_unavailable", True, False)
