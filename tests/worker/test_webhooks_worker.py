"""A job run by a real worker (fake trainer) triggers signed status and checkpoint webhooks, delivered by
the dispatcher thread of the real reaper process to a real HTTP receiver on loopback."""

from __future__ import annotations

import json
import time

import pytest
from standardwebhooks import Webhook

from service.db import webhooks as wh
from service.db.models import Owner, WebhookEndpoint
from service.db.session import session_scope
from tests.api.test_webhooks import Receiver

pytestmark = pytest.mark.integration


def test_worker_job_triggers_webhooks(make_stack, backend, spec_for):
    stack = make_stack(backend)
    rec = Receiver(lambda n: 500 if n == 1 else 200)  # the first delivery is retried
    try:
        with session_scope(stack.factory) as s:
            owner = Owner(name="tests")
            s.add(owner)
            s.flush()
            ep = WebhookEndpoint(owner_id=owner.id, url=rec.url, description="", secret=wh.new_secret(),
                                 events=["job.status_changed", "job.succeeded", "job.checkpoint_saved"],
                                 start_event_id=0)
            s.add(ep)
            s.flush()
            secret = ep.secret
        stack.start_worker()
        stack._spawn(["-m", "worker.reaper", "--interval", "0.5"], "reaper",
                     {"PEAGLE_WEBHOOK_POLL_SECONDS": "0.1", "PEAGLE_WEBHOOK_RETRY_BASE_SECONDS": "0.2",
                      "PEAGLE_WEBHOOK_ALLOW_HOSTS": "127.0.0.1"})  # the receiver is on loopback
        job_id = stack.submit(spec_for(steps=8, every=4))
        assert stack.wait_status(job_id, "succeeded", "failed", timeout=90).status == "succeeded"

        def unique() -> dict[str, dict]:
            return {r["headers"]["webhook-id"]: json.loads(r["body"]) for r in rec.requests}

        deadline = time.monotonic() + 30
        while (len(unique()) < 6 or len(rec.requests) < 7) and time.monotonic() < deadline:
            time.sleep(0.1)
        for req in rec.requests:
            Webhook(secret).verify(req["body"], req["headers"])
        got = [(b["type"], b["data"].get("status") or b["data"].get("step")) for b in unique().values()]
        # the job is created as the API creates it (service.db.jobs.create_job): its `queued` state is an event too
        assert sorted(got, key=str) == sorted([("job.status_changed", "queued"), ("job.status_changed", "running"), ("job.checkpoint_saved", 4),
                                               ("job.checkpoint_saved", 8), ("job.status_changed", "succeeded"),
                                               ("job.succeeded", "succeeded")], key=str), (got, stack.logs())
        time.sleep(0.5)  # nothing more arrives
        assert len(rec.requests) == 7  # 6 messages, the first one twice (after its 500)
        assert rec.requests[0]["headers"]["webhook-id"] in [r["headers"]["webhook-id"] for r in rec.requests[1:]]
        assert all(b["data"]["job_id"] == job_id for b in unique().values())
    finally:
        rec.close()
