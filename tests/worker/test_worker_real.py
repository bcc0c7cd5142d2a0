"""End to end with the real trainer (`python -m peagle train`, tiny preset): API -> broker -> worker -> trainer.

Each test starts real Celery worker processes (and the reaper) against SQLite + the filesystem broker
(embedded default) or PostgreSQL + Redis, submits through the API app, and checks the database, the run
directory and the API's answers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import pytest

from service.db.models import JobEvent, JobLog, JobMetric

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The tiny preset, 6 steps, a checkpoint every 2, no held-out rows and no acceptance-length pass: the
# service path is what is tested here (a run takes ~15 s on an idle 2-core machine, much more under load).
OVERRIDES = {"data": {"eval_samples": 0}, "optim": {"max_steps": 6}, "checkpoints": {"every_steps": 2},
             "eval": {"prompt_sets": []}}


def submit(client, overrides=None):
    r = client.post("/v1/jobs", json={"preset": "tiny", "overrides": overrides or OVERRIDES})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def training_steps(stack, job_id):
    """Steps of the training metric records (rows with `loss`; eval rows share a step)."""
    return [m.step for m in stack.rows(JobMetric, job_id) if "loss" in m.values]


def trainer_pid(stack, job_id, attempt):
    return stack.trainer_pid(job_id, attempt)  # the job's events name no pid: found in /proc


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def final_weights(stack, job_id):
    """fp32 draft weights of the job's latest checkpoint (from its training state) and its name."""
    import torch

    run = stack.settings.resolved_artifact_root() / job_id
    name = json.loads((run / "checkpoints" / "state.json").read_text())["latest"]
    state = torch.load(run / "checkpoints" / name / "training_state.pt", map_location="cpu", weights_only=False)
    return state["draft"], name


def test_end_to_end_embedded_download_and_pause_resume(make_stack, api):
    """Two jobs with the same spec: A uninterrupted, B paused mid-training then resumed; same weights."""
    stack = make_stack("embedded", fake_trainer=False)
    stack.start_worker()
    stack.start_worker()
    client = api(stack)
    # one short AL measurement at the end (the checkpoints table must show it)
    # 24 steps: B must still be training when the pause arrives (the trainer got fast enough to finish 6 first)
    with_al = {**OVERRIDES, "optim": {"max_steps": 24, "epochs": 50}, "checkpoints": {"every_steps": 6},
               "eval": {"prompt_sets": [{"name": "humaneval", "num_prompts": 1}], "max_new_tokens": 4}}
    job_a, job_b = submit(client, with_al), submit(client, with_al)
    stack.wait(job_b, lambda j: (j.progress or {}).get("step", 0) >= 1 and j.status == "running", 120, "B training")
    r = client.post(f"/v1/jobs/{job_b}/pause")
    assert r.status_code == 200 and r.json()["status"] in ("pausing", "paused"), r.text
    b = stack.wait_status(job_b, "paused", "failed", "succeeded", timeout=90)
    assert b.status == "paused", (b.error_code, b.error_message, stack.logs())
    paused_at = b.latest_checkpoint_step
    assert paused_at is not None and paused_at >= 1
    a = stack.wait_status(job_a, "succeeded", "failed", timeout=300)
    assert a.status == "succeeded", (a.error_code, a.error_message, stack.logs())
    assert client.post(f"/v1/jobs/{job_b}/resume").status_code == 200
    b = stack.wait_status(job_b, "succeeded", "failed", timeout=300)
    assert b.status == "succeeded", (b.error_code, b.error_message, stack.logs())

    # A: progress, phases, metrics, checkpoints, provenance, export; download through the API.
    out = client.get(f"/v1/jobs/{job_a}").json()
    total = out["progress"]["total_steps"]
    assert out["progress"]["step"] == total and out["progress"]["percent"] == 100.0 and out["phase"] == "done"
    assert out["resolved_spec"] and out["provenance"]["worker"]["packages"]["torch"]
    assert out["provenance"]["trainer"] is not None
    assert training_steps(stack, job_a) == list(range(1, total + 1))
    run_a = stack.settings.resolved_artifact_root() / job_a
    assert (run_a / "export" / "model.safetensors").exists() and (run_a / "export" / "config.json").exists()
    cks = client.get(f"/v1/jobs/{job_a}/checkpoints").json()["data"]
    best = next(c for c in cks if c["is_best"])
    f = next(x for x in best["files"] if x["path"] == "model.safetensors")
    r = client.get(f"/v1/jobs/{job_a}/checkpoints/{best['step']}/files/model.safetensors")
    assert r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == f["sha256"]
    # walk-through rough edges: the final measured AL is on the best checkpoint's row; no tqdm bars in logs
    assert best["acceptance_length"] is not None and best["acceptance_length"] >= 1.0, best
    logs = [g.message for g in stack.rows(JobLog, job_a)]
    assert logs and not any("it/s]" in m or "%|" in m for m in logs), logs

    # B: resumed exactly at its pause checkpoint; final weights equal A's; metrics without gaps/duplicates.
    assert training_steps(stack, job_b) == list(range(1, total + 1))
    assert any(e.kind == "paused" for e in stack.rows(JobEvent, job_b))
    wa, name_a = final_weights(stack, job_a)
    wb, name_b = final_weights(stack, job_b)
    assert name_a == name_b and wa.keys() == wb.keys()
    for key in wa:
        assert wa[key].equal(wb[key]), key
    assert b.attempt == 0


