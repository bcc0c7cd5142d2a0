"""The chunk protocol of a job split over engine workers (`resources.engine`): plan, chunk, stream.

The trainer and the engine workers share only the job's folder (the artifact volume). Everything they
exchange is a file there, each written whole under a temporary name and renamed (`peagle.fileio`), so a
reader never sees half of one; ``D = RUN/data/features/remote``:

* ``plan.json`` (trainer, once): the capture's fixed order, cut into chunks of `chunk_micro_batches`
  consecutive micro-batches of the trainer's own order (`epoch_order`, as the other sources), what one
  micro-batch file weighs, the aux layer ids; ``rows.safetensors``: the packed training rows, so an engine
  worker needs neither the data nor its preparation;
* ``release.json`` (trainer): ``generation`` (bumped whenever the trainer (re)starts its stream, e.g. a
  resumed attempt), ``start`` (the first micro-batch of that stream), ``consumed`` (the last micro-batch
  read) and ``released`` (chunks ``[0, released)`` may run: `releasable` keeps the bytes ahead of the
  trainer within `resources.feature_disk_gb`; chunks wait, never fail);
* ``mb_<j>.safetensors`` (engine worker, `run_capture_chunk`): micro-batch j with the keys of
  `peagle.target.streaming` (unshifted ids/masks, ``aux``, normed ``final``), then ``chunk_<i>.done``
  (generation, tokens, seconds, worker) once all of chunk i is there;
* ``consumed.log`` (trainer): one line per micro-batch read, in order (no gap, no repeat: tests read it);
  the trainer deletes every ``mb_<k>`` with k <= the one it read;
* ``failed.json`` (the dispatcher): the engine work cannot go on (its message is raised in the trainer).

A chunk whose worker died is run again from its start by another one (the same files, the same bytes);
the micro-batches the trainer already read are skipped. Who sends chunks (Celery, the worker's
supervisor) is not this module's business: `pending_chunks` says which released chunks are not done.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from peagle.data.packing import PackedRows, shift_features
from peagle.errors import EngineError
from peagle.fileio import atomic_path, atomic_write_json, read_json
from peagle.target.sources import _Ordered

__all__ = ["PLAN_VERSION", "CaptureEngine", "RemoteFeatureSource", "capture_plan", "chunk_range", "engine_key", "eval_dir",
           "eval_pending", "pending_chunks", "read_plan", "releasable", "run_capture_chunk",
           "run_eval_chunk", "start_capture_engine", "wait_for_eval", "write_plan"]

PLAN_VERSION = 1


def _mb_file(d: Path, j: int) -> Path:
    return d / f"mb_{j:08d}.safetensors"


def _done_file(d: Path, i: int) -> Path:
    return d / f"chunk_{i:06d}.done"


# ---------------------------------------------------------------------------------------------------
# The plan (pure)
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
    """[start, end) micro-batches of chunk `index`."""
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


def pending_chunks(d: Path) -> list[int]:
    """Released chunks of the current generation whose results are not all there (the dispatcher's list)."""
    plan, rel = read_plan(d), read_json(d / "release.json")
    if plan is None or rel is None:
        return []
    out = []
    for i in range(int(rel["released"])):
        _s, e = chunk_range(plan, i)
        if e <= max(int(rel["start"]), int(rel["consumed"]) + 1):
            continue
        done = read_json(_done_file(d, i))
        if done is None or done.get("generation") != rel["generation"]:
            out.append(i)
    return out


def write_plan(d: Path, plan: dict[str, Any], rows: PackedRows, eval_rows: PackedRows | None = None) -> None:
    """Write the rows (and the held-out rows: one `eval` chunk captures them as offline shards into
    ``d/../eval``), then the plan (its presence means all are complete)."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    for name, r in (("rows", rows), ("eval_rows", eval_rows)):
        if r is not None:
            with atomic_path(d / f"{name}.safetensors") as tmp:
                save_file({k: v.contiguous() for k, v in r.to_dict().items()}, str(tmp))
    atomic_write_json(d / "plan.json", {**plan, "eval": eval_rows is not None and len(eval_rows) > 0})


def eval_dir(d: Path) -> Path:
    """Where the `eval` chunk writes the held-out features (offline shards with their manifest)."""
    return d.parent / "eval"


def eval_pending(d: Path) -> bool:
    """Whether the plan has held-out rows whose shards are not complete yet."""
    plan = read_plan(d)
    if plan is None or not plan.get("eval"):
        return False
    manifest = read_json(eval_dir(d) / "manifest.json")
    return not (manifest and manifest.get("complete"))


def run_eval_chunk(d: Path, capture: Any, *, aux_dtype: torch.dtype, worker: str = "") -> dict[str, Any]:
    """Capture the held-out rows into offline shards (`write_feature_shards`: resumable, a redo continues)."""
    from peagle.target.sources import write_feature_shards

    t0 = time.monotonic()
    rows = _read_rows(d, "eval_rows")
    write_feature_shards(capture, rows, eval_dir(d), aux_dtype=aux_dtype)
    return {"micro_batches": 0, "tokens": rows.num_tokens(), "seconds": round(time.monotonic() - t0, 3),
            "worker": worker}


def wait_for_eval(d: Path, *, poll_s: float = 0.5, timeout_s: float | None = None) -> None:
    """The trainer waits for the held-out shards (raises the dispatcher's ``failed.json`` as `EngineError`)."""
    t0 = time.monotonic()
    while eval_pending(d):
        failed = read_json(d / "failed.json")
        if failed is not None:
            raise EngineError(str(failed.get("message") or "the engine workers failed"))
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            raise EngineError(f"the held-out features did not arrive from the engine workers in {timeout_s:.0f} s")
        time.sleep(poll_s)


def read_plan(d: Path) -> dict[str, Any] | None:
    """The plan, or None while there is none."""
    plan = read_json(d / "plan.json")
    if plan is not None and plan.get("version") != PLAN_VERSION:
        raise EngineError(f"{d / 'plan.json'}: plan version {plan.get('version')}, this worker reads {PLAN_VERSION}")
    return plan


def _read_rows(d: Path, name: str = "rows") -> PackedRows:
    from safetensors.torch import load_file

    t = load_file(str(d / f"{name}.safetensors"))
    return PackedRows(input_ids=t["input_ids"], loss_mask=t["loss_mask"], document_ids=t["document_ids"])


# ---------------------------------------------------------------------------------------------------
# The engine side
# ---------------------------------------------------------------------------------------------------


def run_capture_chunk(
    d: Path, index: int, capture: Any, *, worker: str = "", should_stop: Callable[[], bool] | None = None,
) -> dict[str, Any] | None:
    """Capture chunk `index` of the plan in `d` with `capture` (a `VllmCapture` on a running engine, or
    anything with its `hidden`), each micro-batch written whole, then the chunk's ``.done`` marker.

    Micro-batches the trainer already read (or before its stream's start) are skipped. `should_stop` is
    asked between micro-batches (the job was cancelled or paused): then None is returned, no marker written.

    Returns:
        {"generation", "micro_batches", "tokens", "seconds", "worker"} (also the marker's content).
    """
    from safetensors.torch import save_file

    plan, rel = read_plan(d), read_json(d / "release.json")
    if plan is None or rel is None:
        raise EngineError(f"no capture plan in {d}")
    rows = _read_rows(d)
    order = _Ordered(int(plan["num_rows"]), int(plan["micro_batch_size"]), int(plan["seed"]))
    nb = order.num_batches()
    s, e = chunk_range(plan, index)
    t0, tokens, written = time.monotonic(), 0, 0
    for j in range(s, e):
        if should_stop is not None and should_stop():
            return None
        now = read_json(d / "release.json") or rel
        if now.get("generation") != rel["generation"]:
            return None  # the trainer restarted its stream: the dispatcher sends this chunk again if needed
        if j < int(now["start"]) or j <= int(now["consumed"]):
            continue
        epoch, idx = divmod(j, nb)
        part = rows.select(order._indices(epoch, idx))
        aux, final = capture.hidden(part.input_ids, part.document_ids)
        tensors = {**part.to_dict(), "aux": aux, "final": final}
        with atomic_path(_mb_file(d, j)) as tmp:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))
        tokens += int((part.document_ids >= 0).sum())
        written += 1
    stats = {"generation": rel["generation"], "micro_batches": written, "tokens": tokens,
             "seconds": round(time.monotonic() - t0, 3), "worker": worker}
    atomic_write_json(_done_file(d, index), stats)
    return stats


