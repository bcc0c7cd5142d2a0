"""The error tree of the `peagle` library. Every class has a stable snake_case `.code`.

    PeagleError                      code = peagle_error
    ├── SpecInvalidError (peagle.spec, a ValueError)   spec_invalid
    ├── DataInvalidError             data_invalid       (bad dataset rows/files; names the line)
    ├── TargetLoadError              target_load_failed (target model/tokenizer cannot be loaded)
    ├── ExportInvalidError           export_invalid     (a directory vLLM would reject; lists violations)
    ├── CheckpointError              checkpoint_invalid (missing/incomplete/corrupt checkpoint)
    ├── ResourceError                resource_unavailable (e.g. dense mask too large for CPU)
    └── TrainingInterrupted          interrupted        (SIGTERM/SIGINT: checkpoint saved, resumable)

The worker maps these codes (and the trainer's exit codes, `EXIT_CODES`) onto job error codes.
"""

from __future__ import annotations

__all__ = [
    "EXIT_CODES",
    "CheckpointError",
    "DataInvalidError",
    "ExportInvalidError",
    "PeagleError",
    "ResourceError",
    "TargetLoadError",
    "TrainingInterrupted",
]


class PeagleError(Exception):
    """Base of every error the library raises on purpose."""

    code = "peagle_error"


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
    "interrupted": 75,  # EX_TEMPFAIL: checkpoint saved, resumable
}
