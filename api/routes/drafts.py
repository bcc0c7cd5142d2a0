"""Uploaded drafts: a tar or zip of a speculators-format export folder, the start of warm-started jobs.

    curl -F file=@my-draft.tar.gz -H "Authorization: Bearer $KEY" $URL/v1/drafts
    -> {"id": "drf_...", "status": "ready", "init_from": "draft:drf_...", ...}

then a job spec names it as `draft.init_from: draft:<id>` (docs/warm_start.md). The archive streams to disk
through the dataset upload's reader (size limit `Settings.max_draft_upload_bytes`, sha256, the owner's
upload quota shared with datasets), and is unpacked here, file by file, by rules an attacker's archive
cannot get past (`unpack_export`): regular files and folders only (no link of any kind, no device, no
fifo), relative names without `..`, at most `MAX_ENTRIES` entries, and no more unpacked bytes than the
limit, counted as they are written. The export folder (the archive's root or its one top folder) is then
checked by the export validator (`peagle validate --json --portable`, in a subprocess: the API never imports
the ML stack): `ready` when vLLM would load it, else `invalid` with the validator's reasons (and no files
kept). Drafts are the owner's: another owner's id is 404 "no draft", exactly as a missing one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import stat
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import IO, Annotated, Any

import sqlalchemy as sa
from fastapi import APIRouter, Query, Request, Response
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.deps import DB, AppState, Reader, State, Writer, releases_db
from api.errors import ApiError
from api.openapi import AUTH, error_responses
from api.routes.datasets import _receive_file
from api.schemas import DraftOut, DraftPage
from peagle.fileio import read_json
from peagle.spec.init_from import DRAFT_PREFIX, source_facts
from service.db import repo
from service.db.init_from import DRAFT_READY
from service.db.models import DraftUpload, new_id, utcnow

__all__ = ["MAX_ENTRIES", "router", "unpack_export"]

router = APIRouter(prefix="/v1/drafts", tags=["drafts"])
log = logging.getLogger("peagle.api")

#: Entries (files and folders) an uploaded archive may hold: an export is two files.
MAX_ENTRIES = 64
DRAFT_INVALID = "invalid"
VALIDATE_TIMEOUT_S = 300.0
_CHUNK = 1 << 20

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


class ArchiveRefused(Exception):
    """Why an uploaded archive is not unpacked (its message is the draft's `error`)."""


def _entries_tar(path: Path) -> Iterator[tuple[str, str, int, Callable[[], IO[bytes] | None]]]:
    with tarfile.open(path, "r:*") as tar:
        for m in tar:
            kind = "dir" if m.isdir() else "file" if m.isreg() else \
                "link" if m.issym() or m.islnk() else "device" if m.isdev() else "other"
            yield m.name, kind, int(m.size), lambda m=m: tar.extractfile(m)  # type: ignore[misc]


def _entries_zip(path: Path) -> Iterator[tuple[str, str, int, Callable[[], IO[bytes] | None]]]:
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            mode = info.external_attr >> 16  # unix mode of zips made on unix; no file type bits elsewhere
            if info.is_dir():
                kind = "dir"
            elif stat.S_ISLNK(mode):
                kind = "link"
            elif stat.S_IFMT(mode) in (0, stat.S_IFREG):
                kind = "file"
            else:
                kind = "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "other"
            yield info.filename, kind, int(info.file_size), lambda info=info: zf.open(info)  # type: ignore[misc]


def _safe_parts(name: str) -> tuple[str, ...]:
    """The path parts of an archive member's name, refusing what could land outside the folder."""
    if "\\" in name or "\x00" in name or name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise ArchiveRefused(f"{name!r}: only relative paths (no absolute path, drive or backslash)")
    parts = tuple(p for p in PurePosixPath(name).parts if p not in ("", "."))
    if any(p == ".." for p in parts):
        raise ArchiveRefused(f"{name!r}: a path with '..' (outside the archive's folder)")
    if len(parts) > 4:
        raise ArchiveRefused(f"{name!r}: nested too deep (an export folder is config.json + model.safetensors)")
    return parts


def unpack_export(archive: Path, dest: Path, *, limit: int) -> Path:
    """Unpack `archive` (tar, tar.gz/bz2/xz, zip) into `dest` (module docstring's rules) and return the
    export folder in it: `dest` itself, or the archive's one top folder, holding config.json.

    Raises:
        ArchiveRefused: not an archive, a link / device / fifo, a path out of `dest`, too many entries, more
            than `limit` unpacked bytes, a name twice, or no config.json + model.safetensors.
    """
    if zipfile.is_zipfile(archive):
        entries = _entries_zip(archive)
    elif tarfile.is_tarfile(archive):
        entries = _entries_tar(archive)
    else:
        raise ArchiveRefused("not a tar or zip archive (upload a tar, tar.gz or zip of the export folder)")
    dest.mkdir(parents=True, exist_ok=True)
    written, seen = 0, set[tuple[str, ...]]()
    try:
        for count, (name, kind, size, open_) in enumerate(entries, start=1):
            if count > MAX_ENTRIES:
                raise ArchiveRefused(f"more than {MAX_ENTRIES} entries (an export folder is two files)")
            if kind not in ("file", "dir"):
                raise ArchiveRefused(f"{name!r} is a {kind}: only regular files and folders are accepted")
            parts = _safe_parts(name)
            if not parts:
                continue
            if parts in seen:
                raise ArchiveRefused(f"{name!r} appears twice")
            seen.add(parts)
            target = dest.joinpath(*parts)
            if kind == "dir":
                target.mkdir(parents=True, exist_ok=True)
                continue
            if written + size > limit:
                raise ArchiveRefused(f"unpacks to more than the limit of {limit} bytes")
            target.parent.mkdir(parents=True, exist_ok=True)
            src = open_()
            if src is None:
                raise ArchiveRefused(f"{name!r} cannot be read")
            with src, target.open("xb") as out:  # "x": never through a name that exists (or a link to it)
                while chunk := src.read(_CHUNK):
                    written += len(chunk)
                    if written > limit:  # a header that understated the size
                        raise ArchiveRefused(f"unpacks to more than the limit of {limit} bytes")
                    out.write(chunk)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, ValueError, RuntimeError) as exc:
        raise ArchiveRefused(f"the archive cannot be read: {exc}") from None
    top = {p[0] for p in seen}
    folder = dest if (dest / "config.json").is_file() else dest / next(iter(top)) if len(top) == 1 else dest
    missing = [f for f in ("config.json", "model.safetensors") if not (folder / f).is_file()]
    if missing:
        raise ArchiveRefused(f"no {' and no '.join(missing)} at the archive's root or in its one top folder "
                             "(not a speculators-format export folder)")
    return folder


