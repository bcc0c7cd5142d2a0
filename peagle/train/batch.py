"""What the trainer consumes: a random-access source of micro-batches (`BatchSource`).

Random access by (epoch, index) makes resume exact: the data position of a run is a number, and the
batch at a position never depends on what was read before. Every tensor is AFTER the shift of
docs/decisions.md decision 1 (slot i: token x[i+1], aux g[i], target z[i+1], mask m[i+1]):

    input_ids      [B, T] int64
    loss_mask      [B, T] int64 0/1
    document_ids   [B, T] int64 (-1 = padding)
    aux            [B, T, 3H] float (fp32, or bf16 as a bf16 target computed them: the draft upcasts)
    target_logits  [B, T, Vd] float (target logits restricted to the draft vocab; fp32 or bf16: the
                   loss takes them in fp32 a chunk at a time)

`micro_batch_size` rows form one micro-batch; under DDP every rank reads the same global micro-batch
index and takes the rows `rank::world_size` (a source may implement `batch_rows(epoch, index, rows)`
to load only those).

`SyntheticBatchSource` (random tensors, deterministic) is for tests and benchmarks.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["BATCH_KEYS", "BatchSource", "SyntheticBatchSource", "select_rows"]

BATCH_KEYS = ("input_ids", "loss_mask", "document_ids", "aux", "target_logits")


@runtime_checkable
class BatchSource(Protocol):
    """Random-access micro-batches, deterministic given (seed, epoch, index)."""

    def num_batches(self) -> int:
        """Micro-batches per epoch."""
        ...

    def batch(self, epoch: int, index: int) -> dict[str, Tensor]:
        """Micro-batch `index` (0 <= index < num_batches()) of `epoch`; keys `BATCH_KEYS`."""
        ...


def select_rows(source: BatchSource, epoch: int, index: int, rows: list[int] | None) -> dict[str, Tensor]:
    """The micro-batch, restricted to `rows` (None = all); uses `source.batch_rows` when it has one."""
    if rows is None:
        return source.batch(epoch, index)
    loader = getattr(source, "batch_rows", None)
    if loader is not None:
        return loader(epoch, index, rows)
    full = source.batch(epoch, index)
    keep = [r for r in rows if r < full["input_ids"].shape[0]]
    idx = torch.tensor(keep, dtype=torch.long)
    return {k: v.index_select(0, idx) for k, v in full.items()}


class SyntheticBatchSource:
    """Random rows (tests, benchmarks): one or more documents per row, a random assistant mask.

    Args:
        num_batches: micro-batches per epoch.
        batch_size: rows per micro-batch (B).
        seq_len: T.
        hidden_size: H (aux is [B, T, 3H]).
        vocab_size: token ids drawn from [0, vocab_size).
        draft_vocab_size: Vd (target_logits is [B, T, Vd]).
        seed: everything is a function of (seed, epoch, index).
        num_docs: documents packed per row (the tail `pad` positions are padding).
        pad: padding positions at the end of each row.
        supervised: probability that a position is supervised.
        learnable: target logits peak at a function of the slot's input token that is also written
            into the aux features (a draft can learn it); otherwise they are pure noise.
    """

    def __init__(
        self,
        *,
        num_batches: int,
        batch_size: int,
        seq_len: int,
        hidden_size: int,
        vocab_size: int,
        draft_vocab_size: int,
        seed: int = 0,
        num_docs: int = 1,
        pad: int = 0,
        supervised: float = 0.7,
        learnable: bool = False,
    ) -> None:
        self._n = num_batches
        self.batch_size, self.seq_len = batch_size, seq_len
        self.hidden_size, self.vocab_size, self.draft_vocab_size = hidden_size, vocab_size, draft_vocab_size
        self.seed, self.num_docs, self.pad, self.supervised = seed, num_docs, pad, supervised
        self.learnable = learnable

    def num_batches(self) -> int:
        return self._n

    def batch(self, epoch: int, index: int) -> dict[str, Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch * 10_007 + index)
        b, t = self.batch_size, self.seq_len
        used = t - self.pad
        doc = torch.full((b, t), -1, dtype=torch.long)  # [B, T]
        doc[:, :used] = torch.arange(used) * self.num_docs // max(used, 1)
        ids = torch.randint(0, self.vocab_size, (b, t), generator=g)
        mask = (torch.rand(b, t, generator=g) < self.supervised).long() * (doc >= 0).long()
        aux = torch.randn(b, t, 3 * self.hidden_size, generator=g)
        target = 3.0 * torch.randn(b, t, self.draft_vocab_size, generator=g)
        ids[doc < 0] = 0
        if self.learnable:
            peak = (ids * 7 + 1) % self.draft_vocab_size  # [B, T]
            hot = torch.nn.functional.one_hot(peak, self.draft_vocab_size).float()  # [B, T, Vd]
            target = target / 3.0 + 6.0 * hot
            aux[..., : self.draft_vocab_size] += 4.0 * hot  # the aux features carry the answer
        return {"input_ids": ids, "loss_mask": mask, "document_ids": doc, "aux": aux, "target_logits": target}
