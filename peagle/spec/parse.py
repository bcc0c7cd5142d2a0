"""A job spec from a mapping or a file: a `TrainSpec`, or every problem at once (`SpecInvalidError`).

    spec = parse_spec({"target": {"model": "builtin:tiny-llama"}})
    spec = load_spec_file("spec.yaml")        # YAML or JSON, the same validation

Field-level problems come from pydantic; the cross-field ones from `peagle.spec.checks`, raised by the
`TrainSpec` model validator and unpacked here, each with its own field path. Pydantic runs the model
validator only when every field passed, so with field problems the cross-field ones are collected by
`cross_field_problems_beside` and listed in the same answer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from peagle.errors import SpecInvalidError
from peagle.spec.checks import cross_field_problems_beside
from peagle.spec.schema import SpecProblem, TrainSpec

__all__ = ["load_spec_file", "parse_spec"]


def _problems_from(exc: ValidationError) -> list[SpecProblem]:
    problems: list[SpecProblem] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == "spec_cross_field":
            for p in err.get("ctx", {}).get("problems", []):
                problems.append(SpecProblem(loc=loc + tuple(p["loc"]), message=p["message"]))
            continue
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field (not part of the job spec)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif err["type"] == "string_unicode":
            msg = "must be valid UTF-8 text: no lone surrogate (\\ud800-\\udfff)"
        problems.append(SpecProblem(loc=loc, message=msg))
    return problems


def parse_spec(data: Any) -> TrainSpec:
    """Validate a mapping (e.g. parsed JSON/YAML) into a `TrainSpec`.

    Raises:
        SpecInvalidError: with every problem (field path + reason), field-level and cross-field.
    """
    if isinstance(data, TrainSpec):
        return data
    if not isinstance(data, dict):
        raise SpecInvalidError([SpecProblem(loc=(), message=f"must be an object, got {type(data).__name__}")])
    try:
        return TrainSpec.model_validate(data)
    except ValidationError as exc:
        problems = _problems_from(exc)
        failed = [tuple(e["loc"]) for e in exc.errors(include_url=False) if e["type"] != "spec_cross_field"]
        if failed:  # the model validator did not run: its problems too, in the same answer
            problems += cross_field_problems_beside(data, failed)
        raise SpecInvalidError(problems) from None


def load_spec_file(path: str | Path) -> TrainSpec:
    """Load a YAML or JSON spec file (same validation for both)."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecInvalidError([SpecProblem(loc=(), message=f"cannot read {path}: {exc}")]) from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise SpecInvalidError([SpecProblem(loc=(), message=f"{path} is not valid YAML/JSON: {exc}")]) from None
    return parse_spec(data)
