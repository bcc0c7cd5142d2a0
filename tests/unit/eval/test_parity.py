"""The served-parity gate's rule (peagle.eval.parity): which drops fail, what the message says, the record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peagle.eval.parity import (
    AGREEMENT,
    FLOOR,
    MIN_REQUESTS,
    PARITY_FILE,
    USUAL_CAUSES,
    agreement_holds,
    check_parity,
    parity_record,
    parity_summary,
    position_tolerance,
    read_parity,
    request_agreement,
)


def test_tolerance_is_three_standard_errors_of_the_difference_or_the_floor() -> None:
    # the worked example of the module docstring
    assert position_tolerance(0.8, 100, 0.6, 110) == pytest.approx(0.19, abs=0.005)
    # many drafts: the floor
    assert position_tolerance(0.5, 100_000, 0.5, 100_000) == FLOOR
    # no drafts on a side: nothing can be said, nothing fails
    assert position_tolerance(0.5, 0, 0.0, 10) == 1.0


def test_a_drop_beyond_tolerance_fails_and_names_positions_figures_and_causes() -> None:
    ref = {"per_position": [0.9, 0.7, 0.5], "num_drafts": 200, "acceptance_length": 3.1}
    vllm = {"per_position": [0.88, 0.1, 0.02], "num_drafts": 400, "acceptance_length": 2.0,
            "parallel_drafting_ok": True, "problems": []}  # fmt: skip
    res = check_parity(ref, vllm)
    assert not res.ok and res.failed_positions == [1, 2]
    assert "position 1: vLLM 0.10 vs reference 0.70" in res.message
    assert "position 2: vLLM 0.02 vs reference 0.50" in res.message
    assert "position 0" not in res.message.split("Usual causes")[0]
    assert all(cause in res.message for cause in USUAL_CAUSES)
    assert "\n" not in res.message  # one line: the job's error message, the CLI's error line
    assert res.to_dict()["failed_positions"] == [1, 2]


def test_a_gain_or_a_drop_within_noise_passes() -> None:
    ref = {"per_position": [0.6, 0.3], "num_drafts": 50}
    assert check_parity(ref, {"per_position": [0.5, 0.25], "num_drafts": 55, "parallel_drafting_ok": True}).ok
    assert check_parity(ref, {"per_position": [0.9, 0.8], "num_drafts": 40, "parallel_drafting_ok": True}).ok


def test_sequential_drafting_or_no_drafts_fail_on_their_own() -> None:
    ref = {"per_position": [0.6, 0.3], "num_drafts": 50}
    seq = check_parity(ref, {"per_position": [0.6, 0.3], "num_drafts": 50, "parallel_drafting_ok": False,
                             "problems": ["no mask_hidden"]})  # fmt: skip
    assert not seq.ok and "did not draft in parallel (no mask_hidden)" in seq.message
    none = check_parity(ref, {"per_position": [], "num_drafts": 0, "parallel_drafting_ok": True})
    assert not none.ok and "vLLM drafted nothing" in none.message


def test_the_record_round_trips_through_the_export_folder(tmp_path: Path) -> None:
    report = {"acceptance_length": 2.5, "per_position": [0.9, 0.6], "num_drafts": 40}
    rec = parity_record(report, prompt_set="humaneval", prompts=[[1, 2, 3], [4, 5]], num_speculative_tokens=2,
                        max_new_tokens=32, checkpoint="step_000010", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert rec["accepted_per_pos"] == [36, 24] and rec["temperature"] == 0.0 and rec["num_prompts"] == 2
    assert "prompts" not in parity_summary(rec)
    assert read_parity(tmp_path) is None
    (tmp_path / PARITY_FILE).write_text(json.dumps(rec))
    assert read_parity(tmp_path) == rec
    assert check_parity(rec, {**report, "parallel_drafting_ok": True}).ok


def test_a_float32_record_is_reported_but_not_enforced() -> None:
    # vLLM serves bfloat16: a record of a float32 target follows other greedy paths
    ref = {"per_position": [0.94, 0.08], "num_drafts": 127, "target_dtype": "float32"}
    res = check_parity(ref, {"per_position": [0.75, 0.07], "num_drafts": 141, "parallel_drafting_ok": True})
    assert not res.ok and not res.fails and res.failed_positions == [0]
    assert res.message.startswith("served parity not enforced (the reference decoder ran the target in float32")
    assert check_parity({**ref, "target_dtype": "bfloat16"}, {"per_position": [0.75, 0.07], "num_drafts": 141,
                                                             "parallel_drafting_ok": True}).fails  # fmt: skip


def test_only_prompts_with_the_same_generated_tokens_are_compared() -> None:
    # prompt 1's target output differs between the engines (bf16 kernels): its drafts say nothing of the draft
    ref = {"outputs": [[1, 2], [3, 4], [5, 6]], "histograms": [[0, 0, 5], [0, 0, 5], [0, 0, 5]],
           "per_position": [1.0, 1.0], "num_drafts": 15, "target_dtype": "bfloat16"}
    vllm = {"outputs": [[1, 2], [3, 9], [5, 6]], "histograms": [[0, 0, 5], [5, 0, 0], [0, 0, 5]],
            "per_position": [0.67, 0.67], "num_drafts": 15, "parallel_drafting_ok": True}
    res = check_parity(ref, vllm)
    assert res.ok and "on the 2 of 3 prompts where both engines generated the same tokens" in res.message
    broken = {**vllm, "histograms": [[5, 0, 0], [5, 0, 0], [5, 0, 0]]}
    assert check_parity(ref, broken).fails
    # most prompts on other paths: not comparable, reported only
    other = {**broken, "outputs": [[0], [0], [5, 6]]}
    assert not check_parity(ref, other).ok and not check_parity(ref, other).fails


# the parity fixture's 5 prompts decoded alike by both engines, histograms as measured (reference, then vLLM)
_REF = [[0, 5, 2, 4], [0, 16, 0, 0], [2, 6, 2, 3], [1, 14, 1, 0], [2, 15, 0, 0]]
_GOOD = [[0, 8, 1, 3], [0, 16, 0, 0], [2, 6, 2, 3], [1, 14, 1, 0], [2, 15, 0, 0]]
_AUX = [[1, 4, 1, 5], [0, 16, 0, 0], [1, 6, 1, 4], [0, 16, 0, 0], [2, 15, 0, 0]]


def _reports(ref_h: list[list[int]], v_h: list[list[int]]) -> tuple[dict[str, object], dict[str, object]]:
    from peagle.eval.acceptance import compute_acceptance

    outs = [[i, i + 1] for i in range(len(ref_h))]
    ref = {**compute_acceptance(ref_h).to_dict(), "outputs": outs, "histograms": ref_h, "target_dtype": "bfloat16"}
    vllm = {**compute_acceptance(v_h).to_dict(), "outputs": outs, "histograms": v_h, "parallel_drafting_ok": True}
    return ref, vllm


def test_request_agreement_counts_equal_histograms_on_prompts_decoded_alike() -> None:
    ref = {"outputs": [[1], [2], [3], [4]], "histograms": [[0, 3], [1, 2, 0], [4, 0], []]}
    vllm = {"outputs": [[1], [2], [9], [4]], "histograms": [[0, 3], [1, 2], [4, 0], []]}
    # prompt 2 decoded differently: not compared; prompt 3 drafted nothing: not compared; trailing zeros equal
    assert request_agreement(ref, vllm) == (2, 2)
    assert request_agreement(ref, {**vllm, "histograms": [[1, 2], [1, 2], [4, 0], []]}) == (1, 2)
    assert request_agreement({"per_position": [0.5]}, vllm) == (0, 0)  # an older record: nothing compared


def test_agreement_rule_threshold_and_minimum() -> None:
    assert agreement_holds(3, 5) and not agreement_holds(2, 5)  # AGREEMENT = 0.6
    assert agreement_holds(0, MIN_REQUESTS - 1)  # too few prompts: not applied
    assert not agreement_holds(0, MIN_REQUESTS) and AGREEMENT == 0.6


def test_a_draft_whose_proposals_changed_fails_even_when_its_rates_hold() -> None:
    # aux ids shifted by one on the parity fixture: the rates hold, the per-prompt histograms do not
    res = check_parity(*_reports(_REF, _AUX))
    assert res.failed_positions == [] and res.fails
    assert (res.requests_matching, res.requests_compared) == (2, 5) and not res.agreement_ok
    assert "acceptance histograms match the reference's on 2 of 5 prompts decoded alike" in res.message
    assert res.message.startswith("served parity failed") and res.to_dict()["requests"]["ok"] is False
    good = check_parity(*_reports(_REF, _GOOD))  # one prompt differs by a near-tie: passes
    assert good.ok and (good.requests_matching, good.requests_compared) == (4, 5)