def test_kill9_trainer_then_worker_resumes_from_checkpoint(make_stack, api):
    stack = make_stack("embedded", fake_trainer=False)
    stack.start_reaper()
    worker = stack.start_worker()
    client = api(stack)
    job_id = submit(client, {**OVERRIDES, "optim": {"max_steps": 8}, "checkpoints": {"every_steps": 1}})
    pid0 = trainer_pid(stack, job_id, 0)
    stack.wait(job_id, lambda j: (j.latest_checkpoint_step or 0) >= 1, 120, "first checkpoint")
    os.kill(pid0, signal.SIGKILL)  # the trainer child: the supervisor requeues (attempt 1)
    pid1 = trainer_pid(stack, job_id, 1)
    first = stack.job(job_id).latest_checkpoint_step
    assert first < 8, "the run finished before it could be interrupted"
    stack.wait(job_id, lambda j: (j.latest_checkpoint_step or 0) > first, 120, "a checkpoint of attempt 1")
    os.kill(pid1, signal.SIGSTOP)  # freeze it mid-training, so the worker dies with the job unfinished
    assert stack.job(job_id).status == "running"
    os.killpg(worker.pid, signal.SIGKILL)  # the whole worker: its trainer dies with it, the reaper requeues
    worker.wait(timeout=10)
    stack.wait(job_id, lambda j: not alive(pid1), 10, "the trainer to die with its worker")
    stack.start_worker()
    job = stack.wait_status(job_id, "succeeded", "failed", timeout=300)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs())
    assert job.attempt == 2
    resumed = [e.message for e in stack.rows(JobEvent, job_id) if e.kind == "resumed"]
    assert any("SIGKILL" in m and "(attempt 1)" in m for m in resumed), resumed
    assert any("resumed from checkpoint step" in m and "(attempt 2)" in m for m in resumed), resumed
    total = job.progress["total_steps"]
    assert training_steps(stack, job_id) == list(range(1, total + 1))


