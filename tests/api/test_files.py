"""Checkpoint downloads (Range, If-Range, 416, traversal, archive) and dataset uploads."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from typing import Any

from fastapi.testclient import TestClient

BLOB = bytes(range(256)) * 40  # 10240 bytes


def _job_with_ckpt(client: TestClient, alice: dict, sim: Any, submit: Any) -> str:
    jid = submit(client, alice)["id"]
    d = sim.checkpoint(jid, 4, {"model.safetensors": BLOB, "sub/meta.json": b"{}", "training_state.pt": b"adam"})
    (d.parent.parent / "secret.txt").write_text("not yours")
    (d / "link").symlink_to(d.parent.parent / "secret.txt")
    return jid


def test_range_requests(client: TestClient, alice: dict, sim: Any, submit: Any) -> None:
    jid = _job_with_ckpt(client, alice, sim, submit)
    url = f"/v1/jobs/{jid}/checkpoints/4/files/model.safetensors"
    full = client.get(url, headers=alice)
    sha = hashlib.sha256(BLOB).hexdigest()
    assert full.status_code == 200 and full.content == BLOB and full.headers["x-checksum-sha256"] == sha
    assert full.headers["accept-ranges"] == "bytes" and full.headers["etag"] == f'"{sha}"'
    r = client.get(url, headers={**alice, "Range": "bytes=100-199"})
    assert r.status_code == 206 and r.content == BLOB[100:200]
    assert r.headers["content-range"] == f"bytes 100-199/{len(BLOB)}"
    r = client.get(url, headers={**alice, "Range": "bytes=-10"})
    assert r.status_code == 206 and r.content == BLOB[-10:]
    r = client.get(url, headers={**alice, "Range": f"bytes={len(BLOB)}-"})
    assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{len(BLOB)}"
    r = client.get(url, headers={**alice, "Range": "bytes=0-9", "If-Range": f'"{sha}"'})
    assert r.status_code == 206 and r.content == BLOB[:10]
    r = client.get(url, headers={**alice, "Range": "bytes=0-9", "If-Range": '"stale"'})
    assert r.status_code == 200 and r.content == BLOB
    nested = client.get(f"/v1/jobs/{jid}/checkpoints/4/files/sub/meta.json", headers=alice)
    assert nested.status_code == 200 and nested.content == b"{}"


def test_path_traversal_is_404(client: TestClient, alice: dict, sim: Any, submit: Any) -> None:
    jid = _job_with_ckpt(client, alice, sim, submit)
    base = f"/v1/jobs/{jid}/checkpoints/4/files/"
    for path in ("../secret.txt", "..%2Fsecret.txt", "%2E%2E/secret.txt", "link", "/etc/passwd",
                 "sub/../../secret.txt", "COMPLETE", "..%2F..%2F..%2Fapi.db"):
        r = client.get(base + path, headers=alice)
        assert r.status_code == 404, (path, r.status_code)
        assert b"not yours" not in r.content
    assert client.get(f"/v1/jobs/{jid}/checkpoints/5/files/model.safetensors", headers=alice).status_code == 404


def test_archive_is_deterministic_and_ranged(client: TestClient, alice: dict, sim: Any, submit: Any) -> None:
    jid = _job_with_ckpt(client, alice, sim, submit)
    url = f"/v1/jobs/{jid}/checkpoints/4/archive"
    a = client.get(url, headers=alice)
    b = client.get(url, headers=alice)
    assert a.status_code == 200 and a.content == b.content
    assert a.headers["x-checksum-sha256"] == hashlib.sha256(a.content).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(a.content)) as tar:
        members = tar.getmembers()
        assert [m.name.split("/", 1)[1] for m in members] == ["model.safetensors", "sub/meta.json"]
        assert all(m.mtime == 0 and m.uid == 0 for m in members)
        assert tar.extractfile(members[0]).read() == BLOB
    r = client.get(url, headers={**alice, "Range": "bytes=0-511"})
    assert r.status_code == 206 and r.content == a.content[:512]
    listing = client.get(f"/v1/jobs/{jid}/checkpoints", headers=alice).json()["data"]
    assert listing[0]["is_best"] and listing[0]["is_latest"] and listing[0]["tau_sim"] == 1.5
    assert listing[0]["files"][0]["sha256"] == hashlib.sha256(BLOB).hexdigest()
    serve = client.get(f"/v1/jobs/{jid}/checkpoints/4/serve", headers=alice).json()
    assert serve["command"].startswith("vllm serve ") and serve["speculative_config"]["num_speculative_tokens"] == 3
    assert "t/v" in serve["long_command"] and '"parallel_drafting": true' in serve["long_command"]
    tok = client.post("/v1/auth/stream-token", json={"job_id": jid, "purpose": "download"},
                      headers=alice).json()["token"]
    assert client.get(f"{url}?token={tok}").content == a.content
    # the optimizer state only on request (walk-through: a 70 MB draft came as a 509 MB archive)
    full = client.get(f"{url}?training_state=true", headers=alice)
    with tarfile.open(fileobj=io.BytesIO(full.content)) as tar:
        assert [m.name.split("/", 1)[1] for m in tar.getmembers()] == [
            "model.safetensors", "sub/meta.json", "training_state.pt"]
    assert full.headers["x-checksum-sha256"] != a.headers["x-checksum-sha256"]


def _upload(client: TestClient, headers: dict, data: bytes, name: str = "chats.jsonl") -> Any:
    return client.post("/v1/datasets", files={"file": (name, data, "application/jsonl")}, headers=headers)


def test_dataset_upload_and_report(client: TestClient, alice: dict, bob: dict) -> None:
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(5)]
    data = ("\n".join(json.dumps(r) for r in rows) + "\nnot json\n").encode()
    r = _upload(client, alice, data, name="../../evil name.jsonl")
    assert r.status_code == 201, r.text
    ds = r.json()
    assert ds["sha256"] == hashlib.sha256(data).hexdigest() and ds["size"] == len(data)
    assert ds["filename"] == "evil_name.jsonl" and ds["report"]["rows_kept"] == 5
    assert ds["status"] == "ready"
    assert client.get(f"/v1/datasets/{ds['id']}", headers=alice).json()["id"] == ds["id"]
    assert client.get(f"/v1/datasets/{ds['id']}", headers=bob).status_code == 404
    assert [d["id"] for d in client.get("/v1/datasets", headers=alice).json()["data"]] == [ds["id"]]
    est = client.post("/v1/jobs?dry_run=true", json={"preset": "tiny", "overrides": {
        "data": {"sources": [{"path": ds["path_ref"]}]}}}, headers=alice)
    assert est.status_code == 200 and est.json()["rows"] == 1  # 5 rows - 4 eval samples
    r = client.post("/v1/jobs", json={"preset": "tiny", "overrides": {
        "data": {"sources": [{"path": ds["path_ref"]}]}}}, headers=bob)
    assert r.status_code == 422 and r.json()["error"]["param"] == "/data/sources/0/path"
    bad = _upload(client, alice, b"\xff\xfe garbage")
    assert bad.status_code == 201 and bad.json()["status"] == "invalid"


def test_oversized_upload_and_quota(settings_factory: Any, sim: Any) -> None:
    from api.main import create_app

    with TestClient(create_app(settings_factory(max_upload_bytes=1000, max_upload_bytes_per_owner=1500))) as c:
        h = {"Authorization": f"Bearer {sim.key('gina', 'write')}"}
        line = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        r = _upload(c, h, (line + "\n") * 200)
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        assert not any((settings_factory().resolved_dataset_root()).rglob("*.jsonl"))
        ok = (line + "\n") * 10
        assert _upload(c, h, ok.encode()).status_code == 201
        r = _upload(c, h, ok.encode())  # 2 * 900 bytes > the 1500-byte owner quota
        assert r.status_code == 429 and "Retry-After" in r.headers and r.json()["error"]["code"] == "quota_exceeded"
        assert c.post("/v1/datasets", content=b"x", headers={**h, "Content-Type": "text/plain"}).status_code == 415
