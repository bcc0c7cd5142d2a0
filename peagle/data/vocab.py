"""Draft vocabulary (docs/decisions.md decision 7) and the mask token (docs/decisions.md decision 8).

Draft vocab = the Vd most frequent ASSISTANT tokens (ties: lower id first), padded with the lowest unused
ids, sorted ascending. Stored as ``d2t`` int64 [Vd] offsets (``target_id = i + d2t[i]``) and ``t2d`` bool
[V]; invariant ``arange(Vd) + d2t == nonzero(t2d)``. Vd == V means no compression: no d2t/t2d (vLLM uses
the identity). Saved as ``RUN/data/vocab.safetensors``.

Example: V=6, Vd=3, assistant counts [0, 5, 1, 5, 0, 2] -> by (-count, id): 1, 3, 5 -> selected [1, 3, 5],
d2t = [1, 2, 3], t2d = [F, T, F, T, F, T].
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from peagle.errors import DataInvalidError
from peagle.fileio import atomic_path

__all__ = [
    "DraftVocab",
    "build_draft_vocab",
    "count_assistant_tokens",
    "load_vocab",
    "resolve_mask_token_id",
    "save_vocab",
]


@dataclass
class DraftVocab:
    """Selected target ids (ascending) and the d2t/t2d tensors; `d2t`/`t2d` are None when Vd == V."""

    selected: Tensor  # [Vd] int64 ascending target ids
    vocab_size: int  # V
    d2t: Tensor | None  # [Vd] int64 offsets
    t2d: Tensor | None  # [V] bool

    @property
    def draft_vocab_size(self) -> int:
        return int(self.selected.numel())

    @property
    def is_full(self) -> bool:
        return self.draft_vocab_size == self.vocab_size


def count_assistant_tokens(rows: Iterable[tuple[Tensor, Tensor]], vocab_size: int) -> Tensor:
    """Token counts [V] int64 over positions with loss_mask == 1 (input_ids, loss_mask pairs, any shape)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in rows:
        sel = ids[mask.bool()].long()
        if sel.numel() and int(sel.max()) >= vocab_size:
            raise DataInvalidError(f"token id {int(sel.max())} >= target vocab size {vocab_size}")
        counts += torch.bincount(sel, minlength=vocab_size)
    return counts


def build_draft_vocab(counts: Tensor, draft_vocab_size: int | None) -> DraftVocab:
    """The draft vocabulary (docs/decisions.md decision 7) from assistant token counts [V]; `draft_vocab_size` None or >= V = full vocab."""
    v = int(counts.numel())
    vd = v if draft_vocab_size is None else min(int(draft_vocab_size), v)
    if vd == v:
        return DraftVocab(torch.arange(v, dtype=torch.long), v, None, None)
    # stable sort by descending count: ties keep ascending id; zero-count ids follow in ascending id order,
    # which is exactly "padded with the lowest unused ids"
    order = torch.sort(-counts.long(), stable=True).indices  # [V]
    selected = torch.sort(order[:vd]).values  # [Vd] ascending
    d2t = selected - torch.arange(vd, dtype=torch.long)  # [Vd]
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[selected] = True
    return DraftVocab(selected, v, d2t, t2d)


def save_vocab(vocab: DraftVocab, path: str | Path) -> None:
    """Write ``d2t`` int64 [Vd] and ``t2d`` bool [V] (none when Vd == V) with sizes in the metadata."""
    from safetensors.torch import save_file

    tensors = {}
    if not vocab.is_full:
        assert vocab.d2t is not None and vocab.t2d is not None, "a reduced vocabulary has its mapping"
        tensors = {"d2t": vocab.d2t.contiguous(), "t2d": vocab.t2d.contiguous()}
    meta = {"vocab_size": str(vocab.vocab_size), "draft_vocab_size": str(vocab.draft_vocab_size)}
    with atomic_path(Path(path)) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def load_vocab(path: str | Path) -> DraftVocab:
    """Read a vocab written by `save_vocab`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
        keys = set(fh.keys())
        v = int(meta["vocab_size"])
        if "t2d" not in keys:
            return DraftVocab(torch.arange(v, dtype=torch.long), v, None, None)
        t2d, d2t = fh.get_tensor("t2d"), fh.get_tensor("d2t")
    return DraftVocab(torch.nonzero(t2d).flatten(), v, d2t, t2d)


def _reserved_candidates(tokenizer: Any) -> list[int]:
    """Special added tokens other than bos/eos/pad/unk/template tokens; names with 'reserved' first."""
    used = {
        getattr(tokenizer, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    }
    template = str(getattr(tokenizer, "chat_template", "") or "")
    reserved: list[int] = []
    other: list[int] = []
    for tid, tok in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items()):
        content = getattr(tok, "content", str(tok))
        if not getattr(tok, "special", True) or tid in used or content in template:
            continue
        (reserved if re.search(r"reserved", content, re.I) else other).append(int(tid))
    return reserved + other


def resolve_mask_token_id(
    requested: int | str, tokenizer: Any, vocab_size: int, used: Tensor
) -> tuple[int, str]:
    """The mask token (docs/decisions.md decision 8): (mask_token_id, how it was chosen).

    Order: explicit id; the tokenizer's mask token; the first unused embedding slot ``len(tokenizer)`` when
    ``len(tokenizer) < vocab_size``; an unused reserved special token. The id must be in [0, V) and must
    not occur in the data.

    Args:
        requested: `DraftSpec.mask_token_id` (int or "auto").
        used: bool [V], True for every token id that occurs in the training/eval rows.

    Raises:
        DataInvalidError: explicit id out of range or present in the data; no candidate left.
    """

    def free(tid: int) -> bool:
        return 0 <= tid < vocab_size and not bool(used[tid])

    if requested != "auto":
        tid = int(requested)
        if not 0 <= tid < vocab_size:
            raise DataInvalidError(f"draft.mask_token_id {tid} is outside the target vocab [0, {vocab_size})")
        if bool(used[tid]):
            raise DataInvalidError(
                f"draft.mask_token_id {tid} occurs in the training data; choose an unused id"
            )
        return tid, "explicit"
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is not None and free(int(mask_id)):
        return int(mask_id), "tokenizer mask token"
    if len(tokenizer) < vocab_size and free(len(tokenizer)):
        return len(tokenizer), "first unused embedding slot"
    for tid in _reserved_candidates(tokenizer):
        if free(tid):
            return tid, "unused reserved special token"
    raise DataInvalidError(
        "no mask token available: the tokenizer has no mask token, no unused embedding slot and no unused "
        "reserved special token; set draft.mask_token_id to an id that does not occur in the data"
    )
