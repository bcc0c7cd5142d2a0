"""The file protocol of a job split over engine workers: folders, file names, plans, markers, what is pending.

The trainer and the engine workers share only the job's folder (the artifact volume). Everything they
exchange is a file there, each written whole under a temporary name and renamed (`peagle.fileio`), so a
reader never sees half of one. Torch-free (stdlib, `peagle.fileio`, `peagle.errors`): the trainer worker's
dispatcher (`worker.dispatch`) reads it on every tick.

**Capture**, ``D = remote_dir(RUN) = RUN/data/features/remote``:

* ``plan.json`` (trainer, once, `capture_plan`): the capture's fixed order, cut into chunks of
  `chunk_micro_batches` consecutive micro-batches of the trainer's own order (`epoch_order`, as the other
  sources), what one micro-batch file weighs, the aux layer ids; ``rows.safetensors``: the packed training
  rows, so an engine worker needs neither the data nor its preparation (`peagle.target.remote.write_plan`);
* ``release.json`` (trainer, `write_release`): ``generation`` (bumped whenever the trainer (re)starts its
  stream, e.g. a resumed attempt), ``start`` (the first micro-batch of that stream), ``consumed`` (the last
  micro-batch read) and ``released`` (chunks ``[0, released)`` may run: `releasable` keeps the bytes ahead
  of the trainer within `resources.feature_disk_gb`; chunks wait, never fail);
* ``mb_<j>.safetensors`` (engine worker, `mb_file`): micro-batch j with the keys of
  `peagle.target.streaming` (unshifted ids/masks, ``aux``, normed ``final``), then ``chunk_<i>.done``
  (`write_done`: generation, tokens, seconds, worker) once all of chunk i is there;
* ``consumed.log`` (trainer, `log_consumed`): one line per micro-batch read, in order (no gap, no repeat:
  tests read it); the trainer deletes every ``mb_<k>`` with k <= the one it read (`drop_micro_batches`);
* ``eval_rows.safetensors`` and ``eval_dir(D)``: the held-out rows, captured by one `eval` chunk as offline
  shards (`eval_pending` until their manifest is complete);
* ``failed.json`` (the dispatcher, `write_failed`): the engine work cannot go on (its message is raised in
  the trainer, `wait_while`).

A chunk whose worker died is run again from its start by another one (the same files, the same bytes);
the micro-batches the trainer already read are skipped. Who sends chunks (Celery, the worker's supervisor)
is not this module's business: `pending_chunks` says which released chunks are not done.

**Regeneration** (issue 37), ``R = regen_dir(RUN) = RUN/data/regenerate/remote``:

* ``conversations.json`` then ``plan.json`` (trainer, `write_regen_plan`): the conversations the shared
  cache does not hold yet, cut into chunks of `chunk_size` consecutive ones, with the regeneration
  settings, the target identity and the cache group the trainer keys its cache with (so an engine worker's
  answers land under the trainer's keys, whatever its own paths); ``plan_id`` names the set of conversations;
* ``chunk_<i>/<group>.jsonl`` (engine worker, `chunk_dir`): the chunk's answers as regeneration cache
  records, then ``chunk_<i>.done`` ({"plan_id", ...}); `pending_regen_chunks` lists the chunks without it.
  ``D/failed.json`` is the regeneration's failure file too.
"""

from __future__ import annotations

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
    "CONSUMED_LOG",
    "CONVERSATIONS",
    "FAILED",
    "PLAN",
    "PLAN_VERSION",
    "REGEN_PLAN_VERSION",
    "RELEASE",
    "bytes_ahead",
    "capture_plan",
    "chunk_dir",
    "chunk_range",
    "done_file",
    "drop_micro_batches",
    "engine_key",
    "eval_dir",
    "eval_pending",
    "log_consumed",
    "mb_file",
    "pending_chunks",
    "pending_regen_chunks",
    "publish_plan",
    "read_conversations",
    "read_done",
    "read_failed",
    "read_plan",
    "read_regen_plan",
    "read_release",
    "regen_dir",
    "regen_plan",
    "releasable",
    "remote_dir",
    "wait_while",
    "write_done",
    "write_failed",
    "write_regen_plan",
    "write_release",
]

PLAN_VERSION = 1
REGEN_PLAN_VERSION = 1

#: the protocol's fixed file names (module docstring); per-index names come from `mb_file`, `done_file`, `chunk_dir`
PLAN = "plan.json"
RELEASE = "release.json"
FAILED = "failed.json"
CONSUMED_LOG = "consumed.log"
CONVERSATIONS = "conversations.json"


# ---------------------------------------------------------------------------------------------------
# Folders and file names
# ---------------------------------------------------------------------------------------------------


def remote_dir(run: Path) -> Path:
    """A split job's capture folder inside the job's run folder (the capture plan, chunks and micro-batch
    files) and where the dispatcher writes ``failed.json`` when it gives up on any chunk."""
    return Path(run) / "data" / "features" / "remote"


