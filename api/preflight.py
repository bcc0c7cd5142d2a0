"""What a job spec must satisfy before it is queued: one check for create, dry run and clone.

Two kinds of problem, listed together in spec order (`[{"param", "message"}]`):

- forbidden (`api.access`): a path no API job may name, or a `dataset:<id>` the caller does not own. Always
  a 422, dry run included (the spec cannot be estimated for this caller);
- not runnable yet, known without running anything:
  - an uploaded dataset that is not `ready`: `invalid` (the message carries the dataset's own error, from
    its public report) or still `validating` (submit again once it is `ready`: the upload answers only
    after validation, so this is rare);
  - a `ready` dataset without a usable row, or whose `skip` skips every row. A data source's prompts-only
    rows (no answer, a user turn last: its report's `prompts_only`) count as usable only when
    `data.regenerate.enabled` resolves to true (the target writes their answers); without it, a dataset of
    nothing but them is refused with the reason (`N of M rows end with a user turn ...`). A prompt set
    (`eval.prompt_sets[].name`) always counts them: a prompt is all it needs;
  - a `target.model` folder under the operator's model roots that does not exist or holds no
    `config.json`;
  - a hub id `target.model` that is not in the hub cache and the hub cannot be reached, or says it has no
    such model (`api.target_checks.HubProbe`);
  - `data.max_length` beyond the target's context, when its config can be read here (builtin fixtures,
    folders under the model roots, cached hub snapshots: `api.target_checks.local_config`);
  - `vllm` asked for (`resources.target_engine`, `data.regenerate.engine`, `eval.engine`) where the
    workers have no vLLM engine (`Settings.vllm_available`);
  - no live worker consumes the job's queue (`/queue`), or none of them has `resources.gpus` GPUs
    (`service.db.workers`, as `Settings.worker_check` says);
  - a warm start (`draft.init_from`) whose source does not fit: the owner's job not succeeded, its checkpoint
    gone, an upload not `ready`, or a draft whose hidden size, layers, aux layer ids, vocabulary or mask token
    differ from this job's (`peagle.spec.init_from`, from the source's config.json). Another owner's job or
    upload, or a local folder, is an access problem.

  Create and clone answer 422 `spec_invalid` and queue nothing; the dry run answers 200 with
  `valid: false` and the same `problems` (and still its estimate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from api.access import access_problems, under_model_roots
from api.dataset_checks import public_report
from api.errors import ApiError
from api.target_checks import HubProbe, context_problem, local_config
from peagle.fileio import read_json
from peagle.spec import TrainSpec
from peagle.spec.init_from import init_from_problems, parse_init_from
from peagle.spec.targets import is_hub_id
from service.channels import dataset_id
from service.db.init_from import init_source
from service.db.models import Dataset
from service.db.workers import worker_problems
from service.queue import engine_queue, train_queue

__all__ = ["Preflight", "WorkerCheck", "preflight"]

_SECTIONS = {"target": 0, "data": 1, "draft": 2, "eval": 3, "resources": 4, "queue": 5}


@dataclass
class Preflight:
    """The outcome of `preflight`: dataset reports for the estimate, and every problem found."""

    reports: dict[str, dict[str, Any]] = field(default_factory=dict)  # `dataset:<id>` -> its stored report
    problems: list[dict[str, str]] = field(default_factory=list)
    forbidden: bool = False  # some problem is an access problem (a 422 even for the dry run)

    def check(self, *, dry_run: bool) -> None:
        """Raise the 422 `spec_invalid` listing every problem, unless only a dry run sees them."""
        if self.problems and (self.forbidden or not dry_run):
            raise ApiError(422, "spec_invalid", "; ".join(f"{p['param']}: {p['message']}" for p in self.problems),
                           param=self.problems[0]["param"], details=self.problems)


def _order(problem: dict[str, str]) -> tuple[Any, ...]:
    parts = problem["param"].strip("/").split("/")
    return (_SECTIONS.get(parts[0], 9), *(int(p) if p.isdigit() else -1 for p in parts[1:]))


def _target_problems(spec: TrainSpec, roots: Sequence[Path], hub: HubProbe | None) -> list[dict[str, str]]:
    """The target's problems: a missing model folder, an unreachable hub id, `data.max_length` beyond its
    context (when its config can be read here)."""
    name, folder = spec.target.model, None
    if under_model_roots(name, roots):
        if not Path(name).is_dir():
            return [{"param": "/target/model", "message": "no such folder under the server's model roots"}]
        if not (Path(name) / "config.json").is_file():
            return [{"param": "/target/model",
                     "message": "the folder has no config.json (not a Hugging Face model folder)"}]
        folder = Path(name)
    elif is_hub_id(name) and hub is not None:
        why = hub.problem(name, spec.target.revision)
        if why is not None:
            return [{"param": "/target/model", "message": why}]
    config = local_config(name, spec.target.revision, folder=folder)
    too_long = context_problem(config, spec.data.max_length) if config is not None else None
    return [{"param": "/data/max_length", "message": too_long}] if too_long is not None else []


def _dataset_problem(ds: Dataset, skip: int, *, prompts_usable: bool = False) -> str | None:
    """Why `ds` cannot feed the job, or None; with `prompts_usable` (the job regenerates, or `ds` is a prompt
    set) its prompts-only rows count."""
    ref = f"dataset {ds.id}"
    if ds.status == "validating":
        return f"{ref} is still being validated; submit again once GET /v1/datasets/{ds.id} shows status 'ready'"
    if ds.status != "ready":
        error = public_report(ds).get("error") or f"see GET /v1/datasets/{ds.id}"
        return f"{ref} is {ds.status}: {error}"
    report = ds.report or {}
    kept, prompts = report.get("rows_kept"), report.get("prompts_only")
    if not isinstance(kept, int) or isinstance(kept, bool):
        return None  # no count in the report: the trainer checks
    prompts = prompts if isinstance(prompts, int) and not isinstance(prompts, bool) else 0
    if prompts_usable:
        kept += prompts
    if kept <= 0 and prompts > 0:
        read = report.get("rows_read", prompts)
        return (f"{ref}: {prompts} of {read} rows end with a user turn and have no answer to train on; turn on "
                "data.regenerate.enabled so the target writes them")
    if kept <= 0:
        return f"{ref} has no usable row"
    if kept - skip <= 0:
        return f"{ref} has {kept} usable rows and skip={skip} skips them all"
    return None


def _engine_problems(spec: TrainSpec, vllm_available: bool) -> list[dict[str, str]]:
    """Fields that ask for the vLLM engine where the workers have none."""
    if vllm_available:
        return []
    why = ("needs the vLLM engine, which the workers do not have (operator: `make vllm-env` on the worker, or "
           "PEAGLE_VLLM_PYTHON; PEAGLE_VLLM_ON_WORKERS says whether they do)")
    asks = [("/resources/target_engine", spec.resources.target_engine),
            ("/data/regenerate/engine", spec.data.regenerate.engine), ("/eval/engine", spec.eval.engine)]
    return [{"param": param, "message": f"'vllm' {why}"} for param, value in asks if value == "vllm"]


def _init_from_problems(session: Session, owner_id: int, spec: TrainSpec, artifact_root: Path | None
                        ) -> tuple[list[dict[str, str]], bool]:
    """(problems, forbidden) of `draft.init_from`: its source for this owner, then whether it fits."""
    value = spec.draft.init_from
    if value is None:
        return [], False
    found = init_source(session, owner_id, value, artifact_root=artifact_root)
    if found.export_dir is None:
        return [{"param": "/draft/init_from", "message": str(found.problem)}], found.forbidden
    cfg = read_json(found.export_dir / "config.json")
    if cfg is None:
        return [{"param": "/draft/init_from", "message": f"the config.json of {value} is unreadable"}], False
    target = local_config(spec.target.model, spec.target.revision)
    ref = parse_init_from(value)
    source = f"uploaded draft {ref.ref}" if ref.kind == "draft" else \
        f"job {ref.ref}'s draft" + (f" (step {ref.step})" if ref.step is not None else "")
    return [{"param": "/draft/init_from", "message": m}
            for m in init_from_problems(cfg, spec, target, source=source)], False


@dataclass(frozen=True)
class WorkerCheck:
    """Which workers must be able to take the job: its queue, `Settings.worker_check`, heartbeat age."""

    queue: str
    mode: str = "auto"
    stale_after_s: float = 60.0


def _placement_problems(session: Session, spec: TrainSpec, workers: WorkerCheck) -> list[dict[str, str]]:
    """No live worker for the job's train task (`service.queue.train_queue`), or for a split job's engine
    chunks (`resources.engine.queue`, default `engine-<the job's queue>`)."""
    r = spec.resources
    trainer = r.trainer.queue if r.trainer is not None else None
    queue = train_queue(workers.queue, r)
    gpus = r.trainer.gpus if r.trainer is not None and r.trainer.gpus is not None else r.gpus
    out = worker_problems(session, queue=queue, gpus=gpus, stale_after_s=workers.stale_after_s, mode=workers.mode,
                          queue_param="/resources/trainer/queue" if trainer else "/queue",
                          gpus_param="/resources/trainer/gpus" if r.trainer is not None and r.trainer.gpus is not None
                          else "/resources/gpus")
    if r.engine is not None:
        out += worker_problems(session, queue=r.engine.queue or engine_queue(queue), gpus=r.engine.gpus,
                               stale_after_s=workers.stale_after_s, mode=workers.mode,
                               queue_param="/resources/engine/queue", gpus_param="/resources/engine/gpus")
    return out


def preflight(session: Session, owner_id: int, spec: TrainSpec, model_roots: Sequence[Path], *,
              vllm_available: bool = True, hub: HubProbe | None = None, workers: WorkerCheck | None = None,
              artifact_root: Path | None = None) -> Preflight:
    """Every problem of `spec` knowable before queueing, for this owner (module docstring); `hub` None
    leaves hub ids to the worker, `workers` None does not look at the workers; `artifact_root` is where a
    job's relative `artifact_dir` lives (the worker writes absolute ones)."""
    out = Preflight(problems=access_problems(spec, model_roots))
    out.forbidden = bool(out.problems)
    warm, warm_forbidden = _init_from_problems(session, owner_id, spec, artifact_root)
    out.problems += warm
    out.forbidden = out.forbidden or warm_forbidden
    out.problems += _target_problems(spec, model_roots, hub)
    if workers is not None:
        out.problems += _placement_problems(session, spec, workers)
    out.problems += _engine_problems(spec, vllm_available)
    # (param, `dataset:<id>`, rows skipped, is a data source) of every dataset ref: sources and prompt sets
    named = [(f"/data/sources/{i}/path", src.path, src.skip, True) for i, src in enumerate(spec.data.sources)]
    named += [(f"/eval/prompt_sets/{i}/name", ps.name, 0, False) for i, ps in enumerate(spec.eval.prompt_sets)]
    ids = {ds_id for _, ref, _, _ in named if (ds_id := dataset_id(ref)) is not None}
    regenerate = bool(ids) and spec.resolve(cuda_available=spec.resources.gpus > 0, vllm_available=vllm_available
                                            ).data.regenerate.enabled is True
    owned = {ds.id: ds for ds in session.scalars(
        sa.select(Dataset).where(Dataset.id.in_(ids), Dataset.owner_id == owner_id))} if ids else {}
    for param, ref, skip, is_source in named:
        ds_id = dataset_id(ref)
        if ds_id is None:
            continue
        ds = owned.get(ds_id)
        if ds is None:
            out.problems.append({"param": param, "message": f"no dataset {ds_id!r}"})
            out.forbidden = True
            continue
        if is_source:  # the data funnel of the estimate reads the sources' reports
            out.reports[ref] = ds.report or {}
        problem = _dataset_problem(ds, skip, prompts_usable=regenerate or not is_source)
        if problem is not None:
            out.problems.append({"param": param, "message": problem})
    out.problems.sort(key=_order)
    return out
