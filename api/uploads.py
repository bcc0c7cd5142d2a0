"""One upload path for every kind (datasets, drafts, and any later one), below the routes.

    async with uploads.begin(state, owner_id, uploads.DRAFT) as up:     # count, hourly rate, quota
        got = await up.receive(request, limit=s.max_draft_upload_bytes, subdir="upload")
        export = await up.unpack(got.path, limit=s.max_draft_upload_bytes)  # drafts: hostile-archive rules
        report = await uploads.validate_export(export, state, home=up.home)  # in the sandbox
        row = await up.store(build_row, keep=report["ok"])

- **Limits per kind** (`check_upload_allowed`): at most `Kind.count_setting` uploads kept per owner (409
  `<kind>_limit_reached`, a count: waiting does not help) and `Kind.hourly_setting` in any rolling hour
  (429 `rate_limited`, `Retry-After` = until the oldest of the hour ages out). Refused before the body is
  read. They count the owner's rows (every API process agrees) plus this process's uploads in flight.
- **One quota** (`Settings.max_upload_bytes_per_owner`): the bytes on disk of everything the owner keeps,
  datasets and drafts together (`used_bytes`; a draft counts what it unpacked to, never its archive),
  plus what the owner's uploads in flight have written so far: the streamed file, then the archive and
  what it has unpacked (`QuotaLedger`). Every chunk is reserved before it is written, so uploads at once
  never hold more than the quota; past it 429 `quota_exceeded` and nothing is kept. The ledger is per API
  process: across several processes each sees the others' stored uploads (the database) but not their
  uploads in flight, so together they can pass the quota by what is in flight elsewhere.
- **Temporary names.** An upload is written into `<dataset_root>/<owner>/.partial-<id>/` and renamed to
  `<id>/` once it is kept (the row is inserted right after). An API killed mid-upload leaves only a
  `.partial-*` (in no row and no quota): `sweep_leftovers` deletes those at start-up once nothing in them
  changed for `Settings.sandbox_wall_seconds` + `SWEEP_MARGIN_S` (an upload another API process is
  validating is left alone).
- **Hostile archives** (`api.archives`): regular files and folders only (no link of any kind, no device,
  no fifo), relative names without `..`, at most `MAX_ENTRIES` entries, the same name once, at most the
  limit in unpacked bytes. What the headers declare is reserved against the owner's quota before anything
  is written, and the unpacking child may write no more than that.
- **The sandbox.** Every parser of the tenant's bytes (the dataset validator, the export validator) runs
  as a child in `peagle.engine.sandbox` (`run_sandboxed`): no service secret in its environment, rlimits
  from `Settings.sandbox_*`, a wall clock, at most `max_concurrent_validations` at once per API process.
  A breach is the upload's refusal naming the limit. Unpacking an archive is parsing the tenant's bytes
  too: it runs there as well (`python -m api.archives size|unpack`), never in the API process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any, Protocol, TypeVar

import sqlalchemy as sa
from python_multipart.multipart import MultipartParser, parse_options_header
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from api.archives import MAX_ENTRIES, ArchiveRefused
from api.errors import ApiError
from peagle.engine import sandbox
from peagle.run_folder import inside
from service.db.models import Dataset, DraftUpload, new_id, utcnow
from service.settings import Settings

__all__ = [
    "DATASET", "DRAFT", "INVALID", "KINDS", "MAX_ENTRIES", "PARTIAL_PREFIX", "ArchiveRefused", "Kind",
    "QuotaExceeded", "QuotaLedger", "Received", "Upload", "UploadState", "begin", "check_upload_allowed",
    "export_validator_command", "run_sandboxed", "sandbox_limits", "sweep_leftovers", "used_bytes", "validate_export",
]  # fmt: skip

log = logging.getLogger("peagle.api")

INVALID = "invalid"  # the status of an upload that failed validation, of every kind (its bytes are not kept)
PARTIAL_PREFIX = ".partial-"
SWEEP_MARGIN_S = 60.0
_CHUNK = 1 << 20
_FRAMING_BYTES = 1024  # at least this much of a multipart body is framing, not the file (boundaries, headers)
_HOUR = timedelta(hours=1)
_Row = TypeVar("_Row", Dataset, DraftUpload)


@dataclass(frozen=True)
class Kind:
    """One kind of upload: its table, id prefix and limits (names of `Settings` fields)."""

    name: str
    model: type[Dataset] | type[DraftUpload]
    id_prefix: str
    count_setting: str
    hourly_setting: str


DATASET = Kind("dataset", Dataset, "ds", "max_datasets_per_owner", "max_dataset_uploads_per_hour")
DRAFT = Kind("draft", DraftUpload, "drf", "max_drafts_per_owner", "max_draft_uploads_per_hour")
KINDS = (DATASET, DRAFT)


def check_upload_allowed(session: Session, owner_id: int, settings: Settings, kind: Kind = DATASET, *,
                         in_flight: int = 0) -> None:
    """409 past the owner's count of `kind`, 429 (with Retry-After) past their hourly rate of it; `in_flight`
    is how many other uploads of `kind` of the owner this process is receiving."""
    model = kind.model
    limit, per_hour = int(getattr(settings, kind.count_setting)), int(getattr(settings, kind.hourly_setting))
    count = int(session.scalar(sa.select(sa.func.count()).select_from(model).where(model.owner_id == owner_id)) or 0)
    if count + in_flight >= limit:
        raise ApiError(409, f"{kind.name}_limit_reached", f"{count} {kind.name}s uploaded"
                       f"{f' and {in_flight} in flight' if in_flight else ''} (limit {limit} per owner)")
    now = utcnow()
    recent, oldest = session.execute(
        sa.select(sa.func.count(), sa.func.min(model.created_at))
        .where(model.owner_id == owner_id, model.created_at >= now - _HOUR)).one()
    if int(recent or 0) + in_flight >= per_hour:
        if oldest is not None and oldest.tzinfo is None:  # SQLite returns naive UTC
            oldest = oldest.replace(tzinfo=UTC)
        wait = int(((oldest or now) + _HOUR - now).total_seconds()) + 1
        raise ApiError(429, "rate_limited", f"{recent} {kind.name} uploads in the last hour (limit "
                       f"{per_hour} per owner)", headers={"Retry-After": str(max(1, min(wait, 3600)))})


def used_bytes(session: Session, owner_id: int) -> int:
    """Bytes on disk of the owner's kept uploads, every kind (invalid ones keep no bytes)."""
    return sum(int(session.scalar(sa.select(sa.func.coalesce(sa.func.sum(k.model.size), 0))
                                  .where(k.model.owner_id == owner_id, k.model.status != INVALID)) or 0)
               for k in KINDS)  # fmt: skip


