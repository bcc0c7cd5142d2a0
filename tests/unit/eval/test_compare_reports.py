"""`compare_reports`: the side-by-side written to RUN/export/serve_check.json."""

from peagle.eval.serve_check import compare_reports


def test_outputs_not_compared_when_one_side_has_none() -> None:
    # walk-through: the in-job serve check said "0 identical of 0 prompts" because eval.json has no outputs
    ref = {"acceptance_length": 1.25, "per_position": [0.2, 0.05]}
    vllm = {"acceptance_length": 1.2, "per_position": [0.18, 0.02], "outputs": [[1, 2], [3]]}
    cmp = compare_reports(ref, vllm)
    assert cmp["identical_outputs"] is None and cmp["num_prompts"] is None
    assert abs(cmp["al_ratio_vllm_over_reference"] - 0.96) < 1e-9 and cmp["al_within_5pct"] is True


def test_outputs_compared_when_both_have_them() -> None:
    ref = {"acceptance_length": 1.0, "outputs": [[1, 2], [3, 4]]}
    vllm = {"acceptance_length": 1.2, "outputs": [[1, 2], [3, 5]]}
    cmp = compare_reports(ref, vllm)
    assert cmp["identical_outputs"] == 1 and cmp["num_prompts"] == 2 and cmp["al_within_5pct"] is False
