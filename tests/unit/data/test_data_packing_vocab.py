"""Packing (deterministic, document ids), the shift of docs/decisions.md decision 1, draft vocab and mask token."""

from __future__ import annotations

import pytest
import torch

from peagle.data.packing import pack_documents, shift_features, shift_rows
from peagle.data.vocab import (
    build_draft_vocab,
    count_assistant_tokens,
    load_vocab,
    resolve_mask_token_id,
    save_vocab,
)
from peagle.errors import DataInvalidError


def _docs(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(3, 30, (1,), generator=g))
        ids = (torch.arange(L) + 100 * i).tolist()
        mask = (torch.arange(L) % 3 != 0).long().tolist()
        out.append((ids, mask))
    return out


def test_packing_keeps_every_document_once_and_is_deterministic():
    docs = _docs()
    a = pack_documents(docs, 64, seed=3)
    b = pack_documents(docs, 64, seed=3)
    c = pack_documents(docs, 64, seed=4)
    for x, y in zip(a.to_dict().values(), b.to_dict().values(), strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert a.num_documents() == len(docs) and a.num_tokens() == sum(len(d[0]) for d in docs)
    found = []
    for r in range(len(a)):
        doc = a.document_ids[r]
        n = int(doc.max()) + 1
        assert torch.all(doc[(doc >= 0).sum() :] == -1)  # padding only at the tail
        for d in range(n):
            sel = doc == d
            pos = sel.nonzero().flatten()
            assert torch.equal(pos, torch.arange(int(pos[0]), int(pos[-1]) + 1))  # contiguous
            found.append((a.input_ids[r][sel].tolist(), a.loss_mask[r][sel].tolist()))
        assert torch.all(a.input_ids[r][doc < 0] == 0) and torch.all(a.loss_mask[r][doc < 0] == 0)
    assert sorted(found) == sorted(docs)
    assert a.input_ids.shape[1] == 64 and len(a) <= 20  # best fit: 40 docs of mean ~16 tokens


def test_shift_matches_decision_1():
    ids = torch.tensor([[10, 11, 12, 20, 21, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0]])
    doc = torch.tensor([[0, 0, 0, 1, 1, -1]])
    s_ids, s_mask, s_doc = shift_rows(ids, mask, doc)
    assert s_ids.tolist() == [[11, 12, 20, 21, 0, 0]]
    assert s_mask.tolist() == [[1, 1, 0, 1, 0, 0]]  # boundary slot (next token in doc 1) and tail: 0
    assert s_doc.tolist() == doc.tolist()
    aux = torch.arange(6.0).view(1, 6, 1).expand(1, 6, 3)
    z = torch.arange(6.0).view(1, 6, 1).expand(1, 6, 4) + 100
    out = shift_features(ids, mask, doc, aux, z)
    assert out["aux"][0, :5, 0].tolist() == [0, 1, 2, 3, 4]  # g[i] not shifted
    assert out["target_logits"][0, :, 0].tolist() == [101, 102, 0, 104, 0, 0]  # z[i+1]; 0 at document ends
    assert out["aux"][0, 5].abs().sum() == 0


def test_vocab_decision_7_and_invariants(tmp_path):
    counts = torch.tensor([0, 5, 1, 5, 0, 2])
    v = build_draft_vocab(counts, 3)
    assert v.selected.tolist() == [1, 3, 5] and v.d2t.tolist() == [1, 2, 3]
    assert v.t2d.tolist() == [False, True, False, True, False, True]
    # ties -> lower id; padding with the lowest unused ids; ascending
    v = build_draft_vocab(torch.tensor([0, 0, 7, 0, 7, 0, 0, 1]), 5)
    assert v.selected.tolist() == [0, 1, 2, 4, 7]
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 4, (1000,), generator=g)
    v = build_draft_vocab(counts, 100)
    assert v.d2t.dtype == torch.int64 and v.t2d.dtype == torch.bool and v.d2t.shape == (100,)
    assert torch.equal(torch.arange(100) + v.d2t, torch.nonzero(v.t2d).flatten())
    assert torch.all(v.selected[1:] > v.selected[:-1])
    assert counts[v.selected].min() >= counts[~v.t2d].max()
    save_vocab(v, tmp_path / "vocab.safetensors")
    back = load_vocab(tmp_path / "vocab.safetensors")
    assert torch.equal(back.d2t, v.d2t) and torch.equal(back.t2d, v.t2d) and back.vocab_size == 1000
    full = build_draft_vocab(counts, None)
    assert full.is_full and full.d2t is None and full.t2d is None
    save_vocab(full, tmp_path / "full.safetensors")
    assert load_vocab(tmp_path / "full.safetensors").is_full


def test_counts_only_assistant_tokens():
    ids = torch.tensor([[1, 2, 3, 3]])
    mask = torch.tensor([[0, 1, 1, 1]])
    assert count_assistant_tokens([(ids, mask)], 5).tolist() == [0, 0, 1, 2, 0]
    with pytest.raises(DataInvalidError, match="vocab size"):
        count_assistant_tokens([(torch.tensor([9]), torch.tensor([1]))], 5)


def test_mask_token_decision_8(smollm2_tokenizer):
    tok = smollm2_tokenizer
    v = len(tok)
    used = torch.zeros(v + 8, dtype=torch.bool)
    used[:20] = True
    assert resolve_mask_token_id(7, tok, v + 8, torch.zeros(v + 8, dtype=torch.bool)) == (7, "explicit")
    with pytest.raises(DataInvalidError, match="occurs in the training data"):
        resolve_mask_token_id(7, tok, v + 8, used)
    with pytest.raises(DataInvalidError, match="outside"):
        resolve_mask_token_id(v + 8, tok, v + 8, used)
    assert resolve_mask_token_id("auto", tok, v + 8, used) == (v, "first unused embedding slot")
    used = torch.zeros(v, dtype=torch.bool)
    used[[0, 1, 2, 3]] = True
    tid, how = resolve_mask_token_id("auto", tok, v, used)
    assert (tid, how) == (4, "unused reserved special token")  # <reponame>; <repo_name> (3) is in the data
    used[:17] = True
    with pytest.raises(DataInvalidError, match="no mask token"):
        resolve_mask_token_id("auto", tok, v, used)
