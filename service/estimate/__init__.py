"""The cost model: the dry-run estimate of a job (its data funnel, per-phase wall time and how far to trust it).

No torch, no tokenizer, no data read, no database (`api.history` reads the earlier jobs). Two sources,
stated in the answer (`basis`, `accuracy`):

* **history**: earlier succeeded jobs comparable to this one (`Comparable`: the same target and revision,
  resolved target dtype, target and regeneration engines and hardware class; `api.history` reads them).
  Each phase is measured as a rate of its own work (conversations read, regenerated tokens, captured
  tokens, training tokens, generated tokens: `PhaseModel`), so a comparable job of another size scales;
  the median rate per phase replaces the model's, and the spread between the jobs is the stated accuracy
  (`rates`). A job of another model never informs it.
* **model** (the phases no comparable job measured): the calibrated model (`phases`), for the job's hardware
  class (`peagle.spec.hardware.hardware_class`: `cpu-bf16`, `cpu-avx512`, `cpu-avx2`, `cpu`, `cuda-<n>gpu`).
  Its constants were measured on the 2-core `cpu-bf16` development machine (AVX-512 with AMX-BF16) with
  the demo preset (SmolLM2-135M in bfloat16, K=4, pack 1024; bench/README.md "The demo end to end",
  docs/experiments.md "Estimates"); `TARGET_SPEED` and `DRAFT_SPEED` scale them for the other classes
  and target dtypes. A loaded machine is slower, hence the stated range `MODEL_RANGE`
  (`make bench` checks each phase within 1.5x on this machine: `bench/bench_estimate.py`). The constants
  and the scaling are `calibration`.

The data funnel (`funnel`) uses `peagle.spec.funnel` (the keys the job's data report and the dataset
report use): a dataset's own validator report when the source is an uploaded dataset, the measured profile
of the builtin ShareGPT data (`BUILTIN_PROFILE`), else assumptions listed in `notes`.

Modules, each below the next: `calibration` (measured constants, hardware scaling) -> `funnel` (data funnel,
optimizer steps) -> `phases` (`PhaseModel` per phase, the preview, split jobs) -> `rates` (what earlier
comparable jobs measured) -> `dry_run` (`estimate`: the answer). This package is the public surface.
"""

from __future__ import annotations

from service.estimate.calibration import (
    ALL_POSITIONS_STEP_COST,
    CALIBRATION_CLASS,
    HISTORY_JOBS,
    MODEL_RANGE,
    PHASE_GROUPS,
    spec_hardware,
)
from service.estimate.dry_run import estimate
from service.estimate.phases import PhaseModel, PreviewModel, model_phases, model_seconds, preview_model
from service.estimate.rates import Comparable, Measured, PhaseRate, measured_rates

__all__ = ["ALL_POSITIONS_STEP_COST", "CALIBRATION_CLASS", "HISTORY_JOBS", "MODEL_RANGE", "PHASE_GROUPS", "Comparable",
           "Measured", "PhaseModel", "PhaseRate", "PreviewModel", "estimate", "measured_rates", "model_phases",
           "model_seconds", "preview_model", "spec_hardware"]
