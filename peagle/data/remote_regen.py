"""The regeneration side of a split job (`resources.engine`, issue 37): conversation ranges answered by
engine workers.

    write_regen_plan(R, regen_plan(...), conversations)          # the trainer (`peagle.data.prepare`)
    run_regen_chunk(R, i, tokenizer, open_backend, worker=name)  # an engine worker, chunk i
    wait_for_regen(R, failed_dir=D); merge_chunks(R, cache_dir)                   # the trainer

The files, the plan and what is pending are the torch-free `peagle.split.protocol`'s (``R = regen_dir(RUN)``).
An engine worker (its engine: `peagle.target.remote.GenerateEngine`) answers its chunk into the chunk's own
cache file (`peagle.data.regenerate_cache` records: a redone chunk finds its own finished conversations there
and continues), then writes the chunk's marker. The trainer waits for every chunk, appends the chunks'
records to its own cache (`merge_chunks`: the one writer of that file) and then runs the regeneration as a
resumed run does: every conversation is cached, no engine is started.

Greedy (and per-conversation seeded) answers do not depend on which conversations share an engine, so the
result equals the single-worker run. A lost chunk is sent again by the dispatcher (`worker.dispatch`);
``RUN/data/features/remote/failed.json`` (the dispatcher's) is raised here as `EngineError`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peagle.errors import EngineError
from peagle.split import protocol
from peagle.split.protocol import chunk_dir, chunk_range, pending_regen_chunks, read_regen_plan

__all__ = ["merge_chunks", "run_regen_chunk", "wait_for_regen"]


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
    convs = protocol.read_conversations(d)
    s, e = chunk_range(plan, index)
    t0 = time.monotonic()
    res = regenerate_conversations(convs[s:e], tokenizer, _settings(plan), identity=plan["identity"],
                                   open_backend=open_backend, cache_dir=chunk_dir(d, index))
    if res.report.get("cache_file") and Path(res.report["cache_file"]).name != f"{plan['group']}.jsonl":
        raise EngineError("the engine worker keyed the regeneration cache differently from the trainer")
    stats = {"plan_id": plan["plan_id"], "conversations": e - s, "tokens": int(res.report["tokens"]),
             "seconds": round(time.monotonic() - t0, 3), "worker": worker}
    protocol.write_done(d, index, stats)
    return stats


def wait_for_regen(d: Path, *, failed_dir: Path | None = None, poll_s: float = 0.5,
                   timeout_s: float | None = None) -> None:
    """The trainer waits for every chunk (raises the dispatcher's ``failed.json`` in `failed_dir`, the
    capture folder ``remote_dir(RUN)``, as `EngineError`)."""
    protocol.wait_while(lambda: bool(pending_regen_chunks(d)), failed_dir=failed_dir,
                        what="the regenerated answers", poll_s=poll_s, timeout_s=timeout_s)


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
        path = chunk_dir(d, i) / f"{group}.jsonl"
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
