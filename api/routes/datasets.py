"""Datasets: streamed multipart upload (size limit, sha256 while streaming) + validation report.

The upload goes through `api.uploads`, the one path of every kind: the body is parsed incrementally with
`python_multipart` straight from the ASGI stream into a file in the upload's temporary `.partial-<id>`
folder (nothing is spooled, memory stays flat), it stops with 413 as soon as it passes
`settings.max_upload_bytes` and with 429 past the owner's quota (datasets and drafts together). Validation
runs the data helper's torch-free `python -m peagle.data.formats` in the sandbox
(`api.dataset_checks.run_validator`; the API never imports the ML stack).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from sqlalchemy.orm import Session

from api import uploads
from api.dataset_checks import FORMATS, public_report, run_validator
from api.deps import DB, AppState, Reader, State, Writer, releases_db
from api.errors import ApiError
from api.openapi import AUTH, error_responses
from api.schemas import DatasetOut, DatasetPage
from service.channels import dataset_ref
from service.db import repo
from service.db.models import Dataset, utcnow

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])

_UPLOAD_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["file"],
            "properties": {"file": {"type": "string", "format": "binary",
                                    "description": "ShareGPT JSON/JSONL, messages JSONL (OpenAI request bodies "
                                                   "too), tokenized JSONL or a prompt list"},
                           "format": {"type": "string", "enum": list(FORMATS)}},
        }}},
    }
}


def _out(ds: Dataset) -> dict[str, Any]:
    return {"id": ds.id, "object": "dataset", "filename": ds.filename, "size": ds.size, "sha256": ds.sha256,
            "format": ds.format, "status": ds.status, "report": public_report(ds), "created_at": ds.created_at,
            "path_ref": dataset_ref(ds.id)}


@router.post("", status_code=201, response_model=DatasetOut, operation_id="datasets-upload",
             summary="Upload a dataset (multipart, streamed; size limit; sha256; validation report)",
             openapi_extra=_UPLOAD_SCHEMA,
             responses=error_responses(400, *AUTH, 409, 413, 415, 422, 429, descriptions={
                 409: "The owner has `max_datasets_per_owner` datasets already.",
                 429: "The owner's upload quota (datasets and drafts together) or hourly upload rate is reached."}))
async def upload_dataset(request: Request, principal: Writer) -> Any:
    state: AppState = request.app.state.peagle
    async with uploads.begin(state, principal.owner_id, uploads.DATASET) as up:
        got = await up.receive(request, limit=state.settings.max_upload_bytes)
        fmt = got.fields.get("format", "auto")
        if fmt not in FORMATS:
            raise ApiError(422, "validation_error", f"unknown format {fmt[:40]!r}; one of {', '.join(FORMATS)}",
                           param="/format", details=[{"param": "/format", "message": "unknown format"}])
        report = await run_validator(got.path, fmt, state, home=up.home)
        ok = bool(report.get("ok"))

        def row(final: Path, size: int) -> Dataset:  # unusable: the report is kept, not the bytes
            return Dataset(id=up.id, owner_id=principal.owner_id, filename=got.filename,
                           path=str(final / got.filename), size=size, sha256=got.sha256,
                           format=str(report.get("format") or fmt), report=report,
                           status=repo.DATASET_READY if ok else repo.DATASET_INVALID, created_at=utcnow())

        ds = await up.store(row, keep=ok)
    return _out(ds)


@router.get("", response_model=DatasetPage, operation_id="datasets-list", summary="List datasets (newest first)",
            responses=error_responses(*AUTH, 422))
@releases_db
def list_datasets(session: DB, principal: Reader,
                  after: Annotated[str | None, Query(max_length=64, pattern=r"^[A-Za-z0-9_]*$")] = None,
                  limit: Annotated[int, Query(ge=1, le=200)] = 20) -> Any:
    rows, more = repo.list_datasets(session, principal.owner_id, after, limit)
    data = [_out(d) for d in rows]
    return {"object": "list", "data": data, "has_more": more, "next_after": data[-1]["id"] if data else None}


def _load(session: Session, principal: repo.Principal, dataset_id: str) -> Dataset:
    ds = session.get(Dataset, dataset_id) if re.fullmatch(r"[A-Za-z0-9_]{1,64}", dataset_id) else None
    if ds is None or ds.owner_id != principal.owner_id:
        raise ApiError(404, "not_found", f"no dataset {dataset_id!r}", param="/dataset_id")
    return ds


@router.get("/{dataset_id}", response_model=DatasetOut, operation_id="datasets-get", summary="Get one dataset",
            responses=error_responses(*AUTH, 404, 422))
@releases_db
def get_dataset(dataset_id: str, session: DB, principal: Reader) -> Any:
    return _out(_load(session, principal, dataset_id))


@router.delete("/{dataset_id}", status_code=204, response_class=Response, operation_id="datasets-delete",
               summary="Delete a dataset (its row and file); refused while an unfinished job names it",
               responses=error_responses(*AUTH, 404, 409, 422, descriptions={
                   409: "An unfinished job of the owner names the dataset (`dataset:<id>`)."}))
@releases_db
def delete_dataset(dataset_id: str, state: State, session: DB, principal: Writer) -> Response:
    """Invalid uploads too; the bytes stop counting against the owner's upload quota."""
    ds = _load(session, principal, dataset_id)
    users = repo.jobs_using_dataset(session, owner_id=principal.owner_id, ref=dataset_ref(ds.id))
    if users:
        raise ApiError(409, "dataset_in_use", f"dataset {ds.id} is named by unfinished job(s) "
                       f"{', '.join(users[:5])}; cancel them or wait until they end", param="/dataset_id")
    folder = state.settings.resolved_dataset_root() / str(ds.owner_id) / ds.id
    session.delete(ds)
    session.commit()
    shutil.rmtree(folder, ignore_errors=True)
    return Response(status_code=204)
