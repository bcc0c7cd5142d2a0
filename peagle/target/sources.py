"""Batch sources for the trainer: online capture, or offline feature shards on disk.

Both implement the trainer's ``BatchSource`` protocol structurally::

    num_batches() -> int                          # micro-batches per epoch (last one may be smaller)
    batch(epoch, index) -> dict[str, Tensor]      # deterministic given (seed, epoch, index)

Keys (after the shift of docs/decisions.md decision 1, see `peagle.data.packing`): ``input_ids`` [B, T] int64,
``loss_mask`` [B, T] int64, ``document_ids`` [B, T] int64 (-1 padding), ``aux`` [B, T, 3H] and
``target_logits`` [B, T, Vd] floating, in the dtype they were computed or stored in (bf16 for a bf16
target on a GPU: half the memory of an fp32 copy with the same values; the draft and the loss upcast
them where they are used). Row order is a permutation drawn from ``seed`` and ``epoch`` (the same
for both sources, so offline == online). Online tensors live on the target's device; offline on CPU.

Offline layout (``out_dir``): ``manifest.json`` (counts, shard list, ``complete``), ``head.safetensors``
(the Vd lm_head rows; logits are recomputed from the stored final hidden state at read time, as
speculators does, because [T, Vd] fp32 logits per row would be huge), ``shard_00000.safetensors``... with
unshifted per-row ``input_ids``, ``loss_mask``, ``document_ids``, ``aux`` (bf16 by default to halve disk;
fp32 on request) and ``final`` (the target dtype). A shard is written to a temp name then renamed, and the
manifest is updated after each shard, so an interrupted capture resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from peagle.data.packing import PackedRows, shift_features
from peagle.errors import DataInvalidError
from peagle.fileio import atomic_path, atomic_write_json
from peagle.progress import ProgressSink
from peagle.target.capture import TargetCapture

__all__ = [
    "STORED_KEYS",
    "OfflineFeatureSource",
    "OnlineFeatureSource",
    "batch_from_stored",
    "build_batch_source",
    "epoch_order",
    "load_micro_batch",
    "rows_fingerprint",
    "write_feature_shards",
]

MANIFEST_VERSION = 1


def epoch_order(num_rows: int, seed: int, epoch: int) -> Tensor:
    """The row permutation of one epoch [R] (a `torch.Generator` seeded from seed and epoch)."""
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    return torch.randperm(num_rows, generator=gen)


def rows_fingerprint(rows: PackedRows) -> str:
    """sha256 of the packed rows (what the features were computed from)."""
    h = hashlib.sha256()
    for t in (rows.input_ids, rows.loss_mask, rows.document_ids):
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


#: what a stored micro-batch holds (an offline shard's rows, a streamed or remote ``mb_<j>`` file): unshifted
#: ``input_ids``/``loss_mask``/``document_ids`` [B, T] int64, ``aux`` [B, T, 3H], normed ``final`` [B, T, H]
STORED_KEYS = ("input_ids", "loss_mask", "document_ids", "aux", "final")


def batch_from_stored(t: dict[str, Tensor], *, head_weight: Tensor, head_bias: Tensor | None,
                      rows: list[int] | None = None) -> dict[str, Tensor]:
    """A stored micro-batch (`STORED_KEYS`) -> the trainer's batch (module docstring): only `rows` of it
    (positions within the micro-batch; DDP ranks), draft-vocab logits recomputed from ``final`` with the
    head rows (`head_weight` [Vd, H], `head_bias` [Vd] or None), then shifted (`shift_features`)."""
    if rows is not None:
        keep = torch.tensor([r for r in rows if r < t["input_ids"].shape[0]], dtype=torch.long)
        t = {k: v.index_select(0, keep) for k, v in t.items()}
    final = t["final"].to(head_weight.dtype)
    logits = torch.nn.functional.linear(final, head_weight, head_bias)  # [B, T, Vd]
    return shift_features(t["input_ids"], t["loss_mask"], t["document_ids"], t["aux"], logits)


def load_micro_batch(path: Path, *, head_weight: Tensor, head_bias: Tensor | None,
                     rows: list[int] | None = None) -> dict[str, Tensor]:
    """Read one micro-batch file (a safetensors file of `STORED_KEYS`, the streaming and the split job's
    sources) into the trainer's batch (`batch_from_stored`)."""
    from safetensors.torch import load_file

    return batch_from_stored(load_file(str(path)), head_weight=head_weight, head_bias=head_bias, rows=rows)


