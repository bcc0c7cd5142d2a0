"""The regeneration cache: the target's answers stored by content, shared by jobs (torch-free, stdlib only).

    store = RegenCache(regen_cache_dir(), group_key(identity, settings))
    found = store.load(wanted_keys, usable=lambda rec: True)     # key -> record
    store.append(record)                                          # locked, fsynced

A conversation's answers depend on the target (its identity and revision, or for a local folder its path and
the size + mtime of its config, tokenizer and weight files, so replaced weights never reuse answers), the
engine and dtype that generate them, the regeneration settings and the conversation's prompt turns (every
non-assistant turn, and where the assistant turns are: their old content is replaced, so it is not part of
the key). The first four make the *group* (`group_key`); each group is one JSONL file
``<regen_cache_dir()>/<group>.jsonl``, and a conversation's key (`conversation_key`) hashes the group with
its prompt turns. Never a row index: the same conversation in another file, at another position, in another
job, is found again. A conversation that ends with a user turn is keyed with the empty answer the driver
appends to it (`peagle.data.regenerate.with_answer_slot`), so a prompt alone and the same prompt with another
model's answer share one record.

Each line is one finished conversation::

    {"key": "<64 hex>", "messages": [...], "finish": ["stop", "length"], "stop": null, "tokens": 412}

``finish`` holds one `finish_reason` per generated answer (``"max_length"`` for one that reached
`data.max_length`, where training cuts the row: `peagle.data.regenerate`); ``stop`` says why generation stopped before the
last turn (`"length"`: an answer was cut and `on_length: drop` gave up on the rest; `"max_length"`: an answer or
the next prompt reached `data.max_length`), null when every turn was answered.

Durability and concurrency: every append takes an exclusive `flock` on the file, writes one line, flushes
and fsyncs before returning, so a crash loses at most the conversation being written; two jobs appending at
once never interleave. A torn last line (a writer killed mid-line) is skipped by readers and closed with a
newline by the next writer, so it never corrupts the record after it. Reads take no lock: a line being
written is incomplete and skipped like a torn one (that conversation is just generated again).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CACHE_FORMAT",
    "REGEN_CACHE_ENV",
    "RegenCache",
    "conversation_key",
    "folder_fingerprint",
    "group_key",
    "regen_cache_dir",
    "target_identity",
]

#: Environment variable naming the cache folder (the worker points it at a per-owner folder).
REGEN_CACHE_ENV = "PEAGLE_REGEN_CACHE"
#: Bump when the meaning of a record changes: older groups are then never read again.
CACHE_FORMAT = 1
#: Files of a local target folder whose change changes the answers (weights, config, tokenizer, template).
_FINGERPRINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_FINGERPRINT_NAMES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                      "chat_template.jinja", "chat_template.json", "special_tokens_map.json", "tokenizer.model")
_KEY_PREFIX = '{"key": "'


def regen_cache_dir() -> Path:
    """The shared cache folder: `PEAGLE_REGEN_CACHE`, else ``peagle.builtin.cache_root() / "regenerate"``."""
    env = os.environ.get(REGEN_CACHE_ENV)
    if env:
        return Path(env).expanduser()
    from peagle.builtin import cache_root

    return cache_root() / "regenerate"


def folder_fingerprint(folder: str | Path) -> list[list[Any]]:
    """``[[name, size, mtime_ns], ...]`` of the files of a model folder that decide its answers (sorted;
    weight shards in subfolders are not looked for: HF folders keep them at the top)."""
    out: list[list[Any]] = []
    for p in sorted(Path(folder).iterdir()):
        if p.is_file() and (p.name in _FINGERPRINT_NAMES or p.name.endswith(_FINGERPRINT_SUFFIXES)):
            st = p.stat()
            out.append([p.name, st.st_size, st.st_mtime_ns])
    return out


def target_identity(model: str, revision: str | None) -> dict[str, Any]:
    """What names the target's weights: a builtin by its name, a local folder by its absolute path and
    `folder_fingerprint`, anything else as a hub id with its revision.

    Args:
        model: the spec's `target.model` (`builtin:...`, a folder or a hub id).
        revision: `target.revision` (None = the hub's default branch).
    """
    if model.startswith("builtin:"):
        return {"builtin": model}
    folder = Path(model).expanduser()
    if folder.is_dir():
        return {"folder": str(folder.resolve()), "files": folder_fingerprint(folder)}
    return {"hub": model, "revision": revision}


def _hash(blob: Any) -> str:
    return hashlib.sha256(json.dumps(blob, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def group_key(identity: Mapping[str, Any], settings: Mapping[str, Any]) -> str:
    """Hash of (cache format, target identity, generation settings): one cache file per group.

    Args:
        identity: `target_identity(...)`.
        settings: everything else that changes an answer (engine, dtype, temperature, max_new_tokens,
            data.max_length, max_model_len, the seed when sampling); see `RegenSettings.key_fields`.
    """
    return _hash({"format": CACHE_FORMAT, "target": dict(identity), "settings": dict(settings)})


def conversation_key(group: str, messages: Iterable[Mapping[str, str]]) -> str:
    """Hash of the group and the conversation's prompt turns: roles in order, content of every
    non-assistant turn (an assistant turn's old content is replaced, so it does not count)."""
    turns = [[m["role"], "" if m["role"] == "assistant" else m["content"]] for m in messages]
    return _hash({"group": group, "turns": turns})


def _valid(rec: Any) -> bool:
    return (
        isinstance(rec, dict)
        and isinstance(rec.get("key"), str)
        and isinstance(rec.get("messages"), list)
        and isinstance(rec.get("finish"), list)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in rec["messages"])
    )


class RegenCache:
    """One group's JSONL file in the shared cache folder (module docstring).

    Args:
        folder: the cache folder (`regen_cache_dir()`); created when missing.
        group: `group_key(...)`; the file is ``folder / f"{group}.jsonl"``.
    """

    def __init__(self, folder: str | Path, group: str) -> None:
        self.folder = Path(folder)
        self.path = self.folder / f"{group}.jsonl"
        self._fh: Any = None

    def load(self, keys: Iterable[str], usable: Callable[[dict[str, Any]], bool] = lambda rec: True
             ) -> dict[str, dict[str, Any]]:
        """The first usable record of each wanted key (file order: the answer every later job sees too).
        Torn, partial or malformed lines are skipped."""
        wanted = set(keys)
        found: dict[str, dict[str, Any]] = {}
        if not wanted or not self.path.exists():
            return found
        lo, hi = len(_KEY_PREFIX), len(_KEY_PREFIX) + 64
        with self.path.open("r", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                k = line[lo:hi]  # the key sits at a fixed offset: skip the other lines unparsed
                if k not in wanted or k in found or not line.endswith("\n"):
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if _valid(rec) and rec["key"] == k and usable(rec):
                    found[k] = rec
        return found

    def append(self, record: Mapping[str, Any]) -> None:
        """Append one record durably (locked, flushed, fsynced; a torn last line is closed first)."""
        if not isinstance(record.get("key"), str) or len(record["key"]) != 64:
            raise ValueError("a cache record needs its 64-hex `key` first")
        line = json.dumps({"key": record["key"], **{k: v for k, v in record.items() if k != "key"}},
                          ensure_ascii=False) + "\n"
        fh = self._open()
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            end = os.fstat(fh.fileno()).st_size
            if end:
                fh.seek(end - 1)
                if fh.read(1) != b"\n":  # a writer died mid-line: end that line so ours stays whole
                    fh.write(b"\n")
            fh.write(line.encode())
            fh.flush()
            os.fsync(fh.fileno())
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def _open(self) -> Any:
        if self._fh is None:
            from peagle.fileio import fsync_dir

            self.folder.mkdir(parents=True, exist_ok=True)
            new = not self.path.exists()
            self._fh = self.path.open("a+b")  # O_APPEND: every write lands at the end, whoever wrote last
            if new:
                fsync_dir(self.folder)
        return self._fh

    def close(self) -> None:
        """Close the file (appending again reopens it)."""
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
            self._fh = None

    def __enter__(self) -> RegenCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
