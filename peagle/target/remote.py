"""A split job's capture side (`resources.engine`): engine workers capture the trainer's micro-batches, the
trainer reads them; and the engines an engine worker keeps warm between chunks.

    write_plan(D, capture_plan(...), rows, eval_rows)           # the trainer, once (`peagle.target.runtime`)
    run_capture_chunk(D, i, capture, worker=name)                # an engine worker, chunk i (`worker.engine_task`)
    run_eval_chunk(D, capture, aux_dtype=dtype)                  # an engine worker, the held-out rows
    source = RemoteFeatureSource(D, head_weight=w, head_bias=b, disk_budget_bytes=...)   # the trainer's reader
    engine = start_capture_engine(plan, ...); gen = start_generate_engine(plan, ...)     # kept warm by the worker

The files, their names, the release rule and what is pending are the torch-free `peagle.split.protocol`'s
(``D = remote_dir(RUN)``); this module adds what needs torch: the packed rows, the captured tensors and the
trainer's batches (the keys and batches of the offline and streaming sources,
`peagle.target.sources.load_micro_batch`). The regeneration side is `peagle.data.remote_regen`.

The engines start `vllm serve` through `peagle.engine.server.VllmServer` (the one spawner: its guard dies
with the engine worker) with the `EngineConfig` the trainer's own capture or regeneration would use, on the
worker's devices; `worker.engine_task.WarmEngine` keeps one of them for every chunk of one
`peagle.split.protocol.engine_key` and stops it after `engine_keep_warm_seconds` idle or when a chunk needs
another key.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from peagle.data.packing import PackedRows
from peagle.errors import EngineError
from peagle.fileio import atomic_path
from peagle.split import protocol
from peagle.split.protocol import chunk_range, eval_dir, mb_file, read_plan, read_release
from peagle.target.sources import _Ordered, load_micro_batch

__all__ = ["CaptureEngine", "GenerateEngine", "RemoteFeatureSource", "run_capture_chunk", "run_eval_chunk",
           "start_capture_engine", "start_generate_engine", "wait_for_eval", "write_plan"]


def write_plan(d: Path, plan: dict[str, Any], rows: PackedRows, eval_rows: PackedRows | None = None) -> None:
    """Write the rows (and the held-out rows: one `eval` chunk captures them as offline shards into
    ``d/../eval``), then the plan (its presence means all are complete)."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    for name, r in (("rows", rows), ("eval_rows", eval_rows)):
        if r is not None:
            with atomic_path(d / f"{name}.safetensors") as tmp:
                save_file({k: v.contiguous() for k, v in r.to_dict().items()}, str(tmp))
    protocol.publish_plan(d, {**plan, "eval": eval_rows is not None and len(eval_rows) > 0})


def _read_rows(d: Path, name: str = "rows") -> PackedRows:
    from safetensors.torch import load_file

    t = load_file(str(d / f"{name}.safetensors"))
    return PackedRows(input_ids=t["input_ids"], loss_mask=t["loss_mask"], document_ids=t["document_ids"])


# ---------------------------------------------------------------------------------------------------
# The engine side
# ---------------------------------------------------------------------------------------------------


def run_eval_chunk(d: Path, capture: Any, *, aux_dtype: torch.dtype, worker: str = "") -> dict[str, Any]:
    """Capture the held-out rows into offline shards (`write_feature_shards`: resumable, a redo continues)."""
    from peagle.target.sources import write_feature_shards

    t0 = time.monotonic()
    rows = _read_rows(d, "eval_rows")
    write_feature_shards(capture, rows, eval_dir(d), aux_dtype=aux_dtype)
    return {"micro_batches": 0, "tokens": rows.num_tokens(), "seconds": round(time.monotonic() - t0, 3),
            "worker": worker}


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

    plan, rel = read_plan(d), read_release(d)
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
        now = read_release(d) or rel
        if now.get("generation") != rel["generation"]:
            return None  # the trainer restarted its stream: the dispatcher sends this chunk again if needed
        if j < int(now["start"]) or j <= int(now["consumed"]):
            continue
        epoch, idx = divmod(j, nb)
        part = rows.select(order._indices(epoch, idx))
        aux, final = capture.hidden(part.input_ids, part.document_ids)
        tensors = {**part.to_dict(), "aux": aux, "final": final}
        with atomic_path(mb_file(d, j)) as tmp:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))
        tokens += int((part.document_ids >= 0).sum())
        written += 1
    stats = {"generation": rel["generation"], "micro_batches": written, "tokens": tokens,
             "seconds": round(time.monotonic() - t0, 3), "worker": worker}
    protocol.write_done(d, index, stats)
    return stats


