"""A job's queues through the API (issue 46, item 7): `queue` and `resources.trainer.queue` never name an engine
queue (`engine-<queue>`, where split jobs' engine chunks wait for engine workers) nor a name the broker keeps
(`celery`, `unacked`, ...): 422 naming the field, nothing queued, the dry run too. And the serve command
quotes whatever verifier a stored job names (`shlex.quote`), an unsafe one from before the spec checked it too.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from peagle.spec import preset
from service.db.models import Job
from service.db.session import session_scope


def _jobs(sim: Any) -> int:
    with session_scope(sim.sessions) as s:
        return int(s.scalar(sa.select(sa.func.count()).select_from(Job)) or 0)


@pytest.mark.parametrize("queue", ["engine-cpu", "engine-gpu", "celery", "unacked", "w1.dq2"])
def test_a_job_queue_that_is_an_engine_or_reserved_queue_is_refused(client: TestClient, sim: Any, alice: dict,
                                                                    queue: str) -> None:
    for path in ("/v1/jobs", "/v1/jobs?dry_run=true"):
        r = client.post(path, json={"preset": "tiny", "queue": queue}, headers=alice)
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["param"] == "/queue", err
        assert queue in err["message"], err
    assert _jobs(sim) == 0


def test_a_trainer_queue_that_is_an_engine_queue_is_refused(client: TestClient, sim: Any, alice: dict) -> None:
    spec = preset("demo").model_dump(mode="json")
    spec["resources"].update(target_engine="vllm", capture="online", engine={"replicas": 2},
                             trainer={"queue": "engine-q1"})
    r = client.post("/v1/jobs", json={"spec": spec, "queue": "q1"}, headers=alice)
    assert r.status_code == 422, r.text
    params = {d["param"]: d["message"] for d in r.json()["error"]["details"]}
    assert "/resources/trainer/queue" in params and "engine" in params["/resources/trainer/queue"], params
    spec["resources"]["trainer"], spec["resources"]["engine"]["queue"] = None, "q2"  # chunks on a job queue
    r = client.post("/v1/jobs", json={"spec": spec, "queue": "q1"}, headers=alice)
    assert r.status_code == 422, r.text
    assert "/resources/engine/queue" in {d["param"] for d in r.json()["error"]["details"]}, r.text
    assert _jobs(sim) == 0


def test_an_ordinary_queue_still_works(client: TestClient, alice: dict) -> None:
    r = client.post("/v1/jobs", json={"preset": "tiny", "queue": "gpu-a100"}, headers=alice)
    assert r.status_code == 201 and r.json()["queue"] == "gpu-a100", r.text


@pytest.mark.parametrize("name", ["$(id)", "org/m; rm -rf ~", "/etc/passwd`id`"])
def test_an_unsafe_name_or_path_is_refused_and_a_stored_one_is_quoted_in_the_serve_command(
        client: TestClient, sim: Any, alice: dict, submit: Any, name: str) -> None:
    r = client.post("/v1/jobs", json={"preset": "tiny", "overrides": {"target": {"name_or_path": name}}},
                    headers=alice)
    assert r.status_code == 422 and r.json()["error"]["param"] == "/target/name_or_path", r.text
    job = submit(client, alice)  # a job stored before the check: its spec and its export name it
    with session_scope(sim.sessions) as s:
        row = s.get(Job, job["id"])
        assert row is not None
        row.spec = {**row.spec, "target": {**row.spec["target"], "name_or_path": name}}
    sim.set(job["id"], status="succeeded")
    d = sim.checkpoint(job["id"], 4, {"model.safetensors": b"\0" * 16})
    cfg = json.loads((d / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = name
    (d / "config.json").write_text(json.dumps(cfg))
    r = client.get(f"/v1/jobs/{job['id']}/checkpoints/4/serve", headers=alice)
    assert r.status_code == 200, r.text
    long = r.json()["long_command"]
    assert long.startswith(f"vllm serve {shlex.quote(name)} --speculative-config "), long
    assert shlex.split(long)[2] == name  # one word, read back exactly
