"""Slow and surplus clients: the connection-level limits uvicorn does not have.

uvicorn closes an idle keep-alive connection, but a client that sends its headers a byte at a
time (or part of them and then nothing) holds its connection forever, and so does one that
never finishes a declared body. Here:

- `guarded_protocol`: uvicorn's HTTP protocol with a first-byte deadline and a header deadline
  (from the connection's start, and from the end of each response on a kept-alive connection,
  to the end of the next request's headers: answered 408 and closed), caps on open connections
  in all and per client address, and on one address's connections that sent no request yet
  (the one over a cap is answered 503 and closed at once), and a reserve past the cap for the
  orchestrator's probes (`_Guarded`);
- the body deadline is the ASGI guard's (`server/guard.py`, `Guard`): a body not received in
  full within `body_timeout` seconds is answered 408 and the connection closed.

Both answers are OpenAI-shaped JSON errors. No torch here.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dspark_serve.server.config import ServerConfig

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


@dataclass
class ConnectionBook:
    """The connections one server holds, by client address: open ones, those that have not
    sent a request's headers yet (with when each opened), and those in the health reserve."""

    open: Counter[str] = field(default_factory=Counter)
    pending: dict[str, dict[object, float]] = field(default_factory=dict)
    reserve: int = 0

    def silent(self, client: str, now: float, grace: float) -> int:
        """`client`'s connections that have gone `grace` seconds without a request's headers."""
        return sum(1 for since in self.pending.get(client, {}).values() if now - since > grace)

    def heard(self, client: str, conn: object) -> None:
        """`conn` of `client` sent a request's headers, or went away: no longer pending."""
        mine = self.pending.get(client)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.pending[client]


# The ASGI scope extension that marks a request on a reserve connection (`server/guard.py`
# answers anything there but the probes 503).
RESERVE_EXTENSION = "dspark.health_only"


class _Guarded(asyncio.Protocol):
    """The connection limits and deadlines, over uvicorn's protocol (the class after this one
    in the MRO `guarded_protocol` builds). Both implementations set `self.cycle` when a
    request's headers are complete: that is when the deadline stops.

    Per client address (the trusted proxies' excepted) at most `max_client_connections` open
    and `max_client_pending` that have gone `pending_grace` seconds without a request's headers
    (a burst of new connections sending their requests is not refused while the loop reads
    them), so one address cannot fill the pool with idle sockets; a new connection must send
    its first byte within `first_byte_timeout`. Past `max_connections`, `health_reserve` more
    are accepted whose requests may only be the probes (GET /health, /metrics): an
    orchestrator still sees the replica answer while the pool is full."""

    cfg: ServerConfig
    book: ConnectionBook
    # uvicorn's protocol attributes this reads
    connections: set[Any]
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    cycle: Any

    _header_timer: asyncio.TimerHandle | None = None
    _timed_cycle: object = None
    _client: str | None = None  # the address counted in the book (None: not counted)
    _pending = False
    _reserve = False
    _silent = False  # no byte received yet

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        refusal = self._admit(client)
        if refusal is not None:
            self.transport.write(raw_error(503, refusal, "too_many_connections"))
            self.transport.close()
            return
        self._silent = True
        self._arm(self.cfg.first_byte_timeout)

    def _admit(self, client: str) -> str | None:
        """Count the connection in the book, or say why it is refused."""
        cfg, book = self.cfg, self.book
        if client not in cfg.proxy_addresses:
            if book.open[client] >= cfg.max_client_connections:
                most = cfg.max_client_connections
                return f"this client holds its maximum of {most} open connections; retry later"
            if book.silent(client, self.loop.time(), cfg.pending_grace) >= cfg.max_client_pending:
                return (
                    f"this client holds its maximum of {cfg.max_client_pending} connections that have "
                    "sent no request; retry later"
                )
        if len(self.connections) - book.reserve > cfg.max_connections:  # this one counted
            if book.reserve >= cfg.health_reserve:
                return f"the server holds its maximum of {cfg.max_connections} open connections; retry later"
            book.reserve += 1
            self._reserve = True
        self._client, self._pending = client, True
        book.open[client] += 1
        book.pending.setdefault(client, {})[self] = self.loop.time()
        return None

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timed_cycle = self.cycle
        self._header_timer = self.loop.call_later(seconds, self._headers_late)

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
        late = self.cfg.first_byte_timeout if self._silent else self.cfg.header_timeout
        msg = f"the request headers were not received within {late:g}s"
        self.transport.write(raw_error(408, msg, "request_timeout"))
        self.transport.close()

    def _headers_in(self) -> None:
        """A request's headers are complete: its deadline stops; the first request's headers
        end the connection's pending state; on a reserve connection the request is marked."""
        self._disarm()
        if self._pending and self._client is not None:
            self._pending = False
            self.book.heard(self._client, self)
        if self._reserve and self.cycle is not None:
            self.cycle.scope.setdefault("extensions", {})[RESERVE_EXTENSION] = {}

    def data_received(self, data: bytes) -> None:
        if self._silent and data:
            self._silent = False  # the first byte: the rest of the header deadline from here
            self._arm(self.cfg.header_timeout)
        super().data_received(data)
        if self._header_timer is not None and self.cycle is not self._timed_cycle:
            self._headers_in()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if not self.transport.is_closing():
            self._arm(self.cfg.header_timeout)  # the next request's headers have the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        client, book = self._client, self.book
        if client is not None:
            self._client = None
            book.open[client] -= 1
            if book.open[client] <= 0:
                del book.open[client]
            if self._pending:
                book.heard(client, self)
            if self._reserve:
                book.reserve -= 1
        super().connection_lost(exc)


def guarded_protocol(base: type[asyncio.Protocol], cfg: ServerConfig) -> type[Any]:
    """`base` (uvicorn's httptools or h11 protocol) with `cfg`'s connection limits and
    deadlines; every connection of the server shares one `ConnectionBook`."""
    name = f"Guarded{base.__name__}"
    return type(name, (_Guarded, base), {"cfg": cfg, "book": ConnectionBook(), "__qualname__": name})
