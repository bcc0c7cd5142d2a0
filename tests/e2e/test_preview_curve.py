"""Issue 39: the first training curve within minutes. A job with `preview` shows the preview's loss as a
curve of its own ("Preview: first N conversations") from its first point, before any main training metric
exists, and keeps it after the main training starts (its steps start at 1 again: a series of its own).

The records are fed as the trainer prints them and the worker files them (`Feeder.replay`: the worker's
collector and lease write path)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import Server, shot
from tests.e2e.feed import metric_values

pytestmark = pytest.mark.e2e


def _phase(name: str) -> str:
    return json.dumps({"type": "event", "kind": "phase", "phase": name, "message": f"phase {name}"})


def _preview_step(step: int) -> str:
    values = {"preview_loss": 5.0 - step / 2, "preview_full_acc": 0.05 * step, "preview_acc_0": 0.1 * step}
    return json.dumps({"type": "metric", "time": 1.8e9 + step, "step": step, "epoch": step / 2, "values": values})


def _main_step(step: int) -> str:
    values = {k: v for k, v in metric_values(step).items() if not k.startswith(("eval_", "acceptance", "al_pos"))}
    return json.dumps({"type": "metric", "time": 1.8e9 + 100 + step, "step": step, "epoch": step / 12,
                       "values": values})


def test_the_preview_curve_comes_first_and_stays(page: object, server: Server, feeder: object) -> None:
    with server.client() as c:
        r = c.post("/v1/jobs", json={"preset": "tiny", "overrides": {"name": "preview curve",
                                                                      "preview": {"conversations": 8, "steps": 3}}})
        assert r.status_code == 201, r.text
        job_id = str(r.json()["id"])
    feeder.claim(job_id)  # type: ignore[attr-defined]
    feeder.replay(job_id, [_phase("validating"), _phase("preview"), _preview_step(1), _preview_step(2)])  # type: ignore[attr-defined]

    pg = page
    pg.goto(f"/job.html?id={job_id}")
    pg.wait_for_function("window.__peagle && window.__peagle.ready")
    pg.wait_for_function("document.querySelector('#charts').dataset.previewPoints >= 2")
    card = pg.locator('#charts [data-chart="preview"]')
    assert card.is_visible()
    assert card.locator("h3").inner_text().startswith("Preview: first 8 conversations")
    assert card.locator(".uplot").count() == 1
    legend = card.locator(".u-legend .u-series").all_inner_texts()
    assert any("preview loss" in t for t in legend), legend
    # no main training metric yet: the main loss chart is empty, the preview's points are not its points
    assert pg.evaluate("window.__peagle.store.length") == 0
    assert pg.locator('#charts [data-chart="loss"] .chart-empty').count() == 1
    assert pg.locator("#timeline li.current").first.text_content().startswith("preview")
    shot(pg, "job-preview-curve-1280")

    # live: the last preview step, then the main run's first steps (steps 1.. again)
    feeder.replay(job_id, [_preview_step(3), _phase("preparing_data"), _phase("building_vocab"),  # type: ignore[attr-defined]
                           _phase("capturing"), _phase("training"), *map(_main_step, range(1, 5))])
    pg.wait_for_function("document.querySelector('#charts').dataset.points >= 4")
    pg.wait_for_function("document.querySelector('#charts').dataset.previewPoints >= 3")
    assert card.is_visible() and card.locator(".uplot").count() == 1
    assert pg.locator('#charts [data-chart="loss"] .uplot').count() == 1
    assert pg.evaluate("window.__peagle.previewStore.last('preview_loss')") == pytest.approx(3.5)
    assert pg.evaluate("window.__peagle.store.keys().some((k) => k.startsWith('preview_'))") is False

    # a reload reads them back the same way
    pg.reload()
    pg.wait_for_function("window.__peagle && window.__peagle.ready")
    pg.wait_for_function("document.querySelector('#charts').dataset.previewPoints >= 3")
    assert pg.evaluate("window.__peagle.store.length") == 4


def test_the_demo_dry_run_says_when_the_first_curve_comes(page: object) -> None:
    pg = page
    pg.goto("/new.html")
    pg.get_by_role("button", name="demo").click()
    pg.get_by_role("button", name="Validate and estimate (dry run)").click()
    est = pg.locator(".estimate")
    est.locator(".funnel").wait_for()
    assert "first training curve after" in est.locator("dl").inner_text()
    assert "preview:" in est.locator(".estimate-phases li[data-phase='preview']").inner_text()
    assert "preview of 40 steps on the first 48 conversations" in est.inner_text()