# ---------------------------------------------------------------------------------------------------
# The trainer side
# ---------------------------------------------------------------------------------------------------


def wait_for_eval(d: Path, *, poll_s: float = 0.5, timeout_s: float | None = None) -> None:
    """The trainer waits for the held-out shards (raises the dispatcher's ``failed.json`` as `EngineError`)."""
    protocol.wait_while(lambda: protocol.eval_pending(d), failed_dir=d, what="the held-out features",
                        poll_s=poll_s, timeout_s=timeout_s)


class RemoteFeatureSource(_Ordered):
    """Micro-batches captured by engine workers, read in the trainer's fixed order (`peagle.split.protocol`).

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
        rel = read_release(self.d)
        self.generation = int(rel["generation"]) if rel else 0
        self.start, self.consumed = -1, -1
        self.waited_s = 0.0

    def _release(self) -> None:
        n = protocol.releasable(self.plan, start=self.start, consumed=self.consumed, budget_bytes=self.budget)
        protocol.write_release(self.d, generation=self.generation, start=self.start, consumed=self.consumed,
                               released=n)

    def restart(self, j: int) -> None:
        """Start a new stream at micro-batch `j` (a new generation; what is on disk is dropped)."""
        self.generation += 1
        self.start, self.consumed = j, j - 1
        protocol.drop_micro_batches(self.d)
        self._release()

    def batch(self, epoch: int, index: int) -> dict[str, Tensor]:
        return self.batch_rows(epoch, index, None)

    def batch_rows(self, epoch: int, index: int, rows: list[int] | None) -> dict[str, Tensor]:
        """Micro-batch `index` of `epoch` (only `rows` of it), waiting for the engine workers if needed."""
        if not 0 <= index < self.num_batches():
            raise IndexError(f"batch index {index} outside [0, {self.num_batches()})")
        j = epoch * self.num_batches() + index
        if j >= self.total:
            raise IndexError(f"micro-batch {j} is past the last one this source captures ({self.total})")
        if j != self.consumed + 1 or self.start < 0:
            self.restart(j)
        f = mb_file(self.d, j)
        self.waited_s += protocol.wait_while(lambda: not f.exists(), failed_dir=self.d, what=f"micro-batch {j}",
                                             poll_s=self.poll_s, timeout_s=self.timeout_s)
        batch = load_micro_batch(f, head_weight=self.head_weight, head_bias=self.head_bias, rows=rows)
        self.consumed = j
        protocol.log_consumed(self.d, j)
        protocol.drop_micro_batches(self.d, upto=j)
        self._release()
        return batch

    def bytes_ahead(self) -> int:
        """Bytes of the micro-batch files waiting for the trainer."""
        return protocol.bytes_ahead(self.d)

    def close(self) -> None:
        """Nothing to stop here (the engine workers are the dispatcher's); kept for the sources' interface."""


# ---------------------------------------------------------------------------------------------------
# The engines an engine worker keeps warm (one `engine_key` at a time)
# ---------------------------------------------------------------------------------------------------


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


class GenerateEngine:
    """A started generation engine (regeneration chunks, `peagle.data.remote_regen`) and the target's
    tokenizer (`start_generate_engine`)."""

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