# ---------------------------------------------------------------------------------------------------
# The trainer side
# ---------------------------------------------------------------------------------------------------


class RemoteFeatureSource(_Ordered):
    """Micro-batches captured by engine workers, read in the trainer's fixed order (module docstring).

    Args:
        d: the protocol folder (`remote_dir(run)`); the plan must be written (`write_plan`).
        head_weight, head_bias: the draft-vocab rows of the target's lm_head ([Vd, H], [Vd] or None).
        disk_budget_bytes: `resources.feature_disk_gb` in bytes.
        poll_s: how often a waiting trainer looks for its file.
        timeout_s: give up waiting for one micro-batch after this long (None: wait; the dispatcher writes
            ``failed.json`` when the engine work cannot go on).
    """

    def __init__(self, d: Path, *, head_weight: Tensor, head_bias: Tensor | None, disk_budget_bytes: float,
                 poll_s: float = 0.2, timeout_s: float | None = None) -> None:
        plan = read_plan(d)
        if plan is None:
            raise EngineError(f"no capture plan in {d}")
        super().__init__(int(plan["num_rows"]), int(plan["micro_batch_size"]), int(plan["seed"]))
        self.d, self.plan = Path(d), plan
        self.total = int(plan["total_micro_batches"])
        self.head_weight, self.head_bias = head_weight, head_bias
        self.budget, self.poll_s, self.timeout_s = float(disk_budget_bytes), poll_s, timeout_s
        rel = read_json(self.d / "release.json")
        self.generation = int(rel["generation"]) if rel else 0
        self.start, self.consumed = -1, -1
        self.waited_s = 0.0

    def _release(self) -> None:
        n = releasable(self.plan, start=self.start, consumed=self.consumed, budget_bytes=self.budget)
        atomic_write_json(self.d / "release.json", {"generation": self.generation, "start": self.start,
                                                    "consumed": self.consumed, "released": n})

    def restart(self, j: int) -> None:
        """Start a new stream at micro-batch `j` (a new generation; what is on disk is dropped)."""
        self.generation += 1
        self.start, self.consumed = j, j - 1
        for f in self.d.glob("mb_*.safetensors"):
            f.unlink(missing_ok=True)
        self._release()

    def batch(self, epoch: int, index: int) -> dict[str, Tensor]:
        return self.batch_rows(epoch, index, None)

    def batch_rows(self, epoch: int, index: int, rows: list[int] | None) -> dict[str, Tensor]:
        """Micro-batch `index` of `epoch` (only `rows` of it), waiting for the engine workers if needed."""
        from safetensors.torch import load_file

        if not 0 <= index < self.num_batches():
            raise IndexError(f"batch index {index} outside [0, {self.num_batches()})")
        j = epoch * self.num_batches() + index
        if j >= self.total:
            raise IndexError(f"micro-batch {j} is past the last one this source captures ({self.total})")
        if j != self.consumed + 1 or self.start < 0:
            self.restart(j)
        f = _mb_file(self.d, j)
        t0 = time.monotonic()
        while not f.exists():
            failed = read_json(self.d / "failed.json")
            if failed is not None:
                raise EngineError(str(failed.get("message") or "the engine workers failed"))
            if self.timeout_s is not None and time.monotonic() - t0 > self.timeout_s:
                raise EngineError(f"micro-batch {j} did not arrive from the engine workers in {self.timeout_s:.0f} s")
            time.sleep(self.poll_s)
        self.waited_s += time.monotonic() - t0
        t = load_file(str(f))
        self.consumed = j
        with (self.d / "consumed.log").open("a") as log:
            log.write(f"{j}\n")
        for old in self.d.glob("mb_*.safetensors"):
            if int(old.stem.split("_")[1]) <= j:
                old.unlink(missing_ok=True)
        self._release()
        if rows is not None:
            keep = torch.tensor([r for r in rows if r < t["input_ids"].shape[0]], dtype=torch.long)
            t = {k: v.index_select(0, keep) for k, v in t.items()}
        final = t["final"].to(self.head_weight.dtype)
        logits = torch.nn.functional.linear(final, self.head_weight, self.head_bias)  # [B, T, Vd]
        return shift_features(t["input_ids"], t["loss_mask"], t["document_ids"], t["aux"], logits)

    def bytes_ahead(self) -> int:
        """Bytes of the micro-batch files waiting for the trainer."""
        return sum(f.stat().st_size for f in self.d.glob("mb_*.safetensors") if f.is_file())

    def close(self) -> None:
        """Nothing to stop here (the engine workers are the dispatcher's); kept for the sources' interface."""


