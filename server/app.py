"""The HTTP layer: OpenAI-compatible routes over an EngineClient. No torch here.

`build_app` wires the pieces, each in its own module:

- `state.py`: what the routes share (`AppState`: engine, configuration, metrics);
- `guard.py`: the API key and the request body's limits, in front of every route;
- `errors.py`: every error as OpenAI's JSON, counted by status;
- `routes_meta.py`: the live page, /health, /metrics, /v1/models;
- `routes_generate.py`: /v1/chat/completions and /v1/completions, which read the request
  (`body.py`, `protocol.py`), turn it into engine parameters (`params.py`), run it on the
  engine (`generate.py`) and render the response whole or streamed (`render.py`);
- `openapi.py`: /openapi.json.
"""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from dspark_serve.scheduler.client import EngineClient
from dspark_serve.server import routes_generate, routes_meta
from dspark_serve.server.config import ServerConfig
from dspark_serve.server.errors import install_error_handlers
from dspark_serve.server.guard import Guard
from dspark_serve.server.openapi import install_openapi
from dspark_serve.server.routes_meta import live_page_html
from dspark_serve.server.state import AppState

__all__ = ["build_app", "live_page_html"]


def build_app(engine: EngineClient, config: ServerConfig, registry: CollectorRegistry) -> FastAPI:
    """The ASGI app serving `engine`; its error counter goes to `registry`."""
    app = FastAPI(title="dspark-serve", docs_url=None, redoc_url=None)
    state = AppState.create(engine, config, registry)
    app.state.dspark = state
    app.add_middleware(Guard, config=config, on_error=state.count_error, busy=state.engine_busy)
    install_error_handlers(app, state.fail)
    app.include_router(routes_meta.router)
    app.include_router(routes_generate.router)
    install_openapi(app, state)
    return app
