"""Operations and metadata: `/healthz`, `/readyz`, Prometheus `/metrics`, presets, spec JSON schema, `/v1/meta`."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from api.deps import State
from api.schemas import MetaOut, Readiness
from peagle.spec import BUILTIN_DATA, BUILTIN_TARGETS, PHASES, TrainSpec, preset, preset_names
from peagle.spec import metrics as metric_keys
from peagle.spec.funnel import REASONS as FUNNEL_REASONS
from service.db import states

router = APIRouter(tags=["meta"])


@router.get("/healthz", operation_id="meta-healthz", summary="Liveness (the process answers)")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", operation_id="meta-readyz", summary="Readiness: database and broker answer",
            response_model=Readiness,
            responses={503: {"model": Readiness, "description": "A dependency is down (see `checks`)."}})
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


def spec_enums(schema: dict[str, Any] | None = None) -> dict[str, list[Any]]:
    """`{JSON pointer: allowed values}` of every enumerated field of the spec (`Literal` fields), read from
    the spec's own JSON schema (array items are `*`)."""
    schema = schema or TrainSpec.model_json_schema()
    defs = schema.get("$defs", {})
    out: dict[str, list[Any]] = {}

    def walk(node: dict[str, Any], path: str, depth: int) -> None:
        if depth > 16:
            return
        if "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[-1]]
        if "enum" in node or "const" in node:  # Literal[...] (one value: `const`)
            out[path] = list(node["enum"]) if "enum" in node else [node["const"]]
            return
        for sub in (*node.get("anyOf", ()), *node.get("allOf", ())):
            walk(sub, path, depth + 1)
        for name, prop in node.get("properties", {}).items():
            walk(prop, f"{path}/{name}", depth + 1)
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}/*", depth + 1)

    walk(schema, "", 0)
    return out


@router.get("/v1/meta", response_model=MetaOut, operation_id="meta-meta",
            summary="Job states, allowed actions, run phases, spec enums and metric keys (for clients)")
def meta() -> dict[str, Any]:
    return {
        "object": "meta",
        "states": list(states.ALL_STATES),
        "terminal_states": [s for s in states.ALL_STATES if s in states.TERMINAL],
        "actions_by_state": {s: [*states.actions_in(s), "clone"] for s in states.ALL_STATES},
        "phases": list(PHASES),
        "enums": spec_enums(),
        "suggestions": {"/target/model": list(BUILTIN_TARGETS), "/data/sources/*/path": list(BUILTIN_DATA)},
        "metric_keys": dict(metric_keys.key_patterns()),
        "funnel_reasons": dict(FUNNEL_REASONS),
    }
