"""Operations and metadata: `/healthz`, `/readyz`, Prometheus `/metrics`, presets, spec JSON schema."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from api.deps import State
from peagle.spec import TrainSpec, preset, preset_names

router = APIRouter(tags=["meta"])


@router.get("/healthz", operation_id="meta-healthz", summary="Liveness (the process answers)")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", operation_id="meta-readyz", summary="Readiness: database and broker answer",
            responses={503: {"description": "a dependency is down"}})
async def readyz(state: State) -> Any:
    def db_ok() -> bool:
        try:
            with state.engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
            return True
        except Exception:  # noqa: BLE001 - any failure means not ready
            return False

    checks = {"database": await run_in_threadpool(db_ok),
              "broker": await run_in_threadpool(state.producer.ping)}
    if state.redis is not None:
        try:
            checks["redis"] = bool(await state.redis.ping())
        except Exception:  # noqa: BLE001
            checks["redis"] = False
    ok = all(checks.values())
    return JSONResponse({"status": "ok" if ok else "unavailable", "checks": checks}, status_code=200 if ok else 503)


@router.get("/metrics", operation_id="meta-metrics", summary="Prometheus metrics of the service",
            response_class=Response, responses={200: {"content": {"text/plain": {}}}})
def metrics(state: State) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/presets", operation_id="meta-presets", summary="Preset names and their full specs")
def presets() -> dict[str, Any]:
    return {"object": "list", "data": [{"name": n, "spec": preset(n).model_dump(mode="json")}
                                       for n in preset_names()]}


@router.get("/v1/spec/schema", operation_id="meta-spec-schema", summary="JSON schema of the job spec (TrainSpec)")
def spec_schema() -> dict[str, Any]:
    return TrainSpec.model_json_schema()
