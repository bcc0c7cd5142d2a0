"""Browser credentials (issue 19): the API refuses a default or short secret key outside embedded mode; a
cookie forged with the signing key but no server-side session is refused; sign-out revokes the session
(a replayed cookie gets 401); stream tokens are scoped to one job and one purpose."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.auth import SESSION_COOKIE, sign_token
from api.main import create_app

DEFAULT_KEY = "dev-insecure-change-me"


@pytest.mark.parametrize("key", [DEFAULT_KEY, "short-but-not-default", ""])
def test_api_refuses_to_start_with_a_weak_secret_key(settings_factory: Any, key: str) -> None:
    with pytest.raises(RuntimeError, match="PEAGLE_SECRET_KEY"), TestClient(create_app(settings_factory(secret_key=key))):
        pass


def test_embedded_mode_may_keep_the_default_key(settings_factory: Any) -> None:
    with TestClient(create_app(settings_factory(embedded=True, secret_key=DEFAULT_KEY))) as c:
        assert c.get("/healthz").status_code == 200


def test_forged_session_cookie_is_refused(client: TestClient, settings: Any, sim: Any, submit: Any) -> None:
    """Even with the signing key known (the default one, leaked), a cookie that names a key id is not a
    session: reads and writes both answer 401."""
    alice = {"Authorization": f"Bearer {sim.key('alice', 'write')}"}
    submit(client, alice)
    for secret in (settings.secret_key, DEFAULT_KEY):
        forged = sign_token(secret, {"t": "session", "k": 1, "exp": int(time.time()) + 3600})
        client.cookies.set(SESSION_COOKIE, forged)
        assert client.get("/v1/jobs").status_code == 401
        assert client.post("/v1/jobs", json={"preset": "tiny"}).status_code == 401
        client.cookies.clear()


def test_sign_out_revokes_the_session(client: TestClient, sim: Any) -> None:
    key = sim.key("frank", "write")
    r = client.post("/v1/auth/session", json={"api_key": key})
    assert r.status_code == 200
    cookie = client.cookies.get(SESSION_COOKIE)
    assert cookie and client.get("/v1/jobs").status_code == 200
    assert client.delete("/v1/auth/session").status_code == 204
    client.cookies.clear()
    client.cookies.set(SESSION_COOKIE, cookie)  # the replay
    assert client.get("/v1/jobs").status_code == 401
    assert client.get("/v1/auth/session").status_code == 401
    client.cookies.clear()
    # signing in again works, and a second browser's session is independent of the first one's sign-out
    assert client.post("/v1/auth/session", json={"api_key": key}).status_code == 200
    assert client.get("/v1/jobs").status_code == 200


def test_stream_token_is_scoped_to_one_job_and_purpose(client: TestClient, sim: Any, submit: Any) -> None:
    alice = {"Authorization": f"Bearer {sim.key('alice', 'write')}"}
    job_a, job_b = submit(client, alice)["id"], submit(client, alice)["id"]
    sim.set(job_a, status="succeeded")
    sim.set(job_b, status="succeeded")
    r = client.post("/v1/auth/stream-token", json={"job_id": job_a}, headers=alice)
    assert r.status_code == 200, r.text
    tok = r.json()["token"]
    with client.stream("GET", f"/v1/jobs/{job_a}/events/stream?token={tok}") as s:
        assert s.status_code == 200
        assert "event: end" in s.read().decode()
    for kind in ("events", "logs", "metrics"):
        assert client.get(f"/v1/jobs/{job_b}/{kind}/stream?token={tok}").status_code == 401, kind
    # a stream token is not a download token, nor a session cookie
    sim.checkpoint(job_a, 4, {"model.safetensors": b"x" * 10})
    assert client.get(f"/v1/jobs/{job_a}/checkpoints/4/archive?token={tok}").status_code == 401
    client.cookies.set(SESSION_COOKIE, tok)
    assert client.get("/v1/jobs").status_code == 401
    assert client.get(f"/v1/jobs/{job_a}/events/stream").status_code == 401
    client.cookies.clear()
    # a download token for job A downloads A's checkpoint and nothing of job B
    dl = client.post("/v1/auth/stream-token", json={"job_id": job_a, "purpose": "download"}, headers=alice)
    assert dl.status_code == 200, dl.text
    dtok = dl.json()["token"]
    assert client.get(f"/v1/jobs/{job_a}/checkpoints/4/archive?token={dtok}").status_code == 200
    assert client.get(f"/v1/jobs/{job_a}/events/stream?token={dtok}").status_code == 401
    sim.checkpoint(job_b, 4, {"model.safetensors": b"y" * 10})
    assert client.get(f"/v1/jobs/{job_b}/checkpoints/4/archive?token={dtok}").status_code == 401
    # tokens are only minted for the caller's own jobs
    bob = {"Authorization": f"Bearer {sim.key('bob', 'write')}"}
    assert client.post("/v1/auth/stream-token", json={"job_id": job_a}, headers=bob).status_code == 404