# ---------------------------------------------------------------------------------------------------
# The engine a plan needs (an engine worker keeps it warm between chunks of the same key)
# ---------------------------------------------------------------------------------------------------


def engine_key(plan: dict[str, Any]) -> str:
    """What makes two plans' engines the same: target (model, revision, dtype), `resources.vllm` and
    `resources.engine.gpus` (parallelism), the mode and the captured layers."""
    import hashlib

    spec = plan["spec"]
    key = {"target": {k: spec["target"].get(k) for k in ("model", "revision", "dtype")},
           "vllm": spec["resources"]["vllm"], "gpus": (spec["resources"].get("engine") or {}).get("gpus", 0),
           "mode": plan["kind"], "layers": plan["aux_layer_ids"], "seed": spec["optim"]["seed"]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


class CaptureEngine:
    """A started capture engine and the target parts it is read with (`start_capture_engine`)."""

    def __init__(self, server: Any, parts: Any) -> None:
        self.server, self.parts = server, parts

    def capture(self, plan: dict[str, Any]) -> Any:
        """A `VllmCapture` for `plan` (its aux layers, its draft vocabulary: ``selected``)."""
        from peagle.target.vllm_capture import VllmCapture

        sel = plan.get("selected")
        selected = None if sel is None else torch.tensor(sel, dtype=torch.long)
        return VllmCapture(self.server, self.parts, [int(i) for i in plan["aux_layer_ids"]], selected)

    def stop(self) -> None:
        self.server.stop()


def start_capture_engine(plan: dict[str, Any], *, storage_dir: Path, log_path: Path, devices: str | None) -> CaptureEngine:
    """Start the capture engine `plan` needs (an engine worker keeps it for every plan of the same `engine_key`).

    Raises:
        EngineError, TargetLoadError: as `VllmServer.start` and `load_target_parts`.
    """
    from peagle.engine.server import CaptureOptions, VllmServer, engine_config_from_spec
    from peagle.spec import TrainSpec
    from peagle.target.loader import TORCH_DTYPES, locate_target
    from peagle.target.parts import load_target_parts

    resolved = TrainSpec.model_validate(plan["spec"])
    path = locate_target(resolved)
    parts = load_target_parts(path, dtype=TORCH_DTYPES[resolved.target.dtype])
    aux = [int(i) for i in plan["aux_layer_ids"]]
    opts = CaptureOptions(layer_ids=(*aux, int(parts.config.num_hidden_layers)), storage_dir=storage_dir)
    server = VllmServer(engine_config_from_spec(resolved, path, capture=opts, devices=devices), log_path=log_path,
                        name="capture engine")
    server.start()
    return CaptureEngine(server, parts)


# A split job's generation engine (regeneration chunks, `peagle.data.remote_regen`), kept warm by
# `worker.engine_task.WarmEngine` like the capture engine above.


class GenerateEngine:
    """A started generation engine and the target's tokenizer (`start_generate_engine`)."""

    def __init__(self, server: Any, tokenizer: Any) -> None:
        self.server, self.tokenizer = server, tokenizer

    @contextlib.contextmanager
    def backend(self) -> Iterator[Any]:
        """A `VllmBackend` on the running engine (the engine stays up after it)."""
        from peagle.data.regenerate_engines import VllmBackend

        s = self.server
        yield VllmBackend(s.base_url, s.served_name, alive=s.check_alive, failure=s.failure)

    def stop(self) -> None:
        self.server.stop()


def start_generate_engine(plan: dict[str, Any], *, log_path: Path, devices: str | None) -> GenerateEngine:
    """Start the generation engine the plan's spec needs (the same `EngineConfig` the trainer's own
    regeneration would start, on this worker's devices)."""
    from transformers import AutoTokenizer

    from peagle.engine.server import VllmServer, engine_config_from_spec
    from peagle.spec import TrainSpec
    from peagle.target.loader import locate_target

    resolved = TrainSpec.model_validate(plan["spec"])
    path = locate_target(resolved)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    server = VllmServer(engine_config_from_spec(resolved, path, devices=devices), log_path=log_path,
                        name="regeneration engine")
    server.start()
    return GenerateEngine(server, tokenizer)
