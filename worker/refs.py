"""The owner's references in a job's spec -> what its trainer reads, and back (pure).

    ids = dataset_refs(spec)                        # `dataset:<id>` in data.sources and eval.prompt_sets
    local = localize_datasets(spec, files)          # each ref -> the uploaded file's local path
    shown = public_spec(resolved, submitted, redact=redactor.value)   # the trainer's resolved spec, as the owner sees it

The supervisor looks the files up (`service.db.lease.dataset_files`: the job owner's datasets only) and maps
their paths back in what clients see (`worker.redact.Redactor`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from peagle.spec import TrainSpec
from service.channels import dataset_id

__all__ = ["dataset_refs", "localize_datasets", "public_spec"]


def dataset_refs(spec: TrainSpec) -> list[str]:
    """The dataset ids `spec` names (`dataset:<id>` data sources, then prompt sets)."""
    ids = [ds_id for src in spec.data.sources if (ds_id := dataset_id(src.path)) is not None]
    return ids + [ds_id for ps in spec.eval.prompt_sets if (ds_id := dataset_id(ps.name)) is not None]


def localize_datasets(spec: TrainSpec, files: dict[str, str]) -> TrainSpec:
    """`spec` with each `dataset:<id>` source and prompt set replaced by its file (`files`: id -> local path).

    Raises:
        KeyError: a dataset that is not in `files`; its message names the field path
            (``data.sources.0.path: dataset 'ds_x' not found``).
    """

    def local(items: list[Any], field: str, where: str) -> list[Any]:
        out = []
        for i, item in enumerate(items):
            ds_id = dataset_id(getattr(item, field))
            if ds_id is not None and ds_id not in files:
                raise KeyError(f"{where}.{i}.{field}: dataset {ds_id!r} not found")
            out.append(item if ds_id is None else item.model_copy(update={field: files[ds_id]}))
        return out

    sources = local(spec.data.sources, "path", "data.sources")
    prompt_sets = local(spec.eval.prompt_sets, "name", "eval.prompt_sets")
    return spec.model_copy(update={"data": spec.data.model_copy(update={"sources": sources}),
                                   "eval": spec.eval.model_copy(update={"prompt_sets": prompt_sets})})


def public_spec(resolved: dict[str, Any], submitted: dict[str, Any], *,
                redact: Callable[[Any], Any]) -> dict[str, Any]:
    """The trainer's resolved spec as the owner sees it: their own data refs and warm start (from the
    `submitted` spec), no server path (`redact`)."""
    warm = (submitted.get("draft") or {}).get("init_from")
    if warm is not None and isinstance(resolved.get("draft"), dict):
        resolved = {**resolved, "draft": {**resolved["draft"], "init_from": warm}}
    mine = (submitted.get("data") or {}).get("sources") or []
    sources = (resolved.get("data") or {}).get("sources")
    if isinstance(sources, list) and len(sources) == len(mine):
        resolved = {**resolved, "data": {**resolved["data"], "sources": [
            {**s, "path": m.get("path")} if isinstance(s, dict) else s for s, m in zip(sources, mine, strict=True)]}}
    out: dict[str, Any] = redact(resolved)
    return out
