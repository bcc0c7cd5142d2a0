"""The error tree of the project. Every class has a stable snake_case `.code`.

    Exception
    └── PeagleError                        peagle_error           peagle.errors
        ├── SpecInvalidError (+ValueError) spec_invalid           peagle.errors: raised by peagle.spec
        ├── DataInvalidError               data_invalid           peagle.errors: bad dataset rows/files
        ├── TargetLoadError                target_load_failed     peagle.errors: target cannot be loaded
        ├── ExportInvalidError             export_invalid         peagle.errors: vLLM would reject it
        ├── CheckpointError                checkpoint_invalid     peagle.errors: missing/corrupt checkpoint
        ├── ResourceError                  resource_unavailable   peagle.errors: e.g. mask too large for CPU
        ├── EngineError                    engine_failed          peagle.errors: the vLLM target engine failed
        ├── ServedParityError              served_parity_failed   peagle.errors: vLLM serves the draft worse than it trained
        ├── TrainingInterrupted            interrupted            peagle.errors: SIGTERM, checkpoint saved
        ├── ServiceError                   (per answer)           peagle.client: an error answer of the API
        ├── IllegalTransition              illegal_transition     service.db.states: state machine refuses
        ├── ConcurrencyLimited             concurrency_limited    service.db.lease: owner at its job limit
        ├── LeaseLost                      lease_lost             service.db.lease: the lease is not ours
        ├── QuotaExceeded                  quota_exceeded         service.db.jobs: owner's queued-jobs quota
        ├── QueueUnavailable               queue_unavailable      service.db.jobs: the broker refused the job
        └── ApiError                       (per instance)         api.errors: rendered as the error envelope

`SpecInvalidError` is also a `ValueError` so that pydantic validators which parse a nested spec turn it
into a field error. The service classes live beside the code that raises them and derive from
`PeagleError` here; `tests/unit/foundation/test_errors.py` checks that this drawing is true.
The worker maps the library's codes (and the trainer's exit codes, `EXIT_CODES`) onto job error codes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = [
    "EXIT_CODES",
    "CheckpointError",
    "DataInvalidError",
    "EngineError",
    "ExportInvalidError",
    "PeagleError",
    "ResourceError",
    "ServedParityError",
    "SpecInvalidError",
    "TargetLoadError",
    "TrainingInterrupted",
]


class PeagleError(Exception):
    """Base of every error the library raises on purpose."""

    code = "peagle_error"


class SpecProblemLike(Protocol):
    """What `SpecInvalidError` needs of one problem (`peagle.spec.SpecProblem`; this module stands below
    the spec, so it names the shape, not the class)."""

    @property
    def loc(self) -> tuple[str | int, ...]: ...

    @property
    def path(self) -> str: ...

    @property
    def message(self) -> str: ...


class SpecInvalidError(PeagleError, ValueError):
    """The spec has one or more problems; `.problems` lists all of them (each with its field path)."""

    code = "spec_invalid"

    def __init__(self, problems: Sequence[SpecProblemLike]) -> None:
        self.problems = list(problems)
        listed = "; ".join(f"{p.path or '(root)'}: {p.message}" for p in problems)
        n = len(problems)
        super().__init__(f"{n} problem{'s' if n != 1 else ''} in the job spec: {listed}")


class DataInvalidError(PeagleError):
    code = "data_invalid"


class TargetLoadError(PeagleError):
    code = "target_load_failed"


class ExportInvalidError(PeagleError):
    code = "export_invalid"

    def __init__(self, violations: list[str]) -> None:
        self.violations = violations
        super().__init__("export directory invalid: " + "; ".join(violations))


class CheckpointError(PeagleError):
    code = "checkpoint_invalid"


class ResourceError(PeagleError):
    code = "resource_unavailable"


class EngineError(PeagleError):
    """The target's inference engine (vLLM) is missing, failed to start, could not load the target, or
    died; the message names the command, the reason and the last lines of the engine's log."""

    code = "engine_failed"


class ServedParityError(PeagleError):
    """vLLM accepts the export's drafts clearly less than the reference decoder did with the same weights and
    settings (`peagle.eval.parity`); the message names the positions, both rates and the usual causes."""

    code = "served_parity_failed"


class TrainingInterrupted(PeagleError):
    code = "interrupted"


# Process exit codes of `peagle train` (the worker maps them to job states).
EXIT_CODES = {
    "ok": 0,
    "error": 1,
    "usage": 2,
    "spec_invalid": 3,
    "data_invalid": 4,
    "target_load_failed": 5,
    "cuda_oom": 6,
    "host_oom": 7,
    "export_invalid": 8,
    "resource_unavailable": 9,
    "checkpoint_invalid": 10,
    "engine_failed": 11,
    "served_parity_failed": 12,
    "interrupted": 75,  # EX_TEMPFAIL: checkpoint saved, resumable
}