class _Ordered:
    def __init__(self, num_rows: int, micro_batch_size: int, seed: int) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.num_rows, self.micro_batch_size, self.seed = num_rows, micro_batch_size, seed
        self._cached: tuple[int, Tensor] | None = None

    def num_batches(self) -> int:
        return math.ceil(self.num_rows / self.micro_batch_size)

    def _indices(self, epoch: int, index: int, rows: list[int] | None = None) -> Tensor:
        if not 0 <= index < self.num_batches():
            raise IndexError(f"batch index {index} outside [0, {self.num_batches()})")
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, epoch_order(self.num_rows, self.seed, epoch))
        idx = self._cached[1][index * self.micro_batch_size : (index + 1) * self.micro_batch_size]
        if rows is not None:
            idx = idx[torch.tensor([r for r in rows if r < len(idx)], dtype=torch.long)]
        return idx


class OnlineFeatureSource(_Ordered):
    """Captures features on the fly with the target (co-located with training)."""

    def __init__(self, capture: TargetCapture, rows: PackedRows, micro_batch_size: int, seed: int) -> None:
        super().__init__(len(rows), micro_batch_size, seed)
        self.capture, self.rows = capture, rows

    def batch(self, epoch: int, index: int) -> dict[str, Tensor]:
        return self.batch_rows(epoch, index, None)

    def batch_rows(self, epoch: int, index: int, rows: list[int] | None) -> dict[str, Tensor]:
        """Only `rows` (positions within the micro-batch; DDP ranks) of micro-batch `index`."""
        part = self.rows.select(self._indices(epoch, index, rows))
        aux, logits = self.capture.capture(part.input_ids, part.document_ids)
        dev = aux.device
        return shift_features(
            part.input_ids.to(dev), part.loss_mask.to(dev), part.document_ids.to(dev), aux, logits
        )


# ---------------------------------------------------------------------------------------------------
# Offline shards
# ---------------------------------------------------------------------------------------------------


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    atomic_write_json(path, data, indent=1, durable=True)


