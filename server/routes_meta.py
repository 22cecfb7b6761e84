"""The routes about the server rather than a generation: the live page (/), /health, /metrics,
/v1/models and /v1/models/{model_id}. No torch here."""

from __future__ import annotations

from dataclasses import asdict
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dspark_serve.server.errors import ERROR_DOCS, ApiError
from dspark_serve.server.state import AppState, State

router = APIRouter()


def live_page_html() -> str:
    """The live page, read from the installed package's static/ folder."""
    return resources.files("dspark_serve.server").joinpath("static", "index.html").read_text(encoding="utf-8")


@router.get("/", include_in_schema=False)
async def live_page() -> HTMLResponse:
    """The live page: a chat box streaming token provenance and gauges from /metrics
    (server/static/index.html; everything it needs is in that one file)."""
    return HTMLResponse(live_page_html(), headers={"Cache-Control": "no-cache"})


@router.get("/health", responses={503: ERROR_DOCS[503]}, response_model=None)
async def health(state: State) -> JSONResponse | dict[str, str]:
    engine = state.engine
    if state.draining:
        return state.fail(503, "the server is draining (shutting down)", code="draining")
    if engine.ready:
        return {"status": "ok"}
    if engine.load_error:
        return state.fail(503, f"model failed to load: {engine.load_error}", code="load_failed")
    stage = getattr(engine, "loading_stage", None)
    return state.fail(503, f"model is loading: {stage}" if stage else "model is loading", code="loading")


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        200: {
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "description": "Prometheus text exposition",
        }
    },
)
async def metrics(state: State) -> Response:
    return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)


def model_card(state: AppState) -> dict[str, Any]:
    """The served model as /v1/models lists it, with the engine's runtime facts once loaded."""
    entry = {
        "id": state.served_model_name,
        "object": "model",
        "created": 0,
        "owned_by": "dspark-serve",
        "max_model_len": state.engine.max_model_len,
    }
    info = state.engine.runtime_info
    if info is not None:
        entry["runtime"] = asdict(info)
    return entry


@router.get("/v1/models", responses={401: ERROR_DOCS[401]}, response_model=None)
async def models(state: State) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(state)]}


@router.get(
    "/v1/models/{model_id:path}", responses={401: ERROR_DOCS[401], 404: ERROR_DOCS[404]}, response_model=None
)
async def model(model_id: str, state: State) -> dict[str, Any]:
    if model_id != state.served_model_name:
        raise ApiError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")
    return model_card(state)
