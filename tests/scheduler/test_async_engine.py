"""The engine thread's edges: typed inbox messages, readiness signalled by an event."""

import threading
import time
from types import SimpleNamespace

from dspark_serve.scheduler.async_engine import AbortRequest, AddRequest, AsyncEngine, StopEngine


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
    bundle = SimpleNamespace(engine=SimpleNamespace(has_work=lambda: False))

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
