"""The job page's retrain and promotion panel: Retrain on a succeeded job queues a warm-started child, the
owner can make a job the current draft and undo it, and a measured decision shows both drafts' numbers."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from tests.e2e.conftest import Server, shot

pytestmark = pytest.mark.e2e

#: config.json of a `peagle train tiny` draft: what the API checks a warm start against before queueing.
TINY_DRAFT = {"architectures": ["PEagleSpeculator"], "draft_vocab_size": 512, "mask_token_id": 3,
              "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "speculators_model_type": "peagle",
              "transformer_layer_config": {"hidden_size": 64, "vocab_size": 49152, "num_hidden_layers": 1}}


def _succeeded(server: Server, feeder: object, name: str) -> str:
    with server.client() as c:
        job = c.post("/v1/jobs", json={"preset": "tiny", "overrides": {"name": name}}).json()["id"]
    run = feeder.claim(job)  # type: ignore[attr-defined]
    feeder.checkpoint(job, 8)  # type: ignore[attr-defined]
    (run / "checkpoints" / "step_000008" / "config.json").write_text(json.dumps(TINY_DRAFT))
    feeder.finish(job)  # type: ignore[attr-defined]
    return str(job)


def test_retrain_force_promote_and_undo_from_the_job_page(page: object, server: Server, feeder: object) -> None:
    parent = _succeeded(server, feeder, "retrain parent")
    pg = page
    pg.goto(f"/job.html?id={parent}")  # type: ignore[attr-defined]
    panel = pg.locator("#retrain")  # type: ignore[attr-defined]
    expect(panel.get_by_role("heading", name="Retrain and promotion")).to_be_visible()
    expect(panel.locator("#promotion-decisions")).to_have_text("No promotion decision about this job.")

    panel.get_by_label("Other data sources (comma separated)").fill("builtin:sharegpt")
    panel.get_by_label("Max steps").fill("3")
    panel.get_by_label("Promotion batch sizes (comma separated)").fill("1, 8")
    panel.get_by_role("button", name="Retrain this job").click()
    link = panel.locator(".retrain-result a")
    link.wait_for()
    child = link.inner_text()
    with server.client() as c:
        spec = c.get(f"/v1/jobs/{child}").json()["spec"]
    assert spec["draft"]["init_from"] == f"job:{parent}" and spec["optim"]["max_steps"] == 3
    assert [s["path"] for s in spec["data"]["sources"]] == ["builtin:sharegpt"]

    panel.get_by_role("button", name="Make this job the current draft").click()
    pg.get_by_role("dialog").get_by_role("button", name="Make current").click()  # type: ignore[attr-defined]
    expect(panel.locator("#current-draft")).to_contain_text("this job (step 8")
    expect(panel.locator("#promotion-decisions li[data-decision='forced']")).to_contain_text("forced by")

    # a measured decision about the child (what the worker stores at its end) shows both sides' numbers
    from service.db import promotion
    from service.db.models import Job
    from service.db.session import make_engine, make_session_factory, session_scope

    engine = make_engine(server.database_url)
    try:
        with session_scope(make_session_factory(engine)) as s:
            row = s.get(Job, child)
            assert row is not None
            owner = row.owner_id
            rows = [{"batch_size": 1, "child": {"speedup": 1.31, "k": 3}, "current": {"speedup": 1.22, "k": 3}},
                    {"batch_size": 8, "child": {"speedup": 0.97, "k": 2}, "current": {"speedup": 1.01, "k": 3}}]
            promotion.record_decision(s, owner_id=owner, target="builtin:tiny-llama", job_id=child,
                                      decision="declined", decided_by="measurement", compared_with=parent,
                                      reason="batch 8: 0.97x, the current draft 1.01x", batch_sizes=[1, 8],
                                      numbers={"baseline": "current", "rows": rows,
                                               "child": {"acceptance_length": 2.41},
                                               "current": {"acceptance_length": 2.45}})
    finally:
        engine.dispose()
    link.click()
    pg.wait_for_url(f"**/job.html?id={child}")  # type: ignore[attr-defined]
    item = pg.locator("#promotion-decisions li[data-decision='declined']")  # type: ignore[attr-defined]
    expect(item).to_contain_text("batch 8: 0.97x, the current draft 1.01x")
    table = item.locator("table.promotion-numbers")
    expect(table).to_contain_text("1.31x (K=3)")
    expect(table).to_contain_text("0.97x (K=2)")
    expect(table.locator("tr", has_text="AL")).to_contain_text("2.41")
    expect(table.locator("tr", has_text="AL")).to_contain_text("2.45")
    expect(pg.locator("#retrain")).to_contain_text("Retrain is possible once the job has succeeded")  # type: ignore[attr-defined]
    assert "null" not in pg.locator("#promotion-state").inner_text()  # type: ignore[attr-defined]
    shot(pg, "job_promotion_decision")

    pg.goto(f"/job.html?id={parent}")  # type: ignore[attr-defined]
    pg.locator("#retrain").get_by_role("button", name="Undo the last promotion").click()  # type: ignore[attr-defined]
    pg.get_by_role("dialog").get_by_role("button", name="Undo").click()  # type: ignore[attr-defined]
    expect(pg.locator("#current-draft")).to_have_text("none yet")  # type: ignore[attr-defined]
    expect(pg.locator("#promotion-decisions li[data-decision='undone']")).to_be_visible()  # type: ignore[attr-defined]
