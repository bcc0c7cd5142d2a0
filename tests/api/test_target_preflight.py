"""Issue 39: what can be known about the target is refused before queueing, at its field path: a hub id
that is neither in the hub cache nor reachable (the machine reaches no hub), and `data.max_length` beyond
the target's context when its config can be read here (builtin fixture, folder, cached hub snapshot)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from service.db.models import Job

TYPO = "meta-lama/Meta-Llama-3-8B-Instruct"


def _body(model: str, **data: Any) -> dict[str, Any]:
    over: dict[str, Any] = {"target": {"model": model}}
    if data:
        over["data"] = data
        over["optim"] = {"pack_length": max(2048, data.get("max_length", 0))}
    return {"preset": "tiny", "overrides": over}


def _jobs(sim: Any) -> int:
    with sim.engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(Job)))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _refused(client: TestClient, headers: dict, body: dict[str, Any], param: str) -> str:
    """Create is 422 at `param` and queues nothing; the dry run says `valid: false` with the same problem."""
    r = client.post("/v1/jobs", json=body, headers=headers)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "spec_invalid" and param in {d["param"] for d in err["details"]}, err
    dry = client.post("/v1/jobs?dry_run=true", json=body, headers=headers).json()
    assert dry["valid"] is False and param in {p["param"] for p in dry["problems"]}, dry
    return next(d["message"] for d in err["details"] if d["param"] == param)


def _cache_snapshot(cache: Path, repo_id: str, config: dict[str, Any]) -> None:
    """A hub cache entry as huggingface_hub writes it (refs/main -> snapshots/<commit>/config.json)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps(config))


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_hub_id_refused_when_offline(client: TestClient, alice: dict, sim: Any, hub_cache: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    why = _refused(client, alice, _body(TYPO), "/target/model")
    assert "hub cache" in why and "HF_HUB_OFFLINE" in why
    assert _jobs(sim) == 0


def test_hub_id_refused_when_the_hub_does_not_answer(client: TestClient, alice: dict, sim: Any, hub_cache: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")  # a hub nobody answers for
    t0 = time.monotonic()
    why = _refused(client, alice, _body(TYPO), "/target/model")
    assert time.monotonic() - t0 < 10  # a short check, not a hung request
    assert "cannot be reached" in why
    assert _jobs(sim) == 0


def test_cached_hub_id_passes_and_its_context_is_checked(client: TestClient, alice: dict, sim: Any,
                                                         hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _cache_snapshot(hub_cache, "acme/llama-8k", {"model_type": "llama", "max_position_embeddings": 8192})
    r = client.post("/v1/jobs", json=_body("acme/llama-8k"), headers=alice)
    assert r.status_code == 201, r.text
    why = _refused(client, alice, _body("acme/llama-8k", max_length=100000), "/data/max_length")
    assert "8192" in why and "100000" in why
    assert _jobs(sim) == 1


def test_max_length_beyond_a_model_folder_context(settings_factory: Any, sim: Any, tmp_path: Path) -> None:
    from api.main import create_app

    root = tmp_path / "models"
    (root / "small").mkdir(parents=True)
    (root / "small" / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    with TestClient(create_app(settings_factory(model_roots=[root]))) as c:
        h = {"Authorization": f"Bearer {sim.key('carol', 'write')}"}
        why = _refused(c, h, _body(str(root / "small"), max_length=4096), "/data/max_length")
        assert "2048" in why
        assert c.post("/v1/jobs?dry_run=true", json=_body(str(root / "small"), max_length=2048),
                      headers=h).json()["valid"] is True


def test_max_length_beyond_the_builtin_smollm2_context(client: TestClient, alice: dict) -> None:
    from peagle.builtin import cache_root

    if not (cache_root() / "SmolLM2-135M-Instruct" / ".complete").is_file():
        pytest.skip("the SmolLM2 fixture is not built (peagle fixtures smollm2)")
    why = _refused(client, alice, _body("builtin:smollm2-135m-instruct", max_length=100000), "/data/max_length")
    assert "8192" in why