def test_cancel_running_and_invalid_data(make_stack, api, tmp_path):
    stack = make_stack("embedded", fake_trainer=False)
    stack.start_worker()
    client = api(stack)
    bad = tmp_path / "bad.json"
    bad.write_text('[\n{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},\n'
                   '{"messages": [{"role": "user" "content": "x"}]}\n]\n')
    spec = json.loads(json.dumps(stack_spec()))
    spec["data"]["sources"] = [{"path": str(bad)}]
    spec["data"]["eval_samples"] = 0
    bad_job = stack.submit(spec)
    job = stack.wait_status(bad_job, "failed", "succeeded", timeout=90)
    assert job.status == "failed" and job.error_code == "data_invalid", (job.error_code, job.error_message)
    assert "line 3" in job.error_message and job.error_retryable is False
    assert job.phase in ("validating", "preparing_data", "building_vocab")

    # a run far longer than the test (it is cancelled): a short one can end between two polls
    job_id = submit(client, {**OVERRIDES, "optim": {"max_steps": 100_000, "epochs": 1000}})
    pid = trainer_pid(stack, job_id, 0)
    stack.wait(job_id, lambda j: j.phase == "training", 120, "training")
    r = client.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled"), r.text
    job = stack.wait_status(job_id, "cancelled", "failed", "succeeded", timeout=60)
    assert job.status == "cancelled" and job.lease_owner is None
    assert not alive(pid)


def stack_spec():
    from peagle.spec import preset

    spec = preset("tiny").model_dump(mode="json")
    spec["data"]["eval_samples"] = 0
    spec["optim"]["max_steps"] = 6
    spec["checkpoints"]["every_steps"] = 2
    spec["eval"]["prompt_sets"] = []
    return spec


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server on a free port (never the shared one), restartable."""

    def __init__(self, tmp):
        self.port, self.tmp, self.proc = _free_port(), tmp, None

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self):
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.tmp)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        import redis

        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    break
            time.sleep(0.05)
        client.close()

    def kill(self):
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_postgres_redis_end_to_end_survives_redis_restart(make_stack, api, postgres_url, tmp_path):
    import redis

    server = RedisServer(tmp_path)
    server.start()
    try:
        stack = make_stack("services", fake_trainer=False, redis_url=server.url)
        stack.start_reaper()
        stack.start_worker()
        client = api(stack)
        # long enough that training is still running when Redis comes back, even on a quiet machine
        job_id = submit(client, {**OVERRIDES, "optim": {"max_steps": 400, "epochs": 1000},
                                 "checkpoints": {"every_steps": 100}})
        wakeups, stop = [], threading.Event()

        def listen():  # a live-channel listener that reconnects, as the API's does
            while not stop.is_set():
                try:
                    conn = redis.Redis.from_url(server.url, socket_timeout=1)
                    pubsub = conn.pubsub()
                    pubsub.subscribe(f"peagle:job:{job_id}")
                    while not stop.is_set():
                        msg = pubsub.get_message(timeout=0.5)
                        if msg and msg["type"] == "message":
                            wakeups.append((time.monotonic(), json.loads(msg["data"])))
                except (redis.RedisError, OSError):
                    time.sleep(0.2)

        thread = threading.Thread(target=listen, daemon=True)
        thread.start()
        stack.wait(job_id, lambda j: j.phase == "training", 120, "training")
        server.kill()  # Redis (broker + live channel) goes away mid-job ...
        time.sleep(2)
        restarted = time.monotonic()
        server.start()  # ... and comes back empty
        # returns as soon as the job ends; the bound only has to hold 400 real steps on a busy machine
        # (150 s was too short when another training job shared the 2 cores)
        job = stack.wait_status(job_id, "succeeded", "failed", timeout=600)
        stop.set()
        thread.join(timeout=5)
        assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs())
        total = job.progress["total_steps"]
        assert training_steps(stack, job_id) == list(range(1, total + 1))
        after = [w for t, w in wakeups if t > restarted]
        assert after, "no live wake-up after Redis came back"
        assert after[-1]["status"] == "succeeded" and after[-1]["metric_seq"] == job.metric_seq
        r = client.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 1000})
        assert r.status_code == 200, r.text
    finally:
        server.kill()