async def _validate(folder: Path, state: AppState) -> dict[str, Any]:
    """The export validator's verdict on `folder` ({ok, errors, warnings}), run where its messages name
    the folder as `export`, never a server path."""
    async with state.validator_slots:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "peagle", "validate", folder.name, "--json", "--portable", cwd=str(folder.parent),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), VALIDATE_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return {"ok": False, "errors": [f"validation timed out after {VALIDATE_TIMEOUT_S:.0f} s"]}
    try:
        found = json.loads(out.decode().strip().splitlines()[-1])
        return {"ok": bool(found["ok"]), "errors": list(found.get("violations") or []),
                "warnings": list(found.get("warnings") or [])}
    except (ValueError, IndexError, KeyError, TypeError):
        log.error("draft validator failed on %s: %s", folder, err.decode(errors="replace")[-2000:])
        return {"ok": False, "errors": ["the validator could not read this export (internal error)"]}


def _out(up: DraftUpload) -> dict[str, Any]:
    return {"id": up.id, "object": "draft", "filename": up.filename, "size": up.size, "sha256": up.sha256,
            "status": up.status, "report": up.report or {}, "created_at": up.created_at,
            "init_from": f"{DRAFT_PREFIX}{up.id}"}


def _draft_bytes(session: Session, owner_id: int) -> int:
    return int(session.scalar(sa.select(sa.func.coalesce(sa.func.sum(DraftUpload.size), 0))
                              .where(DraftUpload.owner_id == owner_id, DraftUpload.status != DRAFT_INVALID)) or 0)


@router.post("", status_code=201, response_model=DraftOut, operation_id="drafts-upload",
             summary="Upload a draft checkpoint for warm starts (a tar or zip of an export folder; validated)",
             openapi_extra=_UPLOAD_SCHEMA,
             responses=error_responses(400, *AUTH, 413, 415, 422, 429, descriptions={
                 429: "The owner's upload quota (datasets and drafts together) is used."}))
async def upload_draft(request: Request, principal: Writer) -> Any:
    state: AppState = request.app.state.peagle
    s = state.settings

    def used() -> int:
        with state.sessions() as session:
            return repo.owner_upload_bytes(session, principal.owner_id) + _draft_bytes(session, principal.owner_id)

    already = await run_in_threadpool(used)
    if already >= s.max_upload_bytes_per_owner:
        raise ApiError(429, "quota_exceeded", f"upload quota used ({already} of {s.max_upload_bytes_per_owner} "
                       "bytes)", headers={"Retry-After": "3600"})
    drf_id = new_id("drf")
    folder = s.resolved_dataset_root() / str(principal.owner_id) / drf_id
    try:
        path, filename, size, sha, _ = await _receive_file(request, folder / "upload", s.max_draft_upload_bytes,
                                                           s.max_upload_bytes_per_owner - already)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    try:
        export = await run_in_threadpool(unpack_export, path, folder / "unpacked", limit=s.max_draft_upload_bytes)
        report = await _validate(export, state)
    except ArchiveRefused as exc:
        export, report = None, {"ok": False, "errors": [str(exc)]}
    except BaseException:  # a validator that could not start, a cancelled request: no files left behind
        shutil.rmtree(folder, ignore_errors=True)
        raise
    path.unlink(missing_ok=True)  # the archive: what is kept is the folder it unpacked to
    if report["ok"] and export is not None:
        report["facts"] = source_facts(read_json(export / "config.json") or {})
    else:  # unusable: keep the report, not the bytes (they do not count against the quota)
        await run_in_threadpool(shutil.rmtree, folder, True)
    report["error"] = None if report["ok"] else "; ".join(report["errors"])[:2000]

    def insert() -> DraftUpload:
        with state.sessions() as session:
            up = DraftUpload(id=drf_id, owner_id=principal.owner_id, filename=filename,
                             path=str(export) if export is not None else "", size=size, sha256=sha,
                             status=DRAFT_READY if report["ok"] else DRAFT_INVALID, report=report,
                             created_at=utcnow())
            session.add(up)
            session.commit()
            return up

    try:
        return _out(await run_in_threadpool(insert))
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


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
