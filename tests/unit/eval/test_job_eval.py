"""The evaluation end's wording and what a checkpoint keeps of an evaluation (issue 18)."""

from __future__ import annotations

from peagle.eval.final import _serving_summary, al_text, evaluation_summary
from peagle.spec import preset


def _row(b: int, x: float) -> dict:
    from peagle.eval.speedup import speedup_text

    return {"num_speculative_tokens": 4, "batch_size": b, "speedup": x, "speedup_text": speedup_text(x),
            "base_tokens_per_s": 30.0, "spec_tokens_per_s": 30.0 * x, "rounds": 3, "acceptance_length": 1.2}


def test_al_text_names_the_engine_and_a_run_without_drafts() -> None:
    demo = preset("demo")
    assert al_text({"acceptance_length": 1.234, "engine": "vllm"}, demo) == "AL 1.23 (vLLM, humaneval, 8 prompts)"
    assert al_text({"acceptance_length": 1.2}, demo) == "AL 1.20 (reference decoder, humaneval, 8 prompts)"
    assert al_text({"acceptance_length": None}, demo) == "AL not measured (no drafts)"


def test_serving_summary_recommends_and_says_slowdowns() -> None:
    serving = {"num_speculative_tokens": 4, "batch_1": _row(1, 1.07), "batch_n": _row(8, 0.45),
               "table": [_row(1, 1.07), _row(8, 0.45)], "acceptance_length": 1.2,
               "recommended": [{"batch_size": 1, "num_speculative_tokens": 4, "speedup": 1.07},
                               {"batch_size": 8, "num_speculative_tokens": 0, "speedup": 0.45}],
               "hardware": {"device": "cpu", "cpu": "AMD EPYC", "cpu_count": 2},
               "checks": {"4": {"problems": []}}}
    out = _serving_summary(serving, 4)
    assert out is not None and "checks" not in out and out["parallel_drafting_ok"] is True
    assert out["recommended_speculative_config"]["num_speculative_tokens"] == 4
    assert "batch 1 1.07x faster" in out["summary"] and "batch 8 0.45x (2.22x slower)" in out["summary"]
    assert "batch 8: no draft (slower at every K)" in out["summary"] and "AMD EPYC x2" in out["summary"]


def test_a_checkpoint_keeps_no_per_request_lists() -> None:
    ev = {"engine": "vllm", "num_speculative_tokens": 4, "hardware": {"device": "cpu"}, "serving": None,
          "prompt_sets": {"humaneval": {"acceptance_length": 1.2, "per_request": [1.1, 1.3],
                                        "per_request_spread": {"median": 1.2}, "num_prompts": 2, "counters_agree": True}}}
    kept = evaluation_summary(ev)
    assert kept["prompt_sets"]["humaneval"] == {"acceptance_length": 1.2, "per_request_spread": {"median": 1.2},
                                                "num_prompts": 2}
    assert kept["engine"] == "vllm" and kept["hardware"] == {"device": "cpu"}


def test_a_failed_speedup_does_not_cost_the_al(tmp_path, smollm2_tokenizer, monkeypatch) -> None:
    """The job's AL in vLLM is measured again without the speedup when the speedup run fails (a second
    engine that does not fit, ...), with a warning naming why."""
    import json

    from peagle.errors import ResourceError
    from peagle.eval.final import evaluate_export
    from peagle.progress import RecordingSink
    from peagle.spec import parse_spec

    spec = parse_spec({"target": {"model": "builtin:smollm2-135m-instruct"},
                       "data": {"sources": [{"path": "builtin:sharegpt"}]}, "peagle": {"num_depths": 2},
                       "eval": {"engine": "vllm", "prompt_sets": [{"name": "humaneval", "num_prompts": 1}]}})
    ckpt = tmp_path / "step_000004"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text(json.dumps({"metrics": {"tau_sim": 1.1}}))
    calls = []

    def fake_measure(export_dir, sets, *, speedup, **kw):
        calls.append(speedup)
        if speedup is not None:
            raise ResourceError("vLLM probe failed (exit 1): out of memory")
        return {"parallel_drafting_ok": True, "prompt_sets": {"humaneval": {"acceptance_length": 1.3}}, "serving": None}

    monkeypatch.setattr("peagle.engine.locate.vllm_available", lambda: True)
    monkeypatch.setattr("peagle.eval.serve_check.measure_vllm", fake_measure)
    sink = RecordingSink()
    out = evaluate_export(spec, ckpt, None, smollm2_tokenizer, 2, sink, target_path=tmp_path)
    assert out["acceptance_length"] == 1.3 and out["serving"] is None and calls[0] is not None and calls[1] is None
    assert any("serving speedup not measured: vLLM probe failed" in r.get("message", "") for r in sink.records)
