"""`GET /v1/meta`: the dashboard's states, actions, phases and spec enums come from their single sources,
and the frontend keeps no copies of them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args

from fastapi.testclient import TestClient

from api.schemas import MetaOut
from peagle.spec import PHASES, TrainSpec
from peagle.spec.schema import CheckpointSpec, ResourceSpec
from service.channels import job_of_channel, live_channel
from service.db import states

ROOT = Path(__file__).resolve().parents[2]


def test_meta_is_built_from_the_sources(client: TestClient) -> None:
    r = client.get("/v1/meta")  # public: no key needed
    assert r.status_code == 200, r.text
    meta = MetaOut.model_validate(r.json()).model_dump()
    assert meta["states"] == list(states.ALL_STATES)
    assert set(meta["terminal_states"]) == set(states.TERMINAL)
    assert meta["phases"] == list(PHASES)
    for status, actions in meta["actions_by_state"].items():
        assert "clone" in actions
        for action in states.ACTIONS:
            try:
                changes = states.action_target(action, status) != status
            except states.IllegalTransition:
                changes = False
            assert (action in actions) == changes, (status, action)
    enums = meta["enums"]
    assert enums["/resources/device"] == list(get_args(ResourceSpec.model_fields["device"].annotation))
    best_by = CheckpointSpec.model_fields["select_best_by"].annotation
    assert enums["/checkpoints/select_best_by"] == list(get_args(best_by))
    assert "/data/sources/*/format" in enums
    assert meta["metric_keys"]["al_pos_prefix"] == "al_pos_"


def test_meta_enums_cover_every_literal_of_the_spec() -> None:
    from api.routes.meta import spec_enums

    enums = spec_enums()

    def literals(model: Any, path: str) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for name, field in model.model_fields.items():
            ann = field.annotation
            args = get_args(ann)
            if getattr(ann, "__origin__", None) is not None and str(ann).startswith("typing.Literal"):
                out[f"{path}/{name}"] = list(args)
            elif isinstance(ann, type) and hasattr(ann, "model_fields"):
                out |= literals(ann, f"{path}/{name}")
            elif args and all(isinstance(a, type) and hasattr(a, "model_fields") for a in args[:1]):
                out |= literals(args[0], f"{path}/{name}/*")
        return out

    expected = literals(TrainSpec, "")
    assert expected and all(enums.get(k) == v for k, v in expected.items()), (expected, enums)


def test_the_frontend_keeps_no_copies() -> None:
    js = {p.name: p.read_text(encoding="utf-8") for p in (ROOT / "frontend").glob("*.js")}
    for name, text in js.items():
        assert '"preparing_data"' not in text, f"{name} repeats the phase list"
        assert not re.search(r'TERMINAL\s*=\s*\[', text), f"{name} repeats the terminal states"
        assert not re.search(r'cancel:\s*\["queued"', text), f"{name} repeats the allowed actions"
        assert '"bfloat16", "float16"' not in text, f"{name} repeats a spec enum"
    assert "/v1/meta" in js["api.js"]


def test_live_channel_names() -> None:
    from worker.live import channel

    assert live_channel("job_1") == "peagle:job:job_1" == channel("job_1")
    assert job_of_channel(b"peagle:job:job_1") == "job_1" and job_of_channel("other:x") is None
