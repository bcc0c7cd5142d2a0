"""Datasets: streamed multipart upload (size limit, sha256 while streaming) + validation report.

The body is parsed incrementally with `python_multipart` straight from the ASGI stream into the
destination file: nothing is spooled, memory stays flat, and the upload stops with 413 as soon as it
passes `settings.max_upload_bytes`. Validation runs the data helper's torch-free
`python -m peagle.data.formats PATH` in a subprocess (the API never imports the ML stack).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from python_multipart.multipart import MultipartParser, parse_options_header
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.dataset_checks import FORMATS, check_upload_allowed, public_report, run_validator
from api.deps import DB, AppState, Reader, State, Writer, releases_db
from api.errors import ApiError
from api.openapi import AUTH, error_responses
from api.schemas import DatasetOut, DatasetPage
from service.channels import dataset_ref
from service.db import repo
from service.db.models import Dataset, new_id, utcnow

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


def _safe_name(name: str) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]", "_", Path(name.replace("\\", "/")).name)[:200].lstrip(".")
    return base or "upload.jsonl"


async def _receive_file(request: Request, dest_dir: Path, limit: int, quota_left: int
                        ) -> tuple[Path, str, int, str, str]:
    """Stream the `file` part to disk (413 past `limit`, 429 past `quota_left`).

    Returns (path, filename, size, sha256, format field).
    """
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise ApiError(415, "unsupported_media_type", "send multipart/form-data with a 'file' part", param="/file")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + 64 * 1024:
        raise ApiError(413, "payload_too_large", f"upload of {declared} bytes exceeds the limit of {limit} bytes")
    st: dict[str, Any] = {"headers": {}, "name": None, "filename": None, "fh": None, "size": 0,
                          "sha": hashlib.sha256(), "fields": {}, "field": b"", "hname": b"", "hval": b""}
    dest_dir.mkdir(parents=True, exist_ok=True)

    def on_header_field(d: bytes, s: int, e: int) -> None:
        st["hname"] += d[s:e]

    def on_header_value(d: bytes, s: int, e: int) -> None:
        st["hval"] += d[s:e]

    def on_header_end() -> None:
        st["headers"][st["hname"].decode("latin-1").lower()] = st["hval"]
        st["hname"], st["hval"] = b"", b""

    def on_headers_finished() -> None:
        _, opts = parse_options_header(st["headers"].get("content-disposition", b""))
        st["name"] = opts.get(b"name", b"").decode()
        fn = opts.get(b"filename")
        if st["name"] == "file" and fn is not None and st["fh"] is None:
            st["filename"] = _safe_name(fn.decode("utf-8", "replace"))
            st["fh"] = (dest_dir / st["filename"]).open("wb")
        st["field"] = b""

    def on_part_data(d: bytes, s: int, e: int) -> None:
        chunk = d[s:e]
        if st["name"] == "file" and st["fh"] is not None and not st["fh"].closed:
            st["size"] += len(chunk)
            if st["size"] > limit:
                raise ApiError(413, "payload_too_large", f"upload exceeds the limit of {limit} bytes", param="/file")
            if st["size"] > quota_left:
                raise ApiError(429, "quota_exceeded", "upload exceeds this owner's remaining upload quota "
                               f"({quota_left} bytes)", param="/file", headers={"Retry-After": "3600"})
            st["sha"].update(chunk)
            st["fh"].write(chunk)
        elif len(st["field"]) < 1024:
            st["field"] += chunk

    def on_part_end() -> None:
        if st["name"] == "file" and st["fh"] is not None:
            st["fh"].close()
        elif st["name"]:
            st["fields"][st["name"]] = st["field"].decode("utf-8", "replace")
        st["headers"] = {}

    parser = MultipartParser(boundary, {
        "on_header_field": on_header_field, "on_header_value": on_header_value, "on_header_end": on_header_end,
        "on_headers_finished": on_headers_finished, "on_part_data": on_part_data, "on_part_end": on_part_end,
    })
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - malformed multipart
        raise ApiError(400, "bad_request", f"malformed multipart body: {exc}") from None
    finally:
        if st["fh"] is not None and not st["fh"].closed:
            st["fh"].close()
    if st["filename"] is None:
        raise ApiError(422, "validation_error", "missing the 'file' part", param="/file",
                       details=[{"param": "/file", "message": "required multipart file part"}])
    return dest_dir / st["filename"], st["filename"], st["size"], st["sha"].hexdigest(), st["fields"].get(
        "format", "auto")


def basic_check(path: Path, max_rows: int = 100_000) -> dict[str, Any]:
    """Fallback format check (used only if `peagle.data.formats` is unavailable): JSON/JSONL rows."""
    rows, bad, fmt = 0, [], None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {"ok": False, "error": "cannot read as UTF-8 text", "rows_read": 0, "rows_kept": 0}
    items: list[tuple[int, Any]] = []
    if text.lstrip().startswith("["):
        try:
            items = list(enumerate(json.loads(text), start=1))
        except ValueError as exc:
            return {"ok": False, "error": f"invalid JSON array: {exc}", "rows_read": 0, "rows_kept": 0}
    else:
        for ln, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    items.append((ln, json.loads(line)))
                except ValueError:
                    bad.append({"line": ln, "reason": "invalid JSON"})
    for ln, obj in items[:max_rows]:
        rows += 1
        kind = next((k for k in ("conversations", "messages", "input_ids") if isinstance(obj, dict) and k in obj), None)
        if kind is None:
            bad.append({"line": ln, "reason": "no conversations/messages/input_ids"})
        fmt = fmt or {"conversations": "sharegpt", "messages": "messages", "input_ids": "tokenized"}.get(kind or "")
    kept = rows - len([b for b in bad if b["reason"] != "invalid JSON"])
    return {"ok": kept > 0, "error": None if kept > 0 else "no usable row", "format": fmt or "unknown",
            "rows_read": rows + len([b for b in bad if b["reason"] == "invalid JSON"]), "rows_kept": kept,
            "bad_rows": bad[:100], "validator": "basic"}


async def validate(path: Path, fmt: str, state: AppState) -> dict[str, Any]:
    """Run the data helper's validator in a subprocess (`api.dataset_checks`); fall back to `basic_check`."""
    report = await run_validator(path, fmt, state.settings, state.validator_slots)
    return report if report is not None else await run_in_threadpool(basic_check, path)


