"""Regeneration of a split job (`resources.engine`, issue 37): conversation ranges answered by engine workers.

The trainer and the engine workers share only the job's folder; ``D = RUN/data/regenerate/remote``:

* ``conversations.json`` then ``plan.json`` (trainer, `write_regen_plan`): the conversations the shared
  cache does not hold yet, cut into chunks of `chunk_size` consecutive ones, with the regeneration
  settings, the target identity and the cache group the trainer keys its cache with (so an engine worker's
  answers land under the trainer's keys, whatever its own paths); ``plan_id`` names the set of conversations;
* ``chunk_<i>/<group>.jsonl`` (engine worker, `run_regen_chunk`): the chunk's answers as regeneration cache
  records (`peagle.data.regenerate_cache`: one file per chunk, so writers never share a file; a redone chunk
  finds its own finished conversations there and continues), then ``chunk_<i>.done`` ({"plan_id", ...});
* the trainer (`regenerate_remote`) waits for every chunk, appends the chunks' records to its own cache
  (`merge_chunks`: the one writer of that file) and then runs the regeneration as a resumed run does: every
  conversation is cached, no engine is started.

Greedy (and per-conversation seeded) answers do not depend on which conversations share an engine, so the
result equals the single-worker run. A lost chunk is sent again by the dispatcher (`worker.dispatch`);
``RUN/data/features/remote/failed.json`` (the dispatcher's) is raised here as `EngineError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from peagle.errors import EngineError
from peagle.fileio import atomic_write_json, read_json

__all__ = [
    "REGEN_PLAN_VERSION",
    "merge_chunks",
    "pending_regen_chunks",
    "read_regen_plan",
    "regen_dir",
    "regen_plan",
    "remote_dir",
    "run_regen_chunk",
    "wait_for_regen",
    "write_regen_plan",
]

REGEN_PLAN_VERSION = 1


def remote_dir(run: Path) -> Path:
    """A split job's capture folder inside the job's run folder (`peagle.target.remote`'s plan, chunks and
    micro-batch files) and where the dispatcher writes `failed.json` when it gives up on any chunk."""
    return Path(run) / "data" / "features" / "remote"


def regen_dir(run: Path) -> Path:
    """The protocol's folder inside the job's run folder."""
    return Path(run) / "data" / "regenerate" / "remote"


def _done_file(d: Path, i: int) -> Path:
    return d / f"chunk_{i:06d}.done"


def _chunk_dir(d: Path, i: int) -> Path:
    return d / f"chunk_{i:06d}"


def regen_plan(*, keys: list[str], settings: Any, identity: dict[str, Any], group: str, spec: dict[str, Any],
               chunk_size: int) -> dict[str, Any]:
    """The plan for the conversations with content keys `keys` (pure): chunks of `chunk_size` of them."""
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    n = len(keys)
    return {"version": REGEN_PLAN_VERSION, "kind": "regenerate", "aux_layer_ids": [], "spec": spec,
            "settings": asdict(settings), "identity": identity, "group": group,
            "plan_id": hashlib.sha256(json.dumps([group, keys]).encode()).hexdigest()[:16],
            "chunks": [[s, min(s + chunk_size, n)] for s in range(0, n, chunk_size)]}


def write_regen_plan(d: Path, plan: dict[str, Any], conversations: list[list[dict[str, str]]]) -> None:
    """Write the conversations, then the plan (its presence means both are complete). A plan of another
    set of conversations (another attempt's) is removed with its chunks first."""
    old = read_regen_plan(d)
    if old is not None and old.get("plan_id") != plan["plan_id"]:
        shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True, exist_ok=True)
    atomic_write_json(d / "conversations.json", conversations)
    atomic_write_json(d / "plan.json", plan)


def read_regen_plan(d: Path) -> dict[str, Any] | None:
    """The plan, or None while there is none."""
    plan = read_json(d / "plan.json")
    if plan is not None and plan.get("version") != REGEN_PLAN_VERSION:
        raise EngineError(f"{d / 'plan.json'}: plan version {plan.get('version')}, this worker reads "
                          f"{REGEN_PLAN_VERSION}")
    return plan


def pending_regen_chunks(d: Path) -> list[int]:
    """Chunks of the plan whose marker is missing (the dispatcher's list)."""
    plan = read_regen_plan(d)
    if plan is None:
        return []
    out = []
    for i in range(len(plan["chunks"])):
        done = read_json(_done_file(d, i))
        if done is None or done.get("plan_id") != plan["plan_id"]:
            out.append(i)
    return out


def _settings(plan: dict[str, Any]) -> Any:
    from peagle.data.regenerate import RegenSettings

    s = dict(plan["settings"])
    s["engine_args"] = tuple(s.get("engine_args") or ())
    return RegenSettings(**s)


def run_regen_chunk(d: Path, index: int, tokenizer: Any, open_backend: Callable[[], Any], *,
                    worker: str = "") -> dict[str, Any]:
    """Answer chunk `index` of the plan in `d` (`open_backend`: a context manager yielding the backend on
    the warm engine), its records in the chunk's own cache file, then its marker.

    Returns:
        {"plan_id", "conversations", "tokens", "seconds", "worker"} (also the marker's content).
    """
    from peagle.data.regenerate import regenerate_conversations

    plan = read_regen_plan(d)
    if plan is None:
        raise EngineError(f"no regeneration plan in {d}")
    convs = json.loads((d / "conversations.json").read_text())
    s, e = (int(x) for x in plan["chunks"][index])
    t0 = time.monotonic()
    res = regenerate_conversations(convs[s:e], tokenizer, _settings(plan), identity=plan["identity"],
                                   open_backend=open_backend, cache_dir=_chunk_dir(d, index))
    if res.report.get("cache_file") and Path(res.report["cache_file"]).name != f"{plan['group']}.jsonl":
        raise EngineError("the engine worker keyed the regeneration cache differently from the trainer")
    stats = {"plan_id": plan["plan_id"], "conversations": e - s, "tokens": int(res.report["tokens"]),
             "seconds": round(time.monotonic() - t0, 3), "worker": worker}
    atomic_write_json(_done_file(d, index), stats)
    return stats


def wait_for_regen(d: Path, *, failed_file: Path | None = None, poll_s: float = 0.5,
                   timeout_s: float | None = None) -> None:
    """The trainer waits for every chunk (raises the dispatcher's ``failed.json`` as `EngineError`)."""
    t0 = time.monotonic()
    while pending_regen_chunks(d):
        failed = read_json(failed_file) if failed_file is not None else None
        if failed is not None:
            raise EngineError(str(failed.get("message") or "the engine workers failed"))
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise EngineError(f"the regenerated answers did not arrive from the engine workers in {timeout_s:.0f} s")
        time.sleep(poll_s)


def merge_chunks(d: Path, cache_dir: Path) -> int:
    """Append every chunk's records to the trainer's cache (``cache_dir/<group>.jsonl``) unless the key is
    there already; returns how many were appended."""
    from peagle.data.regenerate_cache import RegenCache

    plan = read_regen_plan(d)
    if plan is None:
        return 0
    group = plan["group"]
    records: dict[str, dict[str, Any]] = {}
    for i in range(len(plan["chunks"])):
        path = _chunk_dir(d, i) / f"{group}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict) and isinstance(rec.get("key"), str):
                    records.setdefault(rec["key"], rec)
    with RegenCache(cache_dir, group) as cache:
        have = cache.load(records)
        for k, rec in records.items():
            if k not in have:
                cache.append(rec)
    return len(records) - len(have)


