"""Issue 20 (the first hour of a new user), dashboard details: each rough edge the user met, in a browser.

Jobs are fed through `feed.Feeder` (the worker's own write path); evaluation results are fed as the worker
stores them: their own metric record at the training step they follow (worker/progress.py).
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tests.e2e.conftest import Server
from tests.e2e.feed import metric_values

pytestmark = pytest.mark.e2e

_TRAIN_ONLY = ("eval_", "acceptance_length", "al_pos_")


def _create_job(server: Server, name: str, **overrides: object) -> str:
    with server.client() as c:
        r = c.post("/v1/jobs", json={"preset": "tiny", "overrides": {"name": name, **overrides}})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])


def _feed_as_worker(feeder: object, job_id: str, steps: int, *, total: int = 12) -> None:
    """Training records, then every 4th step an eval record of its own at the same step (as the trainer's
    `eval` events and the pipeline's AL become separate metric rows)."""
    now = datetime.now(UTC)
    rows: list[dict[str, object]] = []
    for s in range(1, steps + 1):
        values = metric_values(s, speed=4.0)
        train = {k: v for k, v in values.items() if not k.startswith(_TRAIN_ONLY)}
        rows.append({"step": s, "epoch": s / total, "values": train, "time": now})
        if s % 4 == 0:
            rows.append({"step": s, "epoch": None, "time": now,
                         "values": {"eval_loss": train["loss"] + 0.1, "eval_tau_sim": train["tau_sim"] * 0.9,
                                    "acceptance_length": 1.0 + s / 10}})
    progress = {"step": steps, "total_steps": total, "epoch": steps / total, "percent": 100.0 * steps / total,
                "seconds_remaining": 1.0}
    feeder.ingest(job_id, metrics=rows, progress=progress)  # type: ignore[attr-defined]


def test_eval_rows_at_a_training_step_are_drawn(page: object, server: Server, feeder: object) -> None:
    """Measured AL and eval loss are their own metric rows at a training step: the job page's AL chart and
    the compare page's 'Measured AL' / 'Eval loss' charts said 'no ... yet' while the table had the values."""
    a, b = _create_job(server, "eval rows A"), _create_job(server, "eval rows B")
    for job_id in (a, b):
        feeder.claim(job_id)  # type: ignore[attr-defined]
        feeder.phase(job_id, "training")  # type: ignore[attr-defined]
        _feed_as_worker(feeder, job_id, 12)
    pg = page
    pg.goto(f"/job.html?id={a}")
    pg.wait_for_function("window.__peagle && window.__peagle.ready")
    legend = pg.locator('[data-chart="al"] .u-legend .u-series').all_inner_texts()
    assert any("measured AL" in t for t in legend), legend
    assert pg.evaluate("window.__peagle.store.last('acceptance_length')") == pytest.approx(2.2)
    pg.goto(f"/compare.html?ids={a},{b}")
    pg.wait_for_function("document.querySelector('#compare').dataset.ready === '1'")
    for key in ("acceptance_length", "eval_loss"):
        chart = pg.locator(f'#compare [data-chart="{key}"]')
        assert chart.locator(".chart-empty").count() == 0, f"{key}: {chart.inner_text()}"
        assert chart.locator(".uplot").count() == 1, key


def test_step_axis_ticks_are_whole_steps(page: object, server: Server, feeder: object) -> None:
    """Early in a run (3 steps) the step axis showed 0.5-step ticks."""
    job_id = _create_job(server, "three steps")
    feeder.claim(job_id)  # type: ignore[attr-defined]
    feeder.phase(job_id, "training")  # type: ignore[attr-defined]
    feeder.metrics(job_id, range(1, 4), total_steps=12)  # type: ignore[attr-defined]
    pg = page
    pg.goto(f"/job.html?id={job_id}")
    pg.wait_for_function("window.__peagle && window.__peagle.ready && window.__peagle.charts.get('loss').plot")
    splits = pg.evaluate("window.__peagle.charts.get('loss').plot.axes[0]._splits")
    assert splits and all(float(s).is_integer() for s in splits), splits


def test_failed_job_page_has_no_empty_charts(page: object, server: Server, feeder: object) -> None:
    """A job that failed before training showed six 'no points yet' charts."""
    job_id = _create_job(server, "fails in data preparation")
    feeder.claim(job_id)  # type: ignore[attr-defined]
    for ph in ("validating", "preparing_data"):
        feeder.phase(job_id, ph)  # type: ignore[attr-defined]
    feeder.ingest(job_id, events=[{"kind": "error", "phase": "preparing_data",  # type: ignore[attr-defined]
                                   "message": "data.sources.0: no usable rows", "data": {"code": "data_invalid"}}])
    feeder.finish(job_id, "failed")  # type: ignore[attr-defined]
    pg = page
    pg.goto(f"/job.html?id={job_id}")
    pg.wait_for_function("window.__peagle && window.__peagle.ready")
    pg.locator("#charts-none").wait_for()
    assert "before its first training step" in pg.locator("#charts-none").inner_text()
    assert pg.get_by_text("no points yet").count() == 0 or not any(
        e.is_visible() for e in pg.get_by_text("no points yet").all())
    failed = pg.locator("#timeline li.failed")
    failed.wait_for()
    assert failed.evaluate("e => e.firstChild.textContent") == "preparing data"


def test_compare_picker_keeps_checkboxes_with_long_names(page: object, server: Server) -> None:
    long_name = "a very long job name " * 9
    job_id = _create_job(server, long_name.strip())
    pg = page
    pg.goto("/compare.html")
    pg.locator("#picker-box[open]").wait_for()
    cb = pg.get_by_label(f"compare {long_name.strip()}")
    cb.wait_for()
    box = cb.bounding_box()
    assert box is not None and box["width"] >= 12 and box["height"] >= 12, box
    assert job_id


def test_compare_diff_shows_the_spec_value(page: object, server: Server, feeder: object) -> None:
    """The diff showed the resolved optim.max_steps (9, what the data allowed) where the spec says 12."""
    a, b = _create_job(server, "diff A"), _create_job(server, "diff B", optim={"lr": 5e-4})
    for job_id in (a, b):
        feeder.claim(job_id)  # type: ignore[attr-defined]
        with server.client() as c:
            spec = c.get(f"/v1/jobs/{job_id}").json()["spec"]
        resolved = {**spec, "optim": {**spec["optim"], "max_steps": 9}}
        feeder.ingest(job_id, resolved_spec=resolved)  # type: ignore[attr-defined]
    pg = page
    pg.goto(f"/compare.html?ids={a},{b}")
    pg.wait_for_function("document.querySelector('#compare').dataset.ready === '1'")
    pg.get_by_label("Show identical fields too").check()
    row = pg.locator("table.diff tr", has=pg.locator("td", has_text="optim.max_steps"))
    cells = row.locator("td.val").all_inner_texts()
    assert cells == ["12 (resolved: 9)", "12 (resolved: 9)"], cells


def test_checkpoint_table_labels_every_number(page: object, server: Server, feeder: object) -> None:
    """tau_sim was the held-out value but loss the training loss, unlabelled; vLLM's AL only in an event."""
    job_id = _create_job(server, "labelled checkpoint")
    feeder.claim(job_id)  # type: ignore[attr-defined]
    feeder.phase(job_id, "training")  # type: ignore[attr-defined]
    feeder.checkpoint(job_id, 8)  # type: ignore[attr-defined]
    feeder.ingest(job_id, checkpoint_metrics=[{"step": 8, "metrics": {  # type: ignore[attr-defined]
        "eval_tau_sim": 1.4321, "eval_loss": 2.5, "acceptance_length": 1.2341463414634146,
        "vllm_acceptance_length": 1.19}}])
    pg = page
    pg.goto(f"/job.html?id={job_id}")
    row = pg.locator("table.checkpoints tr[data-step='8']")
    row.wait_for()
    heads = pg.locator("table.checkpoints thead th").all_inner_texts()
    for label in ("tau_sim (held-out)", "AL (reference)", "AL (vLLM)", "train loss", "eval loss"):
        assert label in heads, heads
    cell = {k: row.locator(f"td[data-key='{k}']").inner_text().strip()
            for k in ("tau_sim", "acceptance_length", "vllm_acceptance_length", "loss", "eval_loss")}
    assert cell == {"tau_sim": "1.432", "acceptance_length": "1.234", "vllm_acceptance_length": "1.19",
                    "loss": "1", "eval_loss": "2.5"}, cell


def test_favicon_and_sign_in_placeholder(browser: object, server: Server, new_context: object) -> None:
    ctx = new_context(signed_in=False)  # type: ignore[operator]
    pg = ctx.new_page()
    missing: list[str] = []
    pg.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
    pg.goto("/signin.html")
    r = pg.request.get("/favicon.ico")
    assert r.status == 200 and r.headers["content-type"].startswith("image/"), (r.status, r.headers)
    placeholder = pg.get_by_label("API key").get_attribute("placeholder")
    assert placeholder is not None and placeholder.startswith("peagle_"), placeholder
    pg.wait_for_timeout(300)
    assert missing == [], missing
