"""Issue 46: one upload path for datasets and drafts, and one sandbox for every validator of tenant bytes.

- the validators run without the service's secrets, never run a tenant's file as code, and a breach of a
  sandbox limit (memory, CPU time) is the upload's refusal naming the limit;
- one per-owner quota counts the bytes on disk of datasets and drafts together: a draft archive that
  unpacks past what is left of it is refused (429) and leaves nothing; uploads in flight hold their bytes;
- drafts have a count and an hourly limit as datasets do;
- a leftover `.partial-*` (an API killed mid-upload) is swept when the API starts.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from api.main import create_app

LINE = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n"
MiB = 1024**2
OK_EXPORT = json.dumps({"ok": True, "violations": [], "warnings": []})


def _key(sim: Any, owner: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {sim.key(owner, 'write')}"}


def _rows(size: int) -> bytes:
    """A ready dataset of about `size` bytes (at most)."""
    return (LINE * max(1, size // len(LINE))).encode()


class _Zeros(io.RawIOBase):
    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        k = min(len(b), self.left)
        b[:k] = bytes(k)
        self.left -= k
        return k


def _draft(zeros: int, *, top: str | None = "d", extra: dict[str, bytes] | None = None) -> bytes:
    """A tar.gz of an export-shaped folder whose model.safetensors is `zeros` zero bytes (a few KB packed)."""
    buf = io.BytesIO()
    prefix = f"{top}/" if top else ""
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in {"config.json": b"{}", **(extra or {})}.items():
            info = tarfile.TarInfo(prefix + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo(prefix + "model.safetensors")
        info.size = zeros
        tar.addfile(info, io.BufferedReader(_Zeros(zeros)))
    return buf.getvalue()


def _up_dataset(c: Any, h: dict, data: bytes, name: str = "chats.jsonl") -> Any:
    return c.post("/v1/datasets", files={"file": (name, data, "application/jsonl")}, headers=h)


def _up_draft(c: Any, h: dict, data: bytes, name: str = "d.tar.gz") -> Any:
    return c.post("/v1/drafts", files={"file": (name, data, "application/octet-stream")}, headers=h)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def _disk(root: Path) -> int:
    """Bytes of the files under `root` now (uploads may delete them meanwhile)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                total += (Path(dirpath) / f).lstat().st_size
    return total


# -- the sandbox -------------------------------------------------------------------------------------------


def test_the_validator_children_see_no_service_secret(settings_factory: Any, sim: Any, monkeypatch: Any) -> None:
    settings = settings_factory(secret_key="the-api-secret-key-of-at-least-32-characters")
    # what the API process's environment holds in production
    for name, value in {"PEAGLE_SECRET_KEY": "the-api-secret-key-of-at-least-32-characters",
                        "PEAGLE_DATABASE_URL": "postgresql+psycopg://peagle:pw@db/peagle",
                        "PEAGLE_BROKER_URL": "redis://:pw@redis/0", "PEAGLE_REDIS_URL": "redis://:pw@redis/1",
                        "PEAGLE_SECRET_KEY_PREVIOUS": "old", "AWS_SECRET_ACCESS_KEY": "aws"}.items():
        monkeypatch.setenv(name, value)
    env_report = "import json, os; print(json.dumps({'ok': True, 'format': 'messages', 'rows_kept': 3, 'env': dict(os.environ)}))"
    monkeypatch.setattr("api.dataset_checks.validator_command", lambda path, fmt, s: _python(env_report))
    env_verdict = "import json, os; print(json.dumps({'ok': False, 'violations': [json.dumps(dict(os.environ))]}))"
    monkeypatch.setattr("api.uploads.export_validator_command", lambda folder: _python(env_verdict))
    with TestClient(create_app(settings)) as c:
        h = _key(sim, "vera")
        ds = _up_dataset(c, h, _rows(1000)).json()
        draft = _up_draft(c, h, _draft(1000)).json()
    seen = [ds["report"]["env"], json.loads(draft["report"]["errors"][0])]
    for env in seen:
        assert not [k for k in env if k.startswith("PEAGLE_") or "SECRET" in k or k.endswith("_URL")], env
        assert settings.secret_key not in json.dumps(env)
        assert env["HOME"] != os.environ.get("HOME") and "PATH" in env


