"""Uploaded drafts: a tar or zip of a speculators-format export folder, the start of warm-started jobs.

    curl -F file=@my-draft.tar.gz -H "Authorization: Bearer $KEY" $URL/v1/drafts
    -> {"id": "drf_...", "status": "ready", "init_from": "draft:drf_...", ...}

then a job spec names it as `draft.init_from: draft:<id>` (docs/warm_start.md). The upload goes through
`api.uploads`, the one path of every kind: the archive streams into the upload's temporary folder (size
limit `Settings.max_draft_upload_bytes`, sha256), is unpacked there by the hostile-archive rules
(`api.archives`, in the sandbox; what its headers declare counts against the owner's quota, shared with
datasets, before anything is written: past what is left of it the upload is 429 `quota_exceeded` and leaves
nothing), and the
archive is deleted. The export folder (the archive's root or its one top folder) is then checked by the
export validator (`peagle validate --json --portable`, in the sandbox: the API never imports the ML stack):
`ready` when vLLM would load it, else `invalid` with the validator's reasons (and no files kept). The
row's `size` is what a ready draft holds on disk (the unpacked files, what the quota counts; also its
`report.unpacked_bytes`); the response's `size` stays the archive's (`report.archive_bytes`). Drafts are
the owner's: another owner's id is 404 "no draft", exactly as a missing one.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import APIRouter, Query, Request, Response
from sqlalchemy.orm import Session

from api import uploads
from api.deps import DB, AppState, Reader, State, Writer, releases_db
from api.errors import ApiError
from api.openapi import AUTH, error_responses
from api.schemas import DraftOut, DraftPage
from peagle.fileio import read_json
from peagle.spec.init_from import DRAFT_PREFIX, source_facts
from service.db import repo
from service.db.init_from import DRAFT_READY
from service.db.models import DraftUpload, utcnow

__all__ = ["router"]

router = APIRouter(prefix="/v1/drafts", tags=["drafts"])

_UPLOAD_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {"multipart/form-data": {"schema": {
            "type": "object", "required": ["file"],
            "properties": {"file": {"type": "string", "format": "binary",
                                    "description": "A tar (optionally gzip/bz2/xz) or zip of a speculators-format "
                                                   "export folder: config.json + model.safetensors"}},
        }}},
    }
}


def _out(up: DraftUpload) -> dict[str, Any]:
    report = up.report or {}  # `size` is the archive's (`DraftOut.size`); the row's is what counts (on disk)
    return {"id": up.id, "object": "draft", "filename": up.filename, "size": report.get("archive_bytes", up.size),
            "sha256": up.sha256,
            "status": up.status, "report": up.report or {}, "created_at": up.created_at,
            "init_from": f"{DRAFT_PREFIX}{up.id}"}


@router.post("", status_code=201, response_model=DraftOut, operation_id="drafts-upload",
             summary="Upload a draft checkpoint for warm starts (a tar or zip of an export folder; validated)",
             openapi_extra=_UPLOAD_SCHEMA,
             responses=error_responses(400, *AUTH, 409, 413, 415, 422, 429, descriptions={
                 409: "The owner has `max_drafts_per_owner` drafts already.",
                 429: "The owner's upload quota (datasets and drafts together, unpacked bytes) or hourly "
                      "draft upload rate is reached."}))
async def upload_draft(request: Request, principal: Writer) -> Any:
    state: AppState = request.app.state.peagle
    limit = state.settings.max_draft_upload_bytes
    async with uploads.begin(state, principal.owner_id, uploads.DRAFT) as up:
        got = await up.receive(request, limit=limit, subdir="upload")
        export: Path | None
        try:
            export = await up.unpack(got.path, limit=limit)
            report = await uploads.validate_export(export, state, home=up.home)
        except uploads.ArchiveRefused as exc:
            export, report = None, {"ok": False, "errors": [str(exc)]}
        ok = bool(report["ok"]) and export is not None
        if ok and export is not None:
            report["facts"] = source_facts(read_json(export / "config.json") or {})
        report["error"] = None if ok else "; ".join(str(e) for e in report["errors"])[:2000]
        report["archive_bytes"] = got.size

        def row(final: Path, size: int) -> DraftUpload:  # unusable: the report is kept, not the bytes
            if ok:
                report["unpacked_bytes"] = size
            path = str(final / export.relative_to(up.partial)) if ok and export is not None else ""
            return DraftUpload(id=up.id, owner_id=principal.owner_id, filename=got.filename, path=path,
                               size=size if ok else got.size, sha256=got.sha256,
                               status=DRAFT_READY if ok else uploads.INVALID, report=report, created_at=utcnow())

        draft = await up.store(row, keep=ok)
    return _out(draft)


@router.get("", response_model=DraftPage, operation_id="drafts-list", summary="List uploaded drafts (newest first)",
            responses=error_responses(*AUTH, 422))
@releases_db
def list_drafts(session: DB, principal: Reader,
                after: Annotated[str | None, Query(max_length=64, pattern=r"^[A-Za-z0-9_]*$")] = None,
                limit: Annotated[int, Query(ge=1, le=200)] = 20) -> Any:
    stmt = sa.select(DraftUpload).where(DraftUpload.owner_id == principal.owner_id)
    if after:
        stmt = stmt.where(DraftUpload.id < after)
    rows = list(session.scalars(stmt.order_by(DraftUpload.id.desc()).limit(limit + 1)))
    data = [_out(d) for d in rows[:limit]]
    return {"object": "list", "data": data, "has_more": len(rows) > limit,
            "next_after": data[-1]["id"] if data else None}


def _load(session: Session, principal: repo.Principal, draft_id: str) -> DraftUpload:
    up = session.get(DraftUpload, draft_id) if re.fullmatch(r"[A-Za-z0-9_]{1,64}", draft_id) else None
    if up is None or up.owner_id != principal.owner_id:
        raise ApiError(404, "not_found", f"no draft {draft_id!r}", param="/draft_id")
    return up


@router.get("/{draft_id}", response_model=DraftOut, operation_id="drafts-get", summary="Get one uploaded draft",
            responses=error_responses(*AUTH, 404, 422))
@releases_db
def get_draft(draft_id: str, session: DB, principal: Reader) -> Any:
    return _out(_load(session, principal, draft_id))


@router.delete("/{draft_id}", status_code=204, response_class=Response, operation_id="drafts-delete",
               summary="Delete an uploaded draft; refused while an unfinished job starts from it",
               responses=error_responses(*AUTH, 404, 409, 422, descriptions={
                   409: "An unfinished job of the owner names the draft (`draft:<id>`)."}))
@releases_db
def delete_draft(draft_id: str, state: State, session: DB, principal: Writer) -> Response:
    up = _load(session, principal, draft_id)
    users = repo.jobs_using_dataset(session, owner_id=principal.owner_id, ref=f'"{DRAFT_PREFIX}{up.id}"')
    if users:
        raise ApiError(409, "draft_in_use", f"draft {up.id} is named by unfinished job(s) {', '.join(users[:5])}; "
                       "cancel them or wait until they end", param="/draft_id")
    folder = state.settings.resolved_dataset_root() / str(up.owner_id) / up.id
    session.delete(up)
    session.commit()
    shutil.rmtree(folder, ignore_errors=True)
    return Response(status_code=204)
