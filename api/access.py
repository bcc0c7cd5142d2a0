"""What an API job may read: the one place the service decides which spec paths a tenant can name.

A job submitted through the API (create, dry run, clone) runs on shared workers that can read the whole
host, so its spec may only name:

- training data (`data.sources[].path`): `builtin:*` data, or `dataset:<id>` of a dataset the caller owns;
- prompt sets (`eval.prompt_sets[].name`): the builtin sets (`humaneval`, `sharegpt-heldout`);
- the target (`target.model`): a builtin, a hub id (`name` or `org/name`: no other slash, no `..`, not
  absolute), or a folder under one of the operator's `model_roots` (`PEAGLE_MODEL_ROOTS`; none by default).

Anything else is a 422 naming the field; the message never says whether a path exists or what it holds.
The CLI (`peagle train`) is not restricted: a local user may read local files.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from api.errors import ApiError
from peagle.spec import BUILTIN_DATA, BUILTIN_PROMPT_SETS, BUILTIN_TARGETS, TrainSpec
from service.channels import dataset_id
from service.db.models import Dataset

__all__ = ["check_spec_access", "model_allowed"]

#: A hub repository id: `name` or `org/name` (what huggingface_hub accepts), never a path.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


def _hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name)) and ".." not in name and not name.endswith(".")


def _under_roots(name: str, roots: Sequence[Path]) -> bool:
    """`name` is an absolute path whose real location (symlinks resolved) lies inside an allowed root."""
    if not roots or not Path(name).is_absolute() or "\\" in name:
        return False
    real = Path(os.path.realpath(name))
    for root in roots:
        base = Path(os.path.realpath(root))
        if real != base and real.is_relative_to(base):
            return True
    return False


def model_allowed(name: str, roots: Sequence[Path]) -> bool:
    """Whether an API job may use `name` as its `target.model`."""
    if name.startswith("builtin:"):
        return name in BUILTIN_TARGETS
    return _hub_id(name) or _under_roots(name, roots)


def check_spec_access(session: Session, owner_id: int, spec: TrainSpec, model_roots: Sequence[Path]
                      ) -> dict[str, dict[str, Any]]:
    """Raise a 422 listing every path of `spec` the owner may not read; returns the reports of its datasets.

    Returns `{"dataset:<id>": report}` of the owner's uploaded datasets the spec names (the dry run's
    estimate reads their row counts).
    """
    problems: list[dict[str, str]] = []
    reports: dict[str, dict[str, Any]] = {}
    if not model_allowed(spec.target.model, model_roots):
        problems.append({"param": "/target/model", "message": "target.model must be a builtin "
                         f"({', '.join(BUILTIN_TARGETS)}), a hub id ('org/name'), or a folder under the "
                         "server's allowed model roots"})
    for i, src in enumerate(spec.data.sources):
        ds_id = dataset_id(src.path)
        param = f"/data/sources/{i}/path"
        if ds_id is None:
            if src.path not in BUILTIN_DATA:
                problems.append({"param": param, "message": "data source must be an uploaded dataset "
                                 f"('dataset:<id>', see POST /v1/datasets) or {', '.join(BUILTIN_DATA)}; "
                                 "server paths are not accepted"})
            continue
        ds = session.scalar(sa.select(Dataset).where(Dataset.id == ds_id, Dataset.owner_id == owner_id))
        if ds is None:
            problems.append({"param": param, "message": f"no dataset {ds_id!r}"})
        else:
            reports[src.path] = ds.report or {}
    for i, ps in enumerate(spec.eval.prompt_sets):
        if ps.name not in BUILTIN_PROMPT_SETS:
            problems.append({"param": f"/eval/prompt_sets/{i}/name", "message": "prompt set must be one of "
                             f"{', '.join(BUILTIN_PROMPT_SETS)}; server paths are not accepted"})
    if problems:
        raise ApiError(422, "spec_invalid", "; ".join(f"{p['param']}: {p['message']}" for p in problems),
                       param=problems[0]["param"], details=problems)
    return reports