# -- the quota of uploads in flight ------------------------------------------------------------------------


class QuotaExceeded(Exception):
    """An upload would pass its owner's quota: `left` bytes were left of `quota`."""

    def __init__(self, left: int, quota: int) -> None:
        super().__init__(f"{left} bytes left of the {quota}-byte upload quota")
        self.left, self.quota = left, quota


@dataclass
class _Owner:
    base: int | None = None  # the database's used bytes, read once the owner's first upload in flight began
    committed: int = 0  # bytes stored by uploads since then (in the database too, not in `base`)
    reserved: int = 0  # bytes written by the uploads in flight
    kinds: dict[str, int] = field(default_factory=dict)  # uploads in flight per kind


class QuotaLedger:
    """Per API process: what each owner's uploads in flight hold (`UploadState.quotas`). Thread-safe (the
    unpacking runs in a threadpool thread); the lock is never held across I/O."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owners: dict[int, _Owner] = {}

    def hold(self, owner_id: int, kind: str, *, quota: int) -> Hold:
        """Register one upload in flight (read the database after this, then `Hold.settle_base`)."""
        with self._lock:
            entry = self._owners.setdefault(owner_id, _Owner())
            entry.kinds[kind] = entry.kinds.get(kind, 0) + 1
        return Hold(self, owner_id, kind, quota)

    def owners(self) -> list[int]:
        """Owners with uploads in flight."""
        with self._lock:
            return list(self._owners)


class UploadState(Protocol):
    """What an upload uses of the app's state (`api.deps.AppState` is one; declared here, below it)."""

    settings: Settings
    sessions: sessionmaker[Session]
    quotas: QuotaLedger
    validator_slots: asyncio.Semaphore  # sandboxed parsers at once (`run_sandboxed`)


