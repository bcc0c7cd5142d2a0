"""Hostile-archive rules for uploaded draft exports (`unpack_export`), used by the one upload path (`api.uploads`).

An uploaded archive is unpacked file by file by rules an attacker's archive cannot get past: regular files and
folders only (no link of any kind, no device, no fifo), relative names without `..` and at most 4 deep, at
most `MAX_ENTRIES` entries, the same name once, at most the limit in unpacked bytes (counted as they are
written, whatever a header declares); what the headers declare (`declared_size`) is reserved against the owner's
quota before anything is written.
Standard library only (tarfile, zipfile). Decompressing is parsing the tenant's bytes, so it runs in the one
sandbox (`peagle.engine.sandbox`, through `api.uploads`), never in the API process:

    python -m api.archives size ARCHIVE --limit N          # {"ok": true, "declared": bytes}: checked, nothing written
    python -m api.archives unpack ARCHIVE DEST --limit N   # {"ok": true, "folder": "DEST/<top>", "written": bytes}

each printing one JSON line, `{"ok": false, "error": "<why>"}` when the archive is refused.
"""

from __future__ import annotations

import argparse
import json
import re
import stat
import sys
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import IO

__all__ = ["MAX_ENTRIES", "ArchiveRefused", "declared_size", "main", "unpack_export"]

#: Entries (files and folders) an uploaded archive may hold: an export is two files.
MAX_ENTRIES = 64
_CHUNK = 1 << 20


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


def _entries(archive: Path) -> Iterator[tuple[str, str, int, Callable[[], IO[bytes] | None]]]:
    if zipfile.is_zipfile(archive):
        return _entries_zip(archive)
    if tarfile.is_tarfile(archive):
        return _entries_tar(archive)
    raise ArchiveRefused("not a tar or zip archive (upload a tar, tar.gz or zip of the export folder)")


def declared_size(archive: Path, *, limit: int) -> int:
    """The bytes `archive`'s headers say its files hold, checked by the same rules as `unpack_export` (kinds,
    names, entries, the limit) without writing anything: what the owner's quota must hold before unpacking.

    Raises:
        ArchiveRefused: as `unpack_export` would, or its files declare more than `limit` bytes.
    """
    total, seen = 0, set[tuple[str, ...]]()
    try:
        for count, (name, kind, size, _open) in enumerate(_entries(archive), start=1):
            if count > MAX_ENTRIES:
                raise ArchiveRefused(f"more than {MAX_ENTRIES} entries (an export folder is two files)")
            if kind not in ("file", "dir"):
                raise ArchiveRefused(f"{name!r} is a {kind}: only regular files and folders are accepted")
            parts = _safe_parts(name)
            if parts in seen and parts:
                raise ArchiveRefused(f"{name!r} appears twice")
            seen.add(parts)
            total += size if kind == "file" else 0
            if total > limit:
                raise ArchiveRefused(f"unpacks to more than the limit of {limit} bytes")
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, ValueError, RuntimeError) as exc:
        raise ArchiveRefused(f"the archive cannot be read: {exc}") from None
    return total


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

    Args:
        limit: the most bytes it may unpack to, in total (the caller reserved them against the owner's
            quota: what `declared_size` found), counted as they are written, whatever a header declares.

    Raises:
        ArchiveRefused: not an archive, a link / device / fifo, a path out of `dest`, too many entries, more
            than `limit` unpacked bytes, a name twice, or no config.json + model.safetensors.
    """
    entries = _entries(archive)
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


def main(argv: list[str] | None = None) -> int:
    """The sandboxed child's entry point (module docstring): one JSON line on stdout, exit 0 either way."""
    parser = argparse.ArgumentParser(prog="python -m api.archives")
    sub = parser.add_subparsers(dest="what", required=True)
    size = sub.add_parser("size")
    size.add_argument("archive", type=Path)
    size.add_argument("--limit", type=int, required=True)
    unpack = sub.add_parser("unpack")
    unpack.add_argument("archive", type=Path)
    unpack.add_argument("dest", type=Path)
    unpack.add_argument("--limit", type=int, required=True)
    args = parser.parse_args(argv)
    out: dict[str, object]
    try:
        if args.what == "size":
            out = {"ok": True, "declared": declared_size(args.archive, limit=args.limit)}
        else:
            folder = unpack_export(args.archive, args.dest, limit=args.limit)
            written = sum(p.stat().st_size for p in args.dest.rglob("*") if p.is_file())
            out = {"ok": True, "folder": str(folder), "written": written}
    except ArchiveRefused as exc:
        out = {"ok": False, "error": str(exc)}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
