"""The ASGI guard in front of every route: the API key on /v1/*, and the request body's size
and arrival deadline. No torch here.

A pure ASGI middleware (an `@app.middleware("http")` would hide client disconnects from the
routes). The body limit is checked on the declared length before anything is read, and again
while the body is buffered; a body not received in full within `body_timeout` seconds is
answered 408 and the connection closed. The header deadline and the connection cap live in
the HTTP protocol itself (`connections.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dspark_serve.server.config import ServerConfig
from dspark_serve.server.connections import RESERVE_EXTENSION
from dspark_serve.server.errors import error_response
from dspark_serve.server.intake import BodyIntake, LineFull
from dspark_serve.server.keys import KEY_NAME_STATE, ApiKeys
from dspark_serve.server.state import SMALL_WORK

# What a connection in the health reserve may ask (`connections.py`): the orchestrator's probes.
PROBES = ("/health", "/metrics")


@dataclass(frozen=True)
class Refusal:
    """A request the guard answers itself."""

    status: int
    message: str
    headers: Mapping[str, str] | None = None
    code: str | None = None


class Guard:
    """The API key, then the body limit and deadline; everything else passes to `app`."""

    def __init__(
        self,
        app: ASGIApp,
        config: ServerConfig,
        on_error: Callable[[int], None],
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        """busy: whether the engine is serving requests (large bodies are paced meanwhile)."""
        self.app, self.config, self.on_error = app, config, on_error
        self._keys = ApiKeys.parse(config.api_key) if config.api_key else None
        # large bodies: a few at a time, from a bounded line, paced while the engine serves
        self.intake = BodyIntake(config, busy)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._check_headers(scope)
        if refusal is not None:
            return await self._reply(scope, receive, send, refusal)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = _content_length(scope)  # a valid number: _check_headers refused any other
        declared = None if length is None else int(length)
        if declared is not None and declared <= SMALL_WORK:
            with self.intake.small_request():  # large bodies are paced while it is handled
                return await self._pass(scope, receive, send, await self._read_body(receive, paced=False))
        try:
            async with self.intake.turn(declared):
                body = await self._read_body(receive, paced=True)
        except LineFull:
            refusal = Refusal(429, self.intake.line_full_message(), {"connection": "close"})
            return await self._reply(scope, receive, send, refusal)
        await self._pass(scope, receive, send, body)

    async def _pass(self, scope: Scope, receive: Receive, send: Send, body: bytes | Refusal | None) -> None:
        """The request with its read body on to the app, or the refusal its reading earned;
        nothing when the client went away (None)."""
        if isinstance(body, Refusal):
            return await self._reply(scope, receive, send, body)
        if body is not None:
            await self.app(scope, _replay(body, receive), send)

    def _check_headers(self, scope: Scope) -> Refusal | None:
        if RESERVE_EXTENSION in scope.get("extensions", {}) and not (
            scope["method"] == "GET" and scope["path"] in PROBES
        ):
            full = (
                "the server holds its maximum of open connections: this one may only ask /health or /metrics"
            )
            return Refusal(503, full, {"connection": "close"}, "too_many_connections")
        if self._keys is not None and scope["path"].startswith("/v1/"):
            name = self._key_name(scope)
            if name is None:
                return Refusal(401, "invalid or missing API key")
            scope.setdefault("state", {})[KEY_NAME_STATE] = name  # the caller (`keys.caller`)
        length = _content_length(scope)
        if length is None:
            return None
        try:
            declared = int(length)
        except ValueError:
            return Refusal(400, "invalid Content-Length")
        return Refusal(413, self._too_large(declared)) if declared > self.config.max_body_bytes else None

    def _key_name(self, scope: Scope) -> str | None:
        """The name of the API key the request carries, or None (no key, or a wrong one)."""
        header = b""
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                header = v
                break
        scheme, _, token = header.partition(b" ")
        if self._keys is None or scheme.lower() != b"bearer":
            return None
        return self._keys.match(token.strip())

    async def _read_body(self, receive: Receive, paced: bool) -> bytes | Refusal | None:
        """The whole body (bounded, within the deadline); None when the client went away.
        paced: a large body, received at the intake's pace while the engine serves."""
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.config.body_timeout):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return None
                    chunk, more = msg.get("body", b""), msg.get("more_body", False)
                    size += len(chunk)
                    if size > self.config.max_body_bytes:
                        return Refusal(413, self._too_large(None))
                    chunks.append(chunk)
                    if paced and more:
                        await self.intake.pace(len(chunk))
                    if not more:
                        return b"".join(chunks)
        except TimeoutError:
            late = f"the request body was not received within {self.config.body_timeout:g}s"
            return Refusal(408, late, {"connection": "close"})

    def _too_large(self, declared: int | None) -> str:
        got = f" ({declared} bytes)" if declared is not None else ""
        return f"request body too large{got}; the limit is {self.config.max_body_bytes} bytes"

    async def _reply(self, scope: Scope, receive: Receive, send: Send, refusal: Refusal) -> None:
        self.on_error(refusal.status)
        response = error_response(refusal.status, refusal.message, code=refusal.code, headers=refusal.headers)
        await response(scope, receive, send)


def _content_length(scope: Scope) -> bytes | None:
    """The request's Content-Length header as sent, or None."""
    return next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands the buffered body on first; later calls reach the server again,
    so the routes still see the client disconnect."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