class Hold:
    """One upload's share of its owner's quota: what it has written (`take`), until it is stored
    (`commit`) or given up (`close`).

    The owner's used bytes are read from the database once their first upload in flight began, and every
    later upload in flight of the owner counts from that reading plus what was stored since: a reading
    taken after a concurrent upload stored its row but before it left the ledger would count it twice,
    and one taken before would miss it. So a deleted upload frees its bytes once nothing is in flight.
    """

    def __init__(self, ledger: QuotaLedger, owner_id: int, kind: str, quota: int) -> None:
        self._ledger, self.owner_id, self.kind, self.quota = ledger, owner_id, kind, quota
        self.mine = 0
        self._closed = False

    def _entry(self) -> _Owner:
        return self._ledger._owners[self.owner_id]

    def settle_base(self, used: int) -> None:
        """The database's used bytes as read after `QuotaLedger.hold` (kept only by the first reader)."""
        with self._ledger._lock:
            entry = self._entry()
            if entry.base is None:
                entry.base = used

    def in_flight(self, kind: str) -> int:
        """The owner's other uploads of `kind` in flight in this process."""
        with self._ledger._lock:
            return self._entry().kinds.get(kind, 0) - (kind == self.kind)

    def _left(self, entry: _Owner) -> int:
        return self.quota - (entry.base or 0) - entry.committed - entry.reserved

    def left(self) -> int:
        """Bytes the owner may still write (negative: past the quota already)."""
        with self._ledger._lock:
            return self._left(self._entry())

    def take(self, n: int) -> None:
        """Reserve `n` more bytes before writing them. Raises QuotaExceeded (nothing reserved) past the quota."""
        with self._ledger._lock:
            if self._closed:  # an unpacking thread that outlived its cancelled request
                raise QuotaExceeded(0, self.quota)
            entry = self._entry()
            left = self._left(entry)
            if n > left:
                raise QuotaExceeded(max(left, 0), self.quota)
            entry.reserved += n
            self.mine += n

    def give_back(self, n: int) -> None:
        """`n` of this upload's bytes are deleted (an archive, once unpacked)."""
        with self._ledger._lock:
            if self._closed:
                return
            n = min(n, self.mine)
            self._entry().reserved -= n
            self.mine -= n

    def commit(self, stored: int) -> None:
        """The upload's row is stored with `stored` bytes on disk: they count as stored from now on."""
        with self._ledger._lock:
            if self._closed:
                return
            entry = self._entry()
            entry.reserved -= self.mine
            entry.committed += stored
            self.mine = 0

    def close(self) -> None:
        """The upload is over: what it still reserves is given back (idempotent)."""
        with self._ledger._lock:
            if self._closed:
                return
            self._closed = True
            entry = self._entry()
            entry.reserved -= self.mine
            self.mine = 0
            entry.kinds[self.kind] -= 1
            if not any(entry.kinds.values()):
                del self._ledger._owners[self.owner_id]


