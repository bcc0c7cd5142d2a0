"""COD visibility predicate: mask_mod cases of docs/algorithm.md 6, dense == mask_mod, flex == SDPA."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle.cod.mask import (
    MAX_DENSE_ELEMENTS,
    additive_mask,
    block_mask,
    check_dense_fits,
    cod_mask_mod,
    dense_mask,
)
from peagle.cod.rows import build_flat_row, mask_for
from peagle.cod.sampling import sample_cod
from peagle.errors import ResourceError


def _t(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long)


def _vis(mod, q: int, k: int) -> bool:
    z = torch.tensor(0)
    return bool(mod(z, z, torch.tensor(q), torch.tensor(k)))


def _pairwise(mod, n: int) -> torch.Tensor:
    q = torch.arange(n)[:, None].expand(n, n)
    k = torch.arange(n)[None, :].expand(n, n)
    z = torch.zeros((), dtype=torch.long)
    return mod(z, z, q, k)


def test_nemo_case() -> None:
    mod = cod_mask_mod(_t([0, 1, 2, 3, 0, 1, 0]), _t([0, 0, 0, 0, 1, 1, 2]), _t([0, 0, 0, 0]))
    assert _vis(mod, 2, 1) and _vis(mod, 2, 2) and not _vis(mod, 1, 2)
    assert _vis(mod, 4, 0) and not _vis(mod, 4, 5) and _vis(mod, 6, 4)


def test_nemo_padding_case() -> None:
    docs = _t([0, 0, -1, -1])
    mod = cod_mask_mod(_t([0, 1, 2, 3]), _t([0, 0, 0, 0]), docs)
    assert not _vis(mod, 3, 0) and not _vis(mod, 1, 3) and not _vis(mod, 3, 3)
    m = dense_mask(_t([0, 1, 2, 3]), _t([0, 0, 0, 0]), docs)
    assert m.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    m = dense_mask(_t([0, 1, 2, 3]), _t([0, 0, 0, 0]), docs, pad_self=False)
    assert m.int().sum(1).tolist() == [1, 2, 0, 0]


def test_sf_packed_case() -> None:
    docs = _t([0, 0, 0, 1, 1, -1])  # lengths [3, 2], T = 6
    mod = cod_mask_mod(_t([0, 1, 1, 2, 4, 4, 5]), _t([0, 0, 1, 0, 0, 1, 0]), docs)
    assert _vis(mod, 2, 1) and _vis(mod, 2, 0) and not _vis(mod, 1, 2)
    assert not _vis(mod, 4, 3) and not _vis(mod, 6, 6)


SPEC_ANCHORS = [0, 1, 2, 3, 4, 5, 0, 1, 3, 4, 0, 3, 0]
SPEC_DEPTHS = [0] * 6 + [1] * 4 + [2] * 2 + [3]
SPEC_ROWS = [
    {0},
    {0, 1},
    {0, 1, 2},
    {0, 1, 2, 3},
    {0, 1, 2, 3, 4},
    {0, 1, 2, 3, 4, 5},
    {0, 6},
    {0, 1, 7},
    {0, 1, 2, 3, 8},
    {0, 1, 2, 3, 4, 9},
    {0, 6, 10},
    {0, 1, 2, 3, 8, 11},
    {0, 6, 10, 12},
]


def test_spec_docstring_matrix() -> None:
    a, d = _t(SPEC_ANCHORS), _t(SPEC_DEPTHS)
    expected = torch.zeros(13, 13, dtype=torch.bool)
    for i, row in enumerate(SPEC_ROWS):
        expected[i, sorted(row)] = True
    assert torch.equal(dense_mask(a, d, None), expected)
    assert torch.equal(_pairwise(cod_mask_mod(a, d, None), 13), expected)
    assert torch.equal(expected, expected.tril())  # subset of the lower triangle


@st.composite
def cod_rows(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lengths = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    pad = draw(st.integers(0, 4))
    docs = _t([i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * pad)
    mask = torch.tensor(draw(st.lists(st.integers(0, 1), min_size=len(docs), max_size=len(docs))))
    mask = mask * (docs >= 0)
    k = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    a, d = sample_cod(mask, k, 0.8, 0.3, document_ids=docs, generator=torch.Generator().manual_seed(seed))
    return a, d, docs, mask


@settings(max_examples=80, deadline=None)
@given(row=cod_rows())
def test_dense_equals_mask_mod_pairwise(row: tuple[torch.Tensor, ...]) -> None:
    a, d, docs, _ = row
    n = a.numel()
    expected = _pairwise(cod_mask_mod(a, d, docs), n)
    assert torch.equal(dense_mask(a, d, docs, pad_self=False), expected)
    padded = dense_mask(a, d, docs)
    is_pad = docs[a] == -1
    assert torch.equal(padded, expected | torch.diag(is_pad))
    assert torch.equal(padded, padded.tril())
    assert bool(padded.any(1).all())  # no empty query row
    # every non-padding element sees itself; padding keys are never seen by real queries
    assert bool(expected.diagonal()[~is_pad].all())
    assert not bool(expected[:, is_pad].any())


def _row_case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    docs = _t([0] * 9 + [1] * 12 + [2] * 6 + [-1] * 5)
    mask = (torch.rand(docs.numel(), generator=torch.Generator().manual_seed(seed)) < 0.7).long() * (
        docs >= 0
    )
    a, d = sample_cod(mask, 5, 0.8, 0.3, document_ids=docs, generator=torch.Generator().manual_seed(seed))
    return a, d, docs


def test_block_mask_builds_on_cpu_and_matches_dense() -> None:
    a, d, docs = _row_case()
    n = a.numel()
    bm = block_mask(a, d, docs, device="cpu", block_size=16)
    assert bm.shape[-2:] == (n, n)
    dense = bm.to_dense()  # [1, 1, nq_blocks, nkv_blocks] block occupancy
    m = dense_mask(a, d, docs, pad_self=False)
    nb = -(-n // 16)
    padded = torch.zeros(nb * 16, nb * 16, dtype=torch.bool)
    padded[:n, :n] = m
    occupied = padded.reshape(nb, 16, nb, 16).any(3).any(1)
    assert torch.equal(dense[0, 0].bool(), occupied)


def test_flex_forward_equals_sdpa_dense() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    a, d, docs = _row_case(1)
    n = a.numel()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64) for _ in range(3))
    bm = block_mask(a, d, docs, device="cpu", block_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is not compiled
        out_flex = flex_attention(q, k, v, block_mask=bm)
    m = dense_mask(a, d, docs)
    out_sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    real = docs[a] >= 0  # flex gives 0 on (fully masked) padding rows, SDPA+pad_self gives v_self
    torch.testing.assert_close(out_flex[:, :, real], out_sdpa[:, :, real])
    out_add = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(m, torch.float64))
    torch.testing.assert_close(out_add, out_sdpa)


def test_padding_rows_no_nan_with_sdpa() -> None:
    a, d, docs = _row_case(2)
    ids = torch.arange(docs.numel()) % 7
    row = build_flat_row(ids, (docs >= 0).long(), docs, a, d, mask_token_id=99)
    n = row.num_elements
    x = torch.randn(1, 2, n, 8, requires_grad=True)
    out = F.scaled_dot_product_attention(x, x, x, attn_mask=mask_for(row))
    loss = (out.sum(dim=(0, 1, 3)) * row.weight).sum()
    loss.backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert bool((row.weight[row.doc == -1] == 0).all())
    # the same through the additive float mask (what the trainer passes to every layer)
    x.grad = None
    out = F.scaled_dot_product_attention(x, x, x, attn_mask=additive_mask(mask_for(row)))
    (out.sum(dim=(0, 1, 3)) * row.weight).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    # eager attention without the self key: padding rows are softmax over all -inf = NaN
    scores = (x @ x.transpose(-1, -2)).masked_fill(~mask_for(row, pad_self=False), float("-inf"))
    assert torch.isnan(scores.softmax(-1)[:, :, row.doc == -1]).all()
    scores = (x @ x.transpose(-1, -2)).masked_fill(~mask_for(row), float("-inf"))
    assert torch.isfinite(scores.softmax(-1)).all()


def test_check_dense_fits() -> None:
    check_dense_fits(MAX_DENSE_ELEMENTS)
    with pytest.raises(ResourceError, match="sequence_partitions") as err:
        check_dense_fits(MAX_DENSE_ELEMENTS + 1)
    assert "max_anchors" in str(err.value) and err.value.code == "resource_unavailable"


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 3)), min_size=1, max_size=30),
    docs=st.lists(st.integers(-1, 2), min_size=10, max_size=10),
    order=st.sampled_from(["as_drawn", "cod"]),
)
def test_dense_equals_mask_mod_any_layout(data: list[tuple[int, int]], docs: list[int], order: str) -> None:
    """Arbitrary (anchor, depth) lists, repeated pairs and non-contiguous documents included: both the
    structured and the generic dense builders must give the predicate exactly."""
    if order == "cod":
        data = sorted(set(data), key=lambda p: (p[1], p[0]))
    a, d = _t([p[0] for p in data]), _t([p[1] for p in data])
    doc = _t(docs)
    expected = _pairwise(cod_mask_mod(a, d, doc), a.numel())
    assert torch.equal(dense_mask(a, d, doc, pad_self=False), expected)


def test_dense_structured_path_on_shuffled_segment() -> None:
    a, d, docs = _row_case(3)
    perm = torch.randperm(a.numel(), generator=torch.Generator().manual_seed(0))
    m = dense_mask(a, d, docs)
    assert torch.equal(dense_mask(a[perm], d[perm], docs), m[perm][:, perm])


def test_block_mask_for_segment_row() -> None:
    from peagle.cod.rows import block_mask_for, plan_segments, segment_row

    a, d, docs = _row_case(4)
    row = build_flat_row(torch.arange(docs.numel()), (docs >= 0).long(), docs, a, d, mask_token_id=99)
    sub = segment_row(row, plan_segments(row, docs.numel(), 2)[1])
    bm = block_mask_for(sub.to("cpu"), block_size=16)
    n = sub.num_elements
    nb = -(-n // 16)
    padded = torch.zeros(nb * 16, nb * 16, dtype=torch.bool)
    padded[:n, :n] = mask_for(sub, pad_self=False)
    assert torch.equal(bm.to_dense()[0, 0].bool(), padded.reshape(nb, 16, nb, 16).any(3).any(1))
