"""Issue 37 end to end: one job across workers (slow: real SmolLM2 in vLLM, real Celery processes).

One stack for the module: PostgreSQL, Redis (broker and live channel), two engine workers
(`python -m worker --role engine`) and one trainer worker (`--role trainer`) sharing the artifact folder.

- A job with `resources.engine` (replicas 2, regeneration and capture online in vLLM) runs through; its
  regeneration and capture chunks ran on the engine workers (the `engine_task` table; the trainer generated
  no answer and started no engine), the trainer read every micro-batch once in order (`consumed.log`), and
  its first-step loss and exported weights equal the same spec without `resources.engine`, run whole by one
  worker.
- kill -9 of an engine worker mid-chunk: another one redoes the chunk, the job succeeds, the trainer read
  every micro-batch once in order, the killed worker's engine died with it. A cancel during capture: the job
  is cancelled, its chunks stopped, and no engine is left.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from service.db.engine_tasks import task_rows
from service.db.models import JobMetric
from service.db.session import session_scope
from tests.worker.conftest import Stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres_admin_url: str, redis_url: str) -> Iterator[Stack]:
    from peagle.engine.locate import vllm_python

    if vllm_python() is None:
        pytest.skip("vLLM venv missing: run `make vllm-env` (builds .vllm-venv)")
    import psycopg

    name = f"peagle_test_{uuid.uuid4().hex[:12]}"
    plain = postgres_admin_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    st = Stack(tmp_path_factory.mktemp("split"), database_url=f"{postgres_admin_url.rsplit('/', 1)[0]}/{name}",
               broker_url=redis_url, redis_url=redis_url, fake_trainer=False)
    st.env["PEAGLE_ENGINE_KEEP_WARM_SECONDS"] = "20"
    st.env["PEAGLE_ENGINE_CHUNK_RESEND_SECONDS"] = "60"  # a lost chunk message costs a minute, not ten
    try:
        st.victim = start_role(st, "engine", 0)
        start_role(st, "engine", 1)
        start_role(st, "trainer", 0)
        yield st
    finally:
        st.close()
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


def split_spec(engine: bool, steps: int = 4, regen: bool = False) -> dict[str, Any]:
    """A small SmolLM2 job, capture online in vLLM (with `regen`, its answers regenerated in vLLM first);
    with `engine`, split over engine workers."""
    from peagle.spec import parse_spec, preset

    spec = preset("demo").model_dump(mode="json")
    spec["data"].update(sources=[{"path": "builtin:sharegpt", "max_samples": 16, "skip": 0, "format": "auto"}],
                        max_length=192, eval_samples=2)
    spec["data"]["regenerate"].update(enabled=regen, engine="vllm", max_new_tokens=12)
    spec["draft"].update(num_layers=1, draft_vocab_size=2048)
    spec["peagle"]["num_depths"] = 3
    spec["optim"].update(max_steps=steps, pack_length=256, epochs=max(1, steps // 2))
    spec["checkpoints"].update(every_steps=steps)
    spec["eval"].update(prompt_sets=[], serve_check=False, engine="auto", al_every_steps=None)
    spec["resources"].update(target_engine="vllm", capture="online", max_restarts=0)
    if engine:
        spec["resources"]["engine"] = {"replicas": 2}
    return parse_spec(spec).model_dump(mode="json")


def start_role(stack: Stack, role: str, n: int) -> Any:
    return stack._spawn(["-m", "worker", "--role", role, "--queue", stack.queue, "--no-reaper",
                         "--hostname", f"{role}{n}-{stack.queue}@localhost"], f"{role}-worker")


def rows_of(stack: Stack, job_id: str) -> list[Any]:
    with session_scope(stack.factory) as s:
        rows = task_rows(s, job_id)
        s.expunge_all()
    return rows


def consumed(stack: Stack, job_id: str) -> list[int]:
    run = stack.settings.resolved_artifact_root() / job_id
    return [int(x) for x in (run / "data" / "features" / "remote" / "consumed.log").read_text().split()]


def first_loss(stack: Stack, job_id: str) -> float:
    rows = sorted(stack.rows(JobMetric, job_id), key=lambda m: m.step)
    return float(next(m.values["loss"] for m in rows if "loss" in m.values))


def weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "export" / "model.safetensors"))


def finished(stack: Stack, job_id: str, status: str = "succeeded") -> Any:
    job = stack.wait_status(job_id, "succeeded", "failed", "cancelled", timeout=1500)
    assert job.status == status, (job.error_code, job.error_message, stack.logs()[-6000:])
    return job


def regen_report(stack: Stack, job_id: str) -> dict[str, Any]:
    import json

    run = stack.settings.resolved_artifact_root() / job_id
    return dict(json.loads((run / "data" / "report.json").read_text())["regeneration"])


def test_split_job_equals_one_worker(stack):
    split = stack.submit(split_spec(engine=True, regen=True))
    finished(stack, split)
    tasks = rows_of(stack, split)
    assert all(t.state == "done" for t in tasks), [(t.kind, t.index, t.state, t.error) for t in tasks]
    assert len({t.worker for t in tasks}) == 2, "chunks did not spread over both engine workers"
    regen = [t for t in tasks if t.kind == "regenerate"]
    assert len(regen) >= 2 and {t.kind for t in tasks} >= {"regenerate", "capture"}
    assert consumed(stack, split) == list(range(len(consumed(stack, split)))) != []
    run = stack.settings.resolved_artifact_root() / split
    assert not list((run / "data" / "features" / "remote").glob("mb_*"))  # every consumed file deleted
    # the trainer generated nothing itself: every answer came from the engine workers' chunks
    rep = regen_report(stack, split)
    assert rep["generated"] == 0 and rep["cached"] > 0, rep  # (a conversation with nothing to ask is not cached)
    assert not (run / "logs" / "engine-regenerate.log").exists()
    Path(rep["cache_file"]).unlink()  # the one-worker run regenerates on its own

    one = stack.submit(split_spec(engine=False, regen=True))  # the same spec run whole by one worker
    finished(stack, one)
    assert not rows_of(stack, one)
    assert regen_report(stack, one)["generated"] > 0
    assert first_loss(stack, split) == first_loss(stack, one)
    a, b = weights(run), weights(stack.settings.resolved_artifact_root() / one)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def running_chunk(stack: Stack, job_id: str, pid: int | None = None, timeout: float = 900) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in rows_of(stack, job_id):
            if r.kind == "capture" and r.state == "running" and (pid is None or r.worker.endswith(f":{pid}")):
                return r
        time.sleep(0.05)
    raise AssertionError(f"no running capture chunk{'' if pid is None else f' on {pid}'}: {stack.logs()[-4000:]}")


def test_kill_an_engine_worker_then_cancel(stack, processes_mentioning):
    victim = stack.victim
    job_id = stack.submit(split_spec(engine=True, steps=40))
    deadline = time.monotonic() + 900  # the victim runs a chunk on its (started) engine
    while not processes_mentioning(f"capture-{victim.pid}"):
        assert time.monotonic() < deadline, stack.logs()[-4000:]
        time.sleep(0.2)
    lost = running_chunk(stack, job_id, victim.pid)
    os.killpg(victim.pid, signal.SIGKILL)
    finished(stack, job_id)
    redone = next(r for r in rows_of(stack, job_id) if r.kind == "capture" and r.index == lost.index)
    assert redone.state == "done" and not redone.worker.endswith(f":{victim.pid}") and redone.attempts >= 2
    assert consumed(stack, job_id) == list(range(40))
    assert not processes_mentioning(f"capture-{victim.pid}")  # the killed worker's engine died with it

    start_role(stack, "engine", 2)
    job_id = stack.submit(split_spec(engine=True, steps=400))
    running_chunk(stack, job_id)
    stack.act(job_id, "cancel")
    finished(stack, job_id, "cancelled")
    engines = str(stack.settings.home.resolve() / "engine")  # every capture engine's storage folder is there
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (any(r.state in ("sent", "running") for r in rows_of(stack, job_id))
                                           or processes_mentioning(engines)):
        time.sleep(0.5)
    assert not any(r.state in ("sent", "running") for r in rows_of(stack, job_id))
    assert not processes_mentioning(engines), "an engine survived the cancel"
