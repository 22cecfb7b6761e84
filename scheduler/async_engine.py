"""Runs the engine loop on its own thread and serves it to asyncio callers.

The HTTP event loop never runs a forward: it hands requests to the engine thread through a
thread-safe inbox and receives deltas through per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.builder import EngineBundle
from dspark_serve.scheduler.client import (
    ChatTemplate,
    DrainReport,
    EngineError,
    GenerationParams,
    RuntimeInfo,
    StreamDelta,
)
from dspark_serve.scheduler.engine import Engine, RequestRejected
from dspark_serve.scheduler.request import Request, RequestOutput

log = logging.getLogger(__name__)


def _delta(out: RequestOutput) -> StreamDelta:
    spec = None
    if out.spec is not None:
        s = out.spec
        spec = {
            "rounds": s.rounds,
            "draft_tokens": s.drafted,
            "accepted_tokens": s.accepted,
            "mean_acceptance_length": round(s.mean_acceptance_length, 4),
        }
    return StreamDelta(
        out.text,
        out.token_ids,
        out.finished,
        out.finish_reason,
        out.prompt_tokens,
        out.completion_tokens,
        spec,
        list(out.tokens),
    )


# Parameters whose range errors (SamplingParams' messages start with the name) name them.
_PARAMS = (
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "top_p",
    "top_k",
)


def _request(request_id: str, prompt_ids: list[int], params: GenerationParams) -> Request:
    """The engine's request for these parameters; a range error is a 400 naming the parameter."""
    try:
        sp = SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            min_p=params.min_p,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            logit_bias=params.logit_bias,
        )
        return Request(
            request_id,
            list(prompt_ids),
            sp,
            params.max_tokens,
            stop=params.stop,
            ignore_eos=params.ignore_eos,
            logprobs=params.logprobs,
            priority=params.priority,
            owner=params.owner,
            tenant=params.tenant,
            key_name=params.key_name,
        )
    except (ValueError, TypeError, RuntimeError) as exc:
        msg = str(exc)
        param = next((p for p in _PARAMS if msg.startswith(p)), "seed" if "seed" in msg else None)
        raise EngineError(msg, 400, param) from exc


DRAIN_MESSAGE = "the server is shutting down; this request was cut off"


@dataclass(frozen=True)
class Cut:
    """Sent to a request's stream in place of its next delta when the server ends it (a drain);
    the stream turns it into the final delta, with the counts it has streamed so far."""

    message: str


StreamItem = StreamDelta | Exception | Cut


@dataclass(frozen=True)
class AddRequest:
    """To the engine thread: queue this request (its deltas go to the queue registered for it)."""

    request: Request


@dataclass(frozen=True)
class AbortRequest:
    """To the engine thread: end this request now and free its KV."""

    request_id: str


@dataclass(frozen=True)
class StopEngine:
    """To the engine thread: leave the loop."""


EngineMessage = AddRequest | AbortRequest | StopEngine


