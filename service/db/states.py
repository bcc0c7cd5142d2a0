"""The job state machine: the ONE place that says which status changes are legal.

    queued     -> running (worker claim) | cancelled (cancel) | paused (pause while queued)
    running    -> pausing | cancelling | succeeded | failed | queued (reaper requeue, attempt+1)
    pausing    -> paused (checkpoint saved, exit 75) | cancelling | succeeded | failed | queued (reaper)
    cancelling -> cancelled | failed
    paused     -> queued (resume) | cancelled (cancel)
    succeeded, failed, cancelled: terminal

User actions (`cancel`, `pause`, `resume`) are idempotent: asking for the state a job is already in or
heading to returns it unchanged. Importable by the worker: no FastAPI, no database access here.
"""

from __future__ import annotations

from peagle.errors import PeagleError

__all__ = [
    "ACTIONS",
    "ACTIVE",
    "ALL_STATES",
    "CANCELLED",
    "CANCELLING",
    "FAILED",
    "PAUSED",
    "PAUSING",
    "QUEUED",
    "RUNNING",
    "SUCCEEDED",
    "TERMINAL",
    "TRANSITIONS",
    "IllegalTransition",
    "action_target",
    "actions_in",
    "can_transition",
    "check_transition",
]

QUEUED = "queued"
RUNNING = "running"
PAUSING = "pausing"
PAUSED = "paused"
CANCELLING = "cancelling"
CANCELLED = "cancelled"
SUCCEEDED = "succeeded"
FAILED = "failed"

ALL_STATES = (QUEUED, RUNNING, PAUSING, PAUSED, CANCELLING, CANCELLED, SUCCEEDED, FAILED)
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
#: States that hold (or will soon hold) a worker: count against the concurrent-jobs quota.
ACTIVE = frozenset({RUNNING, PAUSING, CANCELLING})

TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({RUNNING, CANCELLED, PAUSED}),
    RUNNING: frozenset({PAUSING, CANCELLING, SUCCEEDED, FAILED, QUEUED}),
    PAUSING: frozenset({PAUSED, CANCELLING, SUCCEEDED, FAILED, QUEUED}),
    CANCELLING: frozenset({CANCELLED, FAILED}),
    PAUSED: frozenset({QUEUED, CANCELLED}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}

# For each user action: current status -> new status (same status = idempotent no-op).
_ACTIONS: dict[str, dict[str, str]] = {
    "cancel": {
        QUEUED: CANCELLED,
        PAUSED: CANCELLED,
        RUNNING: CANCELLING,
        PAUSING: CANCELLING,
        CANCELLING: CANCELLING,
        CANCELLED: CANCELLED,
    },
    "pause": {QUEUED: PAUSED, RUNNING: PAUSING, PAUSING: PAUSING, PAUSED: PAUSED},
    "resume": {PAUSED: QUEUED, QUEUED: QUEUED, RUNNING: RUNNING},
}
#: The user actions that go through the state machine (`action_target`).
ACTIONS = tuple(_ACTIONS)


class IllegalTransition(PeagleError):
    """A status change the state machine forbids; `.current` names the job's state (API: 409)."""

    code = "illegal_transition"

    def __init__(self, current: str, target: str, *, action: str | None = None) -> None:
        self.current = current
        self.target = target
        self.action = action
        what = f"cannot {action} a job" if action else f"cannot move a job to {target!r}"
        super().__init__(f"{what} in state {current!r}")


def can_transition(current: str, target: str) -> bool:
    """True if `current -> target` is a legal status change (a same-state write is not a change)."""
    return target in TRANSITIONS.get(current, frozenset())


def check_transition(current: str, target: str) -> None:
    """Raise `IllegalTransition` unless `current -> target` is legal."""
    if not can_transition(current, target):
        raise IllegalTransition(current, target)


def action_target(action: str, current: str) -> str:
    """New status after a user action (`cancel`, `pause`, `resume`) on a job in `current`.

    Returns `current` itself when the action is a no-op (idempotent repeat).

    Raises:
        IllegalTransition: the action is not allowed in `current` (e.g. pause a succeeded job).
        KeyError: unknown action.
    """
    table = _ACTIONS[action]
    if current not in table:
        raise IllegalTransition(current, "", action=action)
    target = table[current]
    if target != current:
        check_transition(current, target)
    return target


def actions_in(current: str) -> list[str]:
    """The user actions that change a job in `current` (idempotent repeats and illegal ones left out)."""
    return [a for a in ACTIONS if _ACTIONS[a].get(current, current) != current]
