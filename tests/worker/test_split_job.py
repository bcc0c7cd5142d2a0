"""Issue 37 end to end: one job across workers (slow: real SmolLM2 in vLLM, real Celery processes).

One stack for the module: PostgreSQL, Redis (broker and live channel), two engine workers
(`python -m worker --role engine`) and one trainer worker (`--role trainer`) sharing the artifact folder.

- A job with `resources.engine` (replicas 2, regeneration and capture online in vLLM) runs through; its
  regeneration and capture chunks ran on the engine workers (the `engine_task` table; the trainer generated
  no answer and started no engine), the trainer read every micro-batch once in order (`consumed.log`), and
  its first-step loss and exported weights equal the same spec without `resources.engine`, run whole by one
  worker.
- Warm engines: with one chunk at a time (replicas 1), every capture chunk after the first goes to the
  worker-direct queue of the engine worker that ran the previous one, so all ran on that worker (FIFO on the
  shared queue would alternate between the two idle workers), and it started its capture engine once.
- kill -9 of the trainer worker (its whole process group) once a checkpoint exists: the reaper requeues the
  job, a new trainer worker resumes it exactly (`consumed.log`: the killed attempt's micro-batches, then
  exactly those from the resumed checkpoint's to the last, each once and in order), its final weights equal
  the same spec run whole by one worker without a kill, and no vLLM process is left.
- kill -9 of an engine worker mid-chunk: another one redoes the chunk, the job succeeds, the trainer read
  every micro-batch once in order, the killed worker's engine died with it. A cancel during capture: the job
  is cancelled, its chunks stopped, and no engine is left.
- kill -9 of an engine worker frozen mid-way through a regeneration chunk (some answers written): another
  one redoes the chunk, continuing from the answers in the chunk's file, the job succeeds, every
  conversation is answered once (chunk files and the trainer's cache), the killed worker's engine died.
"""

from __future__ import annotations

import json
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
from tests.waiting import descendants, gone
from tests.worker.conftest import Stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]


class SplitStack(Stack):
    """The module's stack, with the trainer worker its tests kill."""

    trainer: Any  # the trainer worker


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres_admin_url: str, redis_url: str) -> Iterator[SplitStack]:
    from peagle.engine.locate import vllm_python

    if vllm_python() is None:
        pytest.skip("vLLM venv missing: run `make vllm-env` (builds .vllm-venv)")
    import psycopg

    name = f"peagle_test_{uuid.uuid4().hex[:12]}"
    plain = postgres_admin_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    st = SplitStack(tmp_path_factory.mktemp("split"), database_url=f"{postgres_admin_url.rsplit('/', 1)[0]}/{name}",
               broker_url=redis_url, redis_url=redis_url, fake_trainer=False)
    st.env["PEAGLE_ENGINE_KEEP_WARM_SECONDS"] = "20"
    st.env["PEAGLE_ENGINE_CHUNK_RESEND_SECONDS"] = "60"  # a lost chunk message costs a minute, not ten
    try:
        start_role(st, "engine", 0)
        start_role(st, "engine", 1)
        st.trainer = start_role(st, "trainer", 0)
        yield st
    finally:
        st.close()
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


