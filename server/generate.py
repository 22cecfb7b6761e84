"""Running one generate request on the engine: its n choices as n engine streams, started
together, watched for the client going away, and answered whole or as server-sent events.
No torch here.

n independent samples are one engine request each (its own drafter state; the prompt's KV
shared through the prefix cache); a seeded request's i-th sample uses seed + i.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, cast

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from dspark_serve.scheduler.client import EngineClient, EngineError, GenerationParams, StreamDelta
from dspark_serve.server.errors import ApiError, error_body
from dspark_serve.server.keys import caller
from dspark_serve.server.params import choice_params
from dspark_serve.server.reasoning import ReasoningFormat
from dspark_serve.server.render import Kind, Reply
from dspark_serve.server.state import AppState
from dspark_serve.server.tool_formats import ToolMode

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25  # how often the client is checked for having gone away (until a stream takes over)


@dataclass(frozen=True)
class Generation:
    """One generate request as a route hands it over: the prompt and the engine's parameters,
    and what the response is to include."""

    kind: Kind
    prompt_ids: list[int]
    params: GenerationParams
    n: int
    stream: bool
    include_usage: bool
    provenance: bool
    tools: ToolMode | None = None
    reasoning: ReasoningFormat | None = None


async def respond(
    state: AppState,
    request: Request,
    gen: Generation,
    reply_type: Callable[..., Reply] = Reply,
    id_prefix: str | None = None,
) -> Response | dict[str, Any]:
    """Runs `gen` and answers it with a `reply_type` (a chat or completion, or a Responses
    reply): the whole body, or a stream of server-sent events. An engine refusal at the start is
    an HTTP error (before any event)."""
    rid = f"{id_prefix or ('chatcmpl' if gen.kind == 'chat' else 'cmpl')}-{uuid.uuid4().hex}"
    created = int(time.time())
    streams = ChoiceStreams(state.engine, request, rid, gen)
    firsts = await streams.first_deltas()
    reply = reply_type(
        kind=gen.kind,
        id=rid,
        created=created,
        model=state.served_model_name,
        n=gen.n,
        prompt_tokens=len(gen.prompt_ids),
        logprobs=gen.params.logprobs is not None,
        include_usage=gen.include_usage,
        provenance=gen.provenance,
        tools=gen.tools,
        reasoning=gen.reasoning,
    )
    if not gen.stream:
        return reply.whole(await streams.collect(firsts))
    # From here the streaming response notices a disconnect itself (and closes the streams).
    streams.stop_watching()
    return StreamingResponse(
        sse_events(reply, streams, streams.merged(firsts), state.count_error),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def sse_events(
    reply: Reply,
    streams: ChoiceStreams,
    deltas: AsyncGenerator[tuple[int, StreamDelta], None],
    count_error: Callable[[int], None],
) -> AsyncGenerator[str, None]:
    """The stream's events, from the chat role chunks to `[DONE]`; an engine error mid-stream
    becomes an error event. Closing it (the client went away) aborts the engine requests."""
    progress = [reply.progress() for _ in range(reply.n)]
    last = None
    try:
        for event in reply.opening_events(progress):
            yield event
        async for i, d in deltas:
            last = d
            for event in reply.delta_events(i, d, progress[i]):
                yield event
        for event in reply.closing_events(progress, last):
            yield event
    except EngineError as exc:
        count_error(exc.status)
        error = error_body(str(exc), exc.status, exc.param, exc.code or str(exc.status))["error"]
        for event in reply.failure_events(progress, last, error):
            yield event
    except Exception:  # a fault of the server's: the stream still ends in its protocol's error
        log.exception("stream %s failed", streams.ids[0])
        count_error(500)
        error = error_body("internal error while streaming the response", 500, None, "internal_error")[
            "error"
        ]
        for event in reply.failure_events(progress, last, error):
            yield event
    finally:
        await deltas.aclose()
        await streams.close()  # a client that went away aborts its requests here


class ChoiceStreams:
    """The engine streams of one request's n choices, from their start to their close."""

    def __init__(self, engine: EngineClient, request: Request, rid: str, gen: Generation) -> None:
        self.engine = engine
        self.ids = [rid] if gen.n == 1 else [f"{rid}-{i}" for i in range(gen.n)]
        # the n choices share one owner, and the caller's requests one tenant: their slots
        # count together (fair slots)
        who = caller(request.scope)
        params = dataclasses.replace(
            gen.params, owner=rid if gen.n > 1 else "", tenant=who.tenant, key_name=who.key_name
        )
        self.gens = [
            engine.generate(self.ids[i], gen.prompt_ids, choice_params(params, i)) for i in range(gen.n)
        ]
        # Watch for the client going away from the start: while queued and prefilling too.
        self.watchers = [asyncio.create_task(self._watch_disconnect(request, i)) for i in self.ids]

    async def _watch_disconnect(self, request: Request, request_id: str) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                self.engine.abort(request_id)
                return

    def stop_watching(self) -> None:
        for w in self.watchers:
            w.cancel()

    async def close(self) -> None:
        """Close every stream (an unfinished one aborts its engine request)."""
        for request_id, g in zip(self.ids, self.gens):
            try:
                await g.aclose()
            except RuntimeError:  # still being iterated by a task that is going away
                self.engine.abort(request_id)

    async def first_deltas(self) -> list[StreamDelta | None]:
        """Every stream's first delta: the requests start, and an engine-side rejection becomes
        an HTTP error before any SSE byte (all streams closed)."""
        firsts = await asyncio.gather(*(_first_delta(g) for g in self.gens), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            self.stop_watching()
            await self.close()
            raise failed
        return [cast(StreamDelta | None, f) for f in firsts]

    async def collect(self, firsts: list[StreamDelta | None]) -> list[list[StreamDelta]]:
        """Every choice's deltas to its end (a request that does not stream); then all closed."""
        tasks = [asyncio.create_task(_rest(f, g)) for f, g in zip(firsts, self.gens)]
        try:
            return await asyncio.gather(*tasks)
        except EngineError as exc:
            raise _api_error(exc) from exc
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.stop_watching()
            await self.close()

    async def merged(self, firsts: list[StreamDelta | None]) -> AsyncGenerator[tuple[int, StreamDelta], None]:
        """(choice index, delta) from all n streams as they come."""
        q: asyncio.Queue[tuple[int, StreamDelta | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, first: StreamDelta | None, gen: AsyncIterator[StreamDelta]) -> None:
            try:
                if first is not None:
                    await q.put((i, first))
                if first is not None and not first.finished:
                    async for d in gen:
                        await q.put((i, d))
            except Exception as exc:  # handed to the consumer
                await q.put((i, exc))
            finally:
                await q.put((i, None))

        tasks = [asyncio.create_task(pump(i, f, g)) for i, (f, g) in enumerate(zip(firsts, self.gens))]
        try:
            open_ = len(tasks)
            while open_:
                i, item = await q.get()
                if item is None:
                    open_ -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _first_delta(stream: AsyncIterator[StreamDelta]) -> StreamDelta | None:
    try:
        return await stream.__anext__()
    except EngineError as exc:
        raise _api_error(exc) from exc
    except StopAsyncIteration:
        return None


async def _rest(first: StreamDelta | None, gen: AsyncIterator[StreamDelta]) -> list[StreamDelta]:
    """A stream's deltas from its first to its last."""
    got = [] if first is None else [first]
    if first is not None and not first.finished:
        async for d in gen:
            got.append(d)
    return got


def _api_error(exc: EngineError) -> ApiError:
    return ApiError(exc.status, str(exc), exc.param, exc.code)