def test_a_tenants_file_is_never_run_as_code_by_a_validator(client: TestClient, alice: dict, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    payload = f"open({str(marker)!r}, 'a').write(repr(__import__('os').environ))\n".encode()
    # `python -m peagle.data.formats json.py` in the upload's folder: `import json` must not find this file
    ds = _up_dataset(client, alice, payload, name="json.py")
    assert ds.status_code == 201, ds.text
    # a draft whose export folder is named after a module the validator imports
    draft = _up_draft(client, alice, _draft(100, top="json", extra={"__init__.py": payload}))
    assert draft.status_code == 201, draft.text
    assert not marker.exists(), marker.read_text()[:200]


def test_a_sandbox_breach_is_the_uploads_refusal_naming_the_limit(settings_factory: Any, sim: Any,
                                                                  monkeypatch: Any) -> None:
    settings = settings_factory(sandbox_memory_bytes=256 * MiB, sandbox_cpu_seconds=1)
    command = {"code": "b = bytearray(1 << 30)"}
    monkeypatch.setattr("api.dataset_checks.validator_command", lambda path, fmt, s: _python(command["code"]))
    monkeypatch.setattr("api.uploads.export_validator_command", lambda folder: _python(command["code"]))
    with TestClient(create_app(settings)) as c:
        h = _key(sim, "walt")
        ds = _up_dataset(c, h, _rows(1000)).json()
        assert ds["status"] == "invalid", ds
        assert ds["report"]["error"] == "validation stopped: it exceeded the 256 MiB memory limit", ds["report"]
        draft = _up_draft(c, h, _draft(1000)).json()
        assert draft["status"] == "invalid"
        assert draft["report"]["error"] == "validation stopped: it exceeded the 256 MiB memory limit", draft
        command["code"] = "while True: pass"
        ds = _up_dataset(c, h, _rows(1000)).json()
        assert ds["status"] == "invalid"
        assert ds["report"]["error"] == "validation stopped: it exceeded the CPU time limit of 1 s", ds["report"]
        for up in (ds, draft):
            assert "internal error" not in json.dumps(up["report"])
    assert not _files(settings.resolved_dataset_root())  # refused: no bytes kept


# -- one quota, one path ----------------------------------------------------------------------------------


def test_a_draft_that_unpacks_past_the_remaining_quota_is_refused_and_leaves_nothing(settings_factory: Any,
                                                                                      sim: Any) -> None:
    settings = settings_factory(max_upload_bytes_per_owner=20 * MiB)
    archive = _draft(30 * MiB)
    assert len(archive) < 100 * 1024  # a few KB on the wire: the archive alone is far under the quota
    with TestClient(create_app(settings)) as c:
        h = _key(sim, "xena")
        r = _up_draft(c, h, archive)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "quota_exceeded" and "unpack" in r.json()["error"]["message"]
        assert c.get("/v1/drafts", headers=h).json()["data"] == []
    assert not _files(settings.resolved_dataset_root())
    assert not list(settings.resolved_dataset_root().rglob(".partial-*"))


def test_datasets_and_drafts_share_one_quota_of_bytes_on_disk(settings_factory: Any, sim: Any,
                                                              monkeypatch: Any) -> None:
    monkeypatch.setattr("api.uploads.export_validator_command", lambda folder: _python(f"print({OK_EXPORT!r})"))
    quota = 8 * MiB
    settings = settings_factory(max_upload_bytes_per_owner=quota, max_upload_bytes=quota)
    root = settings.resolved_dataset_root()
    with TestClient(create_app(settings)) as c:
        h = _key(sim, "yuri")
        archive = _draft(5 * MiB)
        draft = _up_draft(c, h, archive).json()
        assert draft["status"] == "ready", draft
        on_disk = _disk(root)
        # the quota counts the unpacked files (no archive is kept); the response's size stays the archive's
        assert draft["report"]["unpacked_bytes"] == on_disk == 5 * MiB + 2
        assert draft["size"] == draft["report"]["archive_bytes"] == len(archive)
        assert not [p for p in _files(root) if p.name.endswith(".tar.gz")]
        # a dataset past what the draft left is refused, as it would be past another dataset
        r = _up_dataset(c, h, _rows(quota - on_disk + 4096))
        assert r.status_code == 429 and r.json()["error"]["code"] == "quota_exceeded", r.text
        ds = _up_dataset(c, h, _rows(2 * MiB)).json()
        assert ds["status"] == "ready" and ds["size"] == _disk(root) - on_disk
        # and a draft past what both left is refused while unpacking
        r = _up_draft(c, h, _draft(quota - _disk(root) + 1))
        assert r.status_code == 429 and r.json()["error"]["code"] == "quota_exceeded", r.text
        # deleting the draft frees its unpacked bytes
        assert c.delete(f"/v1/drafts/{draft['id']}", headers=h).status_code == 204
        assert _up_dataset(c, h, _rows(4 * MiB)).status_code == 201


def test_drafts_have_a_count_and_an_hourly_limit(settings_factory: Any, sim: Any) -> None:
    with TestClient(create_app(settings_factory(max_drafts_per_owner=2))) as c:
        h, other = _key(sim, "zack"), _key(sim, "zora")
        for _ in range(2):
            assert _up_draft(c, h, b"not an archive").status_code == 201
        r = _up_draft(c, h, b"not an archive")
        assert r.status_code == 409 and r.json()["error"]["code"] == "draft_limit_reached", r.text
        assert _up_draft(c, other, b"not an archive").status_code == 201  # per owner
        assert _up_dataset(c, h, _rows(1000)).status_code == 201  # per kind
    with TestClient(create_app(settings_factory(max_draft_uploads_per_hour=1))) as c:
        h = _key(sim, "abel")
        assert _up_draft(c, h, b"not an archive").status_code == 201
        r = _up_draft(c, h, b"not an archive")
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited", r.text
        assert 0 < int(r.headers["Retry-After"]) <= 3600


def test_concurrent_uploads_of_one_owner_never_hold_more_than_the_quota(settings_factory: Any, sim: Any,
                                                                        live_server: Any, monkeypatch: Any) -> None:
    """Three drafts at once, each unpacking to 40% of the quota and held while validated: the third is
    refused (before: all three unpacked at once, whatever the quota)."""
    slow = ("import json, time; time.sleep(2); "
            "print(json.dumps({'ok': False, 'violations': ['not served']}))")
    monkeypatch.setattr("api.uploads.export_validator_command", lambda folder: _python(slow))
    quota = 30 * MiB
    settings = settings_factory(max_upload_bytes_per_owner=quota, max_concurrent_validations=3)
    root = settings.resolved_dataset_root()
    key = _key(sim, "bea")
    archive = _draft(12 * MiB)
    codes: list[int] = []
    peak = {"bytes": 0}
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak["bytes"] = max(peak["bytes"], _disk(root))
            time.sleep(0.01)

    def one() -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as hc:
            codes.append(_up_draft(hc, key, archive).status_code)

    with live_server(create_app(settings)) as srv:
        watcher = threading.Thread(target=watch)
        watcher.start()
        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        watcher.join()
    assert sorted(codes) == [201, 201, 429], codes
    assert 24 * MiB <= peak["bytes"] <= quota, peak
    assert not _files(root)  # the two that got in were invalid: nothing kept


def test_the_quota_ledger_holds_bytes_in_flight() -> None:
    from api.uploads import QuotaExceeded, QuotaLedger

    ledger = QuotaLedger()
    a, b = ledger.hold(1, "draft", quota=100), ledger.hold(1, "dataset", quota=100)
    a.settle_base(10)
    b.settle_base(999)  # read later: the ledger keeps the first reading while uploads are in flight
    a.take(50)
    with pytest.raises(QuotaExceeded) as exc:
        b.take(41)
    assert exc.value.left == 40
    b.take(40)
    assert a.in_flight("dataset") == 1 and a.in_flight("draft") == 0  # the others of a kind
    a.commit(50)  # its row is in the database: still counted until the ledger reads it again
    a.close()
    with pytest.raises(QuotaExceeded):
        b.take(1)
    b.close()  # refused or invalid: its bytes are given back
    c = ledger.hold(1, "dataset", quota=100)
    c.settle_base(60)  # nobody in flight: the database is read again
    c.take(40)
    other = ledger.hold(2, "dataset", quota=100)
    other.settle_base(0)
    other.take(100)  # per owner
    c.close()
    other.close()
    assert not ledger.owners()


# -- temporary names ----------------------------------------------------------------------------------------


def test_leftover_partial_uploads_are_swept_at_start_up(settings_factory: Any) -> None:
    settings = settings_factory()
    owner = settings.resolved_dataset_root() / "7"
    old = time.time() - 3 * 3600
    leftovers = [owner / ".partial-ds_old" / "chats.jsonl", owner / ".partial-drf_old" / "upload" / "d.tar.gz",
                 owner / ".partial-stray"]
    kept = [owner / ".partial-ds_fresh" / "chats.jsonl", owner / "ds_done" / "chats.jsonl"]
    for p in leftovers + kept:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * 1000)
    for p in [*leftovers, kept[1], *(q.parent for q in leftovers[:2]), leftovers[1].parent.parent, kept[1].parent]:
        os.utime(p, (old, old))
    with TestClient(create_app(settings)):
        pass
    assert not [p for p in leftovers if p.exists()] and not (owner / ".partial-ds_old").exists()
    assert not (owner / ".partial-drf_old").exists()
    assert all(p.exists() for p in kept)  # an upload in flight (another API process) and a stored dataset


