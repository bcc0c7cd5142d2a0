"""`draft.init_from` through the API: the owner's job (best or a named checkpoint) is checked before queueing
(its config.json against the new spec), another owner's job reads "not found", and the job shows its parent."""

from __future__ import annotations

import json
from typing import Any

import pytest


def _export_config(*, hidden: int = 64, layers: int = 1, vd: int = 512) -> dict[str, Any]:
    """A speculators export config of a tiny-llama draft (`peagle train tiny`), as the API reads it."""
    return {"architectures": ["PEagleSpeculator"], "draft_vocab_size": vd, "mask_token_id": 3,
            "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "speculators_model_type": "peagle",
            "speculators_config": {"verifier": {"name_or_path": "builtin:tiny-llama"},
                                   "proposal_methods": [{"speculative_tokens": 3}]},
            "transformer_layer_config": {"hidden_size": hidden, "vocab_size": 49152, "num_hidden_layers": layers,
                                         "num_attention_heads": 4, "num_key_value_heads": 2}}


@pytest.fixture
def parent(client, sim, alice, submit) -> str:
    """Alice's tiny job, succeeded, best checkpoint at step 8 (and one at step 4)."""
    job = submit(client, alice)
    for step in (4, 8):
        d = sim.checkpoint(job["id"], step, {"model.safetensors": b"x"}, best=step == 8)
        (d / "config.json").write_text(json.dumps(_export_config()))
    sim.set(job["id"], status="succeeded")
    return str(job["id"])


def _child(client, headers, init_from: str, **draft: Any):
    return client.post("/v1/jobs", headers=headers,
                       json={"preset": "tiny", "overrides": {"draft": {"init_from": init_from, **draft}}})


def test_a_job_warm_starts_from_the_owners_job_and_shows_its_parent(client, alice, parent) -> None:
    r = _child(client, alice, f"job:{parent}")
    assert r.status_code == 201, r.text
    assert r.json()["parent"] == {"kind": "job", "id": parent, "step": None, "url": f"/v1/jobs/{parent}"}
    child = client.get(f"/v1/jobs/{r.json()['id']}", headers=alice).json()
    assert child["parent"]["id"] == parent and child["spec"]["draft"]["init_from"] == f"job:{parent}"
    r = _child(client, alice, f"job:{parent}@step_4")
    assert r.status_code == 201, r.text
    assert r.json()["parent"]["step"] == 4
    assert client.get(f"/v1/jobs/{parent}", headers=alice).json()["parent"] is None
    dry = client.post("/v1/jobs?dry_run=true", headers=alice,
                      json={"preset": "tiny", "overrides": {"draft": {"init_from": f"job:{parent}"}}})
    assert dry.status_code == 200 and dry.json()["valid"] is True, dry.text


def test_another_owners_job_is_not_found(client, alice, bob, parent) -> None:
    theirs, missing = _child(client, bob, f"job:{parent}"), _child(client, bob, "job:job_nosuch")
    assert theirs.status_code == missing.status_code == 422
    assert theirs.json()["error"]["param"] == "/draft/init_from"
    assert theirs.json()["error"]["message"].replace(parent, "X") == \
        missing.json()["error"]["message"].replace("job_nosuch", "X")
    assert "no job" in theirs.json()["error"]["message"]
    dry = client.post("/v1/jobs?dry_run=true", headers=bob,
                      json={"preset": "tiny", "overrides": {"draft": {"init_from": f"job:{parent}"}}})
    assert dry.status_code == 422  # not the caller's to name: refused even for a dry run


def test_a_source_that_does_not_fit_is_refused_naming_the_field(client, alice, parent) -> None:
    r = _child(client, alice, f"job:{parent}", num_layers=2)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "/draft/init_from" and "draft.num_layers" in err["message"]
    assert f"job {parent}'s draft has 1 decoder layers" in err["message"]
    r = _child(client, alice, f"job:{parent}", draft_vocab_size=256)
    assert r.status_code == 422 and "draft.draft_vocab_size 256" in r.json()["error"]["message"]


def test_the_hidden_size_is_checked_against_the_target(client, sim, alice, submit, tiny_target_path) -> None:
    job = submit(client, alice)["id"]
    d = sim.checkpoint(job, 4, {"model.safetensors": b"x"})
    (d / "config.json").write_text(json.dumps(_export_config(hidden=576)))
    sim.set(job, status="succeeded")
    r = _child(client, alice, f"job:{job}")
    assert r.status_code == 422, r.text
    assert f"hidden size 576 of job {job}'s draft differs from the target's 64" in r.json()["error"]["message"]


def test_what_cannot_start_a_job_yet_is_said(client, sim, alice, submit, parent) -> None:
    running = submit(client, alice)["id"]
    r = _child(client, alice, f"job:{running}")
    assert r.status_code == 422 and "not succeeded" in r.json()["error"]["message"]
    assert f"job:{running}@step_<N>" in r.json()["error"]["message"]
    r = _child(client, alice, f"job:{parent}@step_12")
    assert r.status_code == 422 and "no complete checkpoint at step 12" in r.json()["error"]["message"]
    r = _child(client, alice, "/srv/drafts/mine")
    assert r.status_code == 422 and "peagle train --init-from" in r.json()["error"]["message"]
    r = _child(client, alice, "draft:drf_nosuch")
    assert r.status_code == 422 and "no draft 'drf_nosuch'" in r.json()["error"]["message"]