@router.post("", status_code=201, response_model=DatasetOut, operation_id="datasets-upload",
             summary="Upload a dataset (multipart, streamed; size limit; sha256; validation report)",
             openapi_extra=_UPLOAD_SCHEMA,
             responses=error_responses(400, *AUTH, 409, 413, 415, 422, 429, descriptions={
                 409: "The owner has `max_datasets_per_owner` datasets already.",
                 429: "The owner's upload quota or hourly upload rate is reached."}))
async def upload_dataset(request: Request, principal: Writer) -> Any:
    state: AppState = request.app.state.peagle
    s = state.settings

    def used() -> int:
        with state.sessions() as session:
            check_upload_allowed(session, principal.owner_id, s)
            return repo.owner_upload_bytes(session, principal.owner_id)

    already = await run_in_threadpool(used)
    if already >= s.max_upload_bytes_per_owner:
        raise ApiError(429, "quota_exceeded", f"upload quota used ({already} of {s.max_upload_bytes_per_owner} "
                       "bytes)", headers={"Retry-After": "3600"})
    ds_id = new_id("ds")
    folder = s.resolved_dataset_root() / str(principal.owner_id) / ds_id
    try:
        path, filename, size, sha, fmt = await _receive_file(request, folder, s.max_upload_bytes,
                                                             s.max_upload_bytes_per_owner - already)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if fmt not in FORMATS:
        shutil.rmtree(folder, ignore_errors=True)
        raise ApiError(422, "validation_error", f"unknown format {fmt[:40]!r}; one of {', '.join(FORMATS)}",
                       param="/format", details=[{"param": "/format", "message": "unknown format"}])
    report = await validate(path, fmt, state)
    if not report.get("ok"):  # unusable: keep the report, not the bytes (they do not count against the quota)
        await run_in_threadpool(shutil.rmtree, folder, True)

    def insert() -> Dataset:
        with state.sessions() as session:
            ds = Dataset(id=ds_id, owner_id=principal.owner_id, filename=filename, path=str(path), size=size,
                         sha256=sha, format=str(report.get("format") or fmt), report=report,
                         status=repo.DATASET_READY if report.get("ok") else repo.DATASET_INVALID, created_at=utcnow())
            session.add(ds)
            session.commit()
            return ds

    try:
        return _out(await run_in_threadpool(insert))
    except BaseException:  # no row, no file (a dropped connection's retry uploads it again under a new id)
        shutil.rmtree(folder, ignore_errors=True)
        raise


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