# -- one upload ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """The `file` part as written: its path (in the upload's temporary folder), safe name, size, sha256,
    and the other (small) form fields."""

    path: Path
    filename: str
    size: int
    sha256: str
    fields: dict[str, str]


def _safe_name(name: str) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]", "_", Path(name.replace("\\", "/")).name)[:200].lstrip(".")
    return base or "upload.jsonl"


def _disk_bytes(folder: Path) -> int:
    """Bytes of the regular files under `folder` (links are not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for f in files:
            st = (Path(dirpath) / f).lstat()
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


class Upload:
    """One upload in flight (made by `begin`): `id`, its temporary folder `partial`, its final folder
    `final`, the sandbox's HOME `home` (inside `partial`, removed before the upload is measured)."""

    def __init__(self, state: UploadState, owner_id: int, kind: Kind, hold: Hold) -> None:
        self.state, self.owner_id, self.kind, self.hold = state, owner_id, kind, hold
        self.id = new_id(kind.id_prefix)
        owner_dir = state.settings.resolved_dataset_root() / str(owner_id)
        self.partial = owner_dir / f"{PARTIAL_PREFIX}{self.id}"
        self.final = owner_dir / self.id
        self.home = self.partial / ".home"  # uploaded names never start with a dot (`_safe_name`)
        self.stored = False

    async def receive(self, request: Request, *, limit: int, subdir: str | None = None) -> Received:
        """Stream the `file` part of a multipart body into the temporary folder (`subdir` of it): 415 if
        the body is not multipart, 413 past `limit`, 429 past the owner's quota, 400 malformed, 422 no file."""
        ctype, params = parse_options_header(request.headers.get("content-type", ""))
        boundary = params.get(b"boundary")
        if ctype != b"multipart/form-data" or not boundary:
            raise ApiError(415, "unsupported_media_type", "send multipart/form-data with a 'file' part", param="/file")
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit + 64 * 1024:
            raise ApiError(413, "payload_too_large", f"upload of {declared} bytes exceeds the limit of {limit} bytes")
        dest_dir = self.partial / subdir if subdir else self.partial
        dest_dir.mkdir(parents=True, exist_ok=True)

        def over_quota(exc: QuotaExceeded) -> ApiError:
            return ApiError(429, "quota_exceeded", "upload exceeds this owner's remaining upload quota "
                            f"({exc.left} bytes)", param="/file", headers={"Retry-After": "3600"})

        # A declared length is reserved before the body is read (less what the framing surely takes, and at
        # most `limit`: past it the upload is 413 whatever the quota), so uploads at once of one owner do not
        # each get part of what is left and all fail; what the file takes past it is reserved chunk by
        # chunk, what it leaves is given back.
        prepaid = min(max(0, int(declared) - _FRAMING_BYTES), limit) if declared and declared.isdigit() else 0
        try:
            self.hold.take(prepaid)
        except QuotaExceeded as exc:
            raise over_quota(exc) from None
        st: dict[str, Any] = {"headers": {}, "name": None, "filename": None, "fh": None, "size": 0,
                              "sha": hashlib.sha256(), "fields": {}, "field": b"", "hname": b"", "hval": b""}

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
                st["fh"] = (dest_dir / st["filename"]).open("xb")
            st["field"] = b""

        def on_part_data(d: bytes, s: int, e: int) -> None:
            chunk = d[s:e]
            if st["name"] == "file" and st["fh"] is not None and not st["fh"].closed:
                st["size"] += len(chunk)
                if st["size"] > limit:
                    raise ApiError(413, "payload_too_large", f"upload exceeds the limit of {limit} bytes",
                                   param="/file")
                if st["size"] > prepaid:
                    try:
                        self.hold.take(min(len(chunk), st["size"] - prepaid))
                    except QuotaExceeded as exc:
                        raise over_quota(exc) from None
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
        })  # fmt: skip
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
        self.hold.give_back(max(0, prepaid - st["size"]))
        if st["filename"] is None:
            raise ApiError(422, "validation_error", "missing the 'file' part", param="/file",
                           details=[{"param": "/file", "message": "required multipart file part"}])
        return Received(dest_dir / st["filename"], st["filename"], st["size"], st["sha"].hexdigest(), st["fields"])

    async def unpack(self, archive: Path, *, limit: int) -> Path:
        """Unpack `archive` into `partial/unpacked` (`api.archives`, in the sandbox: decompressing is parsing
        the tenant's bytes) and delete the archive (its bytes are given back). What its headers declare is
        reserved against the quota first, and the unpacking child may write no more than that. Returns the
        export folder.

        Raises:
            ArchiveRefused: the hostile-archive rules or a sandbox limit (the upload is `invalid`, its report
                says why).
            ApiError: 429 `quota_exceeded`, it unpacks past what is left of the owner's quota.
        """
        archive_bytes = archive.stat().st_size
        try:
            size = await self._archive_child(["size", archive.name, "--limit", str(limit)], archive.parent,
                                             file_bytes=1 << 20)
            declared = int(size["declared"])
            try:
                self.hold.take(declared)
            except QuotaExceeded as exc:
                raise ApiError(429, "quota_exceeded", f"the archive unpacks to more than this owner's remaining "
                               f"upload quota ({exc.left} bytes left of {exc.quota}; the {archive_bytes}-byte "
                               "archive counts until it is unpacked)", param="/file",
                               headers={"Retry-After": "3600"}) from None
            dest = self.partial / "unpacked"
            done = await self._archive_child(["unpack", os.path.relpath(archive, self.partial), dest.name, "--limit", str(declared)],
                                             self.partial, file_bytes=max(declared, 1) + 1)
            written = await run_in_threadpool(_disk_bytes, dest)
            self.hold.give_back(max(0, declared - written))
            folder = (self.partial / str(done["folder"])).resolve()
            if not inside(folder, dest) or not folder.is_dir():
                raise ArchiveRefused("the unpacked export folder is not inside the upload's folder")
            return folder
        finally:
            archive.unlink(missing_ok=True)
            self.hold.give_back(archive_bytes)
            if archive.parent != self.partial:
                shutil.rmtree(archive.parent, ignore_errors=True)

    async def _archive_child(self, args: list[str], cwd: Path, *, file_bytes: int) -> dict[str, Any]:
        """`python -m api.archives ARGS` in the sandbox (its largest file: `file_bytes`); its JSON answer.

        Raises:
            ArchiveRefused: the archive is refused, a sandbox limit was hit, or the child gave no answer.
        """
        out = await run_sandboxed([sys.executable, "-m", "api.archives", *args], cwd=cwd, home=self.home,
                                  state=self.state, file_bytes=file_bytes, what="unpacking")
        if out.breach is not None:
            raise ArchiveRefused(str(out.message))
        try:
            answer = json.loads(out.stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            log.error("archive child failed (exit %s): %s", out.returncode, out.stderr.decode(errors="replace")[-2000:])
            raise ArchiveRefused(f"the archive could not be read (the unpacker stopped with exit code "
                                 f"{out.returncode})") from None
        if not answer.get("ok"):
            raise ArchiveRefused(str(answer.get("error") or "the archive is refused"))
        return dict(answer)

    async def store(self, build: Callable[[Path, int], _Row], *, keep: bool) -> _Row:
        """Insert the upload's row, `build(final_folder, bytes_on_disk)`. `keep`: rename the temporary
        folder to the final one first (its bytes now count as stored); else delete it (the report is kept,
        not the bytes). On an error nothing is left (`begin`)."""
        shutil.rmtree(self.home, ignore_errors=True)
        size = await run_in_threadpool(_disk_bytes, self.partial)
        if keep:
            self.partial.rename(self.final)
        else:
            await run_in_threadpool(shutil.rmtree, self.partial, True)
        row = build(self.final, size)

        def insert() -> _Row:
            with self.state.sessions() as session:
                session.add(row)
                session.commit()
                return row

        stored = await run_in_threadpool(insert)
        self.stored = True
        self.hold.commit(size if keep else 0)
        return stored


@asynccontextmanager
async def begin(state: UploadState, owner_id: int, kind: Kind) -> AsyncIterator[Upload]:
    """One upload of `kind` by `owner_id`: the count and rate limits and the quota checked before the body
    is read (module docstring), its temporary folder made. On any error (a refusal, a dropped connection,
    a cancelled request) its files are deleted and its bytes given back."""
    s = state.settings
    hold = state.quotas.hold(owner_id, kind.name, quota=s.max_upload_bytes_per_owner)
    up: Upload | None = None
    try:
        def check() -> int:
            with state.sessions() as session:
                check_upload_allowed(session, owner_id, s, kind, in_flight=hold.in_flight(kind.name))
                return used_bytes(session, owner_id)

        hold.settle_base(await run_in_threadpool(check))
        left = hold.left()
        if left <= 0:
            raise ApiError(429, "quota_exceeded", f"upload quota used ({hold.quota - left} of {hold.quota} bytes)",
                           headers={"Retry-After": "3600"})
        up = Upload(state, owner_id, kind, hold)
        up.partial.mkdir(parents=True)
        yield up
    except BaseException:
        if up is not None and not up.stored:  # no row: no files (a retry uploads it again under a new id)
            shutil.rmtree(up.partial, ignore_errors=True)
            shutil.rmtree(up.final, ignore_errors=True)
        raise
    finally:
        hold.close()


# -- leftovers ----------------------------------------------------------------------------------------------


def _newest_mtime(path: Path) -> float:
    newest = path.lstat().st_mtime
    if path.is_dir() and not path.is_symlink():
        for dirpath, dirs, files in os.walk(path):
            for name in dirs + files:
                with contextlib.suppress(OSError):
                    newest = max(newest, (Path(dirpath) / name).lstat().st_mtime)
    return newest


def sweep_leftovers(settings: Settings, *, now: float | None = None) -> int:
    """Delete the `.partial-*` uploads an API killed mid-upload left in owners' folders: those where
    nothing changed for `sandbox_wall_seconds` + `SWEEP_MARGIN_S` before `now` (the API's start; an upload
    another API process has in flight writes, or is validated within its wall clock). Returns how many."""
    root = settings.resolved_dataset_root()
    cutoff = (time.time() if now is None else now) - settings.sandbox_wall_seconds - SWEEP_MARGIN_S
    swept = 0
    if not root.is_dir():
        return 0
    for owner in root.iterdir():
        if owner.is_symlink() or not owner.is_dir():
            continue
        for entry in owner.glob(f"{PARTIAL_PREFIX}*"):
            try:
                if _newest_mtime(entry) >= cutoff:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
                swept += 1
            except OSError as exc:
                log.warning("could not sweep the leftover upload %s: %s", entry, exc)
    if swept:
        log.info("swept %d leftover partial upload(s) under %s", swept, root)
    return swept


# -- the sandboxed validators -------------------------------------------------------------------------------


def sandbox_limits(settings: Settings) -> sandbox.Limits:
    """The limits of every child that parses uploaded bytes (`Settings.sandbox_*`)."""
    return sandbox.Limits(memory_bytes=settings.sandbox_memory_bytes, cpu_seconds=settings.sandbox_cpu_seconds,
                          file_bytes=settings.sandbox_file_bytes, wall_seconds=settings.sandbox_wall_seconds)


async def run_sandboxed(cmd: list[str], *, cwd: Path, home: Path, state: UploadState, file_bytes: int | None = None,
                        what: str = "validation") -> sandbox.Outcome:
    """Run a parser of tenant bytes in the sandbox, waiting for one of `UploadState.validator_slots`.

    `file_bytes`: the largest file it may write, when it writes the tenant's files (an unpacked archive);
    None = `Settings.sandbox_file_bytes`. `what` names the work in a refusal.
    """
    limits = sandbox_limits(state.settings)
    if file_bytes is not None:
        limits = dataclasses.replace(limits, file_bytes=file_bytes)
    async with state.validator_slots:
        return await sandbox.run(cmd, cwd=cwd, home=home, limits=limits, what=what)


def export_validator_command(folder: Path) -> list[str]:
    """The export validator, run in `folder`'s parent on its bare name (its messages never name a server path)."""
    return [sys.executable, "-m", "peagle", "validate", folder.name, "--json", "--portable"]


async def validate_export(folder: Path, state: UploadState, *, home: Path) -> dict[str, Any]:
    """The export validator's verdict on `folder` ({ok, errors, warnings}); a sandbox breach is
    {ok: false, errors: [the refusal naming the limit], limit}."""
    out = await run_sandboxed(export_validator_command(folder), cwd=folder.parent, home=home, state=state)
    if out.breach is not None:
        return {"ok": False, "errors": [out.message], "warnings": [], "limit": out.breach}
    try:
        found = json.loads(out.stdout.decode().strip().splitlines()[-1])
        return {"ok": bool(found["ok"]), "errors": list(found.get("violations") or []),
                "warnings": list(found.get("warnings") or [])}
    except (ValueError, IndexError, KeyError, TypeError):
        log.error("draft validator failed on %s (exit %s): %s", folder, out.returncode,
                  out.stderr.decode(errors="replace")[-2000:])
        return {"ok": False, "errors": [f"the validator stopped without a verdict (exit code {out.returncode}); nothing of this export was kept"]}
