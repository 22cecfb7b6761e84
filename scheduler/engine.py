"""The engine step, as the method reads: schedule -> draft and choose lengths -> verify -> commit.

- schedule (`scheduler.py`): admission against KV capacity, chunked prefill under the step's
  token budget, preemption; the scheduler owns the KV block allocator (`block_manager.py`);
- draft and choose lengths (`speculation.py`): the drafter, the draft gate and the policy behind
  one call that returns a `StepProposal` (draft blocks + verification lengths);
- verify (`verify_step.py`): one flat target forward over every request's segment, then
  rejection sampling (`verifier/verify.py`);
- commit: the verdict applied to the engine's state (`settle.py`: KV rollback, drafter
  feedback), then each request's tokens under its stop conditions, text and metrics
  (`commit.py`).

Single-threaded and synchronous; `scheduler.async_engine` runs it off the HTTP event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Protocol

from dspark_serve.drafter.base import AcceptedContext, Drafter
from dspark_serve.ops.processors import GuardedConstraint
from dspark_serve.scheduler.admission import Limits, RequestRejected, check_request, step_problem
from dspark_serve.scheduler.block_manager import BlockManager
from dspark_serve.scheduler.client import TokenRecord
from dspark_serve.scheduler.commit import (
    append_tokens,
    eos_token_ids,
    record_tokens,
    request_output,
    target_logprobs,
    token_records,
)
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.detokenizer import IncrementalDetokenizer
from dspark_serve.scheduler.idle_profile import IdleProfile
from dspark_serve.scheduler.load import LoadMonitor, LoadState
from dspark_serve.scheduler.metrics_sink import EngineMetricsSink, EngineSnapshot, NullMetrics
from dspark_serve.scheduler.policy import CostTable
from dspark_serve.scheduler.prefix import TapCache
from dspark_serve.scheduler.request import Request, RequestOutput, Status
from dspark_serve.scheduler.scheduler import ScheduledBatch, Scheduler
from dspark_serve.scheduler.settle import Committed, Settler
from dspark_serve.scheduler.speculation import Drafts, Speculation, StepProposal
from dspark_serve.scheduler.verify_step import Verification, VerifyStep
from dspark_serve.verifier.grammar import Grammar, GrammarCompiler, GrammarConfig
from dspark_serve.verifier.model_runner import ModelRunner

__all__ = ["Engine", "HiddenCapture", "RequestRejected"]

log = logging.getLogger(__name__)


class HiddenCapture(Protocol):
    """Receives the target's hidden states of every token it commits (training-data
    generation: the tap states the drafter learns from, captured in the serving pass)."""

    layers: tuple[int, ...]

    def observe(self, contexts: list[AcceptedContext]) -> None: ...


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        sched: SchedulerConfig,
        max_model_len: int,
        drafter: Drafter | None = None,
        cost_table: CostTable | None = None,
        metrics: EngineMetricsSink | None = None,
        capture: HiddenCapture | None = None,
    ) -> None:
        self.runner, self.tokenizer, self.cfg, self.max_model_len = runner, tokenizer, sched, max_model_len
        self.metrics: EngineMetricsSink = metrics if metrics is not None else NullMetrics()
        self.capture = capture
        self.speculation = Speculation(drafter, sched, max_model_len, cost_table)
        if capture is not None and self.speculating:
            raise ValueError("hidden-state capture runs with plain decoding (drafter none)")
        kv = runner.kv
        self.scheduler = Scheduler(
            sched, BlockManager(kv.num_blocks, kv.block_size, sched.enable_prefix_caching)
        )
        self.blocks = self.scheduler.blocks
        self.taps = TapCache(self.blocks, runner.device)
        self.verify = VerifyStep(runner, self.blocks, self.taps, self.metrics)
        self.settle = Settler(self.blocks, self.verify, self.speculation, self.metrics)
        self.load = LoadMonitor(runner.device, self.blocks)
        self.requests: dict[str, Request] = {}
        self.eos_ids = eos_token_ids(runner.model, tokenizer)
        self.vocab_size = int(runner.embed.num_embeddings)  # type: ignore[arg-type]
        self.limits = Limits(self.vocab_size, max_model_len, kv.num_blocks, kv.block_size)
        # Structured output: built on the first request that needs it (llguidance reads the
        # whole tokenizer); tests may set their own.
        self.grammars: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self.grammar_config = GrammarConfig()
        self.idle_profile: IdleProfile | None = None  # the cost table, measured while idle

    def compile_grammar(self, kind: str, schema: str | None) -> Grammar:
        """A request's grammar (thread-safe; the server calls it off the engine thread).
        Raises GrammarError for a schema it refuses, ValueError when the tokenizer has no
        llguidance support."""
        with self._grammar_lock:
            if self.grammars is None:
                eos, cfg = sorted(self.eos_ids), self.grammar_config
                self.grammars = GrammarCompiler.for_hf(self.tokenizer, self.vocab_size, eos, cfg)
        return self.grammars.compile(kind, schema)

    # -- the parts, as the rest of the code sees them ------------------------------------------
    @property
    def drafter(self) -> Drafter | None:
        return self.speculation.drafter

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def speculating(self) -> bool:
        """A drafter is loaded and the policy may verify drafts (policy `none` = plain decoding)."""
        return self.speculation.speculating

    @property
    def tap_layers(self) -> tuple[int, ...]:
        capture = tuple(self.capture.layers) if self.capture is not None else ()
        return self.speculation.tap_layers if self.speculating else capture

    def set_policy(self, spec: str) -> None:
        """Switch the verification policy (only between requests: drafter state is per request).
        The prefix cache starts afresh (its blocks carry the old setting's tap states); the tap
        rows' buffer stays while a drafter taps the target (a policy switched back reuses it)."""
        if self.scheduler.has_work():
            raise RuntimeError("set_policy needs an idle engine")
        self.speculation.use_policy(spec)
        self.blocks.reset_prefix_cache()
        d = self.speculation.drafter
        self.taps.reset(keep=d is not None and bool(d.tap_layers))

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turn prefix caching on or off (only between requests; benchmarks compare both);
        the cache starts empty either way."""
        if self.scheduler.has_work():
            raise RuntimeError("set_prefix_caching needs an idle engine")
        self.blocks.enable_caching = bool(enabled)
        self.blocks.reset_prefix_cache()
        self.taps.reset()

    def snapshot(self) -> EngineSnapshot:
        """What the engine carries now, for the gauges."""
        d, b = self.drafter, self.blocks
        calibrator = d.calibrator if d is not None else None
        return EngineSnapshot(
            len(self.running),
            len(self.waiting),
            b.usage,
            calibrator,
            b.cached_free_usage,
            b.stats(),
            self.scheduler.num_preemptions,
            self.scheduler.slot_shares(),
        )

    # -- requests in and out -----------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request after checking everything it brings, so that no step can fail
        because of its input (raises RequestRejected with an HTTP status and the parameter)."""
        check_request(req, self.limits, req.request_id in self.requests)
        if self.scheduler.queue_full:
            raise RequestRejected("the server is at capacity; retry later", 429)
        if req.constraint is not None and not isinstance(req.constraint, GuardedConstraint):
            req.constraint = GuardedConstraint(req.constraint)  # its failures stay its own
        try:
            req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.stop)
        except Exception as exc:  # the tokenizer cannot decode this prompt's ids
            raise RequestRejected(f"the prompt cannot be decoded: {exc}", 400, "prompt") from exc
        self.scheduler.add(req)
        self.requests[req.request_id] = req
        self.metrics.record_step(self.snapshot())

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self._finish(req, "abort")
        self.metrics.record_step(self.snapshot())  # /metrics must not show it running after the last abort
        return self._output(req, [], final=True)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step. Never raises because of one request: a request found invalid before any
        state changed is failed alone; an error later in the step fails the step's batch
        (their KV and drafter state freed, finish_reason "error"), and everyone else goes on."""
        if self.idle_profile is not None:
            self.idle_profile.pause()  # its scratch KV slots go back before scheduling
        batch, failed = self._schedule()
        if not batch:
            return failed
        try:
            with self.runner.attention_backends():
                t0 = time.perf_counter()
                self._restore_contexts(batch)
                load = self._load(batch) if batch.decodes else None  # the gate and policy read it
                drafts = self.speculation.draft(batch.decodes, load)
                proposal = self._choose_lengths(batch, drafts, load)
                verification = self.verify(batch, proposal, self.tap_layers)
                outputs = self._commit(batch, proposal, verification)
                self._record_step(proposal, batch, outputs, time.perf_counter() - t0, verification)
            return failed + outputs
        except Exception:
            return failed + self._fail_batch(batch)

    def _record_step(
        self,
        proposal: StepProposal,
        batch: ScheduledBatch,
        outputs: list[RequestOutput],
        took: float,
        v: Verification,
    ) -> None:
        """What the step cost and made, for the gate and the overhead estimate."""
        decoding = {r.request_id for r in batch.decodes}
        made = sum(len(o.token_ids) for o in outputs if o.request_id in decoding)
        n = len(batch.decodes)
        self.speculation.record_step(proposal, n, bool(batch.prefills), made, took, v.forward_seconds)
        c = self.speculation.correction
        if n and not batch.prefills and c.last_measured:
            rows = n + sum(proposal.lengths)
            self.metrics.record_cost(c.last_predicted, c.last_measured, c.factor(rows, n))

    def _schedule(self) -> tuple[ScheduledBatch, list[RequestOutput]]:
        """The step's batch (preempted requests' drafter state freed), less the requests whose
        state is found invalid before anything is touched (failed alone: their outputs)."""
        spec = self.speculation
        batch = self.scheduler.schedule(spec.draft_reserve(self.running, len(self.waiting)), spec.lookahead)
        for r in batch.preempted:  # it recomputes its context when it runs again
            spec.free(r.request_id)
        self.metrics.record_queue_waits(batch.waits)
        if not batch and batch.preempted:
            self.metrics.record_step(self.snapshot())
        failed = []
        for r in batch.requests:
            problem = step_problem(r, self.vocab_size)
            if problem is not None:
                log.error("request %s failed its pre-step check: %s", r.request_id, problem)
                failed.append(self._fail(r, f"invalid request state: {problem}"))
        return (batch.without_finished() if failed else batch), failed

    def _fail_batch(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """The last resort for a failure outside any one request (the forward): the step's
        requests fail, their KV, forks and drafter state freed."""
        log.exception("engine step failed; failing its %d requests", len(batch.requests))
        self.verify.free_open_branches()
        out = [
            self._fail(r, "internal error while generating")
            for r in batch.requests
            if not r.finished or r.request_id in self.requests
        ]
        self.metrics.record_step(self.snapshot())
        return out

    def _fail(self, r: Request, message: str, status: int = 500) -> RequestOutput:
        """r ends with finish_reason "error" (status 400: its own input failed it); its KV and
        drafter state are freed, everyone else goes on."""
        if r.finished:  # finished inside the failed step: its final output was never sent
            r.finish_reason = "error"
        else:
            self._finish(r, "error")
        self.blocks.free(r.request_id)
        out = self._output(r, [], final=True)
        out.error, out.error_status = message, status
        if status == 400:
            log.warning("request %s failed alone: %s", r.request_id, message)
        return out

    def _restore_contexts(self, batch: ScheduledBatch) -> None:
        """Requests admitted with a cached prefix skip its forward: the drafter (and the hidden
        capture) get that prefix's context from the tap states cached beside its blocks."""
        if not (self.speculating or self.capture is not None):
            return
        copy = self.capture is not None  # the capture keeps rows, not positions
        admitted = [(r, n) for r, n in batch.admitted if n > 0]
        contexts = [self.taps.context(r.request_id, r.prefill_ids, n, copy) for r, n in admitted]
        if contexts:
            self._observe(contexts)

    def _observe(self, contexts: list[AcceptedContext]) -> None:
        self.speculation.observe(contexts)
        if contexts and self.capture is not None:
            self.capture.observe(contexts)

    def _load(self, batch: ScheduledBatch) -> LoadState:
        prefilling = len(self.running) - len(batch.decodes)
        return self.load.snapshot(len(batch.decodes), len(self.waiting), batch.prefill_tokens, prefilling)

    def _choose_lengths(self, batch: ScheduledBatch, drafts: Drafts, load: LoadState | None) -> StepProposal:
        room = self.cfg.max_num_batched_tokens - batch.prefill_tokens - len(batch.decodes)
        proposal = self.speculation.choose_lengths(batch.decodes, drafts, room, load)
        if proposal.decision is not None:
            self.metrics.record_policy(proposal.decision, load, self.speculation.priced_overhead)
        return proposal

    # -- commit ------------------------------------------------------------------------------
    def _commit(self, batch: ScheduledBatch, proposal: StepProposal, v: Verification) -> list[RequestOutput]:
        settled = self.settle(batch, proposal, v, self.speculating or self.capture is not None)
        contexts = settled.contexts
        if self.blocks.enable_caching and self.tap_layers:
            contexts = self.taps.write(contexts, v.forward.hidden, v.forward.slots)
        self._observe(contexts)
        now = time.monotonic()
        outputs = [self._fail(r, why, 400) for r, why in settled.faults]
        outputs += [self._emit(c, v, now) for c in settled.kept]
        self.metrics.record_step(self.snapshot())
        return outputs

    def _emit(self, c: Committed, v: Verification, now: float) -> RequestOutput:
        """Append a request's kept tokens under its stop conditions; its delta for the client.
        What fails here (its stop strings, its grammar, its logprobs) fails it alone."""
        r = c.request
        try:
            logprobs = None
            if v.result is not None:
                start = int(v.result.offsets[c.row])
                logprobs = target_logprobs(r, v.forward.logits, start, c.tokens, self.tokenizer)
            appended = append_tokens(r, c.tokens, self.eos_ids)
            if r.constraint is not None and appended.token_ids:
                r.constraint.commit(appended.token_ids)
                if isinstance(r.constraint, GuardedConstraint) and r.constraint.error:
                    return self._fail(r, f"the grammar failed: {r.constraint.error}", 400)
        except Exception as exc:
            log.exception("request %s failed while committing its tokens", r.request_id)
            why = f"the request failed while committing its tokens: {type(exc).__name__}: {exc}"
            return self._fail(r, why)
        if appended.finish_reason is not None:
            self._finish(r, appended.finish_reason)
        record_tokens(self.metrics, r, len(appended.token_ids), len(c.tokens) if c.decoding else None, now)
        records = token_records(appended, c.provenance, logprobs)
        return self._output(r, appended.token_ids, final=r.finished, tokens=records)

    def _finish(self, r: Request, reason: str) -> None:
        r.status = Status.FINISHED
        r.finish_reason = reason
        self.scheduler.remove(r)
        self.blocks.free(r.request_id)
        self.speculation.free(r.request_id)
        self.metrics.record_finished(reason, time.monotonic() - r.arrival_time)

    def _output(
        self, r: Request, appended: list[int], final: bool, tokens: list[TokenRecord] | None = None
    ) -> RequestOutput:
        if final:
            self.requests.pop(r.request_id, None)
        return request_output(r, appended, final, self.drafter is not None, tokens)
