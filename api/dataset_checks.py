"""Limits and validation of dataset uploads: per-owner count and rate, bounded validator subprocesses.

- count: at most `max_datasets_per_owner` datasets per owner; one more is 409 `dataset_limit_reached`
  (a count, not a rate: waiting does not help), refused before the body is read;
- rate: at most `max_dataset_uploads_per_hour` uploads per owner in any rolling hour; one more is 429
  `rate_limited` with `Retry-After` = seconds until the oldest upload of the hour ages out. Both count the
  owner's rows in the database, so every API process agrees;
- concurrency: at most `max_concurrent_validations` validator subprocesses per API process; an upload
  beyond that waits for a slot (its request stays open: the file is already received, and the answer is
  the same report, only later);
- the validator (`python -m peagle.data.formats`) runs in the dataset's folder on the bare file name, so
  its report names `<filename>: line N`, never a server path; a validator crash is reported as a generic
  `invalid` dataset (its stderr goes to the server log, not to the client).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any, get_args

import sqlalchemy as sa
from sqlalchemy.orm import Session

from api.errors import ApiError
from peagle.spec.schema import DataSource
from service.db.models import Dataset, utcnow
from service.settings import Settings

__all__ = ["FORMATS", "check_upload_allowed", "public_report", "run_validator"]

log = logging.getLogger("peagle.api")

#: The upload formats: the spec's `data.sources[].format` values (one source of truth).
FORMATS: tuple[str, ...] = get_args(DataSource.model_fields["format"].annotation)
VALIDATE_TIMEOUT_S = 300.0
_HOUR = timedelta(hours=1)


def check_upload_allowed(session: Session, owner_id: int, settings: Settings) -> None:
    """409 past the owner's dataset count, 429 (with Retry-After) past their hourly upload rate."""
    count = int(session.scalar(sa.select(sa.func.count()).select_from(Dataset)
                               .where(Dataset.owner_id == owner_id)) or 0)
    if count >= settings.max_datasets_per_owner:
        raise ApiError(409, "dataset_limit_reached", f"{count} datasets uploaded (limit "
                       f"{settings.max_datasets_per_owner} per owner)")
    now = utcnow()
    recent, oldest = session.execute(
        sa.select(sa.func.count(), sa.func.min(Dataset.created_at))
        .where(Dataset.owner_id == owner_id, Dataset.created_at >= now - _HOUR)).one()
    if int(recent or 0) >= settings.max_dataset_uploads_per_hour:
        if oldest is not None and oldest.tzinfo is None:  # SQLite returns naive UTC
            oldest = oldest.replace(tzinfo=UTC)
        wait = int(((oldest or now) + _HOUR - now).total_seconds()) + 1
        raise ApiError(429, "rate_limited", f"{recent} dataset uploads in the last hour (limit "
                       f"{settings.max_dataset_uploads_per_hour} per owner)",
                       headers={"Retry-After": str(max(1, min(wait, 3600)))})


async def run_validator(path: Path, fmt: str, settings: Settings, slots: asyncio.Semaphore) -> dict[str, Any] | None:
    """The validator's report for `path` (None if the validator module is missing: use the fallback).

    `slots` bounds the validations running at once (`AppState.validator_slots`, of
    `settings.max_concurrent_validations`); an upload waits for a free one.
    """
    async with slots:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "peagle.data.formats", path.name, "--format", fmt,
            "--max-row-bytes", str(settings.max_dataset_row_bytes), cwd=str(path.parent),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), VALIDATE_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return {"ok": False, "error": f"validation timed out after {VALIDATE_TIMEOUT_S:.0f} s"}
    try:
        report = json.loads(out.decode().strip().splitlines()[-1])
        report.setdefault("validator", "peagle.data.formats")
        return report
    except (ValueError, IndexError):
        if b"No module named" in err:
            return None
        log.error("dataset validator failed on %s: %s", path, err.decode(errors="replace")[-2000:])
        return {"ok": False, "error": "the validator could not read this file (internal error)",
                "validator": "peagle.data.formats"}


def _scrub(value: Any, replace: list[tuple[str, str]]) -> Any:
    if isinstance(value, str):
        for old, new in replace:
            value = value.replace(old, new)
        return value
    if isinstance(value, list):
        return [_scrub(v, replace) for v in value]
    if isinstance(value, dict):
        return {k: _scrub(v, replace) for k, v in value.items()}
    return value


def public_report(ds: Dataset) -> dict[str, Any]:
    """The dataset's report as clients see it: the file is named by its upload name, never a server path."""
    report = dict(ds.report or {})
    folder = str(Path(ds.path).parent) if ds.path else ""
    pairs = [(p, ds.filename) for p in (ds.path, str(Path(ds.path).resolve()) if ds.path else "") if p]
    if folder:
        pairs.append((folder + "/", ""))
    report = _scrub(report, sorted(set(pairs), key=lambda p: -len(p[0])))
    if "path" in report:
        report["path"] = ds.filename
    return report