class AsyncEngine:
    def __init__(self, build: Callable[..., EngineBundle], model_name: str, max_model_len: int) -> None:
        """build: makes the engine bundle on the engine thread; when it takes an `on_stage`
        keyword it is told what is loading (shown on /health and in the log)."""
        self._build = build
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.bundle: EngineBundle | None = None
        self._error: str | None = None
        self._inbox: queue.Queue[EngineMessage] = queue.Queue()
        self._settled = threading.Event()  # set once the engine loaded, or failed to
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[StreamItem]]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._max_chars: int | None = None
        self._stage: str | None = "starting"
        self._finished_in_drain = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(StopEngine())
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def ready(self) -> bool:
        return self.bundle is not None

    @property
    def alive(self) -> bool:
        """The engine thread is running (False before start, after stop, or if it died)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def loading_stage(self) -> str | None:
        """What is loading now (None once ready)."""
        return None if self.ready else self._stage

    def set_stage(self, stage: str) -> None:
        self._stage = stage
        log.info("loading: %s", stage)

    @property
    def vocab_size(self) -> int | None:
        return self.bundle.engine.vocab_size if self.bundle is not None else None

    @property
    def max_chars_per_token(self) -> int | None:
        """The most characters one token's text holds (the longest vocabulary entry, special
        tokens included: byte-level and SentencePiece entries are no shorter than their text),
        once loaded: the server bounds a prompt's tokens from its characters with it."""
        if self._max_chars is None and self.bundle is not None:
            self._max_chars = max(len(t) for t in self.bundle.tokenizer.get_vocab())
        return self._max_chars

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    async def drain(self, timeout: float) -> DrainReport:
        """Graceful drain (SIGTERM, or a supervisor stopping this replica): refuse new requests
        from now on (503, and /health says so), let those in flight finish for up to `timeout`
        seconds, then end the rest: each gets a final delta with finish_reason "abort" and an
        error, and its KV is freed. Returns what happened; safe to call more than once."""
        self._draining = True
        t0 = time.monotonic()
        before = len(self._queues)
        log.info("draining: %d requests in flight, waiting up to %.0fs", before, timeout)
        while self._queues and time.monotonic() - t0 < timeout:
            await asyncio.sleep(0.05)
        cut = list(self._queues)
        for rid in cut:
            self.abort(rid)
            self._send(rid, Cut(DRAIN_MESSAGE))
        report = DrainReport(finished=before - len(cut), cut=len(cut), seconds=time.monotonic() - t0)
        log.info("drained in %.1fs: %d finished, %d cut", report.seconds, report.finished, report.cut)
        return report

    @property
    def load_error(self) -> str | None:
        return self._error

    @property
    def runtime_info(self) -> RuntimeInfo | None:
        b = self.bundle
        if b is None:
            return None
        e = b.engine
        return RuntimeInfo(
            dtype=b.dtype.name,
            dtype_reason=b.dtype.reason,
            device=str(e.runner.device),
            drafter=e.drafter.name if e.drafter is not None else "none",
            verify_policy=e.speculation.policy.name,
            weights=b.weights_detail,
            weights_reason=b.weights.reason if b.weights is not None else "",
        )

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the engine has loaded (True) or failed to load, or `timeout` passed (False)."""
        self._settled.wait(timeout)
        return self.ready

    # -- tokenization (thread-safe on HF fast tokenizers) ----------------------------------------
    def _bundle(self) -> EngineBundle:
        if self.bundle is None:
            raise EngineError("the model is still loading", 503)
        return self.bundle

    def chat_template(self) -> ChatTemplate:
        b = self._bundle()
        tok = b.tokenizer
        template = tok.chat_template if isinstance(tok.chat_template, str) else None
        model_type = getattr(b.engine.runner.config, "model_type", None)
        added = {str(t): int(i) for t, i in tok.get_added_vocab().items()}
        return ChatTemplate(template, model_type if isinstance(model_type, str) else None, added)

    def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        tok = self._bundle().tokenizer
        ids = tok.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **dict(template_kwargs or {}),
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def tokenize(self, text: str) -> list[int]:
        return list(self._bundle().tokenizer(text, add_special_tokens=False)["input_ids"])

    # -- requests --------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_ids: list[int], params: GenerationParams
    ) -> AsyncGenerator[StreamDelta, None]:
        """Queue one request on the engine thread and yield its deltas until it finishes; a
        caller that goes away aborts it (its KV is freed at once)."""
        req = await self._prepare(request_id, prompt_ids, params)
        q: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), q)
        self._inbox.put(AddRequest(req))
        finished = False
        last: StreamDelta | None = None
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, Cut):  # the tokens so far count: usage stays true
                    prompt = last.prompt_tokens if last is not None else len(prompt_ids)
                    done = last.completion_tokens if last is not None else 0
                    spec = last.spec if last is not None else None
                    item = StreamDelta("", [], True, "abort", prompt, done, spec=spec, error=item.message)
                finished, last = item.finished, item
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the caller went away: free the request's KV now
                self.abort(request_id)

    async def _prepare(self, request_id: str, prompt_ids: list[int], params: GenerationParams) -> Request:
        """The engine's request for these parameters, its grammar compiled; an EngineError
        while draining or loading, or for a parameter out of range."""
        if self._draining:
            raise EngineError("the server is draining (shutting down)", 503, code="draining")
        if not self.ready:
            raise EngineError("the model is still loading", 503)
        req = _request(request_id, prompt_ids, params)
        if params.grammar is not None:
            g = params.grammar
            try:  # off the event loop and off the engine thread (bounded by GrammarConfig)
                req.constraint = await asyncio.get_running_loop().run_in_executor(
                    None, self._bundle().engine.compile_grammar, g.kind, g.schema
                )
            except ValueError as exc:
                raise EngineError(str(exc), 400, g.param) from exc
        return req

    def abort(self, request_id: str) -> None:
        self._inbox.put(AbortRequest(request_id))

    # -- the engine thread -----------------------------------------------------------------------
    def _send(self, request_id: str, item: StreamItem) -> None:
        entry = self._queues.get(request_id)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _handle(self, msg: AddRequest | AbortRequest) -> None:
        engine = self._bundle().engine
        if isinstance(msg, AddRequest):
            req = msg.request
            try:
                engine.add_request(req)
            except RequestRejected as exc:
                self._send(req.request_id, EngineError(str(exc), exc.status, exc.param, exc.code))
            except Exception as exc:  # never let one request stop the engine thread
                log.exception("add_request failed for %s", req.request_id)
                self._send(req.request_id, EngineError(f"the request could not be queued: {exc}", 500))
        elif isinstance(msg, AbortRequest):
            out = engine.abort(msg.request_id)
            if out is not None:  # whoever still waits on it (a non-streaming handler) is told
                self._send(out.request_id, _delta(out))

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            if "on_stage" in inspect.signature(self._build).parameters:
                bundle = self._build(on_stage=self.set_stage)
            else:
                bundle = self._build()
        except Exception as exc:  # reported by /health and logged; the server stays up
            self._error = f"{type(exc).__name__}: {exc}"
            log.error("engine failed to load:\n%s", traceback.format_exc())
            self._settled.set()
            return
        self.bundle = bundle
        self._settled.set()
        log.info("ready: the engine loaded in %.1fs and accepts requests", time.monotonic() - t0)
        engine = self.bundle.engine
        while not self._stopping:
            msg = self._next_message(engine)
            while msg is not None:
                if isinstance(msg, StopEngine):
                    return
                self._handle(msg)
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    msg = None
            if not engine.has_work():
                idle_work(engine)
                continue
            try:
                outputs = engine.step()
            except Exception:
                log.error("engine step failed; failing the running requests:\n%s", traceback.format_exc())
                self._fail_all(engine)
                continue
            for out in outputs:
                if out.error is not None:  # the engine failed this request alone
                    self._send(out.request_id, EngineError(out.error, out.error_status))
                else:
                    self._send(out.request_id, _delta(out))

    def _next_message(self, engine: Engine) -> EngineMessage | None:
        """The next message, if any: waited for only while the engine has no step to run, and
        no longer than until its idle work is due."""
        idle = engine.idle_profile
        wait = 0.0 if engine.has_work() else None if idle is None else idle.wait()
        try:
            if wait is None:
                return self._inbox.get()
            return self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _fail_all(self, engine: Engine) -> None:
        for r in list(engine.running) + list(engine.waiting):
            engine.abort(r.request_id)
            self._send(r.request_id, EngineError("internal error while generating", 500))


def idle_work(engine: Engine) -> None:
    """While no request waits or runs: one forward of the full cost table's measurement
    (`scheduler/idle_profile.py`), once the engine has been quiet long enough."""
    idle = engine.idle_profile
    if idle is None or idle.wait() > 0.0:
        return
    try:
        done = idle.advance()
    except Exception:  # the engine goes on with the table it has; never a dead engine thread
        log.error("measuring the cost table failed; keeping the one in force:\n%s", traceback.format_exc())
        idle.pause()
        done = True
    if done:
        engine.idle_profile = None