def write_feature_shards(
    capture: TargetCapture | Any,
    rows: PackedRows,
    out_dir: str | Path,
    *,
    rows_per_shard: int = 64,
    batch_size: int = 4,
    aux_dtype: torch.dtype = torch.bfloat16,
    sink: ProgressSink | None = None,
) -> dict[str, Any]:
    """Capture features of every row into safetensors shards; resumable, never rewrites finished shards.

    `capture` is a `TargetCapture` or anything with its interface (`peagle.target.vllm_capture.VllmCapture`:
    the engine computes the states; its `batch_rows` sets how many rows go to it at once).

    Returns:
        The final manifest (``complete`` true after checking that every row has its features).

    Raises:
        DataInvalidError: `out_dir` holds shards of different rows or settings, or the final check fails.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mpath = out / "manifest.json"
    fp = rows_fingerprint(rows)
    settings = {
        "version": MANIFEST_VERSION,
        "rows_fingerprint": fp,
        "num_rows": len(rows),
        "pack_length": int(rows.input_ids.shape[1]),
        "rows_per_shard": rows_per_shard,
        "aux_dtype": str(aux_dtype).removeprefix("torch."),
        "aux_layer_ids": capture.aux_layer_ids,
        "draft_vocab_size": capture.draft_vocab_size,
        "hidden_size": capture.hidden_size,
    }
    manifest: dict[str, Any] = {**settings, "shards": [], "complete": False}
    if mpath.exists():
        old = json.loads(mpath.read_text())
        if {k: old.get(k) for k in settings} != settings:
            raise DataInvalidError(f"{out}: holds features of other rows/settings; use a fresh directory")
        manifest = old
    save_head = out / "head.safetensors"
    if not save_head.exists():
        head = {"weight": capture.head_weight.detach().cpu().contiguous()}
        if capture.head_bias is not None:
            head["bias"] = capture.head_bias.detach().cpu().contiguous()
        with atomic_path(save_head) as tmp:
            save_file(head, str(tmp))
    done = {s["file"] for s in manifest["shards"] if (out / s["file"]).exists()}
    manifest["shards"] = [s for s in manifest["shards"] if s["file"] in done]
    num_shards = math.ceil(len(rows) / rows_per_shard)
    for k in range(num_shards):
        name = f"shard_{k:05d}.safetensors"
        if name in done:
            continue
        start, end = k * rows_per_shard, min((k + 1) * rows_per_shard, len(rows))
        parts: dict[str, list[Tensor]] = {"aux": [], "final": []}
        step = int(getattr(capture, "batch_rows", batch_size))
        for b in range(start, end, step):
            idx = list(range(b, min(b + step, end)))
            part = rows.select(idx)
            aux, final = capture.hidden(part.input_ids, part.document_ids)
            parts["aux"].append(aux.to(aux_dtype).cpu())
            parts["final"].append(final.cpu())
        piece = rows.select(list(range(start, end)))
        tensors = {**piece.to_dict(), "aux": torch.cat(parts["aux"]), "final": torch.cat(parts["final"])}
        with atomic_path(out / name) as tmp:
            save_file({k2: v.contiguous() for k2, v in tensors.items()}, str(tmp))
        manifest["shards"].append({"file": name, "start": start, "end": end})
        manifest["shards"].sort(key=lambda s: s["start"])
        _write_json_atomic(mpath, manifest)
        if sink is not None:
            sink.log("info", f"feature shard {k + 1}/{num_shards} written (rows {start}..{end - 1})")
    covered = sorted((s["start"], s["end"]) for s in manifest["shards"])
    expect = 0
    for s, e in covered:
        if s != expect:
            raise DataInvalidError(f"{out}: rows {expect}..{s - 1} have no features")
        expect = e
    if expect != len(rows):
        raise DataInvalidError(f"{out}: rows {expect}..{len(rows) - 1} have no features")
    manifest["complete"] = True
    _write_json_atomic(mpath, manifest)
    return manifest


class OfflineFeatureSource(_Ordered):
    """Reads features written by `write_feature_shards` (CPU tensors; aux as stored, logits in the
    head's dtype)."""

    def __init__(self, out_dir: str | Path, micro_batch_size: int, seed: int) -> None:
        from safetensors.torch import load_file

        self.out = Path(out_dir)
        mpath = self.out / "manifest.json"
        if not mpath.exists():
            raise DataInvalidError(f"{self.out}: no manifest.json (features not captured)")
        self.manifest = json.loads(mpath.read_text())
        if not self.manifest.get("complete"):
            raise DataInvalidError(f"{self.out}: feature capture is incomplete (resume write_feature_shards)")
        super().__init__(int(self.manifest["num_rows"]), micro_batch_size, seed)
        head = load_file(str(self.out / "head.safetensors"))
        self.head_weight, self.head_bias = head["weight"], head.get("bias")
        self.rows_per_shard = int(self.manifest["rows_per_shard"])

    def _rows(self, indices: Tensor) -> dict[str, Tensor]:
        from safetensors import safe_open

        got: dict[str, list[Tensor]] = {}
        for r in indices.tolist():
            shard = self.out / f"shard_{r // self.rows_per_shard:05d}.safetensors"
            local = r % self.rows_per_shard
            with safe_open(str(shard), framework="pt") as fh:
                for key in STORED_KEYS:
                    got.setdefault(key, []).append(fh.get_slice(key)[local : local + 1])
        return {k: torch.cat(v) for k, v in got.items()}

    def batch(self, epoch: int, index: int) -> dict[str, Tensor]:
        return self.batch_rows(epoch, index, None)

    def batch_rows(self, epoch: int, index: int, rows: list[int] | None) -> dict[str, Tensor]:
        """Only `rows` (positions within the micro-batch; DDP ranks) of micro-batch `index`."""
        t = self._rows(self._indices(epoch, index, rows))
        return batch_from_stored(t, head_weight=self.head_weight, head_bias=self.head_bias)


def build_batch_source(
    spec: Any,
    capture: TargetCapture,
    rows: PackedRows,
    run_dir: str | Path,
    *,
    name: str = "train",
    sink: ProgressSink | None = None,
) -> OnlineFeatureSource | OfflineFeatureSource:
    """The batch source of `spec.resources.capture` (offline shards in ``RUN/data/features/<name>``)."""
    mbs, seed = spec.optim.micro_batch_size, spec.optim.seed
    if spec.resources.capture == "online":
        return OnlineFeatureSource(capture, rows, mbs, seed)
    aux_dtype = torch.bfloat16 if capture.device.type == "cuda" else torch.float32
    out = Path(run_dir) / "data" / "features" / name
    write_feature_shards(capture, rows, out, aux_dtype=aux_dtype, sink=sink)
    return OfflineFeatureSource(out, mbs, seed)
