"""A warm-started job's page links to its parent job (`parent`, from `draft.init_from`)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import Server

pytestmark = pytest.mark.e2e

#: config.json of a `peagle train tiny` draft: what the API checks the new job against before queueing.
TINY_DRAFT = {"architectures": ["PEagleSpeculator"], "draft_vocab_size": 512, "mask_token_id": 3,
              "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "speculators_model_type": "peagle",
              "transformer_layer_config": {"hidden_size": 64, "vocab_size": 49152, "num_hidden_layers": 1}}


def test_the_job_page_links_to_the_parent_job(page: object, server: Server, feeder: object) -> None:
    with server.client() as c:
        parent = c.post("/v1/jobs", json={"preset": "tiny", "overrides": {"name": "warm parent"}}).json()["id"]
    run = feeder.claim(parent)  # type: ignore[attr-defined]
    feeder.checkpoint(parent, 8)  # type: ignore[attr-defined]
    (run / "checkpoints" / "step_000008" / "config.json").write_text(json.dumps(TINY_DRAFT))
    feeder.finish(parent)  # type: ignore[attr-defined]
    with server.client() as c:
        r = c.post("/v1/jobs", json={"preset": "tiny", "overrides": {
            "name": "warm child", "draft": {"init_from": f"job:{parent}@step_8"}}})
        assert r.status_code == 201, r.text
        child = r.json()["id"]
    pg = page
    pg.goto(f"/job.html?id={child}")
    link = pg.locator("#parent a")
    link.wait_for()
    assert link.inner_text() == f"{parent} @ step 8"
    link.click()
    pg.wait_for_url(f"**/job.html?id={parent}")
    pg.locator("h1", has_text="warm parent").wait_for()
    assert pg.locator("#parent").count() == 0  # the parent started from the target
