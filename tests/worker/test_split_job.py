"""Issue 37 end to end: one job across workers (slow: real SmolLM2 in vLLM, real Celery processes).

Two engine workers (`python -m worker --role engine`) and one trainer worker (`--role trainer`) share the
database, the broker and the artifact folder: a job with `resources.engine` (replicas 2, capture online)
runs through; its chunks ran on both engine workers (the `engine_task` table), the trainer read every
micro-batch once in order (`consumed.log`), and its first-step loss and exported weights equal the same
spec without `resources.engine` run by one `all` worker. Nothing of any engine is left afterwards.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from service.db.engine_tasks import task_rows
from service.db.models import JobMetric
from service.db.session import session_scope

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _need_vllm() -> None:
    from peagle.engine.locate import vllm_python

    if vllm_python() is None:
        pytest.skip("vLLM venv missing: run `make vllm-env` (builds .vllm-venv)")


def split_spec(engine: bool) -> dict[str, Any]:
    """A small SmolLM2 job, capture online in vLLM; with `engine`, split over engine workers."""
    from peagle.spec import parse_spec, preset

    spec = preset("demo").model_dump(mode="json")
    spec["data"].update(sources=[{"path": "builtin:sharegpt", "max_samples": 16, "skip": 0, "format": "auto"}],
                        max_length=192, eval_samples=2)
    spec["data"]["regenerate"]["enabled"] = False
    spec["draft"].update(num_layers=1, draft_vocab_size=2048)
    spec["peagle"]["num_depths"] = 3
    spec["optim"].update(max_steps=4, pack_length=256)
    spec["checkpoints"].update(every_steps=4)
    spec["eval"].update(prompt_sets=[], serve_check=False, engine="auto", al_every_steps=None)
    spec["resources"].update(target_engine="vllm", capture="online", max_restarts=0)
    if engine:
        spec["resources"]["engine"] = {"replicas": 2}
    return parse_spec(spec).model_dump(mode="json")


def start_role(stack: Any, role: str, n: int) -> Any:
    return stack._spawn(["-m", "worker", "--role", role, "--queue", stack.queue, "--no-reaper",
                         "--hostname", f"{role}{n}-{stack.queue}@localhost"], f"{role}-worker")


def first_loss(stack: Any, job_id: str) -> float:
    rows = sorted(stack.rows(JobMetric, job_id), key=lambda m: m.step)
    return float(next(m.values["loss"] for m in rows if "loss" in m.values))


def weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "export" / "model.safetensors"))


def test_split_job_equals_one_worker(make_stack, processes_mentioning):
    stack = make_stack("embedded", fake_trainer=False)
    t0 = time.monotonic()
    for n in range(2):
        start_role(stack, "engine", n)
    start_role(stack, "trainer", 0)
    split = stack.submit(split_spec(engine=True))
    job = stack.wait_status(split, "succeeded", "failed", "cancelled", timeout=1500)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs()[-6000:])
    run = stack.settings.resolved_artifact_root() / split
    with session_scope(stack.factory) as s:
        tasks = task_rows(s, split)
        s.expunge_all()
    capture = [t for t in tasks if t.kind == "capture"]
    assert capture and all(t.state == "done" for t in capture), [(t.index, t.state, t.error) for t in tasks]
    assert len({t.worker for t in tasks}) == 2, "chunks did not spread over both engine workers"
    consumed = [int(x) for x in (run / "data" / "features" / "remote" / "consumed.log").read_text().split()]
    assert consumed == list(range(len(consumed))) and consumed
    assert not list((run / "data" / "features" / "remote").glob("mb_*"))  # every consumed file deleted
    split_s = time.monotonic() - t0
    for p in stack.procs:  # the engine workers keep their engines warm: stop them, nothing may be left
        p.terminate()
    for p in stack.procs:
        p.wait(timeout=120)
    engines = str(stack.settings.home.resolve() / "engine")  # every capture engine's storage folder is there
    deadline = time.monotonic() + 60
    while (left := processes_mentioning(engines)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left

    start_role(stack, "all", 0)
    one = stack.submit(split_spec(engine=False))
    job = stack.wait_status(one, "succeeded", "failed", "cancelled", timeout=1500)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs()[-6000:])
    assert first_loss(stack, split) == first_loss(stack, one)
    a, b = weights(run), weights(stack.settings.resolved_artifact_root() / one)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)
    print(f"split job {split_s:.0f} s, whole test {time.monotonic() - t0:.0f} s")


def _rows(stack: Any, job_id: str) -> list[Any]:
    with session_scope(stack.factory) as s:
        rows = task_rows(s, job_id)
        s.expunge_all()
    return rows


def _wait_running_chunk(stack: Any, job_id: str, pid: int | None = None, timeout: float = 900) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in _rows(stack, job_id):
            if r.kind == "capture" and r.state == "running" and (pid is None or r.worker.endswith(f":{pid}")):
                return r
        time.sleep(0.1)
    raise AssertionError(f"no running capture chunk{'' if pid is None else f' on {pid}'}: {stack.logs()[-4000:]}")


def test_kill_an_engine_worker_then_cancel(make_stack, processes_mentioning):
    """kill -9 of an engine worker mid-chunk: another redoes the chunk, the job succeeds, the trainer read
    every micro-batch once in order, the killed worker's engine is gone. Then a cancel during capture:
    the job is cancelled, its chunks stopped, no engine left."""
    import signal

    stack = make_stack("embedded", fake_trainer=False)
    engines = str(stack.settings.home.resolve() / "engine")
    victim = start_role(stack, "engine", 0)
    start_role(stack, "engine", 1)
    start_role(stack, "trainer", 0)
    spec = split_spec(engine=True)
    spec["optim"].update(max_steps=40, epochs=20)
    spec["checkpoints"]["every_steps"] = 40
    job_id = stack.submit(spec)
    deadline = time.monotonic() + 900  # the victim has done a chunk (its engine is warm) and runs another
    while not any(r.state == "done" and r.worker.endswith(f":{victim.pid}") for r in _rows(stack, job_id)):
        assert time.monotonic() < deadline, stack.logs()[-4000:]
        time.sleep(0.2)
    lost = _wait_running_chunk(stack, job_id, victim.pid)
    victim_engines = [p for p in processes_mentioning(f"capture-{victim.pid}")]
    assert victim_engines, "the victim's engine is not running"
    os.killpg(victim.pid, signal.SIGKILL)
    job = stack.wait_status(job_id, "succeeded", "failed", "cancelled", timeout=1500)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs()[-6000:])
    redone = next(r for r in _rows(stack, job_id) if r.kind == "capture" and r.index == lost.index)
    assert redone.state == "done" and not redone.worker.endswith(f":{victim.pid}") and redone.attempts == 2
    run = stack.settings.resolved_artifact_root() / job_id
    consumed = [int(x) for x in (run / "data" / "features" / "remote" / "consumed.log").read_text().split()]
    assert consumed == list(range(40)), consumed
    assert not processes_mentioning(f"capture-{victim.pid}")  # the killed worker's engine died with it

    start_role(stack, "engine", 2)
    spec["optim"].update(max_steps=400, epochs=200)
    spec["checkpoints"]["every_steps"] = 400
    job_id = stack.submit(spec)
    _wait_running_chunk(stack, job_id)
    stack.act(job_id, "cancel")
    job = stack.wait_status(job_id, "cancelled", "failed", "succeeded", timeout=300)
    assert job.status == "cancelled", (job.error_code, job.error_message)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (any(r.state in ("sent", "running") for r in _rows(stack, job_id))
                                           or processes_mentioning(engines)):
        time.sleep(0.5)
    assert not any(r.state in ("sent", "running") for r in _rows(stack, job_id))
    assert not processes_mentioning(engines), "an engine survived the cancel"