def regen_dir(run: Path) -> Path:
    """The regeneration's folder inside the job's run folder."""
    return Path(run) / "data" / "regenerate" / "remote"


def eval_dir(d: Path) -> Path:
    """Where the `eval` chunk writes the held-out features (offline shards with their manifest)."""
    return d.parent / "eval"


def mb_file(d: Path, j: int) -> Path:
    """Micro-batch `j`'s file in the capture folder `d`."""
    return d / f"mb_{j:08d}.safetensors"


def done_file(d: Path, i: int) -> Path:
    """Chunk `i`'s marker (capture and regeneration alike): written once all its results are there."""
    return d / f"chunk_{i:06d}.done"


def chunk_dir(d: Path, i: int) -> Path:
    """Regeneration chunk `i`'s own cache folder (one file per chunk, so writers never share a file)."""
    return d / f"chunk_{i:06d}"


# ---------------------------------------------------------------------------------------------------
# The capture plan and its release (pure, then the files)
# ---------------------------------------------------------------------------------------------------


def capture_plan(
    *, num_rows: int, pack_length: int, hidden_size: int, micro_batch_size: int, seed: int, total_micro_batches: int,
    aux_layer_ids: list[int], chunk_micro_batches: int = 8, aux_bytes: int = 2, final_bytes: int = 4,
) -> dict[str, Any]:
    """The capture plan of `total_micro_batches` micro-batches in chunks of `chunk_micro_batches`.

    ``mb_bytes``: what one micro-batch file weighs at most (3 int64 [B, T] + aux [B, T, 3H] + final [B, T, H]);
    the release rule counts it, before any file exists.
    """
    if total_micro_batches < 1 or chunk_micro_batches < 1:
        raise ValueError("total_micro_batches and chunk_micro_batches must be >= 1")
    b, t, h = micro_batch_size, pack_length, hidden_size
    chunks = [[s, min(s + chunk_micro_batches, total_micro_batches)]
              for s in range(0, total_micro_batches, chunk_micro_batches)]
    return {
        "version": PLAN_VERSION, "kind": "capture", "num_rows": int(num_rows), "micro_batch_size": int(b),
        "seed": int(seed), "total_micro_batches": int(total_micro_batches), "chunks": chunks,
        "aux_layer_ids": [int(i) for i in aux_layer_ids],
        "mb_bytes": int(b * t * (3 * 8 + 3 * h * aux_bytes + h * final_bytes)),
    }


def chunk_range(plan: dict[str, Any], index: int) -> tuple[int, int]:
    """[start, end) micro-batches (capture) or conversations (regeneration) of chunk `index`."""
    s, e = plan["chunks"][index]
    return int(s), int(e)


def releasable(plan: dict[str, Any], *, start: int, consumed: int, budget_bytes: float) -> int:
    """How many chunks may run: chunk i is released while the micro-batches from the trainer's next one to
    the chunk's end weigh at most `budget_bytes` (`mb_bytes` each); the chunk holding the next micro-batch
    always is (a budget below one chunk still makes progress). Chunks ending at or before `start` count as
    released (they are not needed)."""
    nxt = max(consumed + 1, start)
    n = 0
    for i, (s, e) in enumerate(plan["chunks"]):
        if e <= nxt or s <= nxt or (e - nxt) * plan["mb_bytes"] <= budget_bytes:
            n = i + 1
        else:
            break
    return n


def publish_plan(d: Path, plan: dict[str, Any]) -> None:
    """Write ``plan.json`` (last: its presence means everything it names is complete)."""
    atomic_write_json(d / PLAN, plan)


def read_plan(d: Path) -> dict[str, Any] | None:
    """The capture plan, or None while there is none."""
    plan = read_json(d / PLAN)
    if plan is not None and plan.get("version") != PLAN_VERSION:
        raise EngineError(f"{d / PLAN}: plan version {plan.get('version')}, this worker reads {PLAN_VERSION}")
    return plan


def read_release(d: Path) -> dict[str, Any] | None:
    """The trainer's ``release.json`` ({"generation", "start", "consumed", "released"}), or None."""
    return read_json(d / RELEASE)


def write_release(d: Path, *, generation: int, start: int, consumed: int, released: int) -> None:
    """The trainer's stream position and how many chunks may run (module docstring)."""
    atomic_write_json(d / RELEASE, {"generation": generation, "start": start, "consumed": consumed,
                                    "released": released})


def read_done(d: Path, i: int) -> dict[str, Any] | None:
    """Chunk `i`'s marker, or None while it is not done."""
    return read_json(done_file(d, i))


def write_done(d: Path, i: int, stats: dict[str, Any]) -> None:
    """Mark chunk `i` done with its `stats` (after all its results are written)."""
    atomic_write_json(done_file(d, i), stats)


def read_failed(d: Path) -> dict[str, Any] | None:
    """The dispatcher's ``failed.json`` in `d` ({"message"}), or None while the engine work goes on."""
    return read_json(d / FAILED)


def write_failed(d: Path, message: str) -> None:
    """The engine work cannot go on: the trainer raises `message`."""
    atomic_write_json(d / FAILED, {"message": message})


