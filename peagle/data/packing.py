"""Packing conversations into fixed-length rows, and the shift of docs/decisions.md decision 1.

Packing is best-fit decreasing over the conversations in a seeded random order (ties in length keep that
order), so it is deterministic given the seed. A row holds whole conversations back to back; `document_ids`
numbers them 0..n-1 within the row and is -1 on padding (token 0, mask 0).

Shift (docs/decisions.md decision 1, speculators/NeMo): slot i holds token x[i+1], aux g[i], target z[i+1], mask m[i+1];
the row keeps its length T and the tail slot is zero-filled (token 0, target 0, mask 0). `document_ids`
stays unshifted (the document of g[i]); mask and target are also 0 at the last slot of every document,
whose "next token" is the first token of the next document (or padding); padding slots have aux 0. Worked example, two documents::

    x   = [a0 a1 a2 b0 b1  0]     m  = [0 1 1 0 1 0]    doc  = [0 0 0 1 1 -1]
    x'  = [a1 a2 b0 b1  0  0]     m' = [1 1 0 1 0 0]    doc' = [0 0 0 1 1 -1]
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "PackedRows", "document_prompts", "document_spans", "next_in_document", "pack_documents", "shift_features",
    "shift_rows",
]


@dataclass
class PackedRows:
    """Packed, UNSHIFTED rows: ``input_ids``, ``loss_mask``, ``document_ids``, each [R, P] int64."""

    input_ids: Tensor  # [R, P]
    loss_mask: Tensor  # [R, P] 0/1
    document_ids: Tensor  # [R, P] -1 = padding

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def num_documents(self) -> int:
        return int((self.document_ids.max(dim=1).values + 1).sum()) if len(self) else 0

    def num_tokens(self) -> int:
        return int((self.document_ids >= 0).sum())

    def select(self, index: Sequence[int] | Tensor) -> PackedRows:
        """Rows at `index` (a new PackedRows)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return PackedRows(self.input_ids[idx], self.loss_mask[idx], self.document_ids[idx])

    def to_dict(self) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids, "loss_mask": self.loss_mask, "document_ids": self.document_ids}

    @classmethod
    def empty(cls, pack_length: int) -> PackedRows:
        z = torch.zeros(0, pack_length, dtype=torch.long)
        return cls(z, z.clone(), z.clone())


def pack_documents(
    docs: Sequence[tuple[Sequence[int], Sequence[int]]], pack_length: int, seed: int
) -> PackedRows:
    """Pack (input_ids, loss_mask) documents into rows of `pack_length` tokens.

    Documents longer than `pack_length` are truncated. Deterministic given (docs, pack_length, seed).

    Returns:
        `PackedRows` with [R, pack_length] tensors.
    """
    if not docs:
        return PackedRows.empty(pack_length)
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    lengths = [min(len(docs[i][0]), pack_length) for i in order]
    ranked = sorted(range(len(order)), key=lambda k: -lengths[k])  # stable: ties keep the shuffled order
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin id)
    for k in ranked:
        n = lengths[k]
        j = bisect.bisect_left(free, (n, -1))
        if j == len(free):
            bins.append([order[k]])
            bisect.insort(free, (pack_length - n, len(bins) - 1))
        else:
            cap, b = free.pop(j)
            bins[b].append(order[k])
            bisect.insort(free, (cap - n, b))
    ids = torch.zeros(len(bins), pack_length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    doc = torch.full_like(ids, -1)
    for r, members in enumerate(bins):
        pos = 0
        for d, i in enumerate(members):
            x, m = docs[i]
            n = min(len(x), pack_length)
            ids[r, pos : pos + n] = torch.as_tensor(list(x[:n]), dtype=torch.long)
            mask[r, pos : pos + n] = torch.as_tensor(list(m[:n]), dtype=torch.long)
            doc[r, pos : pos + n] = d
            pos += n
    return PackedRows(ids, mask, doc)


def _shift_left(x: Tensor) -> Tensor:
    out = torch.zeros_like(x)
    out[:, :-1] = x[:, 1:]
    return out


def next_in_document(document_ids: Tensor) -> Tensor:
    """[B, T] bool: slot i is a real token whose next token (i + 1) is in the same document, i.e. the
    slots that have a target at all once shifted (`loss_positions` "all" trains every one of them).

    >>> next_in_document(torch.tensor([[0, 0, 1, 1, -1]])).int().tolist()
    [[1, 0, 1, 0, 0]]
    """
    nxt_doc = torch.full_like(document_ids, -1)
    nxt_doc[:, :-1] = document_ids[:, 1:]
    return (nxt_doc == document_ids) & (document_ids >= 0)


def shift_rows(input_ids: Tensor, loss_mask: Tensor, document_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The shift (docs/decisions.md decision 1) of the token-level tensors ([B, T] each); see the module docstring."""
    ids = _shift_left(input_ids)  # [B, T]
    mask = _shift_left(loss_mask) * next_in_document(document_ids).to(loss_mask.dtype)  # [B, T]
    return ids, mask, document_ids.clone()


def shift_features(
    input_ids: Tensor, loss_mask: Tensor, document_ids: Tensor, aux: Tensor, logits: Tensor
) -> dict[str, Tensor]:
    """The shift (docs/decisions.md decision 1) of a captured batch into the trainer's keys.

    Args:
        input_ids, loss_mask, document_ids: [B, T] unshifted.
        aux: [B, T, 3H] target aux states g (not shifted).
        logits: [B, T, Vd] target logits z (shifted: slot i gets z[i+1], tail 0).
    """
    ids, mask, doc = shift_rows(input_ids, loss_mask, document_ids)
    target = torch.zeros_like(logits)
    target[:, :-1] = logits[:, 1:]  # [B, T, Vd]
    # padding slots carry no features; a slot whose next token is in another document has no target
    aux = aux.masked_fill((doc < 0).unsqueeze(-1), 0.0)
    target = target.masked_fill(~next_in_document(doc).unsqueeze(-1), 0.0)
    return {"input_ids": ids, "loss_mask": mask, "document_ids": doc, "aux": aux, "target_logits": target}


def document_prompts(rows: PackedRows) -> list[list[int]]:
    """Each packed document's tokens before its first supervised token: the conversation up to its first
    answer, through the target's chat template with the assistant header (what a server is sent), in row
    order then position. Documents with no supervised token, or one at their first position, are left out.

    >>> rows = PackedRows(torch.tensor([[5, 6, 7, 8, 9, 0]]), torch.tensor([[0, 0, 1, 0, 1, 0]]),
    ...                   torch.tensor([[0, 0, 0, 1, 1, -1]]))
    >>> document_prompts(rows)
    [[5, 6], [8]]
    """
    out: list[list[int]] = []
    for r in range(len(rows)):
        ids, mask = rows.input_ids[r].tolist(), rows.loss_mask[r].tolist()
        for start, end in document_spans(rows.document_ids[r]):
            first = next((j for j in range(start, end) if mask[j]), None)
            if first is not None and first > start:
                out.append(ids[start:first])
    return out


def document_spans(document_ids: Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of the documents of one packed row (document_ids [T], -1 = padding), in order.

    >>> document_spans(torch.tensor([0, 0, 1, 1, 1, -1]))
    [(0, 2), (2, 5)]
    """
    spans: list[tuple[int, int]] = []
    ids = document_ids.tolist()
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            if ids[start] >= 0:
                spans.append((start, i))
            start = i
    return spans

