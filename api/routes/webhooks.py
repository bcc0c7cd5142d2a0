"""`/v1/webhooks`: register endpoints for job events, list/get/delete them, send a test, see deliveries.

The API only writes rows; the dispatcher beside the reaper (`worker/webhooks.py`) signs and sends them,
so a slow receiver never delays a request.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import sqlalchemy as sa
from fastapi import APIRouter, Query, Response
from sqlalchemy.orm import Session

from api.deps import DB, Reader, State, Writer, releases_db
from api.errors import ApiError
from api.openapi import AUTH, error_responses, header
from api.responses import json_ok
from api.schemas import DeliveryOut, DeliveryPage, WebhookCreate, WebhookCreated, WebhookOut, WebhookPage
from service import ssrf
from service.db import repo
from service.db import webhooks as wh
from service.db.models import JobEvent, WebhookDelivery, WebhookEndpoint, new_id, utcnow

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])
_ID = re.compile(r"[A-Za-z0-9_]{1,64}")


def _load(session: Session, principal: repo.Principal, webhook_id: str) -> WebhookEndpoint:
    ep = None
    if _ID.fullmatch(webhook_id):
        ep = session.scalar(sa.select(WebhookEndpoint).where(WebhookEndpoint.id == webhook_id,
                                                             WebhookEndpoint.owner_id == principal.owner_id))
    if ep is None:
        raise ApiError(404, "not_found", f"no webhook {webhook_id!r}", param="/webhook_id")
    return ep


@router.post("", status_code=201, response_model=WebhookCreated, operation_id="webhooks-create",
             summary="Register a webhook endpoint (the signing secret is returned once)",
             responses={201: {"description": "The endpoint, with its signing secret.",
                              "headers": {"Location": header("The endpoint's URL.")}},
                        **error_responses(400, *AUTH, 409, 422, descriptions={409: "Too many endpoints."})})
@releases_db
def create_webhook(body: WebhookCreate, state: State, session: DB, principal: Writer) -> Any:
    """Job events of this owner are POSTed to `url`, signed with the returned `whsec_...` secret.

    Only events that happen after registration are sent. The URL must reach a public address (internal
    ones, e.g. loopback, private, link-local or metadata addresses, only when the operator allows them in
    `PEAGLE_WEBHOOK_ALLOW_HOSTS`); this is checked again each time a message is sent.
    """
    try:
        ssrf.check_url(body.url, ssrf.AllowList.parse(state.settings.webhook_allow_hosts))
    except ssrf.RefusedAddress as exc:
        raise ApiError(422, "invalid_url", f"webhook URL refused: {exc}", param="/url") from None
    n = session.scalar(sa.select(sa.func.count()).select_from(WebhookEndpoint)
                       .where(WebhookEndpoint.owner_id == principal.owner_id)) or 0
    limit = state.settings.max_webhooks_per_owner
    if n >= limit:
        raise ApiError(409, "webhook_limit", f"{n} webhook endpoints already (limit {limit}); delete one first")
    start = session.scalar(sa.select(sa.func.coalesce(sa.func.max(JobEvent.id), 0))) or 0
    secret, wid = wh.new_secret(), new_id("wh")
    ep = WebhookEndpoint(id=wid, owner_id=principal.owner_id, url=body.url, description=body.description,
                         events=list(body.events), secret=wh.seal(wh.secret_box(state.settings), wid, secret),
                         start_event_id=int(start), created_at=utcnow())
    session.add(ep)
    session.commit()
    return json_ok(wh.endpoint_out(ep, secret=secret), 201, {"Location": f"/v1/webhooks/{ep.id}"})


@router.get("", response_model=WebhookPage, operation_id="webhooks-list", summary="List webhook endpoints",
            responses=error_responses(*AUTH))
@releases_db
def list_webhooks(session: DB, principal: Reader) -> Any:
    """Every endpoint of the caller's owner (at most `max_webhooks_per_owner`), newest first."""
    rows = session.scalars(sa.select(WebhookEndpoint).where(WebhookEndpoint.owner_id == principal.owner_id)
                           .order_by(WebhookEndpoint.id.desc())).all()
    data = [wh.endpoint_out(r) for r in rows]
    return json_ok({"object": "list", "data": data, "has_more": False, "next_after": None})


@router.get("/{webhook_id}", response_model=WebhookOut, operation_id="webhooks-get", summary="Get a webhook endpoint",
            responses=error_responses(*AUTH, 404, 422))
@releases_db
def get_webhook(webhook_id: str, session: DB, principal: Reader) -> Any:
    """One endpoint (without its secret)."""
    return json_ok(wh.endpoint_out(_load(session, principal, webhook_id)))


@router.delete("/{webhook_id}", status_code=204, operation_id="webhooks-delete",
               summary="Delete a webhook endpoint (pending deliveries are dropped)",
               responses=error_responses(*AUTH, 404, 422))
@releases_db
def delete_webhook(webhook_id: str, session: DB, principal: Writer) -> Response:
    """Delete the endpoint and its delivery history."""
    ep = _load(session, principal, webhook_id)
    session.execute(sa.delete(WebhookDelivery).where(WebhookDelivery.endpoint_id == ep.id))
    session.delete(ep)
    session.commit()
    return Response(status_code=204)


@router.post("/{webhook_id}/test", status_code=202, response_model=DeliveryOut, operation_id="webhooks-test",
             summary="Queue a signed `webhook.test` message to the endpoint",
             responses=error_responses(*AUTH, 404, 422, 429))
@releases_db
def test_webhook(webhook_id: str, state: State, session: DB, principal: Writer) -> Any:
    """The delivery is sent by the dispatcher within about a second; poll its status under `deliveries`.
    At most `webhook_tests_per_minute` per owner (429 with Retry-After past it)."""
    ep = _load(session, principal, webhook_id)
    limit = state.settings.webhook_tests_per_minute
    wait = wh.test_send_wait(session, owner_id=principal.owner_id, per_minute=limit)
    if wait:
        raise ApiError(429, "rate_limited", f"{limit} test messages in the last minute (limit {limit} per owner)",
                       headers={"Retry-After": str(wait)})
    d = wh.add_test_delivery(session, ep)
    session.commit()
    return json_ok(wh.delivery_out(d), 202)


@router.get("/{webhook_id}/deliveries", response_model=DeliveryPage, operation_id="webhooks-deliveries",
            summary="Deliveries to an endpoint (newest first): status, attempts, last response",
            responses=error_responses(*AUTH, 404, 422))
@releases_db
def list_deliveries(
    webhook_id: str, session: DB, principal: Reader,
    after: Annotated[str | None, Query(max_length=64, pattern=r"^[A-Za-z0-9_]*$",
                                       description="Cursor: next_after of the previous page.")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 20,
) -> Any:
    """Cursor pages of deliveries."""
    ep = _load(session, principal, webhook_id)
    stmt = sa.select(WebhookDelivery).where(WebhookDelivery.endpoint_id == ep.id)
    if after:
        stmt = stmt.where(WebhookDelivery.id < after)
    rows = session.scalars(stmt.order_by(WebhookDelivery.id.desc()).limit(limit + 1)).all()
    data = [wh.delivery_out(r) for r in rows[:limit]]
    return json_ok({"object": "list", "data": data, "has_more": len(rows) > limit,
                    "next_after": data[-1]["id"] if data else None})
