"""The checkpoint row tells a user how to serve the draft they download: folder, short and long command."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.e2e.conftest import Server

pytestmark = pytest.mark.e2e


def test_serve_commands_name_the_downloaded_folder(page: object, server: Server, feeder: object) -> None:
    with server.client() as c:
        r = c.post("/v1/jobs", json={"preset": "demo", "overrides": {"name": "serve me"}})
        assert r.status_code == 201, r.text
        job_id = str(r.json()["id"])
    feeder.claim(job_id)  # type: ignore[attr-defined]
    feeder.phase(job_id, "training")  # type: ignore[attr-defined]
    feeder.checkpoint(job_id, 8)  # type: ignore[attr-defined]
    folder = f"{job_id}-step_000008"
    pg = page
    pg.goto(f"/job.html?id={job_id}")  # type: ignore[attr-defined]
    row = pg.locator("table.checkpoints tr[data-step='8']")  # type: ignore[attr-defined]
    row.wait_for()
    # the archive is saved under the name it unpacks to, and the commands run beside it
    assert row.get_by_role("link", name="Download the archive of step 8").get_attribute("download") == f"{folder}.tar"
    short = row.get_by_label("vllm serve command for step 8", exact=True)
    expect(short).to_have_text(f"vllm serve ./{folder}")  # waits for the serve endpoint's answer
    long = row.get_by_label("Long form of the vllm serve command for step 8", exact=True)
    assert long.is_visible()
    text = long.inner_text()
    assert text.startswith("vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config"), text
    assert f'"model": "./{folder}"' in text and str(server.artifact_root) not in text
    assert row.get_by_text(f"tar xf {folder}.tar").is_visible()
