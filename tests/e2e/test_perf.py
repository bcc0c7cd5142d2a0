"""Job page with 50,000 metric points: first render time and CPU while live points stream.

Reports numbers (printed and written to test-artifacts/perf.json); it asserts only that the page
rendered the downsampled history and kept up with the live points, never a timing.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest

from tests.e2e.conftest import SHOTS, Server, shot
from tests.e2e.feed import metric_values

pytestmark = pytest.mark.e2e

N_POINTS = 50_000


def _cpu_window(cdp: object, feed: object, seconds: float, rate_hz: float) -> dict[str, float]:
    def metrics() -> dict[str, float]:
        return {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}  # type: ignore[attr-defined]

    m0, t0 = metrics(), time.monotonic()
    n = 0
    while time.monotonic() - t0 < seconds:
        feed()  # type: ignore[operator]
        n += 1
        time.sleep(max(0.0, n / rate_hz - (time.monotonic() - t0)))
    m1, wall = metrics(), time.monotonic() - t0
    return {
        "wall_s": round(wall, 2),
        "points_sent": n,
        "cpu_task_pct": round(100 * (m1["TaskDuration"] - m0["TaskDuration"]) / wall, 1),
        "cpu_script_pct": round(100 * (m1["ScriptDuration"] - m0["ScriptDuration"]) / wall, 1),
        "heap_mb": round(m1["JSHeapUsedSize"] / 2**20, 1),
    }


def test_job_page_with_50k_points(page: object, server: Server, feeder: object) -> None:
    with server.client() as c:
        job_id = c.post("/v1/jobs", json={"preset": "tiny", "overrides": {"name": "50k points"}}).json()["id"]
    feeder.claim(job_id)  # type: ignore[attr-defined]
    t_start = time.time() - N_POINTS * 0.5
    for lo in range(1, N_POINTS + 1, 10_000):
        rows = [{"step": s, "epoch": s / N_POINTS, "values": metric_values(s, 8),
                 "time": datetime.fromtimestamp(t_start + s * 0.5, UTC)} for s in range(lo, lo + 10_000)]
        feeder.ingest(job_id, metrics=rows)  # type: ignore[attr-defined]
    feeder.ingest(job_id, progress={"step": N_POINTS, "total_steps": N_POINTS * 2, "percent": 50.0,  # type: ignore[attr-defined]
                                    "seconds_remaining": 3600.0}, phase="training")

    pg = page
    pg.goto(f"/job.html?id={job_id}")
    pg.wait_for_function("window.__peagle && window.__peagle.ready")
    pg.wait_for_function("window.__peagle.historyAt")
    timing = pg.evaluate("""() => {
        const nav = performance.getEntriesByType('navigation')[0];
        const req = performance.getEntriesByType('resource').filter(r => r.name.includes('/metrics?'));
        return {first_render_ms: Math.round(window.__peagle.readyAt),
                full_history_ms: Math.round(window.__peagle.historyAt),
                dom_content_loaded_ms: Math.round(nav.domContentLoadedEventEnd),
                api_metric_requests_ms: req.map(r => Math.round(r.duration)),
                points_drawn: window.__peagle.store.length, first_step: window.__peagle.store.step[0]};
    }""")
    # newest 1000 records at full resolution + the server-downsampled history in front of them
    assert 1500 <= timing["points_drawn"] <= 3100 and timing["first_step"] == 1, timing
    assert pg.locator("#charts .uplot").count() == 6

    cdp = pg.context.new_cdp_session(pg)
    cdp.send("Performance.enable")
    step = [N_POINTS]

    def feed_one() -> None:
        step[0] += 1
        feeder.metrics(job_id, range(step[0], step[0] + 1), total_steps=N_POINTS * 2, depths=8)  # type: ignore[attr-defined]

    idle = _cpu_window(cdp, lambda: None, 3.0, 10.0)
    live1 = _cpu_window(cdp, feed_one, 5.0, 10.0)
    live2 = _cpu_window(cdp, feed_one, 5.0, 10.0)
    pg.wait_for_function(f"window.__peagle.store.lastStep >= {step[0]}")
    shot(pg, "job-50k-1280")
    report = {"job_points": N_POINTS, **timing, "cpu_idle": idle, "cpu_live_first_5s": live1, "cpu_live_next_5s": live2}
    (SHOTS.parent / "perf.json").write_text(json.dumps(report, indent=2))
    print("\nPERF", json.dumps(report))
