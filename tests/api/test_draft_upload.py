"""Uploaded drafts (`POST /v1/drafts`): a real export archive is `ready` and starts a job (`draft:<id>`);
a too-large, hostile (path traversal, link, device) or not-an-export archive is refused, and nothing of it
lands outside its folder; another owner's draft is "not found"."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path


def _tar(entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in entries:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _tar_of(folder: Path, top: str = "my-draft") -> bytes:
    return _tar([(tarfile.TarInfo(f"{top}/{f.name}"), f.read_bytes()) for f in sorted(folder.iterdir())])


def _upload(client, headers, data: bytes, name: str = "draft.tar.gz"):
    return client.post("/v1/drafts", files={"file": (name, data, "application/octet-stream")}, headers=headers)


def test_a_valid_export_is_ready_and_starts_a_job(client, alice, bob, tiny_export) -> None:
    r = _upload(client, alice, _tar_of(tiny_export))
    assert r.status_code == 201, r.text
    up = r.json()
    assert up["status"] == "ready" and up["init_from"] == f"draft:{up['id']}", up
    assert up["report"]["facts"] == {"hidden_size": 64, "vocab_size": 49152, "num_layers": 1,
                                     "aux_layer_ids": [1, 2, 3], "draft_vocab_size": 512, "mask_token_id": 3}
    assert client.get(f"/v1/drafts/{up['id']}", headers=alice).json()["id"] == up["id"]
    assert [d["id"] for d in client.get("/v1/drafts", headers=alice).json()["data"]] == [up["id"]]
    job = client.post("/v1/jobs", headers=alice, json={"preset": "tiny", "overrides": {
        "draft": {"init_from": up["init_from"]}}})
    assert job.status_code == 201, job.text
    assert job.json()["parent"] == {"kind": "draft", "id": up["id"], "step": None, "url": f"/v1/drafts/{up['id']}"}
    # what must match is checked before queueing, naming the field
    bad = client.post("/v1/jobs", headers=alice, json={"preset": "tiny", "overrides": {
        "draft": {"init_from": up["init_from"], "num_layers": 2}}})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "/draft/init_from"
    assert f"uploaded draft {up['id']} has 1 decoder layers" in bad.json()["error"]["message"]
    # a zip of the same folder (files at its root) is a draft too
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for f in sorted(tiny_export.iterdir()):
            zf.writestr(f.name, f.read_bytes())
    assert _upload(client, alice, buf.getvalue(), "d.zip").json()["status"] == "ready"
    # the owner's only
    assert client.get(f"/v1/drafts/{up['id']}", headers=bob).status_code == 404
    assert client.get("/v1/drafts", headers=bob).json()["data"] == []
    theirs = client.post("/v1/jobs", headers=bob, json={"preset": "tiny", "overrides": {
        "draft": {"init_from": up["init_from"]}}})
    assert theirs.status_code == 422 and f"no draft {up['id']!r}" in theirs.json()["error"]["message"]
    assert client.delete(f"/v1/drafts/{up['id']}", headers=alice).status_code == 409  # a queued job names it


def test_an_archive_over_the_limit_is_413(settings_factory, sim, tiny_export) -> None:
    from fastapi.testclient import TestClient

    from api.main import create_app

    headers = {"Authorization": f"Bearer {sim.key('carol', 'write')}"}
    with TestClient(create_app(settings_factory(max_draft_upload_bytes=4096))) as c:
        r = _upload(c, headers, _tar_of(tiny_export))
        assert r.status_code == 413, r.text
        assert c.get("/v1/drafts", headers=headers).json()["data"] == []


def _refused(client, headers, data: bytes) -> str:
    r = _upload(client, headers, data)
    assert r.status_code == 201, r.text
    assert r.json()["status"] == "invalid", r.json()
    return str(r.json()["report"]["error"])


def test_hostile_archives_are_refused_and_write_nothing_outside(client, alice, settings, tmp_path) -> None:
    config = json.dumps({"speculators_model_type": "peagle"}).encode()
    traversal = _tar([(tarfile.TarInfo("../../escaped.txt"), b"x"), (tarfile.TarInfo("config.json"), config)])
    assert "'..'" in _refused(client, alice, traversal)
    absolute = _tar([(tarfile.TarInfo("/tmp/escaped.txt"), b"x")])
    assert "relative paths" in _refused(client, alice, absolute)
    link = tarfile.TarInfo("model.safetensors")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    assert "is a link" in _refused(client, alice, _tar([(tarfile.TarInfo("config.json"), config), (link, None)]))
    hard = tarfile.TarInfo("model.safetensors")
    hard.type, hard.linkname = tarfile.LNKTYPE, "config.json"
    assert "is a link" in _refused(client, alice, _tar([(tarfile.TarInfo("config.json"), config), (hard, None)]))
    dev = tarfile.TarInfo("model.safetensors")
    dev.type, dev.devmajor, dev.devminor = tarfile.CHRTYPE, 1, 3
    assert "is a device" in _refused(client, alice, _tar([(dev, None)]))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        info = zipfile.ZipInfo("model.safetensors")
        info.external_attr = (0o120777 << 16)  # a symlink in a zip
        zf.writestr(info, "/etc/passwd")
    assert "is a link" in _refused(client, alice, buf.getvalue())
    assert "not a tar or zip" in _refused(client, alice, b"just some bytes")
    root = settings.resolved_dataset_root()
    assert not list(root.parent.rglob("escaped.txt")) and not Path("/tmp/escaped.txt").exists()
    # refused uploads keep their report, not their bytes
    assert not [p for p in root.rglob("*") if p.is_file()]


def test_an_archive_that_is_not_a_valid_export_is_invalid_with_the_validators_reasons(client, alice,
                                                                                       tiny_export) -> None:
    assert "no model.safetensors" in _refused(client, alice, _tar([(tarfile.TarInfo("d/config.json"), b"{}")]))
    broken = json.loads((tiny_export / "config.json").read_text())
    broken["eagle_aux_hidden_state_layer_ids"] = [1, 2]
    files = [(tarfile.TarInfo("config.json"), json.dumps(broken).encode()),
             (tarfile.TarInfo("model.safetensors"), (tiny_export / "model.safetensors").read_bytes())]
    error = _refused(client, alice, _tar(files))
    assert "eagle_aux_hidden_state_layer_ids" in error and "/tmp" not in error
    job = client.post("/v1/jobs", headers=alice, json={"preset": "tiny", "overrides": {
        "draft": {"init_from": "draft:" + client.get("/v1/drafts", headers=alice).json()["data"][0]["id"]}}})
    assert job.status_code == 422 and "is invalid" in job.json()["error"]["message"]
