"""Stream and download tokens minted by a browser session die with it: signing out revokes them at once in
the process that signed out (its cached principal dropped) and within `ttl_s` in another API process."""

from __future__ import annotations

import time
from typing import Any

from fastapi.testclient import TestClient

from api.main import create_app


def _tokens(c: TestClient, job_id: str, **headers: str) -> tuple[str, str]:
    got = []
    for purpose in ("stream", "download"):
        r = c.post("/v1/auth/stream-token", json={"job_id": job_id, "purpose": purpose}, headers=headers)
        assert r.status_code == 200, r.text
        got.append(r.json()["token"])
    return got[0], got[1]


def _uses(c: TestClient, job_id: str, stream: str, download: str) -> tuple[int, int]:
    s = c.get(f"/v1/jobs/{job_id}/events/stream", params={"token": stream})  # the job ended: the stream ends
    d = c.get(f"/v1/jobs/{job_id}/checkpoints/4/files/model.safetensors", params={"token": download})
    return s.status_code, d.status_code


def test_sign_out_revokes_the_sessions_stream_and_download_tokens(settings: Any, sim: Any) -> None:
    key = sim.key("alice", "write")
    with TestClient(create_app(settings)) as a, TestClient(create_app(settings)) as b:
        b.app.state.peagle.principals.ttl_s = 0.5  # the other process's cache: short, to see it expire
        assert a.post("/v1/auth/session", json={"api_key": key}).status_code == 200
        jid = a.post("/v1/jobs", json={"preset": "tiny"}).json()["id"]
        sim.checkpoint(jid, 4, {"model.safetensors": b"w"})
        sim.set(jid, status="succeeded")
        stream, download = _tokens(a, jid)
        keyed = _tokens(a, jid, Authorization=f"Bearer {key}")  # minted with the API key: no session
        assert _uses(a, jid, stream, download) == (200, 200)
        assert _uses(b, jid, stream, download) == (200, 200)  # cached in both processes now
        assert a.delete("/v1/auth/session").status_code == 204
        assert _uses(a, jid, stream, download) == (401, 401)
        time.sleep(0.6)
        assert _uses(b, jid, stream, download) == (401, 401)
        assert _uses(a, jid, *keyed) == (200, 200) and _uses(b, jid, *keyed) == (200, 200)
