"""Issue 19: an API job reads only what its owner may read; nothing the API returns shows a host path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from api.main import create_app
from service.db.models import Job
from service.settings import Settings

ROWS = "\n".join(json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]})
                 for i in range(6)).encode()


def _upload(client: TestClient, headers: dict, data: bytes = ROWS, name: str = "chats.jsonl", **form: str) -> Any:
    return client.post("/v1/datasets", files={"file": (name, data, "application/jsonl")}, data=form or None,
                       headers=headers)


def _job_count(sim: Any) -> int:
    with sim.engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(Job)))


def _tiny(**over: Any) -> dict[str, Any]:
    return {"preset": "tiny", "overrides": over}


def _refused(r: Any, param: str) -> dict[str, Any]:
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert param in [d["param"] for d in err["details"]]
    return err


def test_cross_owner_absolute_path_is_refused(client: TestClient, alice: dict, bob: dict, sim: Any,
                                              settings: Settings) -> None:
    ds = _upload(client, alice).json()
    files = list(settings.resolved_dataset_root().rglob("*.jsonl"))
    assert len(files) == 1  # alice's upload, on the server's disk
    for path in (str(files[0]), f"{settings.resolved_dataset_root()}/../datasets/{files[0].relative_to(settings.resolved_dataset_root())}"):
        for dry in ("", "?dry_run=true"):
            r = client.post(f"/v1/jobs{dry}", json=_tiny(data={"sources": [{"path": path}]}), headers=bob)
            _refused(r, "/data/sources/0/path")
    # her own upload, by the absolute path: refused too (only `dataset:<id>` names it)
    r = client.post("/v1/jobs", json=_tiny(data={"sources": [{"path": str(files[0])}]}), headers=alice)
    _refused(r, "/data/sources/0/path")
    assert _job_count(sim) == 0
    ok = client.post("/v1/jobs", json=_tiny(data={"sources": [{"path": ds["path_ref"]}]}), headers=alice)
    assert ok.status_code == 201, ok.text


HOST_FILES = ["/etc/shadow", "/proc/self/environ", "/etc/passwd", "../../etc/passwd", "relative/file.jsonl",
              "~/x.jsonl"]


@pytest.mark.parametrize("path", HOST_FILES)
def test_host_files_as_data_source_are_refused_without_content(client: TestClient, alice: dict, sim: Any,
                                                               path: str) -> None:
    for dry in ("", "?dry_run=true"):
        r = client.post(f"/v1/jobs{dry}", json=_tiny(data={"sources": [{"path": path}]}), headers=alice)
        err = _refused(r, "/data/sources/0/path")
        assert "starts with" not in r.text and "empty file" not in r.text and "root:" not in r.text, err
    assert _job_count(sim) == 0


@pytest.mark.parametrize("model", ["/etc/shadow", "/proc/self/environ", "../etc", "a/b/c", "org/..", "./x",
                                   "org/name/../../etc", "C:\\x", "org\\name", "/"])
def test_host_paths_as_target_model_are_refused(client: TestClient, alice: dict, sim: Any, model: str) -> None:
    for dry in ("", "?dry_run=true"):
        r = client.post(f"/v1/jobs{dry}", json=_tiny(target={"model": model}), headers=alice)
        _refused(r, "/target/model")
        assert "starts with" not in r.text and "empty file" not in r.text
    assert _job_count(sim) == 0


def test_prompt_set_paths_are_refused(client: TestClient, alice: dict, sim: Any) -> None:
    r = client.post("/v1/jobs", json=_tiny(eval={"prompt_sets": [{"name": "humaneval"}, {"name": "/etc/passwd"}]}),
                    headers=alice)
    _refused(r, "/eval/prompt_sets/1/name")
    assert _job_count(sim) == 0


def test_clone_cannot_add_a_host_path(client: TestClient, alice: dict, sim: Any, submit: Any) -> None:
    jid = submit(client, alice)["id"]
    r = client.post(f"/v1/jobs/{jid}/clone", json={"overrides": {"data": {"sources": [{"path": "/etc/shadow"}]}}},
                    headers=alice)
    _refused(r, "/data/sources/0/path")
    assert _job_count(sim) == 1


def test_hub_ids_builtins_and_model_roots(settings_factory: Any, sim: Any, tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "llama").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "escape").symlink_to(tmp_path / "outside")
    with TestClient(create_app(settings_factory(model_roots=[root]))) as c:
        h = {"Authorization": f"Bearer {sim.key('carol', 'write')}"}
        for model in ("builtin:tiny-llama", "HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", str(root / "llama")):
            r = c.post("/v1/jobs?dry_run=true", json=_tiny(target={"model": model}), headers=h)
            assert r.status_code == 200, (model, r.text)
        for model in (str(root / "llama" / ".." / ".." / "outside"), str(root / "escape"), str(tmp_path / "outside"),
                      "builtin:nope"):
            r = c.post("/v1/jobs?dry_run=true", json=_tiny(target={"model": model}), headers=h)
            _refused(r, "/target/model")


@pytest.mark.parametrize("where", ["name", "target", "data"])
def test_nul_in_spec_is_a_422_naming_the_field(client: TestClient, alice: dict, sim: Any, where: str) -> None:
    spec: dict[str, Any] = {"target": {"model": "builtin:tiny-llama"}, "data": {"sources": [{"path": "builtin:sharegpt"}]}}
    if where == "name":
        spec["name"] = "job\x00name"
        param = "/name"
    elif where == "target":
        spec["target"]["model"] = "org/na\x00me"
        param = "/target/model"
    else:
        spec["data"]["sources"][0]["path"] = "dataset:ds_\x00x"
        param = "/data/sources/0/path"
    r = client.post("/v1/jobs", json={"spec": spec}, headers=alice)
    err = _refused(r, param)
    assert "NUL" in err["message"] and "INSERT" not in r.text
    assert _job_count(sim) == 0


def test_responses_show_no_server_path(client: TestClient, alice: dict, sim: Any, settings: Settings,
                                       tmp_path: Path) -> None:
    roots = [str(tmp_path), str(settings.resolved_dataset_root()), str(settings.resolved_artifact_root())]
    ds = _upload(client, alice).json()
    bad = _upload(client, alice, b"not json at all", name="bad.jsonl").json()
    assert bad["status"] == "invalid" and bad["report"]["error"]
    listing = client.get("/v1/datasets", headers=alice).text
    job = client.post("/v1/jobs", json=_tiny(data={"sources": [{"path": ds["path_ref"]}]}), headers=alice).json()
    sim.checkpoint(job["id"], 4, {"model.safetensors": b"w"})
    texts = [json.dumps(ds), json.dumps(bad), listing, client.get(f"/v1/jobs/{job['id']}", headers=alice).text,
             client.get(f"/v1/jobs/{job['id']}/checkpoints", headers=alice).text,
             client.get(f"/v1/jobs/{job['id']}/checkpoints/4/serve", headers=alice).text]
    for text in texts:
        for root in roots:
            assert root not in text, (root, text[:2000])
    assert "not json" not in json.dumps(bad)  # no file content quoted back
    serve = client.get(f"/v1/jobs/{job['id']}/checkpoints/4/serve", headers=alice).json()
    assert serve["command"] == f"vllm serve ./{job['id']}-step_000004"


@pytest.mark.parametrize("named", ["/etc", "/root/models/secret", "/proc/self"])
def test_host_folders_as_target_name_or_path_are_refused(client: TestClient, alice: dict, sim: Any,
                                                         named: str) -> None:
    """`target.name_or_path` lands in the export's config, which the worker's validator reads as a folder:
    an API job may name only what `target.model` may (issue 46)."""
    for dry in ("", "?dry_run=true"):
        r = client.post(f"/v1/jobs{dry}", json=_tiny(target={"name_or_path": named}), headers=alice)
        _refused(r, "/target/name_or_path")
    assert _job_count(sim) == 0
    ok = client.post("/v1/jobs", json=_tiny(target={"name_or_path": "org/my-target"}), headers=alice)
    assert ok.status_code == 201, ok.text
