"""Issue 38 item 6: the checkpoint's serve command carries the measured K schedule (vLLM's
`num_speculative_tokens_per_batch_size`) in its long form, and says it in words."""

from __future__ import annotations

import json
import shlex
from typing import Any

import sqlalchemy as sa
from fastapi.testclient import TestClient

from peagle.eval.speedup import recommend, speculative_config
from service.db.models import Checkpoint
from service.db.session import session_scope


def _serving() -> dict[str, Any]:
    table = [{"num_speculative_tokens": k, "batch_size": b, "speedup": x, "speedup_per_round": [x] * 3}
             for (k, b), x in {(2, 1): 1.3, (3, 1): 1.2, (2, 8): 0.8, (3, 8): 0.7}.items()]
    rec = recommend(table)
    return {"num_speculative_tokens": 3, "batch_sizes": [1, 8], "table": table, "recommended": rec,
            "recommended_speculative_config": speculative_config("", rec, 3),
            "hardware": {"device": "cpu", "cpu": "AMD EPYC", "cpu_count": 2}}


def test_the_long_form_carries_the_schedule(client: TestClient, alice: dict, sim: Any) -> None:
    job = client.post("/v1/jobs", json={"preset": "demo"}, headers=alice).json()
    sim.checkpoint(job["id"], 4, {"model.safetensors": b"w"})
    with session_scope(sim.sessions) as s:
        s.execute(sa.update(Checkpoint).where(Checkpoint.job_id == job["id"])
                  .values(evaluation={"engine": "vllm", "serving": _serving()}))  # fmt: skip
    serve = client.get(f"/v1/jobs/{job['id']}/checkpoints/4/serve", headers=alice).json()
    cfg = json.loads(shlex.split(serve["long_command"])[4])
    assert cfg == serve["speculative_config"] == {
        "model": f"./{job['id']}-step_000004", "method": "eagle3", "num_speculative_tokens": 2,
        "parallel_drafting": True, "num_speculative_tokens_per_batch_size": [[1, 7, 2], [8, 8, 0]]}
    assert "K=2 at batch 1-7, no draft at batch 8" in serve["speedup_note"], serve["speedup_note"]
