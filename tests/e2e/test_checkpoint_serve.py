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


def test_measured_speedup_shows_next_to_al_with_the_recommended_k(page: object, server: Server,
                                                                    feeder: object) -> None:
    """Issue 18: the checkpoint table shows the measured serving speedup next to AL (a slowdown as one), the
    evaluation below it (AL per prompt set, speedup per K and batch size, the hardware), and the long serve
    command uses the recommended K."""
    import json

    with server.client() as c:
        r = c.post("/v1/jobs", json={"preset": "demo", "overrides": {"name": "speedup"}})
        assert r.status_code == 201, r.text
        job_id = str(r.json()["id"])
    feeder.claim(job_id)  # type: ignore[attr-defined]
    feeder.phase(job_id, "training")  # type: ignore[attr-defined]
    feeder.checkpoint(job_id, 8)  # type: ignore[attr-defined]

    def row(k: int, b: int, x: float, text: str) -> dict[str, object]:
        return {"num_speculative_tokens": k, "batch_size": b, "rounds": 3, "speedup": x, "speedup_text": text,
                "speedup_per_round": [x] * 3, "base_tokens_per_s": 30.0 * b, "spec_tokens_per_s": 30.0 * b * x,
                "acceptance_length": 1.3, "per_position": [0.3]}

    table = [row(1, 1, 1.02, "1.02x faster"), row(2, 1, 1.07, "1.07x faster"),
             row(1, 8, 0.8, "0.80x (1.25x slower)"), row(2, 8, 0.45, "0.45x (2.22x slower)")]
    serving = {"num_speculative_tokens": 2, "batch_sizes": [1, 8], "rounds": 3, "num_prompts": 8,
               "batch_1": table[1], "batch_n": table[3], "acceptance_length": 1.3, "table": table,
               "recommended": [{"batch_size": 1, "num_speculative_tokens": 2, "speedup": 1.07},
                               {"batch_size": 8, "num_speculative_tokens": 0, "speedup": 0.8}],
               "recommended_speculative_config": {"model": "", "method": "eagle3", "num_speculative_tokens": 2,
                                                  "parallel_drafting": True},
               "hardware": {"device": "cpu", "cpu": "AMD EPYC", "cpu_count": 2}, "vllm_version": "0.32.0"}
    evaluation = {"engine": "vllm", "num_speculative_tokens": 2, "serving": serving,
                  "prompt_sets": {"humaneval": {"acceptance_length": 1.31, "num_prompts": 8,
                                                "per_request_spread": {"min": 1.1, "p25": 1.2, "median": 1.25,
                                                                       "p75": 1.4, "max": 1.7, "mean": 1.3}},
                                  "sharegpt-heldout": {"acceptance_length": 1.12, "num_prompts": 8}}}
    feeder.replay(job_id, [json.dumps({"type": "event", "kind": "eval", "checkpoint_step": 8,  # type: ignore[attr-defined]
                                       "metrics": {"acceptance_length": 1.31}, "evaluation": evaluation})])
    pg = page
    pg.goto(f"/job.html?id={job_id}")  # type: ignore[attr-defined]
    cell = pg.locator("table.checkpoints tr[data-step='8'] td[data-label='Speedup']")  # type: ignore[attr-defined]
    expect(cell).to_contain_text("batch 1: 1.07x faster")
    expect(cell).to_contain_text("batch 8: 0.45x (2.22x slower)")
    assert cell.locator(".speedup.slower").count() == 1
    panel = pg.locator("section.evaluation[data-step='8']")  # type: ignore[attr-defined]
    expect(panel).to_contain_text("sharegpt-heldout")
    expect(panel).to_contain_text("AMD EPYC (2 CPUs)")
    expect(panel.locator("tr.rec-row")).to_contain_text("no draft (slower at every K)")
    long = pg.locator("table.checkpoints tr[data-step='8']").get_by_label(  # type: ignore[attr-defined]
        "Long form of the vllm serve command for step 8", exact=True)
    expect(long).to_contain_text('"num_speculative_tokens": 2')