def log_consumed(d: Path, j: int) -> None:
    """Append micro-batch `j` to ``consumed.log`` (the trainer read it)."""
    with (d / CONSUMED_LOG).open("a") as log:
        log.write(f"{j}\n")


def drop_micro_batches(d: Path, upto: int | None = None) -> None:
    """Delete the micro-batch files ``mb_<k>`` with k <= `upto` (every one with None: a new stream)."""
    for f in d.glob("mb_*.safetensors"):
        if upto is None or int(f.stem.split("_")[1]) <= upto:
            f.unlink(missing_ok=True)


def bytes_ahead(d: Path) -> int:
    """Bytes of the micro-batch files waiting for the trainer."""
    return sum(f.stat().st_size for f in d.glob("mb_*.safetensors") if f.is_file())


# ---------------------------------------------------------------------------------------------------
# What is pending (the dispatcher's lists) and the trainer's wait
# ---------------------------------------------------------------------------------------------------


def pending_chunks(d: Path) -> list[int]:
    """Released chunks of the current generation whose results are not all there (the dispatcher's list)."""
    plan, rel = read_plan(d), read_release(d)
    if plan is None or rel is None:
        return []
    out = []
    for i in range(int(rel["released"])):
        _s, e = chunk_range(plan, i)
        if e <= max(int(rel["start"]), int(rel["consumed"]) + 1):
            continue
        done = read_done(d, i)
        if done is None or done.get("generation") != rel["generation"]:
            out.append(i)
    return out


def eval_pending(d: Path) -> bool:
    """Whether the plan has held-out rows whose shards are not complete yet."""
    plan = read_plan(d)
    if plan is None or not plan.get("eval"):
        return False
    manifest = read_json(eval_dir(d) / "manifest.json")
    return not (manifest and manifest.get("complete"))


def pending_regen_chunks(d: Path) -> list[int]:
    """Regeneration chunks of the plan whose marker is missing (the dispatcher's list)."""
    plan = read_regen_plan(d)
    if plan is None:
        return []
    out = []
    for i in range(len(plan["chunks"])):
        done = read_done(d, i)
        if done is None or done.get("plan_id") != plan["plan_id"]:
            out.append(i)
    return out


def wait_while(pending: Callable[[], bool], *, failed_dir: Path | None, what: str, poll_s: float,
               timeout_s: float | None) -> float:
    """Wait while `pending()` holds (the trainer waiting for the engine workers); returns the seconds waited.

    Raises:
        EngineError: the dispatcher's ``failed.json`` in `failed_dir` (its message), or `what` did not
            arrive within `timeout_s`.
    """
    t0 = time.monotonic()
    while pending():
        failed = read_failed(failed_dir) if failed_dir is not None else None
        if failed is not None:
            raise EngineError(str(failed.get("message") or "the engine workers failed"))
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise EngineError(f"{what} did not arrive from the engine workers in {timeout_s:.0f} s")
        time.sleep(poll_s)
    return time.monotonic() - t0


# ---------------------------------------------------------------------------------------------------
# The regeneration plan
# ---------------------------------------------------------------------------------------------------


def regen_plan(*, keys: list[str], settings: Any, identity: dict[str, Any], group: str, spec: dict[str, Any],
               chunk_size: int) -> dict[str, Any]:
    """The plan for the conversations with content keys `keys` (pure): chunks of `chunk_size` of them.
    `settings` is the trainer's `peagle.data.regenerate.RegenSettings` (a dataclass)."""
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
    atomic_write_json(d / CONVERSATIONS, conversations)
    publish_plan(d, plan)


def read_regen_plan(d: Path) -> dict[str, Any] | None:
    """The regeneration plan, or None while there is none."""
    plan = read_json(d / PLAN)
    if plan is not None and plan.get("version") != REGEN_PLAN_VERSION:
        raise EngineError(f"{d / PLAN}: plan version {plan.get('version')}, this worker reads "
                          f"{REGEN_PLAN_VERSION}")
    return plan


def read_conversations(d: Path) -> list[Any]:
    """The plan's conversations (``conversations.json``, a list: `read_json` reads objects only)."""
    data: list[Any] = json.loads((d / CONVERSATIONS).read_text())
    return data


# ---------------------------------------------------------------------------------------------------
# The engine a plan needs (an engine worker keeps it warm between chunks of the same key)
# ---------------------------------------------------------------------------------------------------


def engine_key(plan: dict[str, Any]) -> str:
    """What makes two plans' engines the same: target (model, revision, dtype), `resources.vllm` and
    `resources.engine.gpus` (parallelism), the mode and the captured layers."""
    spec = plan["spec"]
    key = {"target": {k: spec["target"].get(k) for k in ("model", "revision", "dtype")},
           "vllm": spec["resources"]["vllm"], "gpus": (spec["resources"].get("engine") or {}).get("gpus", 0),
           "mode": plan["kind"], "layers": plan["aux_layer_ids"], "seed": spec["optim"]["seed"]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