def test_an_archive_is_decompressed_in_the_sandbox_never_in_the_api(settings_factory: Any, sim: Any,
                                                                    monkeypatch: Any) -> None:
    """Decompressing is parsing the tenant's bytes (an xz header can ask for a dictionary of gigabytes):
    the API process itself never opens the archive; the sandboxed `python -m api.archives` children do, with
    the archive's declared size reserved before and the largest file they may write bounded by it."""
    import api.archives
    import api.uploads
    from peagle.engine import sandbox

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("the API process decompressed an uploaded archive")

    for module in (api.archives, api.uploads):
        for name in ("unpack_export", "declared_size", "_entries_tar", "_entries_zip"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, refuse)
    children: list[tuple[list[str], int]] = []
    real_run = sandbox.run

    async def run(cmd: Any, **kw: Any) -> Any:
        children.append(([str(c) for c in cmd], kw["limits"].file_bytes))
        return await real_run(cmd, **kw)

    monkeypatch.setattr(sandbox, "run", run)
    monkeypatch.setattr(api.uploads, "export_validator_command",
                        lambda folder: _python(f"print({OK_EXPORT!r})"))
    settings = settings_factory()
    with TestClient(create_app(settings)) as c:
        r = _up_draft(c, _key(sim, "yuri"), _draft(3 * MiB))
        assert r.status_code == 201 and r.json()["status"] == "ready", r.text
    steps = [(cmd[cmd.index("api.archives") + 1], limit) for cmd, limit in children if "api.archives" in cmd]
    assert [s for s, _ in steps] == ["size", "unpack"], children
    assert steps[1][1] == 3 * MiB + 2 + 1  # the two files' declared bytes (+1: RLIMIT_FSIZE is exclusive)
