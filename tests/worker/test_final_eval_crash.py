"""A trainer killed (SIGKILL) during the final `evaluating` phase: the job resumes (attempt 1) without
starting capture or training again (training was complete), and the final evaluation's metric record is
stored, once. Real worker, real trainer (`python -m peagle train`, tiny preset), SQLite + filesystem broker."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from peagle.spec import preset
from service.db.models import JobEvent, JobMetric

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _phases(path: Path) -> list[str]:
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if '"phase"' in line:
            rec = json.loads(line)
            if rec.get("kind") == "phase":
                out.append(rec["phase"])
    return out


def test_kill_during_evaluating_resumes_into_evaluation_and_keeps_its_record(
        make_stack: Any, tiny_target_path: Path) -> None:
    stack = make_stack("embedded", fake_trainer=False)
    stack.start_worker()
    spec = preset("tiny").model_dump(mode="json")
    spec["optim"]["max_steps"] = 6
    spec["checkpoints"]["every_steps"] = 3
    spec["eval"]["prompt_sets"] = [{"name": "humaneval", "num_prompts": 4}]
    spec["eval"]["max_new_tokens"] = 16
    spec["resources"]["max_restarts"] = 2
    job_id = stack.submit(spec)
    pid = stack.trainer_pid(job_id, 0, timeout=120)
    progress = stack.settings.resolved_artifact_root() / job_id / "progress.jsonl"
    deadline, polls = time.monotonic() + 300, 0
    while "evaluating" not in _phases(progress):
        polls += 1
        if polls % 100 == 0:  # the job ended, or it takes too long: say why
            job = stack.job(job_id)
            assert job.status == "running" and time.monotonic() < deadline, \
                (job.status, job.phase, job.error_code, job.error_message, stack.logs())
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)  # the trainer, during the final evaluation
    assert "exporting" not in _phases(progress), "the evaluation ended before the kill"

    job = stack.wait_status(job_id, "succeeded", "failed", timeout=300)
    assert job.status == "succeeded", (job.error_code, job.error_message, stack.logs())
    assert job.attempt == 1
    resumed = [e.message for e in stack.rows(JobEvent, job_id) if e.kind == "phase" and e.attempt == 1]
    assert resumed and not any("capturing" in m or "training" in m.split(":")[0] for m in resumed), resumed
    phases = [e.phase for e in stack.rows(JobEvent, job_id) if e.kind == "phase" and e.attempt == 1]
    assert "evaluating" in phases and "capturing" not in phases and "training" not in phases, phases

    rows = stack.rows(JobMetric, job_id)
    final = [m for m in rows if "num_speculative_tokens" in m.values]  # only the final evaluation has it
    assert len(final) == 1 and final[0].attempt == 1, [(m.step, m.attempt, sorted(m.values)) for m in rows]
    assert final[0].values["acceptance_length"] >= 1.0 and final[0].step == 6
    # its AL is not stored a second time as a record of its own (evaluate_run prints it as a metric too)
    again = [m for m in rows if "acceptance_length" in m.values and "loss" not in m.values and m.epoch is not None]
    assert [m.seq for m in again] == [final[0].seq], [(m.seq, m.step, m.epoch, sorted(m.values)) for m in again]
