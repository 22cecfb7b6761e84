"""The engine thread's edges: typed inbox messages, readiness signalled by an event, a drain's
final deltas."""

import asyncio
import threading
import time
from types import SimpleNamespace

from dspark_serve.scheduler.async_engine import AbortRequest, AddRequest, AsyncEngine, StopEngine
from dspark_serve.scheduler.client import GenerationParams, StreamDelta


def test_readiness_is_an_event_set_when_the_engine_loads():
    release = threading.Event()

    def build():
        release.wait(10)
        raise RuntimeError("no model here")  # the load fails once released

    eng = AsyncEngine(build, "m", 64)
    eng.start()
    try:
        t0 = time.monotonic()
        assert not eng.wait_ready(timeout=0.2)  # still loading: times out
        assert time.monotonic() - t0 >= 0.2
        release.set()
        t0 = time.monotonic()
        assert not eng.wait_ready(timeout=30)  # failed: returns at once, not ready
        assert time.monotonic() - t0 < 5
        assert eng.load_error == "RuntimeError: no model here"
    finally:
        eng.stop()


def test_ready_wakes_waiters_without_polling():
    release = threading.Event()
    bundle = SimpleNamespace(engine=SimpleNamespace(has_work=lambda: False, idle_profile=None))

    def build():
        release.wait(10)
        return bundle

    eng = AsyncEngine(build, "m", 64)
    eng._inbox.put(StopEngine())  # the engine loop ends at its first message
    eng.start()
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(eng.wait_ready(timeout=30)))
    waiter.start()
    time.sleep(0.05)
    assert not woke
    release.set()
    waiter.join(5)
    assert woke == [True] and eng.bundle is bundle
    eng.stop()


def test_messages_to_the_engine_thread_are_typed():
    eng = AsyncEngine(lambda: None, "m", 64)
    eng.abort("r1")
    msg = eng._inbox.get_nowait()
    assert msg == AbortRequest("r1") and isinstance(msg, AbortRequest)
    assert AddRequest("x") != AbortRequest("x")


def test_a_drain_ends_each_stream_with_the_counts_it_streamed():
    """A request cut by a drain gets a final delta: finish_reason "abort", the drain's error,
    and the prompt and completion tokens it has streamed (usage stays true)."""
    eng = AsyncEngine(lambda: None, "m", 64)
    eng.bundle = SimpleNamespace()  # ready; no engine thread: the test plays its part

    async def run():
        stream = eng.generate("r1", [5, 6, 7], GenerationParams(max_tokens=50))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the request is queued
        spec = {"rounds": 2}
        eng._send("r1", StreamDelta("ab", [1, 2], False, None, 3, 2, spec=spec))
        got = [await first]
        eng._send("r1", StreamDelta("c", [3], False, None, 3, 3, spec=spec))
        got.append(await stream.__anext__())
        report = await eng.drain(timeout=0.0)
        got.append(await stream.__anext__())
        return got, report

    got, report = asyncio.run(run())
    last = got[-1]
    assert report.cut == 1
    assert last.finished and last.finish_reason == "abort" and "shutting down" in last.error
    assert (last.prompt_tokens, last.completion_tokens, last.spec) == (3, 3, {"rounds": 2})
