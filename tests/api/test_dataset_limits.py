"""Issue 19: dataset uploads are bounded (row size, nesting, format, count, rate, validator concurrency)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
from fastapi.testclient import TestClient

from api.main import create_app

LINE = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
ROWS = ((LINE + "\n") * 3).encode()


def _upload(client: Any, headers: dict, data: bytes = ROWS, name: str = "chats.jsonl", **form: str) -> Any:
    return client.post("/v1/datasets", files={"file": (name, data, "application/jsonl")}, data=form or None,
                       headers=headers)


def _no_traceback(ds: dict[str, Any]) -> None:
    text = json.dumps(ds)
    assert "Traceback" not in text and "RecursionError" not in text and ".py" not in text, text[:1000]


def test_deep_nesting_is_a_clean_invalid_report(client: TestClient, alice: dict) -> None:
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = _upload(client, alice, (deep + "\n").encode())
    assert r.status_code == 201, r.text
    ds = r.json()
    _no_traceback(ds)
    assert ds["status"] == "invalid"
    assert "line 1" in ds["report"]["error"] and "too_deep" in ds["report"]["error"]
    # one deep row among good ones: skipped, named; the rest is usable
    ds = _upload(client, alice, ROWS + (deep + "\n").encode() + ROWS).json()
    _no_traceback(ds)
    assert ds["status"] == "ready" and ds["report"]["bad_rows"][0]["line"] == 4
    # the same inside a JSON array: the container is unreadable past it -> invalid, naming the line
    arr = ("[\n" + LINE + ",\n" + deep + "\n]").encode()
    ds = _upload(client, alice, arr, name="a.json").json()
    _no_traceback(ds)
    assert ds["status"] == "invalid" and "line 3" in ds["report"]["error"]


def test_row_size_cap(settings_factory: Any, sim: Any) -> None:
    with TestClient(create_app(settings_factory(max_dataset_row_bytes=4096))) as c:
        h = {"Authorization": f"Bearer {sim.key('dora', 'write')}"}
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 5000},
                                       {"role": "assistant", "content": "y"}]})
        ds = _upload(c, h, ROWS + (big + "\n").encode()).json()
        assert ds["status"] == "invalid", ds
        assert "line 4" in ds["report"]["error"] and "4096" in ds["report"]["error"]
        assert ds["report"]["skipped_by_reason"] == {"row_too_large": 1}
        arr = ("[" + LINE + ",\n" + big + "]").encode()
        ds = _upload(c, h, arr, name="a.json").json()
        assert ds["status"] == "invalid" and "4096" in ds["report"]["error"]
        assert _upload(c, h).json()["status"] == "ready"


def test_unknown_format_is_a_422(client: TestClient, alice: dict, settings: Any) -> None:
    r = _upload(client, alice, format="sharegtp")
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "/format"
    assert not list(settings.resolved_dataset_root().rglob("*.jsonl"))  # nothing kept
    assert _upload(client, alice, format="messages").json()["format"] == "messages"


def test_dataset_count_limit(settings_factory: Any, sim: Any) -> None:
    with TestClient(create_app(settings_factory(max_datasets_per_owner=2))) as c:
        h = {"Authorization": f"Bearer {sim.key('erin', 'write')}"}
        other = {"Authorization": f"Bearer {sim.key('fred', 'write')}"}
        assert _upload(c, h).status_code == 201 and _upload(c, h).status_code == 201
        r = _upload(c, h)
        assert r.status_code == 409 and r.json()["error"]["code"] == "dataset_limit_reached", r.text
        assert _upload(c, other).status_code == 201  # per owner


def test_dataset_upload_rate_limit(settings_factory: Any, sim: Any) -> None:
    with TestClient(create_app(settings_factory(max_dataset_uploads_per_hour=2))) as c:
        h = {"Authorization": f"Bearer {sim.key('gabe', 'write')}"}
        assert _upload(c, h).status_code == 201 and _upload(c, h).status_code == 201
        r = _upload(c, h)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited", r.text
        assert 0 < int(r.headers["Retry-After"]) <= 3600


def test_validator_subprocesses_are_capped(settings_factory: Any, sim: Any, live_server: Any,
                                           monkeypatch: Any) -> None:
    running = {"now": 0, "max": 0}
    real = asyncio.create_subprocess_exec

    class SlowValidator:
        returncode = 0

        async def communicate(self) -> tuple[bytes, bytes]:
            running["now"] += 1
            running["max"] = max(running["max"], running["now"])
            await asyncio.sleep(0.4)
            running["now"] -= 1
            return json.dumps({"ok": True, "format": "messages", "rows_kept": 3}).encode() + b"\n", b""

        async def wait(self) -> int:
            return 0

        def kill(self) -> None:
            pass

    async def fake(*args: Any, **kw: Any) -> Any:
        if "peagle.data.formats" in args:
            return SlowValidator()
        return await real(*args, **kw)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", fake)
    key = sim.key("hana", "write")
    with live_server(create_app(settings_factory(max_concurrent_validations=1))) as srv:
        codes: list[int] = []

        def one() -> None:
            with httpx.Client(base_url=srv.url, timeout=30) as hc:
                codes.append(_upload(hc, {"Authorization": f"Bearer {key}"}).status_code)

        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert codes == [201, 201, 201]  # the excess waited for a slot
    assert running["max"] == 1


def test_invalid_uploads_can_be_deleted_and_do_not_count_against_the_quota(settings_factory: Any, sim: Any,
                                                                            submit: Any) -> None:
    """An upload that failed validation keeps its report but not its bytes: they do not count against the
    owner's byte quota, and it can be deleted (also a ready one, unless an unfinished job names it)."""
    bad = b"{not json\n" * 400  # 4000 bytes, invalid
    settings = settings_factory(max_upload_bytes_per_owner=len(bad) + len(ROWS) + 10)
    with TestClient(create_app(settings)) as c:
        h = {"Authorization": f"Bearer {sim.key('hana', 'write')}"}
        invalid = _upload(c, h, bad).json()
        assert invalid["status"] == "invalid"
        for _ in range(2):  # the invalid bytes leave room for these (quota: one invalid + one ready upload)
            r = _upload(c, h)
            assert r.status_code == 201 and r.json()["status"] == "ready", r.text
        folder = settings.resolved_dataset_root()
        assert list(folder.glob(f"*/{invalid['id']}")) == []  # the report is kept, not the bytes
        assert c.delete(f"/v1/datasets/{invalid['id']}", headers=h).status_code == 204
        assert c.get(f"/v1/datasets/{invalid['id']}", headers=h).status_code == 404
        assert c.delete(f"/v1/datasets/{invalid['id']}", headers=h).status_code == 404
        ready = c.get("/v1/datasets", headers=h).json()["data"]
        other = {"Authorization": f"Bearer {sim.key('ivan', 'write')}"}
        assert c.delete(f"/v1/datasets/{ready[0]['id']}", headers=other).status_code == 404
        # a queued job names the first one: refused while it is unfinished, then allowed
        job = submit(c, h, preset="tiny", overrides={"data": {"sources": [{"path": ready[0]["path_ref"]}]}})
        r = c.delete(f"/v1/datasets/{ready[0]['id']}", headers=h)
        assert r.status_code == 409 and r.json()["error"]["code"] == "dataset_in_use" and job["id"] in r.text
        sim.set(job["id"], status="cancelled")
        assert c.delete(f"/v1/datasets/{ready[0]['id']}", headers=h).status_code == 204
        assert list(folder.glob(f"*/{ready[0]['id']}")) == [] and list(folder.glob(f"*/{ready[1]['id']}"))
        assert c.delete(f"/v1/datasets/{ready[1]['id']}", headers=h).status_code == 204
        assert c.get("/v1/datasets", headers=h).json()["data"] == []
