"""Run the app under uvicorn with a graceful drain on SIGTERM / SIGINT.

The first signal does not stop the server at once: the engine drains (new requests and /health
get 503 so balancers move away; in-flight requests may finish for up to `shutdown_timeout`
seconds; the rest are ended with an error event and finish_reason "abort"), then uvicorn shuts
down. A second signal exits at once. No torch here.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from dspark_serve.server.config import ServerConfig
from dspark_serve.server.connections import guarded_protocol

if TYPE_CHECKING:
    from types import FrameType

    from dspark_serve.scheduler.client import DrainReport

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signal first drains `engine` (anything with `async drain(timeout)`)."""

    def __init__(self, config: uvicorn.Config, engine: Any, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Future[None] | None = None
        self.drain_report: DrainReport | None = None

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if (
            self._drain_started()
            or self._loop is None
            or self.should_exit
            or not hasattr(self.engine, "drain")
        ):
            return super().handle_exit(sig, frame)  # a second signal: exit now
        log.info("received %s: draining (up to %.0fs)", signal.Signals(sig).name, self.shutdown_timeout)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _drain_started(self) -> bool:
        return self._drain_task is not None

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain_and_exit())

    async def drain_and_exit(self) -> None:
        """Drain, give the cut streams a moment to flush their last events, then stop serving.
        Callable directly (e.g. by a supervisor stopping this replica)."""
        try:
            self.drain_report = await self.engine.drain(self.shutdown_timeout)
            await asyncio.sleep(0.2)
        finally:
            self.should_exit = True


def uvicorn_config(app: Any, cfg: ServerConfig, protocol: type[Any] | None = None) -> uvicorn.Config:
    """uvicorn's configuration for `cfg`: its HTTP protocol (`protocol`, by default the one
    uvicorn picks: httptools where installed, else h11) guarded against slow and surplus
    clients (`server/connections.py`)."""
    base = protocol if protocol is not None else AutoHTTPProtocol
    return uvicorn.Config(
        app,
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        http=guarded_protocol(base, cfg),
        # X-Forwarded-For names the client only on the trusted proxies' connections (uvicorn's
        # default believes any local peer's)
        forwarded_allow_ips=sorted(cfg.proxy_addresses),
        # after the drain only finished responses remain to be written
        timeout_graceful_shutdown=5,
    )


def serve(app: Any, engine: Any, cfg: ServerConfig) -> None:
    DrainingServer(uvicorn_config(app, cfg), engine, cfg.shutdown_timeout).run()
