"""How a job attempt ends: the trainer's exit -> the job's final state (pure), then recorded.

    ending = decide_ending(rc=rc, status=status, stopped_cleanly=..., kill_sent=..., shutdown=...,
                           checkpoint_step=step, stderr_tail=tail, last_error=err, redact=redactor.text)
    status = record_crash(...) if ending.crash else record_ending(factory, lease, ending, ...)

The rule (`status` is the job row's status when the trainer exited; first match wins):

    cancel requested (cancelling)                         -> cancelled
    exit 0                                                -> succeeded (a pause that came after the last step)
    pause requested, stopped cleanly or killed            -> paused (resume continues from its checkpoint)
    the worker shuts down and the trainer stopped cleanly -> queued (no message: the reaper sends it)
    killed by a signal it was not sent, or exit 75 unasked -> crash (`host_oom` for SIGKILL, else `trainer_killed`)
    a failure the worker restarts (`classify_exit`)       -> crash (`engine_failed`)
    any other exit                                        -> failed with `classify_exit`'s code

A crash requeues the job (attempt + 1, resuming from its last complete checkpoint) up to its `max_restarts`,
then fails it with that code (`service.db.requeue.requeue_crashed`).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from peagle.errors import EXIT_CODES
from service.db import states
from service.db.lease import Lease, finish
from service.db.requeue import record_task_id, requeue_crashed
from service.db.session import session_scope
from worker.live import Publisher
from worker.trainer import classify_exit

__all__ = ["Ending", "Outcome", "decide_ending", "record_crash", "record_ending"]

log = logging.getLogger(__name__)


class Outcome:
    """Final status names returned by `Supervisor.run` besides job states."""

    LEASE_LOST = "lease_lost"


@dataclass(frozen=True, slots=True)
class Ending:
    """What to record for an attempt: `status` with its error (`code`, `message`, `retryable`) and `event`
    (kind, message); or, with `crash`, a requeue within the job's `max_restarts` (`message`: the reason)."""

    status: str | None = None
    code: str | None = None
    message: str | None = None
    retryable: bool | None = None
    event: tuple[str, str] | None = None
    crash: bool = False


def decide_ending(*, rc: int, status: str | None, stopped_cleanly: bool, kill_sent: bool, shutdown: bool,
                  checkpoint_step: int | None, stderr_tail: list[str], last_error: dict[str, Any] | None,
                  redact: Callable[[str], str]) -> Ending:
    """The attempt's ending (module docstring) from the trainer's exit code `rc` and the row's `status`
    (None: the row is gone).

    `stopped_cleanly`: it exited 75, or saved a checkpoint after SIGTERM was sent; `kill_sent`: SIGKILL was
    sent after the grace period; `shutdown`: the worker is stopping. `redact` cleans the trainer's message
    in a crash's reason (a final message and event are redacted when recorded).
    """
    where = f"checkpoint step {checkpoint_step}" if checkpoint_step is not None else "the last complete checkpoint"
    if status == states.CANCELLING:
        return Ending(states.CANCELLED, event=("cancelled", "cancelled by request"))
    if rc == 0:
        late = " (the pause request came after the last step)" if status == states.PAUSING else ""
        return Ending(states.SUCCEEDED, event=("succeeded", "training finished" + late))
    if status == states.PAUSING and (stopped_cleanly or kill_sent):
        return Ending(states.PAUSED, event=("paused", f"paused; resume continues from {where}"))
    if shutdown and stopped_cleanly:
        # No message is sent here: the worker is stopping and could still take it (then die with it).
        # The job is queued with no task id, so a reaper sends it once a worker is there.
        return Ending(states.QUEUED, event=("interrupted", f"worker shut down; requeued, resumes from {where}"))
    if rc < 0 or rc == EXIT_CODES["interrupted"]:
        name = signal.Signals(-rc).name if rc < 0 else "SIGTERM"
        why = f"trainer killed by {name}" + (" (the kernel OOM killer sends SIGKILL)" if rc == -9 else "")
        return Ending(code="host_oom" if rc == -9 else "trainer_killed", message=why, crash=True)
    failure = classify_exit(returncode=rc, stderr_tail=stderr_tail, last_error=last_error)
    if failure.restart:  # a new attempt resumes from what was done (regeneration cache, checkpoints)
        return Ending(code=failure.code, message=f"{failure.code}: {redact(failure.message)}", crash=True)
    return Ending(states.FAILED, code=failure.code, message=failure.message, retryable=failure.retryable,
                  event=("error", f"{failure.code}: {failure.message}"))


def record_ending(factory: sessionmaker[Session], lease: Lease, ending: Ending, *, redact: Callable[[str], str],
                  publisher: Publisher | None) -> str:
    """Store a final `ending` (its message and event redacted) and wake live listeners; returns its status,
    or `Outcome.LEASE_LOST` when the lease was lost (nothing written)."""
    assert ending.status is not None and not ending.crash, "a crash is recorded by record_crash"
    message = redact(ending.message) if ending.message is not None else None
    event = (ending.event[0], redact(ending.event[1])) if ending.event is not None else None
    with session_scope(factory) as s:
        ok = finish(s, lease, status=ending.status, error_code=ending.code, error_message=message,
                    retryable=ending.retryable, event=event)
    if not ok:
        return Outcome.LEASE_LOST
    if publisher is not None:
        publisher.publish_status(lease.job_id, ending.status)
    return ending.status


def record_crash(factory: sessionmaker[Session], lease: Lease, ending: Ending, *,
                 send_task: Callable[[str, str], str] | None, publisher: Publisher | None) -> str:
    """Requeue a crashed attempt (`requeue_crashed`); a requeued job is sent again with `send_task` (None:
    a stopping worker could take it back, or no broker here: the reaper re-sends queued jobs that have no
    broker message). Returns the job's new status, or `Outcome.LEASE_LOST`."""
    assert ending.crash and ending.code is not None and ending.message is not None
    with session_scope(factory) as s:
        act = requeue_crashed(s, lease, reason=ending.message, code=ending.code)
    if act is None:
        return Outcome.LEASE_LOST
    if act.status == states.QUEUED and send_task is not None:
        _send(factory, lease, send_task)
    if publisher is not None:
        publisher.publish_status(lease.job_id, act.status)
    return act.status


def _send(factory: sessionmaker[Session], lease: Lease, send_task: Callable[[str, str], str]) -> None:
    try:
        task_id = send_task(lease.job_id, lease.queue)
    except Exception as exc:  # noqa: BLE001 - broker down: the reaper re-sends later
        log.warning("job %s: requeue message not sent (%s); the reaper will", lease.job_id, exc)
        return
    with session_scope(factory) as s:
        record_task_id(s, lease.job_id, task_id, only_if_unsent=True)
