"""COD sampler: parity with the reference sampler of docs/algorithm.md 1.7, the cases of docs/algorithm.md 6, invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle.cod.sampling import sample_cod


def reference_cod(loss_mask: list[int], k: int, r: float, r_min: float) -> tuple[list[int], list[int]]:
    """docs/algorithm.md 1.7, NeMo variant (position 0 filtered), one document, global RNG, plain Python."""
    t = len(loss_mask)
    valid = [p for p in range(t) if loss_mask[p] == 1]
    valid_set = set(valid)
    seeds = valid
    pool = [p for p in seeds if p != 0]
    anchors, depths = list(range(t)), [0] * t
    for d in range(1, k):
        n_keep = math.floor(max(0, len(seeds) - d) * max(r**d, r_min))
        if n_keep <= 0:
            break
        if len(pool) >= n_keep:
            perm = torch.randperm(len(pool))[:n_keep]
            chosen = sorted(pool[i] for i in perm.tolist())
        else:
            chosen = list(pool)
        anchors += [o - d for o in chosen]
        depths += [d] * len(chosen)
        nxt = [(o + 1) % t for o in chosen]
        pool = [o for o in nxt if o != 0 and o in valid_set]
    return anchors, depths


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _counts(depth: torch.Tensor, k: int) -> list[int]:
    return torch.bincount(depth, minlength=k).tolist()


masks = st.lists(st.integers(0, 1), min_size=1, max_size=40)
ratios = st.tuples(st.floats(0.05, 1.0), st.floats(0.0, 1.0)).map(lambda p: (p[0], min(p[0], p[1])))


@settings(max_examples=150, deadline=None)
@given(mask=masks, k=st.integers(1, 9), rr=ratios, seed=st.integers(0, 2**31 - 1))
def test_equals_reference_sampler(mask: list[int], k: int, rr: tuple[float, float], seed: int) -> None:
    r, r_min = rr
    torch.manual_seed(seed)
    ref_a, ref_d = reference_cod(mask, k, r, r_min)
    a, d = sample_cod(torch.tensor(mask), k, r, r_min, generator=_gen(seed))
    assert a.tolist() == ref_a
    assert d.tolist() == ref_d
    # the global RNG path gives the same draws
    torch.manual_seed(seed)
    a2, d2 = sample_cod(torch.tensor([mask]), k, r, r_min)
    assert a2.tolist() == ref_a and d2.tolist() == ref_d


def test_reference_parity_fixed_masks_many_seeds() -> None:
    mask = [0] + [1] * 20 + [0] * 3 + [1] * 8
    for seed in range(40):
        torch.manual_seed(seed)
        ref = reference_cod(mask, 8, 0.7, 0.2)
        a, d = sample_cod(torch.tensor(mask), 8, 0.7, 0.2, generator=_gen(seed))
        assert (a.tolist(), d.tolist()) == ref


def test_depth0_is_every_position_and_counts_decay() -> None:
    a, d = sample_cod(torch.ones(16), 8, 0.7, 0.2, generator=_gen(0))
    assert a[:16].tolist() == list(range(16)) and d[:16].tolist() == [0] * 16
    counts = _counts(d, 8)
    assert counts == [16, 10, 6, 4, 2, 2, 2, 1]
    assert int((a + d).max()) < 16


def test_deeper_references_only_supervised() -> None:
    a, d = sample_cod(torch.tensor([1] * 8 + [0] * 8), 8, 0.9, 0.2, generator=_gen(0))
    assert int((a + d)[d > 0].max()) < 8
    mask = torch.tensor([0, 1, 1, 1, 0, 1])
    a, d = sample_cod(mask, 4, 1.0, 1.0, generator=_gen(3))
    assert a[d == 0].tolist() == list(range(6))
    ref = (a + d)[d > 0]
    assert bool((ref < 6).all()) and bool((mask[ref] == 1).all())


def test_no_negative_anchors_all_ones() -> None:
    for seed in range(8):
        a, d = sample_cod(torch.ones(16), 8, 0.9, 0.2, generator=_gen(seed))
        assert int(a.min()) >= 0 and _counts(d, 8)[0] == 16


def test_deterministic_example() -> None:
    for seed in (0, 1, 7):
        a, d = sample_cod(torch.ones(8), 4, 1.0, 1.0, generator=_gen(seed))
        assert a.tolist() == [*range(8), *range(7), *range(6), *range(5)]
        assert d.tolist() == [0] * 8 + [1] * 7 + [2] * 6 + [3] * 5


def test_degenerate_masks() -> None:
    for mask in ([0] * 10, [0, 0, 1, 0, 0]):
        a, d = sample_cod(torch.tensor(mask), 6, 1.0, 1.0, generator=_gen(0))
        assert d.tolist() == [0] * len(mask) and a.tolist() == list(range(len(mask)))
    mask = torch.zeros(8)
    mask[3:5] = 1
    seen = set()
    for seed in range(12):
        a, d = sample_cod(mask, 6, 1.0, 1.0, generator=_gen(seed))
        assert _counts(d, 6) == [8, 1, 0, 0, 0, 0]
        seen.add(int(a[8]))
    assert seen <= {2, 3} and seen


def test_max_anchors() -> None:
    mask = torch.ones(64)
    a0, d0 = sample_cod(mask, 6, 0.7, 0.2, generator=_gen(5))
    a1, d1 = sample_cod(mask, 6, 0.7, 0.2, max_anchors=None, generator=_gen(5))
    assert torch.equal(a0, a1) and torch.equal(d0, d1)
    a2, d2 = sample_cod(mask, 6, 0.7, 0.2, max_anchors=64, generator=_gen(5))
    assert torch.equal(a0, a2) and torch.equal(d0, d2)
    a3, d3 = sample_cod(mask, 6, 0.7, 0.2, max_anchors=10, generator=_gen(5))
    assert a3[d3 == 0].tolist() == list(range(64))
    assert max(_counts(d3, 6)[1:]) <= 10
    for dep in range(1, 6):
        sel = a3[d3 == dep]
        assert torch.equal(sel, sel.sort().values)
    with pytest.raises(ValueError, match="max_anchors"):
        sample_cod(mask, 6, max_anchors=0)


def test_packed_documents_two_by_three() -> None:
    docs = torch.tensor([0, 0, 0, 1, 1, 1])
    a, d = sample_cod(torch.ones(6), 3, 1.0, 1.0, document_ids=docs, generator=_gen(0))
    assert a.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 3, 4, 0, 3]
    deep = d > 0
    assert torch.equal(docs[a[deep]], docs[(a + d)[deep]])


def test_device_and_shape_errors() -> None:
    with pytest.raises(ValueError, match="num_depths"):
        sample_cod(torch.ones(4), 0)
    with pytest.raises(ValueError, match="document_ids"):
        sample_cod(torch.ones(4), 2, document_ids=torch.zeros(5, dtype=torch.long))


@st.composite
def packed_rows(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed row: a few documents of random lengths, then padding (-1); random loss mask."""
    lengths = draw(st.lists(st.integers(1, 10), min_size=1, max_size=4))
    pad = draw(st.integers(0, 5))
    docs = [i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * pad
    mask = draw(st.lists(st.integers(0, 1), min_size=len(docs), max_size=len(docs)))
    mask = [m if doc >= 0 else 0 for m, doc in zip(mask, docs, strict=True)]
    return torch.tensor(mask), torch.tensor(docs)


@settings(max_examples=150, deadline=None)
@given(
    row=packed_rows(),
    k=st.integers(1, 8),
    rr=ratios,
    max_anchors=st.one_of(st.none(), st.integers(1, 12)),
    seed=st.integers(0, 2**31 - 1),
)
def test_invariants(
    row: tuple[torch.Tensor, torch.Tensor],
    k: int,
    rr: tuple[float, float],
    max_anchors: int | None,
    seed: int,
) -> None:
    mask, docs = row
    t = mask.numel()
    a, d = sample_cod(mask, k, *rr, document_ids=docs, max_anchors=max_anchors, generator=_gen(seed))
    ref = a + d
    # depth 0 = every position; grouped by depth; sorted by anchor within a depth
    assert a[:t].tolist() == list(range(t)) and bool((d[:t] == 0).all())
    assert torch.equal(d, d.sort(stable=True).values)
    n_seeds = int(mask.sum()) if max_anchors is None else min(int(mask.sum()), max_anchors)
    counts = _counts(d, k)
    for dep in range(1, k):
        sel = a[d == dep]
        assert torch.equal(sel, sel.sort().values)
        assert sel.unique().numel() == sel.numel()
        n_keep = math.floor(max(0, n_seeds - dep) * max(rr[0] ** dep, rr[1]))
        assert counts[dep] <= n_keep  # per-depth count bound
    deep = d > 0
    assert int(a.min()) >= 0 and int(ref.max()) < t
    assert bool((mask[ref[deep]] == 1).all())  # references only at supervised positions
    assert torch.equal(docs[a[deep]], docs[ref[deep]])  # no cross-document chain
    assert bool((docs[a[deep]] >= 0).all())
    # chain contiguity: every depth-d element's parent (same anchor, depth d-1) is present
    keys = set(zip(a.tolist(), d.tolist(), strict=True))
    assert all((ai, di - 1) in keys for ai, di in keys if di > 0)
    # non-increasing counts among non-empty depths
    nonempty = [c for c in counts if c > 0]
    assert nonempty == sorted(nonempty, reverse=True)
