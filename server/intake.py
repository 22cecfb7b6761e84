"""Large request bodies before admission: received a few at a time, from a bounded line, and
paced while the engine is serving. No torch here.

A body over `SMALL_WORK` bytes is work before the request is even read: receiving and parsing
megabytes costs the event loop and the interpreter what an engine step needs (on a small host, a
burst of 4 MB bodies that are all refused would otherwise hold the CPU from other clients' steps
until the last one is refused). So:

- at most `tokenize_concurrency` large bodies are received at once; the rest wait in their
  sockets' buffers (uvicorn stops reading a connection whose request nobody receives);
- the bodies in the server at once, received or waiting, hold at most `intake_queue_bytes`
  declared bytes; one that would pass it is refused 429 (Retry-After) unread, its connection
  closed: a burst is answered at once instead of queueing for seconds;
- while the engine has requests in flight, or a small request is on its way to it, large
  bodies are received at no more than `intake_rate_busy` bytes a second between them (a shared
  budget): the steps keep the CPU, the uploads take longer. An idle server receives them at
  full speed.

Small bodies (a chat of a few pages) pass none of this: they are read at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

from dspark_serve.server.config import ServerConfig


class LineFull(Exception):
    """A large body that would take the intake line past `intake_queue_bytes`."""


class BodyIntake:
    """The line and the pace of large bodies. `busy()` says whether the engine is serving."""

    def __init__(self, config: ServerConfig, busy: Callable[[], bool]) -> None:
        self.config = config
        self.busy = busy
        self.line_bytes = 0  # declared bytes of the large bodies in the server (received or waiting)
        self.small_requests = 0  # small requests being read or answered (not yet the engine's, maybe)
        self._slots = asyncio.Semaphore(config.tokenize_concurrency)
        self._free_at = 0.0  # loop time when the shared pace lets the next bytes in

    @contextlib.asynccontextmanager
    async def turn(self, declared: int | None) -> AsyncIterator[None]:
        """Wait for a slot to receive a large body of `declared` bytes (None: not declared, so
        counted as the largest allowed); `LineFull` at once when the line cannot take it. The
        line takes any one body when it is empty."""
        size = self.config.max_body_bytes if declared is None else declared
        if self.line_bytes and self.line_bytes + size > self.config.intake_queue_bytes:
            raise LineFull
        self.line_bytes += size
        try:
            async with self._slots:
                yield
        finally:
            self.line_bytes -= size

    @contextlib.contextmanager
    def small_request(self) -> Iterator[None]:
        """Around a small request's handling: large bodies are paced meanwhile (a chat that
        arrives in a burst of uploads is tokenized and reaches the engine at their pace)."""
        self.small_requests += 1
        try:
            yield
        finally:
            self.small_requests -= 1

    async def pace(self, nbytes: int) -> None:
        """After `nbytes` of a large body came in: while the engine serves (or a small request
        is on its way to it), wait until the shared rate has room for them."""
        rate = self.config.intake_rate_busy
        if not rate or not (self.small_requests or self.busy()):
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._free_at = max(now, self._free_at) + nbytes / rate
        await asyncio.sleep(self._free_at - now)

    def line_full_message(self) -> str:
        limit = self.config.intake_queue_bytes
        return (
            f"the server holds its maximum of {limit} bytes of large request bodies; retry later "
            "(see Retry-After)"
        )
