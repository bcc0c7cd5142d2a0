"""Issue 18: the evaluation of the best checkpoint (engine, AL per prompt set with its spread, the measured
serving speedup with the hardware) is stored on that checkpoint, as its measured AL already was."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from service.db import lease as L
from service.db import progress as P
from service.db.models import Checkpoint
from service.db.session import session_scope
from tests.worker.conftest import new_job
from worker.progress import ProgressCollector

ROW = {"num_speculative_tokens": 4, "batch_size": 1, "rounds": 3, "speedup": 0.8, "speedup_per_round": [0.8] * 3,
       "base_tokens_per_s": 30.0, "spec_tokens_per_s": 24.0, "acceptance_length": 1.2, "per_position": [0.2],
       "base_tokens": 300, "spec_tokens": 300, "speedup_text": "0.80x (1.25x slower)"}
EVALUATION = {
    "engine": "vllm", "num_speculative_tokens": 4,
    "prompt_sets": {"humaneval": {"acceptance_length": 1.25, "per_position": [0.2, 0.05],
                                  "per_request_spread": {"min": 1.0, "p25": 1.1, "median": 1.2, "p75": 1.3,
                                                         "max": 1.6, "mean": 1.22}, "num_prompts": 8}},
    "serving": {"num_speculative_tokens": 4, "batch_sizes": [1, 8], "batch_1": ROW, "batch_n": None,
                "table": [ROW], "recommended": [{"batch_size": 1, "num_speculative_tokens": 0, "speedup": 0.8,
                                                 "best_measured_k": 4}],
                "hardware": {"device": "cpu", "cpu": "AMD EPYC", "cpu_count": 2}},
    "hardware": {"device": "cpu", "cpu": "AMD EPYC", "cpu_count": 2},
}


def test_the_eval_event_carries_the_evaluation_to_its_checkpoint() -> None:
    c = ProgressCollector()
    c.add({"type": "event", "kind": "eval", "time": 1.0, "checkpoint_step": 8,
           "metrics": {"acceptance_length": 1.25, "engine": "vllm"}, "evaluation": EVALUATION})
    assert c.take().checkpoint_metrics == [{"step": 8, "metrics": {"acceptance_length": 1.25},
                                            "evaluation": EVALUATION}]


def test_ingest_stores_and_merges_the_evaluation(factory: Any) -> None:
    job_id = new_job(factory)
    with session_scope(factory) as s:
        lease = L.claim_job(s, job_id, owner="w1", lease_seconds=60.0, artifact_dir="/tmp/x")
    c = ProgressCollector()
    c.add_line('{"type":"event","kind":"checkpoint","step":8,"metrics":{"tau_sim":0.8},"is_best":true}\n')
    reference = {"engine": "reference", "prompt_sets": {"humaneval": {"acceptance_length": 1.3}}}
    c.add_line(json.dumps({"type": "event", "kind": "eval", "checkpoint_step": 8,
                           "metrics": {"acceptance_length": 1.3}, "evaluation": reference}) + "\n")
    # the serve check adds vLLM's serving report to the same checkpoint later
    c.add_line(json.dumps({"type": "event", "kind": "eval", "checkpoint_step": 8,
                           "metrics": {"vllm_acceptance_length": 1.25},
                           "evaluation": {"serving": EVALUATION["serving"]}}) + "\n")
    with session_scope(factory) as s:
        P.ingest(s, lease, c.take())
    with factory() as s:
        ck = s.scalars(sa.select(Checkpoint).where(Checkpoint.job_id == job_id)).one()
    assert ck.metrics == {"tau_sim": 0.8, "acceptance_length": 1.3, "vllm_acceptance_length": 1.25}
    assert ck.evaluation == {**reference, "serving": EVALUATION["serving"]}