def split_spec(engine: bool, steps: int = 4, regen: bool = False, *, every: int | None = None, max_restarts: int = 0,
               replicas: int = 2, skip: int = 0, disk_gb: float = 20.0, dtype: str = "auto") -> dict[str, Any]:
    """A small SmolLM2 job on 16 conversations (after the first `skip`), capture online in vLLM (with `regen`,
    its answers regenerated in vLLM first); with `engine`, split over engine workers (`replicas` chunks at
    once, `disk_gb` of features ahead of the trainer); a checkpoint `every` steps (default only at the end);
    the target in `dtype`."""
    from peagle.spec import parse_spec, preset

    spec = preset("demo").model_dump(mode="json")
    spec["data"].update(sources=[{"path": "builtin:sharegpt", "max_samples": 16, "skip": skip, "format": "auto"}],
                        max_length=192, eval_samples=2)
    spec["target"]["dtype"] = dtype
    spec["data"]["regenerate"].update(enabled=regen, engine="vllm", max_new_tokens=12)
    spec["draft"].update(num_layers=1, draft_vocab_size=2048)
    spec["peagle"]["num_depths"] = 3
    spec["optim"].update(max_steps=steps, pack_length=256, epochs=max(1, steps // 2))
    spec["checkpoints"].update(every_steps=every or steps)
    spec["eval"].update(prompt_sets=[], serve_check=False, engine="auto", al_every_steps=None)
    spec["resources"].update(target_engine="vllm", capture="online", max_restarts=max_restarts, feature_disk_gb=disk_gb)
    if engine:
        spec["resources"]["engine"] = {"replicas": replicas}
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
    run = stack.settings.resolved_artifact_root() / job_id
    return dict(json.loads((run / "data" / "report.json").read_text())["regeneration"])


def test_split_job_equals_one_worker(stack):
    # float32: in bfloat16, vLLM's greedy answers depend on which conversations share a batch on some CPUs
    # (2-core Xeon with AMX: 5 of 15 answers differed from the one-worker run's, docs/service.md 9)
    split = stack.submit(split_spec(engine=True, regen=True, dtype="float32"))
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

    one = stack.submit(split_spec(engine=False, regen=True, dtype="float32"))  # the same spec, whole, one worker
    finished(stack, one)
    assert not rows_of(stack, one)
    assert regen_report(stack, one)["generated"] > 0
    assert first_loss(stack, split) == first_loss(stack, one)
    a, b = weights(run), weights(stack.settings.resolved_artifact_root() / one)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def engine_starts(stack: Stack, job_id: str, worker: str) -> int:
    """How many times `worker` started a vLLM engine for `job_id` (each start appends its banner to the
    worker's engine log in the job's folder)."""
    log = stack.settings.resolved_artifact_root() / job_id / "logs" / f"engine-{worker.replace(':', '-')}.log"
    return log.read_text(errors="replace").count("Initializing a V1 LLM engine") if log.exists() else 0


def test_chunks_go_to_the_warm_engine_worker(stack):
    job_id = stack.submit(split_spec(engine=True, steps=8, replicas=1))
    finished(stack, job_id)
    tasks = rows_of(stack, job_id)
    capture = [t for t in tasks if t.kind == "capture"]
    assert len(capture) >= 3 and all(t.state == "done" for t in tasks), [(t.kind, t.index, t.state) for t in tasks]
    # the first chunk went to the shared queue, every later one to the worker-direct queue of the warm worker
    assert len({t.worker for t in capture}) == 1, [(t.index, t.worker) for t in capture]
    # its capture engine started at most once for the job (none: still warm from an earlier job of the same
    # engine configuration)
    assert engine_starts(stack, job_id, capture[0].worker) <= 1
    assert consumed(stack, job_id) == list(range(8))


def complete_checkpoints(run: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*/COMPLETE"))


def requeue_lapsed(stack: Stack, job_id: str, timeout: float = 60) -> None:
    """Reaper passes (`worker.reaper.reap_once`, as every worker's reaper runs them) until the job whose worker
    died is requeued and its message sent."""
    from service.queue import make_producer
    from worker.reaper import reap_once

    producer = make_producer(stack.settings)
    try:
        deadline = time.monotonic() + timeout
        while not any(a.job_id == job_id for a in reap_once(stack.factory, producer)):
            assert time.monotonic() < deadline, f"the reaper did not requeue {job_id}: {stack.logs()[-4000:]}"
            time.sleep(0.2)
    finally:
        producer.close()


def test_kill_the_trainer_worker_resumes_exactly(stack, processes_mentioning):
    # chunks of 3 micro-batches (1.5 MB each) and 4 MB ahead of the trainer: chunks are in flight, released
    # as the trainer reads, when its worker dies
    steps, every, disk_gb = 24, 2, 0.004
    job_id = stack.submit(split_spec(engine=True, steps=steps, every=every, max_restarts=1, disk_gb=disk_gb))
    run = stack.settings.resolved_artifact_root() / job_id
    deadline = time.monotonic() + 900
    while not complete_checkpoints(run):  # a checkpoint exists mid-training
        assert time.monotonic() < deadline and stack.job(job_id).status in ("queued", "running"), stack.logs()[-4000:]
        time.sleep(0.02)
    trainer = stack.trainer_pid(job_id, 0)
    os.kill(trainer, signal.SIGSTOP)  # it stays mid-training until the kill (SIGKILL ends a stopped process)
    assert complete_checkpoints(run)[-1] < steps, "the run finished before it could be interrupted"
    os.killpg(stack.trainer.pid, signal.SIGKILL)  # the trainer worker as a crash kills it: its whole group
    stack.trainer.wait(timeout=30)
    deadline = time.monotonic() + 60
    while not gone(trainer):  # the trainer dies with its supervisor (parent-death signal)
        assert time.monotonic() < deadline, f"trainer {trainer} survived its worker"
        time.sleep(0.05)
    before = consumed(stack, job_id)  # what the killed attempt read (the log does not change any more)
    resumed_at = complete_checkpoints(run)[-1]  # what `--resume auto` takes: the newest complete checkpoint
    assert stack.job(job_id).status == "running"

    requeue_lapsed(stack, job_id)
    stack.trainer = start_role(stack, "trainer", 1)
    job = finished(stack, job_id)
    assert job.attempt == 1
    # Exact resume (grad_accumulation 1, micro_batch_size 1: micro-batch j is step j's): the killed attempt read
    # 0..k in order; the resumed one read exactly the micro-batches from its checkpoint's, `resumed_at`, to the
    # last, each once, in order: the log is the killed attempt's run followed by range(resumed_at, steps).
    assert before == list(range(len(before))) and 0 < resumed_at <= len(before) < steps, (before, resumed_at)
    assert consumed(stack, job_id) == before + list(range(resumed_at, steps))
    # the killed attempt read stream 1; the resumed one's stream starts at its checkpoint's micro-batch (stream
    # 2, no chunk captured from 0 for nothing while the held-out chunks ran, then stream 3 from `resumed_at`)
    assert max(r.generation for r in rows_of(stack, job_id) if r.kind == "capture") == 2
    assert not list((run / "data" / "features" / "remote").glob("mb_*"))

    one = stack.submit(split_spec(engine=False, steps=steps, every=every, max_restarts=1, disk_gb=disk_gb))  # one worker
    finished(stack, one)
    a, b = weights(run), weights(stack.settings.resolved_artifact_root() / one)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    # no vLLM process is left: the engine workers' warm engines stop after their keep-warm time, the one-worker
    # run's engine with its trainer
    markers = [str(stack.settings.home.resolve() / "engine"), str(stack.settings.resolved_artifact_root() / one)]
    deadline = time.monotonic() + 120
    while any(processes_mentioning(m) for m in markers):
        assert time.monotonic() < deadline, f"vLLM left running: {[processes_mentioning(m) for m in markers]}"
        time.sleep(0.5)


def running_chunk(stack: Stack, job_id: str, timeout: float = 900) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in rows_of(stack, job_id):
            if r.kind == "capture" and r.state == "running":
                return r
        time.sleep(0.05)
    raise AssertionError(f"no running capture chunk: {stack.logs()[-4000:]}")


def test_kill_an_engine_worker_then_cancel(stack, processes_mentioning):
    job_id = stack.submit(split_spec(engine=True, steps=40))
    remote = stack.settings.resolved_artifact_root() / job_id / "data" / "features" / "remote"
    lost, pid = None, 0
    deadline = time.monotonic() + 900
    while lost is None:  # a capture chunk running on an engine worker with its engine up, frozen before its end
        # (whichever worker: the one whose engine is warm from the tests before takes most chunks, maybe all)
        assert time.monotonic() < deadline and stack.job(job_id).status in ("queued", "running"), stack.logs()[-4000:]
        for r in rows_of(stack, job_id):
            pid = int(r.worker.rsplit(":", 1)[1]) if r.worker else 0  # the main process runs chunks (solo pool)
            if r.kind != "capture" or r.state != "running" or not processes_mentioning(f"capture-{pid}"):
                continue
            os.kill(pid, signal.SIGSTOP)  # it writes nothing more until the kill
            if (remote / f"chunk_{r.index:06d}.done").exists():
                os.kill(pid, signal.SIGCONT)  # the chunk ended meanwhile: look again
                continue
            lost = r
            break
        time.sleep(0.05)
    os.killpg(pid, signal.SIGKILL)  # the worker's group (a stopped process dies of SIGKILL too)
    finished(stack, job_id)
    redone = next(r for r in rows_of(stack, job_id) if r.kind == "capture" and r.index == lost.index)
    assert redone.state == "done" and not redone.worker.endswith(f":{pid}") and redone.attempts >= 2
    assert consumed(stack, job_id) == list(range(40))
    assert not processes_mentioning(f"capture-{pid}")  # the killed worker's engine died with it

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



def test_kill_an_engine_worker_during_regeneration(stack):
    from peagle.split.protocol import read_regen_plan, regen_dir

    # conversations no earlier test regenerated (the owner's regeneration cache has none of them); as many
    # chunks in flight as there are live engine workers, so that idle ones take chunks from the shared queue
    job_id = stack.submit(split_spec(engine=True, regen=True, skip=16, replicas=2))
    d = regen_dir(stack.settings.resolved_artifact_root() / job_id)
    deadline = time.monotonic() + 900
    victim = None
    while victim is None:  # an engine worker has answered part of its regeneration chunk
        assert time.monotonic() < deadline and stack.job(job_id).status in ("queued", "running"), stack.logs()[-4000:]
        plan = read_regen_plan(d)
        for r in rows_of(stack, job_id):
            if r.kind == "regenerate" and r.state == "running" and plan is not None:
                answers = d / f"chunk_{r.index:06d}" / f"{plan['group']}.jsonl"
                if answers.exists() and answers.read_text().strip():
                    victim = r
        time.sleep(0.05)
    pid = int(victim.worker.rsplit(":", 1)[1])  # the engine worker's main process runs its chunks (solo pool)
    os.kill(pid, signal.SIGSTOP)  # frozen mid-chunk until the kill: it writes no more answers, no marker
    assert not (d / f"chunk_{victim.index:06d}.done").exists(), "the chunk ended before the kill"
    engines = descendants(pid)  # its generation engine (vllm serve and its engine core)
    assert engines, "the engine worker runs no engine"
    os.killpg(pid, signal.SIGKILL)
    finished(stack, job_id)
    redone = next(r for r in rows_of(stack, job_id) if r.kind == "regenerate" and r.index == victim.index)
    assert redone.state == "done" and redone.worker != victim.worker and redone.attempts >= 2
    deadline = time.monotonic() + 60
    while any(not gone(p) for p in engines):  # the killed worker's engine died with it
        assert time.monotonic() < deadline, f"engine processes {sorted(engines)} survived their worker"
        time.sleep(0.2)
    # every conversation answered exactly once: in the chunks' files and in the trainer's cache
    plan = read_regen_plan(d)
    assert plan is not None
    keys: list[str] = []
    for i in range(len(plan["chunks"])):
        for line in (d / f"chunk_{i:06d}" / f"{plan['group']}.jsonl").read_text().splitlines():
            try:
                keys.append(json.loads(line)["key"])
            except ValueError:
                continue  # a line the killed worker left half-written
    assert keys and len(keys) == len(set(keys)), sorted(keys)  # the redone chunk continued, answering no one twice
    rep = regen_report(stack, job_id)  # the trainer found every answer in its cache (merged from the chunks)
    assert rep["generated"] == 0 and rep["cached"] >= len(keys), rep
    cached = [json.loads(x)["key"] for x in Path(rep["cache_file"]).read_text().splitlines() if x.strip()]
    assert set(keys) <= set(cached) and len(cached) == len(set(cached))
