"""Online capture through an engine: it runs ahead of the trainer, and consumed features are deleted.

    source = StreamingFeatureSource(capture, rows, micro_batch_size=1, seed=0, out_dir=RUN/"data/stream",
                                    total_micro_batches=steps * grad_accumulation, disk_budget_bytes=20e9)
    batch = source.batch(epoch, index)     # waits for the engine when the trainer is ahead of it
    source.close()

A producer thread walks the trainer's own order of micro-batches (`epoch_order`, the same permutation the
offline source uses, so both give the same batches) from the first one the trainer asks for, captures
each with `capture.hidden` (`peagle.target.vllm_capture.VllmCapture`: the engine does the work) and writes
it as ``mb_<j>.safetensors`` (the offline shard keys: unshifted ids/masks, ``aux``, normed ``final``).
The trainer's `batch` reads a file, deletes it and every older one, and recomputes the draft-vocab logits
from ``final`` as the offline source does. The producer stays within `disk_budget_bytes` (the spec's
`resources.feature_disk_gb`) and at most `max_ahead` micro-batches ahead; it always may write one, so a
budget smaller than one micro-batch still makes progress. A full dump is never needed.

A trainer that asks for a micro-batch the producer is not heading for (a resumed run, a second epoch
that restarts from the first batch) restarts the producer there. An engine failure in the producer is
raised in the trainer as `EngineError`.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

from torch import Tensor

from peagle.data.packing import PackedRows
from peagle.errors import EngineError, PeagleError
from peagle.fileio import atomic_path
from peagle.target.sources import _Ordered, load_micro_batch

__all__ = ["StreamingFeatureSource"]


class StreamingFeatureSource(_Ordered):
    """Micro-batches captured by an engine just ahead of the trainer (module docstring).

    Args:
        capture: a `VllmCapture` (or anything with `hidden`, `head_weight`, `head_bias`).
        rows: the packed training rows.
        micro_batch_size, seed: as for the other sources (same order).
        out_dir: where micro-batch files live while waiting (emptied by `close`).
        total_micro_batches: the last micro-batch the trainer will ask for + 1 (epochs and max_steps).
        disk_budget_bytes: the producer waits while the files ahead of the trainer take this much.
        max_ahead: at most this many micro-batches ahead.
    """

    def __init__(
        self, capture: Any, rows: PackedRows, micro_batch_size: int, seed: int, *, out_dir: str | Path,
        total_micro_batches: int, disk_budget_bytes: float, max_ahead: int = 16,
    ) -> None:
        super().__init__(len(rows), micro_batch_size, seed)
        self.capture, self.rows = capture, rows
        self.out = Path(out_dir)
        self.total = int(total_micro_batches)
        self.budget = float(disk_budget_bytes)
        self.max_ahead = max(1, int(max_ahead))
        self.head_weight, self.head_bias = capture.head_weight, capture.head_bias
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._next = -1  # the micro-batch the producer writes next
        self._consumed = -1  # the last micro-batch the trainer read
        self._error: BaseException | None = None
        self.produced = 0

    # ------------------------------------------------------------------ producer

    def _file(self, j: int) -> Path:
        return self.out / f"mb_{j:08d}.safetensors"

    def _disk_ahead(self) -> int:
        return sum(f.stat().st_size for f in self.out.glob("mb_*.safetensors") if f.is_file())

    def _produce(self, start: int, generation: int) -> None:
        from safetensors.torch import save_file

        nb = self.num_batches()
        try:
            for j in range(start, self.total):
                with self._cond:
                    while not self._stop and self._gen == generation and (
                        j - self._consumed > self.max_ahead
                        or (j - self._consumed > 1 and self._disk_ahead() >= self.budget)
                    ):
                        self._cond.wait(timeout=1.0)
                    if self._stop or self._gen != generation:
                        return
                epoch, index = divmod(j, nb)
                part = self.rows.select(self._indices(epoch, index))
                aux, final = self.capture.hidden(part.input_ids, part.document_ids)
                tensors = {**part.to_dict(), "aux": aux, "final": final}
                with atomic_path(self._file(j)) as tmp:
                    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
                with self._cond:
                    if self._gen != generation:
                        self._file(j).unlink(missing_ok=True)
                        return
                    self._next = j + 1
                    self.produced += 1
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread, raised there
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    _gen = 0

    def _restart(self, j: int) -> None:
        """(Re)start the producer at micro-batch `j` (the old one stops at its next step)."""
        with self._cond:
            self._gen += 1
            gen = self._gen
            self._next, self._consumed, self._error = j, j - 1, None
            self._cond.notify_all()
        old = self._thread
        if old is not None:
            old.join()
        for f in self.out.glob("mb_*.safetensors"):
            f.unlink(missing_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._produce, args=(j, gen), name="peagle-capture", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ consumer (the trainer)

    def batch(self, epoch: int, index: int) -> dict[str, Tensor]:
        return self.batch_rows(epoch, index, None)

    def batch_rows(self, epoch: int, index: int, rows: list[int] | None) -> dict[str, Tensor]:
        """Micro-batch `index` of `epoch` (only `rows` of it), waiting for the engine if needed."""
        if not 0 <= index < self.num_batches():
            raise IndexError(f"batch index {index} outside [0, {self.num_batches()})")
        j = epoch * self.num_batches() + index
        if j >= self.total:
            raise IndexError(f"micro-batch {j} is past the last one this source captures ({self.total})")
        if self._thread is None or not (self._consumed < j and (j < self._next or self._thread.is_alive())):
            self._restart(j)
        with self._cond:
            while not self._file(j).exists() or j >= self._next:
                if self._error is not None:
                    err = self._error
                    if isinstance(err, PeagleError):
                        raise err
                    raise EngineError(f"feature capture failed: {type(err).__name__}: {err}") from err
                if (not self._thread or not self._thread.is_alive()) and self._next <= j:
                    raise EngineError("feature capture stopped before the trainer's micro-batch")
                self._cond.wait(timeout=1.0)
        batch = load_micro_batch(self._file(j), head_weight=self.head_weight, head_bias=self.head_bias, rows=rows)
        with self._cond:
            self._consumed = j
            for f in self.out.glob("mb_*.safetensors"):
                if int(f.stem.split("_")[1]) <= j:
                    f.unlink(missing_ok=True)
            self._cond.notify_all()
        return batch

    def close(self) -> None:
        """Stop the producer and remove what it left (idempotent)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=600)
            self._thread = None
        shutil.rmtree(self.out, ignore_errors=True)
