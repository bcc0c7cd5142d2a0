"""Atomic file writes: a reader sees the old content or the new, never a partial file or directory.

    atomic_write_text(run / "job_spec.json", text)
    atomic_write_json(path, data, indent=2, sort_keys=True)
    with atomic_path(run / "model.safetensors") as tmp:      # for writers that take a path
        save_file(tensors, str(tmp))
    with publish_dir(out_dir) as tmp:                         # a whole directory, renamed into place
        (tmp / "config.json").write_text(...)

Every write goes to a temporary name in the destination's own directory (same filesystem, so the final
`os.replace`/`rename` is atomic) and is removed if the writer fails. `durable=True` also fsyncs the data
and the directory entry, so the new content survives a power cut once the call returns.

The one implementation for peagle, the service, the API and the worker. Torch-free, stdlib only.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "fsync_dir",
    "fsync_file",
    "publish_dir",
]

FILE_MODE = 0o644
DIR_MODE = 0o755


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a written file's data to disk."""
    with Path(path).open("rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (a rename into it, a new file) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, mode: int | None = FILE_MODE, durable: bool = False
                ) -> Iterator[Path]:
    """A temporary path beside `path`; what the block writes there replaces `path` when it exits cleanly.

    If the block raises (or writes nothing), `path` is left untouched and the temporary file removed.

    Args:
        path: the destination file (its directory must exist).
        mode: permission bits of the published file (None: as the writer created it).
        durable: fsync the file before the rename and the directory after it.
    """
    dest = Path(path)
    tmp = _tmp_name(dest)
    try:
        yield tmp
        if not tmp.exists():
            raise FileNotFoundError(f"{tmp}: nothing was written for {dest}")
        if mode is not None:
            tmp.chmod(mode)
        if durable:
            fsync_file(tmp)
        tmp.replace(dest)
        if durable:
            fsync_dir(dest.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int = FILE_MODE,
                       durable: bool = False) -> None:
    """Write `data` to `path` atomically (see `atomic_path` for `mode` and `durable`)."""
    with atomic_path(path, mode=mode, durable=durable) as tmp, tmp.open("xb") as fh:
        fh.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8",
                      mode: int = FILE_MODE, durable: bool = False) -> None:
    """Write `text` to `path` atomically (see `atomic_path` for `mode` and `durable`)."""
    atomic_write_bytes(path, text.encode(encoding), mode=mode, durable=durable)


def atomic_write_json(path: str | os.PathLike[str], data: Any, *, indent: int | None = 2,
                      sort_keys: bool = False, default: Callable[[Any], Any] | None = None,
                      newline: bool = False, mode: int = FILE_MODE, durable: bool = False) -> None:
    """Write `data` as JSON to `path` atomically; `newline` appends a final line break.

    The JSON is rendered before anything touches the disk, so an unserializable value leaves no file.
    """
    text = json.dumps(data, indent=indent, sort_keys=sort_keys, default=default)
    atomic_write_text(path, text + "\n" if newline else text, mode=mode, durable=durable)


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            fsync_file(p)
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(d)
    fsync_dir(root)


@contextlib.contextmanager
def publish_dir(dest: str | os.PathLike[str], *, tmp_name: str | None = None, mode: int | None = DIR_MODE,
                durable: bool = False) -> Iterator[Path]:
    """A fresh temporary directory beside `dest`; when the block exits cleanly it becomes `dest`.

    An existing `dest` is replaced: it is first renamed aside (`.trash-<name>-...`) and removed after the
    new one is in place, so `dest` is never a half-written directory. If the block raises, `dest` is left
    as it was and the temporary directory is removed.

    Args:
        dest: the directory to publish (its parent is created if missing).
        tmp_name: a fixed name for the temporary directory (a stale one from a crash is removed first);
            default `.<name>.tmp-<random>`.
        mode: permission bits of the published directory (None: mkdtemp's 0700).
        durable: fsync every file and directory before the rename, and the parent after it.
    """
    dest = Path(dest)
    parent = dest.parent
    parent.mkdir(parents=True, exist_ok=True)
    if tmp_name is None:
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=parent))
    else:
        tmp = parent / tmp_name
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    try:
        if mode is not None:
            tmp.chmod(mode)
        yield tmp
        if durable:
            _fsync_tree(tmp)
        trash = None
        if dest.exists():
            trash = parent / f".trash-{dest.name}-{os.getpid()}-{secrets.token_hex(4)}"
            dest.rename(trash)
        tmp.rename(dest)
        if durable:
            fsync_dir(parent)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when it is missing, unreadable, not JSON or not an object (a file
    another process writes, a config that may not be there)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None

