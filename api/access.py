"""What an API job may read: the one place the service decides which spec paths a tenant can name.

A job submitted through the API (create, dry run, clone) runs on shared workers that can read the whole
host, so its spec may only name:

- training data (`data.sources[].path`): `builtin:*` data, or `dataset:<id>` of a dataset the caller owns;
- prompt sets (`eval.prompt_sets[].name`): the builtin sets (`humaneval`, `sharegpt-heldout`, and `heldout`,
  the job's own held-out conversations), or `dataset:<id>` of a dataset the caller owns;
- the target (`target.model`): a builtin, a hub id (`name` or `org/name`: no other slash, no `..`, not
  absolute), or a folder under one of the operator's `model_roots` (`PEAGLE_MODEL_ROOTS`; none by default).

Anything else is a 422 naming the field; the message never says whether a path exists or what it holds.
What an allowed name must also be before a job is queued (a `ready` dataset with usable rows, a model
folder under a root) is `api.preflight`'s part.
The CLI (`peagle train`) is not restricted: a local user may read local files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from peagle.spec import BUILTIN_DATA, BUILTIN_PROMPT_SETS, BUILTIN_TARGETS, TrainSpec
from peagle.spec.targets import is_hub_id
from service.channels import dataset_id

__all__ = ["access_problems", "model_allowed", "under_model_roots"]

def under_model_roots(name: str, roots: Sequence[Path]) -> bool:
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
    return is_hub_id(name) or under_model_roots(name, roots)


def access_problems(spec: TrainSpec, model_roots: Sequence[Path]) -> list[dict[str, str]]:
    """`[{"param", "message"}]` of every spec path no API job may name (the `dataset:<id>` sources aside:
    whether the caller owns them is `api.preflight`'s database look-up)."""
    problems: list[dict[str, str]] = []
    if not model_allowed(spec.target.model, model_roots):
        problems.append({"param": "/target/model", "message": "target.model must be a builtin "
                         f"({', '.join(BUILTIN_TARGETS)}), a hub id ('org/name'), or a folder under the "
                         "server's allowed model roots"})
    named = spec.target.name_or_path
    if named is not None and not model_allowed(named, model_roots):  # the export and the worker read it
        problems.append({"param": "/target/name_or_path", "message": "target.name_or_path must be a builtin, a "
                         "hub id ('org/name'), or a folder under the server's allowed model roots"})
    for i, src in enumerate(spec.data.sources):
        if dataset_id(src.path) is None and src.path not in BUILTIN_DATA:
            problems.append({"param": f"/data/sources/{i}/path", "message": "data source must be an uploaded "
                             f"dataset ('dataset:<id>', see POST /v1/datasets) or {', '.join(BUILTIN_DATA)}; "
                             "server paths are not accepted"})
    for i, ps in enumerate(spec.eval.prompt_sets):
        if ps.name not in BUILTIN_PROMPT_SETS and dataset_id(ps.name) is None:
            problems.append({"param": f"/eval/prompt_sets/{i}/name", "message": "prompt set must be one of "
                             f"{', '.join(BUILTIN_PROMPT_SETS)} or an uploaded dataset ('dataset:<id>'); "
                             "server paths are not accepted"})
    return problems
