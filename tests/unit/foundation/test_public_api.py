"""`peagle`'s public surface: `__all__` is exactly the pinned names, each resolves, and importing `peagle`
(or its spec) does not load torch."""

from __future__ import annotations

import subprocess
import sys

import peagle

PUBLIC = [
    "CheckpointError", "DataInvalidError", "DraftConfig", "ExportInvalidError", "ONEDNN_CACHE_BOUNDS",
    "PEagleDraft", "PeagleClient", "PeagleError", "PipelineResult", "ResourceError", "ServiceError",
    "SpecInvalidError", "TargetLoadError", "TrainSpec", "TrainingInterrupted", "evaluate_prompts",
    "export_draft", "load_exported_draft", "load_spec_file", "parse_spec", "preset", "preset_names",
    "run_pipeline", "validate_export",
]  # fmt: skip


def test_all_is_the_pinned_public_names_sorted() -> None:
    assert peagle.__all__ == sorted(peagle.__all__, key=lambda n: (n != "ONEDNN_CACHE_BOUNDS", n))
    assert sorted(peagle.__all__) == sorted(PUBLIC)
    assert set(peagle.__all__) - {"ONEDNN_CACHE_BOUNDS"} == set(peagle._EXPORTS)


def test_every_public_name_resolves_to_its_definition() -> None:
    for name in peagle.__all__:
        obj = getattr(peagle, name)
        if hasattr(obj, "__module__") and callable(obj):
            assert obj.__module__.startswith("peagle."), (name, obj.__module__)
    assert peagle.SpecInvalidError is peagle.errors.SpecInvalidError


def test_unknown_name_is_an_attribute_error() -> None:
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        peagle.nope  # noqa: B018


def test_import_peagle_stays_torch_free() -> None:
    code = "import sys, peagle, peagle.spec; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
