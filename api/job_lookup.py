"""The job lookup every `/v1/jobs/{job_id}/...` route shares: the caller's own job, or 404.

Another owner's job is answered exactly as a missing one (`not_found`), so a job id tells nothing about
jobs that are not the caller's. An id that cannot be one (`JOB_ID`) is 404 without a database round trip.
"""

from __future__ import annotations

import re

from sqlalchemy.orm import Session

from api.errors import ApiError
from service.db import repo
from service.db.models import Job

__all__ = ["JOB_ID", "is_job_id", "load_job", "no_job"]

#: What a job id can be (`service.db.models.new_id`: a prefix, `_`, base32); anything else names no job.
JOB_ID = re.compile(r"[A-Za-z0-9_]{1,64}")


def is_job_id(job_id: str) -> bool:
    """Whether `job_id` can name a job at all (`JOB_ID`)."""
    return JOB_ID.fullmatch(job_id) is not None


def no_job(job_id: str) -> ApiError:
    """The 404 of a job the caller has not (missing, or another owner's)."""
    return ApiError(404, "not_found", f"no job {job_id!r}", param="/job_id")


def load_job(session: Session, principal: repo.Principal, job_id: str, *, lock: bool = False) -> Job:
    """The caller's job or 404 (also for another owner's job); `lock` takes a row lock (`FOR UPDATE`)."""
    job = repo.get_job(session, principal.owner_id, job_id, lock=lock) if is_job_id(job_id) else None
    if job is None:
        raise no_job(job_id)
    return job
