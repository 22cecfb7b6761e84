"""Slow and surplus clients: the connection-level limits uvicorn does not have.

uvicorn closes an idle keep-alive connection, but a client that sends its headers a byte at a
time (or part of them and then nothing) holds its connection forever, and so does one that
never finishes a declared body. Here:

- `guarded_protocol`: uvicorn's HTTP protocol with a header deadline (from the connection's
  start, and from the end of each response on a kept-alive connection, to the end of the next
  request's headers: answered 408 and closed) and a cap on open connections (the one over the
  cap is answered 503 and closed at once);
- the body deadline is the ASGI guard's (`server/guard.py`, `Guard`): a body not received in
  full within `body_timeout` seconds is answered 408 and the connection closed.

Both answers are OpenAI-shaped JSON errors. No torch here.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

ERROR_REASONS = {408: "Request Timeout", 503: "Service Unavailable"}


def raw_error(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection (written straight to the
    transport, where no request cycle exists yet)."""
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = (
        f"HTTP/1.1 {status} {ERROR_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class _Guarded(asyncio.Protocol):
    """The header deadline and the connection cap, over uvicorn's protocol (the class after
    this one in the MRO `guarded_protocol` builds). Both implementations set `self.cycle` when
    a request's headers are complete: that is when the deadline stops."""

    header_timeout: float
    max_connections: int
    # uvicorn's protocol attributes this reads
    connections: set[Any]
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any

    _header_timer: asyncio.TimerHandle | None = None
    _timed_cycle: object = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            msg = f"the server holds its maximum of {self.max_connections} open connections; retry later"
            self.transport.write(raw_error(503, msg, "too_many_connections"))
            self.transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._timed_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.cycle is not self._timed_cycle:
            return
        if self.cycle is not None and not getattr(self.cycle, "response_complete", True):
            return  # a (pipelined) request is being served: its headers came
        msg = f"the request headers were not received within {self.header_timeout:g}s"
        self.transport.write(raw_error(408, msg, "request_timeout"))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is not None and self.cycle is not self._timed_cycle:
            self._disarm()  # a request's headers are complete

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._arm()  # the next request's headers have the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def guarded_protocol(base: type[asyncio.Protocol], header_timeout: float, max_connections: int) -> type[Any]:
    """`base` (uvicorn's httptools or h11 protocol) with the header deadline and the
    connection cap."""
    name = f"Guarded{base.__name__}"
    limits = {"header_timeout": header_timeout, "max_connections": max_connections, "__qualname__": name}
    return type(name, (_Guarded, base), limits)
