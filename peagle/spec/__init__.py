"""The job spec, torch-free: the schema (`schema`), the named presets (`presets`), the reference doc (`doc`).

`TrainSpec` is the single source of truth for a training run: the CLI input, the API body, the database
JSON column and the worker input. The API imports only this package (and `peagle.errors`) from `peagle`.
"""

from peagle.spec.checks import cross_field_problems
from peagle.spec.parse import load_spec_file, parse_spec
from peagle.spec.phases import PHASES
from peagle.spec.presets import preset, preset_names
from peagle.spec.schema import (
    BUILTIN_DATA,
    BUILTIN_PROMPT_SETS,
    BUILTIN_TARGETS,
    DATASET_PREFIX,
    HELDOUT_PROMPT_SET,
    SPEC_VERSION,
    CheckpointSpec,
    DataSource,
    DataSpec,
    DraftSpec,
    EvalSpec,
    OptimSpec,
    PEagleSpec,
    PromptSet,
    RegenerateSpec,
    ResourceSpec,
    SpecInvalidError,
    SpecProblem,
    TargetSpec,
    TrainSpec,
    dataset_id,
    dataset_ref,
    spec_hash,
)
from peagle.spec.targets import BUILTIN_TARGET_HUB_IDS, portable_verifier

__all__ = [
    "BUILTIN_DATA",
    "BUILTIN_PROMPT_SETS",
    "BUILTIN_TARGETS",
    "BUILTIN_TARGET_HUB_IDS",
    "DATASET_PREFIX",
    "HELDOUT_PROMPT_SET",
    "PHASES",
    "SPEC_VERSION",
    "CheckpointSpec",
    "DataSource",
    "DataSpec",
    "DraftSpec",
    "EvalSpec",
    "OptimSpec",
    "PEagleSpec",
    "PromptSet",
    "RegenerateSpec",
    "ResourceSpec",
    "SpecInvalidError",
    "SpecProblem",
    "TargetSpec",
    "TrainSpec",
    "cross_field_problems",
    "dataset_id",
    "dataset_ref",
    "load_spec_file",
    "parse_spec",
    "portable_verifier",
    "preset",
    "preset_names",
    "spec_hash",
]
