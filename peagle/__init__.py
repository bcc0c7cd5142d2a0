"""P-EAGLE draft training: data, target capture, the draft and its trainer, evaluation and export.

The public surface, importable from `peagle` directly (loaded on first use, so `import peagle` and
`peagle.spec` stay torch-free for the API):

    from peagle import preset, run_pipeline
    result = run_pipeline(preset("tiny"), "runs/tiny")           # spec -> data -> train -> eval -> export
    from peagle import validate_export
    assert validate_export(result.export_dir) == []              # what vLLM would refuse, one line each

Where things live (one hop from the folder names): `spec/` (the job spec, torch-free), `data/` (chat
data -> rows, vocab), `target/` (target features: capture, batch sources), `cod/` (COD sampling, rows,
mask, loss), `model/` (the draft, attention backends, initialisation, CPU kernels), `train/` (loop,
partitioned step, checkpoints), `eval/` (reference decoder, vLLM serve check), `export/` (vLLM-ready
checkpoint and its validator), `cli/`; beside them `pipeline`, `client`, `errors`, `builtin` (the
offline builtin models and data), `fileio`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

ONEDNN_CACHE_BOUNDS = {"LRU_CACHE_CAPACITY": "64", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}
"""Environment bounds on oneDNN's two kernel caches that training processes start with (see `peagle.__main__`)."""

#: public name -> the module that defines it
_EXPORTS = {
    "CheckpointError": "peagle.errors",
    "DataInvalidError": "peagle.errors",
    "DraftConfig": "peagle.model.draft",
    "ExportInvalidError": "peagle.errors",
    "PEagleDraft": "peagle.model.draft",
    "PeagleClient": "peagle.client",
    "PeagleError": "peagle.errors",
    "PipelineResult": "peagle.pipeline",
    "ResourceError": "peagle.errors",
    "ServiceError": "peagle.client",
    "SpecInvalidError": "peagle.errors",
    "TargetLoadError": "peagle.errors",
    "TrainSpec": "peagle.spec",
    "TrainingInterrupted": "peagle.errors",
    "evaluate_prompts": "peagle.eval.reference",
    "export_draft": "peagle.export.writer",
    "load_exported_draft": "peagle.export.writer",
    "load_spec_file": "peagle.spec",
    "parse_spec": "peagle.spec",
    "preset": "peagle.spec",
    "preset_names": "peagle.spec",
    "run_pipeline": "peagle.pipeline",
    "validate_export": "peagle.export.rules",
}

__all__ = [
    "ONEDNN_CACHE_BOUNDS",
    "CheckpointError",
    "DataInvalidError",
    "DraftConfig",
    "ExportInvalidError",
    "PEagleDraft",
    "PeagleClient",
    "PeagleError",
    "PipelineResult",
    "ResourceError",
    "ServiceError",
    "SpecInvalidError",
    "TargetLoadError",
    "TrainSpec",
    "TrainingInterrupted",
    "evaluate_prompts",
    "export_draft",
    "load_exported_draft",
    "load_spec_file",
    "parse_spec",
    "preset",
    "preset_names",
    "run_pipeline",
    "validate_export",
]

if TYPE_CHECKING:
    from peagle.client import PeagleClient, ServiceError
    from peagle.errors import (
        CheckpointError,
        DataInvalidError,
        ExportInvalidError,
        PeagleError,
        ResourceError,
        SpecInvalidError,
        TargetLoadError,
        TrainingInterrupted,
    )
    from peagle.eval.reference import evaluate_prompts
    from peagle.export.rules import validate_export
    from peagle.export.writer import export_draft, load_exported_draft
    from peagle.model.draft import DraftConfig, PEagleDraft
    from peagle.pipeline import PipelineResult, run_pipeline
    from peagle.spec import TrainSpec, load_spec_file, parse_spec, preset, preset_names


def __getattr__(name: str) -> Any:
    """Load a public name's module on first use (PEP 562), so importing `peagle` stays cheap."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'peagle' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
