"""What every route shares: the engine client, the server's configuration, the metrics
registry and its error counter. One `AppState` per app, built by `build_app`. No torch here."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter

from dspark_serve.scheduler.client import EngineClient
from dspark_serve.scheduler.limits import LimitError, check_prompt_chars
from dspark_serve.server.config import ServerConfig
from dspark_serve.server.errors import COUNTED_STATUSES, ApiError, error_response
from dspark_serve.server.tool_formats import ChatSetup, chat_setup

# Bodies (bytes) and prompts (characters) up to this size are parsed and tokenized at once:
# their work is small next to a step; only larger ones queue for `prepare_slots`.
SMALL_WORK = 64 * 1024


@dataclass(frozen=True)
class AppState:
    engine: EngineClient
    config: ServerConfig
    registry: CollectorRegistry
    errors: Counter
    """Error responses by HTTP status (`dspark:http_errors`)."""
    prepare_slots: asyncio.Semaphore
    """Bodies parsed and prompts tokenized at once (`ServerConfig.tokenize_concurrency`)."""

    @classmethod
    def create(cls, engine: EngineClient, config: ServerConfig, registry: CollectorRegistry) -> AppState:
        errors = Counter(
            "dspark:http_errors",
            "Error responses by HTTP status (429: queue full).",
            ["status"],
            registry=registry,
        )
        for status in COUNTED_STATUSES:
            errors.labels(status=str(status))  # exported at zero from the start
        return cls(engine, config, registry, errors, asyncio.Semaphore(config.tokenize_concurrency))

    @property
    def served_model_name(self) -> str:
        """The model's name in /v1/models and in responses (the configured one, else the engine's)."""
        return self.config.served_model_name or self.engine.model_name

    @cached_property
    def chat(self) -> ChatSetup:
        """The chat template, tool format and reasoning format in use (read once the engine has
        loaded)."""
        c = self.config
        return chat_setup(
            c.tool_call_parser, c.chat_template, self.engine.chat_template(), c.reasoning_parser
        )

    @property
    def draining(self) -> bool:
        return bool(getattr(self.engine, "draining", False))

    def engine_busy(self) -> bool:
        """Whether the engine has requests in flight (large bodies are paced meanwhile)."""
        return bool(getattr(self.engine, "in_flight", 0))

    @property
    def vocab_size(self) -> int | None:
        """The engine's vocabulary size once known (token ids are checked against it)."""
        vocab: int | None = getattr(self.engine, "vocab_size", None)
        return vocab

    def preparing(self, size: int) -> contextlib.AbstractAsyncContextManager[object]:
        """Where a body of `size` bytes (or a prompt of `size` characters) is parsed or
        tokenized: a small one at once, a large one in its turn among `prepare_slots` (a burst
        of huge bodies neither holds many threads' memory nor delays the small requests)."""
        return self.prepare_slots if size > SMALL_WORK else contextlib.nullcontext()

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """A 400 (context_length_exceeded) for a prompt whose characters alone cannot fit the
        context, before it is tokenized (`limits.check_prompt_chars`); nothing while the
        engine cannot say how long its tokens are."""
        per_token: int | None = getattr(self.engine, "max_chars_per_token", None)
        if per_token is None:
            return
        try:
            check_prompt_chars(chars, per_token, self.engine.max_model_len, param)
        except LimitError as exc:
            raise ApiError(400, str(exc), exc.param, exc.code) from exc

    def count_error(self, status: int) -> None:
        self.errors.labels(status=str(status)).inc()

    def fail(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> JSONResponse:
        """An error response, counted."""
        self.count_error(status)
        return error_response(status, message, param, code, headers)


async def app_state(request: Request) -> AppState:
    """The AppState of the app serving `request` (async: FastAPI runs it on the event loop)."""
    state: AppState = request.app.state.dspark
    return state


# A route parameter that receives the AppState (no trace in the OpenAPI document).
State = Annotated[AppState, Depends(app_state)]
