"""Issue 20 in the browser: a dataset that cannot train cannot be picked and the dry run says why; the
Logs panel of a job shows what a real trainer run logs (phase changes, step lines)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, Server

pytestmark = pytest.mark.e2e


def test_invalid_dataset_cannot_be_picked_and_dry_run_says_why(page: object, tmp_path: Path) -> None:
    data = tmp_path / "broken.jsonl"
    data.write_text("{not json\n{still not json\n")
    pg = page
    pg.goto("/new.html")
    pg.wait_for_function("document.querySelector('#raw').value.includes('tiny-llama')")
    pg.get_by_label("Dataset file (ShareGPT JSON/JSONL, messages JSONL or tokenised JSONL)").set_input_files(str(data))
    pg.get_by_role("button", name="Upload & validate").click()
    report = pg.locator("#ds-report .error-box")
    report.wait_for(timeout=60_000)
    assert "invalid" in report.inner_text()
    use = report.get_by_role("button", name="Use for training")
    assert use.is_disabled()
    assert "Not usable for training" in report.get_by_role("note").inner_text()
    ds_id = report.locator("dd.mono").inner_text().strip()

    # named by hand anyway: the dry run answers `valid: false` and the problem shows at the field
    field = pg.get_by_label("Training data")
    field.fill(f"dataset:{ds_id}")
    pg.get_by_role("button", name="Validate and estimate (dry run)").click()
    err = pg.locator(".field", has=field).locator(".field-error")
    err.wait_for()
    pg.wait_for_function("document.querySelector('#result').textContent.includes('problem')")
    assert ds_id in err.inner_text() and "invalid" in err.inner_text()
    assert pg.locator(".estimate").count() == 0


def _real_run_progress(tmp_path: Path) -> list[str]:
    """`peagle train` of the tiny preset (6 steps, no AL pass): its RUN/progress.jsonl lines."""
    from peagle.spec import preset

    spec = preset("tiny").model_dump(mode="json")
    spec["data"]["eval_samples"] = 0
    spec["optim"]["max_steps"] = 6
    spec["checkpoints"]["every_steps"] = 6
    spec["eval"]["prompt_sets"] = []
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "peagle", "train", str(tmp_path / "spec.json"), "--out", str(run)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (run / "progress.jsonl").read_text().splitlines()


def test_logs_panel_shows_a_real_runs_progress(page: object, server: Server, feeder: object,
                                               tmp_path: Path) -> None:
    lines = _real_run_progress(tmp_path)
    with server.client() as c:
        r = c.post("/v1/jobs", json={"preset": "tiny", "overrides": {"name": "logs"}})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
    feeder.claim(job_id)  # type: ignore[attr-defined]
    pg = page
    pg.goto(f"/job.html?id={job_id}")
    pg.locator(".chip.running").first.wait_for()
    feeder.replay(job_id, lines)  # type: ignore[attr-defined]  # live, no reload
    logs = pg.locator("#logs")
    logs.get_by_text("phase training", exact=False).first.wait_for()
    logs.get_by_text(re.compile(r"step 6/6 \(100%\) loss [0-9.]+")).first.wait_for()
    text = logs.inner_text()
    assert re.search(r"step 1/6 \(16%\) loss [0-9.]+", text), text
    assert "phase done" in text, text
