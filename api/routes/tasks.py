"""The tasks of a job (issue 37): its trainer and, for a job split over engine workers (`resources.engine`),
its engine chunk tasks grouped by worker: role, worker, GPUs, state, chunks done, tokens/s."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from api.deps import DB, Reader, releases_db
from api.job_lookup import load_job
from api.openapi import AUTH, error_responses
from api.records import worker_label
from service.db.engine_tasks import IN_FLIGHT, task_rows

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


class TaskOut(BaseModel):
    """One task of the job: the trainer, or the chunks one engine worker ran."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["trainer", "engine"]
    worker: str | None = Field(description="Which worker runs it: a stable label of the worker (`w-` and 8 hex "
                                           "digits; no host name or pid), None while not taken.")
    gpus: int
    state: str = Field(description="trainer: the job's status; engine: running while a chunk is in flight, "
                                   "else the state of its last chunk.")
    chunks_done: int
    chunks_total: int
    tokens: int
    tokens_per_second: float | None


class TaskList(BaseModel):
    model_config = ConfigDict(extra="forbid")

    object: Literal["list"] = "list"
    data: list[TaskOut]


def tasks_of(job: Any, rows: list[Any]) -> list[dict[str, Any]]:
    """The trainer's row, then one per engine worker (pure over the job and its `engine_task` rows)."""
    res = (job.spec or {}).get("resources") or {}
    trainer_gpus = ((res.get("trainer") or {}).get("gpus"))
    out: list[dict[str, Any]] = [{
        "role": "trainer", "worker": worker_label(job.lease_owner), "gpus": int(trainer_gpus if trainer_gpus is not None
                                                                  else res.get("gpus", 0) or 0),
        "state": job.status, "chunks_done": 0, "chunks_total": 0, "tokens": 0, "tokens_per_second": None,
    }]
    by_worker: dict[str | None, list[Any]] = {}
    for r in rows:
        by_worker.setdefault(r.worker, []).append(r)
    for worker, mine in sorted(by_worker.items(), key=lambda kv: kv[0] or ""):
        done = [r for r in mine if r.state == "done"]
        tokens, seconds = sum(int(r.tokens) for r in done), sum(float(r.seconds) for r in done)
        running = [r for r in mine if r.state in IN_FLIGHT]
        last = max(mine, key=lambda r: (r.finished_at or r.started_at or r.sent_at or job.created_at))
        out.append({"role": "engine", "worker": worker_label(worker), "gpus": max(int(r.gpus) for r in mine),
                    "state": "running" if running else last.state, "chunks_done": len(done),
                    "chunks_total": len(mine), "tokens": tokens,
                    "tokens_per_second": round(tokens / seconds, 1) if seconds > 0 else None})
    return out


@router.get("/{job_id}/tasks", response_model=TaskList, operation_id="jobs-tasks",
            summary="The job's tasks: its trainer and its engine workers' chunks (role, worker, GPUs, state, "
                    "chunks done, tokens/s)", responses=error_responses(*AUTH, 404, 422))
@releases_db
def list_tasks(job_id: str, session: DB, principal: Reader) -> Any:
    job = load_job(session, principal, job_id)
    return {"object": "list", "data": tasks_of(job, task_rows(session, job.id))}
