"""Webhook signing secrets at rest (issue 19): the database row never holds the secret in plaintext, yet
deliveries still verify with the independent `standardwebhooks` package; the key can be rotated
(`secret_key_previous`), and migration 0003 encrypts the plaintext secrets of an existing database."""

from __future__ import annotations

import base64
import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from standardwebhooks import Webhook

from api.main import create_app
from service.db import upgrade
from service.db.session import make_engine, make_session_factory
from service.settings import get_settings
from tests.api.test_webhooks import Receiver, wait_for
from worker.webhooks import run_dispatcher

KEY_A = "a" * 20 + "-first-server-secret-key"
KEY_B = "b" * 20 + "-second-server-secret-key"


def _raw_rows(url: str) -> list[str]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return [" ".join(map(str, row)) for row in conn.execute(sa.text("SELECT * FROM webhook_endpoint"))]
    finally:
        engine.dispose()


def _dispatch(settings: Any, until: Any) -> None:
    engine = make_engine(settings.resolved_database_url())
    stop = threading.Event()
    t = threading.Thread(target=run_dispatcher, args=(settings, make_session_factory(engine), stop), daemon=True)
    t.start()
    try:
        wait_for(until, what="deliveries")
    finally:
        stop.set()
        t.join(timeout=20)
        engine.dispose()


def _assert_not_plaintext(rows: list[str], secret: str) -> None:
    raw = base64.b64decode(secret.removeprefix("whsec_"))
    for row in rows:
        assert secret not in row and secret.removeprefix("whsec_") not in row, row
        assert base64.b64encode(raw).decode() not in row and raw.hex() not in row, row


def test_secret_encrypted_at_rest_and_deliveries_verify(settings_factory: Any, sim: Any, db_url: str) -> None:
    rec = Receiver()
    common = dict(webhook_allow_hosts="127.0.0.1", webhook_poll_seconds=0.05, webhook_retry_base_seconds=0.2)
    alice = {"Authorization": f"Bearer {sim.key('alice', 'write')}"}
    try:
        with TestClient(create_app(settings_factory(secret_key=KEY_A, **common))) as client:
            r = client.post("/v1/webhooks", json={"url": rec.url, "events": ["job.failed"]}, headers=alice)
            assert r.status_code == 201, r.text
            wid, secret = r.json()["id"], r.json()["secret"]
            assert secret.startswith("whsec_")
            _assert_not_plaintext(_raw_rows(db_url), secret)
            assert client.post(f"/v1/webhooks/{wid}/test", headers=alice).status_code == 202
            _dispatch(settings_factory(secret_key=KEY_A, **common), lambda: len(rec.requests) >= 1)
            Webhook(secret).verify(rec.requests[0]["body"], rec.requests[0]["headers"])
            before = _raw_rows(db_url)
        # rotation: the new key signs with the old one still accepted for reading; the row is re-encrypted
        rotated = settings_factory(secret_key=KEY_B, secret_key_previous=KEY_A, **common)
        with TestClient(create_app(rotated)) as client:
            assert client.post(f"/v1/webhooks/{wid}/test", headers=alice).status_code == 202
        _dispatch(rotated, lambda: len(rec.requests) >= 2)
        Webhook(secret).verify(rec.requests[1]["body"], rec.requests[1]["headers"])
        after = _raw_rows(db_url)
        assert after != before
        _assert_not_plaintext(after, secret)
        # ... and the old key is no longer needed
        only_b = settings_factory(secret_key=KEY_B, **common)
        with TestClient(create_app(only_b)) as client:
            assert client.post(f"/v1/webhooks/{wid}/test", headers=alice).status_code == 202
        _dispatch(only_b, lambda: len(rec.requests) >= 3)
        Webhook(secret).verify(rec.requests[2]["body"], rec.requests[2]["headers"])
    finally:
        rec.close()


def test_migration_encrypts_existing_plaintext_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.db.webhooks import new_secret

    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0002")
    secret = new_secret()
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO owner (id, name, created_at) VALUES (1, 'old', '2026-01-01 00:00:00')"))
        conn.execute(sa.text("INSERT INTO webhook_endpoint (id, owner_id, url, description, events, secret, "
                             "start_event_id, created_at) VALUES ('wh_old', 1, 'https://example.com/h', '', "
                             "'[\"job.failed\"]', :s, 0, '2026-01-01 00:00:00')"), {"s": secret})
    engine.dispose()
    monkeypatch.setenv("PEAGLE_SECRET_KEY", KEY_A)
    upgrade(url)
    _assert_not_plaintext(_raw_rows(url), secret)
    from service.db import webhooks as wh

    engine = make_engine(url)
    with make_session_factory(engine)() as s:
        box = wh.secret_box(get_settings(secret_key=KEY_A))
        stored = s.scalar(sa.text("SELECT secret FROM webhook_endpoint WHERE id = 'wh_old'"))
        assert box.decrypt(stored, aad=b"wh_old") == secret
    engine.dispose()
