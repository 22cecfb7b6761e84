"""The engine step: schedule -> propose -> verify -> commit.

- schedule (`scheduler/scheduler.py`): admission against KV capacity, chunked prefill under the
  step's token budget, the `ScheduledBatch`;
- propose (`scheduler/speculation.py`): drafter, draft gate and policy behind one call that
  returns a `StepProposal` (draft blocks + verification lengths);
- verify: one flat target forward, then the flat verification inputs and rejection sampling
  (`verifier/verify.py`, `verifier/rejection.py`);
- commit (`scheduler/commit.py` and `_commit` here): KV rollback, drafter feedback, stop
  conditions, detokenization, outputs, metrics.

Single-threaded and synchronous; `scheduler.async_engine` runs it off the HTTP event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dspark_serve.drafter.base import AcceptedContext, Drafter
from dspark_serve.ops.processors import GuardedConstraint, TokenContext, needs_processing
from dspark_serve.ops.sampling import SamplingTensors
from dspark_serve.scheduler.client import EngineError, TokenLogprob, TokenRecord, TopLogprob, round_provenance
from dspark_serve.scheduler.commit import append_tokens, eos_token_ids, request_output, token_records
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.detokenizer import IncrementalDetokenizer
from dspark_serve.scheduler.gate import DraftGate
from dspark_serve.scheduler.load import LoadMonitor
from dspark_serve.scheduler.metrics_sink import EngineMetricsSink, EngineSnapshot, NullMetrics
from dspark_serve.scheduler.policy import CostTable, Policy
from dspark_serve.scheduler.prefix import TapCache
from dspark_serve.scheduler.request import Request, RequestOutput, Status
from dspark_serve.scheduler.scheduler import ScheduledBatch, Scheduler
from dspark_serve.scheduler.speculation import Speculation, StepProposal
from dspark_serve.verifier.grammar import Grammar, GrammarCompiler, GrammarConfig
from dspark_serve.verifier.model_runner import ForwardOutput, ModelRunner, Segment
from dspark_serve.verifier.rejection import RejectionResult
from dspark_serve.verifier.verify import VerifyRequest, verify

log = logging.getLogger(__name__)


class RequestRejected(EngineError):
    """A request the engine cannot take (too long, queue full); carries an HTTP status."""


@dataclass
class Verification:
    """The target's verdict for one step.

    forward: the flat forward's logits and hidden states.
    result: rejection sampling's verdict; its requests are the decodes, then the prefills that
        completed their prompt, then the second blocks (None when only partial prefill chunks
        ran).
    branches: per decode index with a second block, where its segment and verdict row are.
    forward_seconds: how long the target forward took (the step's overhead is the rest).
    """

    forward: ForwardOutput
    result: RejectionResult | None
    branches: dict[int, Branch] = field(default_factory=dict)
    forward_seconds: float = 0.0


@dataclass(frozen=True)
class Branch:
    """A second block verified for one decoding request, as a fork of its block table.

    request_id: the fork's id in the block manager.
    tokens: [M] int64, its drafts.
    segment: its segment's index in the forward; row: its request row in the verdict.
    """

    request_id: str
    tokens: torch.Tensor
    segment: int
    row: int


@dataclass
class Committed:
    """What one request kept this step, before stop conditions cut it.

    tokens: the new tokens (accepted drafts + the target's own; the first token after a prompt).
    provenance: (kind, draft position) per token (`round_provenance`).
    decoding: it was a decode (not a completing prefill) this step.
    row: its request row in the step's verdict (where its logprobs are read).
    """

    request: Request
    tokens: list[int]
    provenance: list[tuple[str, int | None]]
    decoding: bool
    row: int


@dataclass
class Settled:
    """The verdict applied: what each request kept, the contexts (tokens kept + their hidden
    states) for the drafter or the hidden-state capture, and the requests whose own input
    failed them this step (request, why), to be failed alone."""

    kept: list[Committed] = field(default_factory=list)
    contexts: list[AcceptedContext] = field(default_factory=list)
    faults: list[tuple[Request, str]] = field(default_factory=list)


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
        self.runner = runner
        self.tokenizer = tokenizer
        self.cfg = sched
        self.max_model_len = max_model_len
        self.metrics: EngineMetricsSink = metrics if metrics is not None else NullMetrics()
        self.capture = capture
        self.speculation = Speculation(drafter, sched, max_model_len, cost_table)
        if capture is not None and self.speculating:
            raise ValueError("hidden-state capture runs with plain decoding (drafter none)")
        runner.blocks.enable_caching = sched.enable_prefix_caching
        self.scheduler = Scheduler(sched, runner.blocks)
        self.taps = TapCache(runner.blocks, runner.device)
        self.load = LoadMonitor(runner)
        self.requests: dict[str, Request] = {}
        # block tables forked for second blocks this step; adopted or freed when it settles
        self._open_branches: list[str] = []
        self.eos_ids = eos_token_ids(runner.model, tokenizer)
        self.vocab_size = int(runner.embed.num_embeddings)  # type: ignore[arg-type]
        # Structured output: built on the first request that needs it (llguidance reads the
        # whole tokenizer, about a second); tests may set their own.
        self.grammars: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self.grammar_config = GrammarConfig()

    def compile_grammar(self, kind: str, schema: str | None) -> Grammar:
        """A request's grammar (thread-safe; the server calls it off the engine thread).
        Raises GrammarError for a schema it refuses, ValueError when the tokenizer has no
        llguidance support."""
        with self._grammar_lock:
            if self.grammars is None:
                self.grammars = GrammarCompiler.for_hf(
                    self.tokenizer, self.vocab_size, sorted(self.eos_ids), self.grammar_config
                )
        return self.grammars.compile(kind, schema)

    # -- the parts, as the rest of the code sees them ------------------------------------------
    @property
    def drafter(self) -> Drafter | None:
        return self.speculation.drafter

    @property
    def policy(self) -> Policy:
        return self.speculation.policy

    @property
    def gate(self) -> DraftGate | None:
        return self.speculation.gate

    @property
    def cost_table(self) -> CostTable | None:
        return self.speculation.cost_table

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def reserved_blocks(self) -> int:
        return self.scheduler.reserved_blocks

    @property
    def speculating(self) -> bool:
        """A drafter is loaded and the policy may verify drafts (policy `none` = plain decoding)."""
        return self.speculation.speculating

    @property
    def tap_layers(self) -> tuple[int, ...]:
        if self.speculating:
            return self.speculation.tap_layers
        return tuple(self.capture.layers) if self.capture is not None else ()

    def set_policy(self, spec: str) -> None:
        """Switch the verification policy (only between requests: drafter state is per request)."""
        if self.scheduler.has_work():
            raise RuntimeError("set_policy needs an idle engine")
        self.speculation.use_policy(spec)
        # Cached blocks carry the tap states of the old setting (or none): start afresh. The
        # rows' buffer is kept while a drafter that taps the target is loaded, plain decoding
        # included (rows are written before read): a policy switched back to drafting would
        # otherwise grow it anew, page by fresh page, and a benchmark alternating plain and
        # drafting arms charged that to every drafting run (~4% of a 32-request run).
        self.runner.blocks.reset_prefix_cache()
        d = self.speculation.drafter
        self.taps.reset(keep=d is not None and bool(d.tap_layers))

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turn prefix caching on or off (only between requests; benchmarks compare both);
        the cache starts empty either way."""
        if self.scheduler.has_work():
            raise RuntimeError("set_prefix_caching needs an idle engine")
        self.runner.blocks.enable_caching = bool(enabled)
        self.runner.blocks.reset_prefix_cache()
        self.taps.reset()

    def snapshot(self) -> EngineSnapshot:
        """What the engine carries now, for the gauges."""
        d = self.drafter
        b = self.runner.blocks
        return EngineSnapshot(
            len(self.running),
            len(self.waiting),
            b.usage,
            d.calibrator if d is not None else None,
            b.cached_free_usage,
            b.stats(),
            self.scheduler.num_preemptions,
        )

    # -- requests in and out -----------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request after checking everything it brings, so that no step can fail
        because of its input (raises RequestRejected with an HTTP status and the parameter)."""
        if req.request_id in self.requests:
            raise RequestRejected(f"request id {req.request_id!r} is already in use", 400)
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty", 400, "messages")
        V = self.vocab_size
        for t in req.prompt_ids:
            if type(t) is not int or not (0 <= t < V):
                raise RequestRejected(f"prompt token id {t!r} is out of range [0, {V})", 400, "prompt")
        if type(req.max_tokens) is not int or req.max_tokens < 1:
            raise RequestRejected(
                f"max_tokens must be a positive integer, got {req.max_tokens!r}", 400, "max_tokens"
            )
        if not all(isinstance(s, str) for s in req.stop):
            raise RequestRejected("stop must be strings", 400, "stop")
        sp = req.sampling
        if sp.seed is not None and req.generator is None:
            raise RequestRejected("a seeded request needs its generator", 400, "seed")
        try:  # the sampling parameters must fit the tensors the step builds from them
            SamplingTensors.from_params([sp], torch.device("cpu"))
        except (ValueError, TypeError, RuntimeError, OverflowError) as exc:
            raise RequestRejected(f"sampling parameters out of range: {exc}", 400) from exc
        bad_bias = [t for t, _ in sp.logit_bias if t >= V]
        if bad_bias:
            raise RequestRejected(
                f"logit_bias token id {bad_bias[0]} is out of range [0, {V})", 400, "logit_bias"
            )
        if req.logprobs is not None and not (0 <= req.logprobs <= 20):
            raise RequestRejected(
                f"top_logprobs must be in [0, 20], got {req.logprobs!r}", 400, "top_logprobs"
            )
        if n + req.max_tokens > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n + req.max_tokens} tokens ({n} in the messages, {req.max_tokens} in "
                f"the completion). Please reduce the length of the messages or completion.",
                400,
                "max_tokens",
            )
        if self.runner.blocks.blocks_needed(n + req.max_tokens) > self.runner.blocks.num_blocks:
            raise RequestRejected("the request needs more KV cache than the server has", 400, "max_tokens")
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
        spec = self.speculation
        batch = self.scheduler.schedule(spec.draft_reserve(self.running), spec.lookahead)
        for r in batch.preempted:  # it recomputes its context when it runs again
            self.speculation.free(r.request_id)
        if not batch:
            if batch.preempted:
                self.metrics.record_step(self.snapshot())
            return []
        failed = []
        for r in batch.requests:
            problem = self._invalid(r)
            if problem is not None:
                log.error("request %s failed its pre-step check: %s", r.request_id, problem)
                failed.append(self._fail(r, f"invalid request state: {problem}"))
        if failed:
            batch = batch.without_finished()
            if not batch:
                return failed
        try:
            with self.runner.attention_backends():
                return failed + self._step(batch)
        except Exception:
            log.exception(
                "engine step failed; failing its %d requests", len(batch.decodes) + len(batch.prefills)
            )
            for bid in self._open_branches:
                self.runner.blocks.free(bid)
            self._open_branches.clear()
            out = failed + [
                self._fail(r, "internal error while generating")
                for r in batch.requests
                if not r.finished or r.request_id in self.requests
            ]
            self.metrics.record_step(self.snapshot())
            return out

    def _step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._restore_contexts(batch)
        proposal = self._propose(batch)
        verification = self._verify(batch, proposal)
        outputs = self._commit(batch, proposal, verification)
        decoding = {r.request_id for r in batch.decodes}
        made = sum(len(o.token_ids) for o in outputs if o.request_id in decoding)
        self.speculation.record_step(
            proposal,
            len(batch.decodes),
            bool(batch.prefills),
            made,
            time.perf_counter() - t0,
            verification.forward_seconds,
        )
        return outputs

    def _invalid(self, r: Request) -> str | None:
        """What is wrong with a scheduled request's input, checked before the step touches any
        state (KV, drafter, generators); None when it is fine."""
        V = self.vocab_size
        if r.detok is None:
            return "not admitted through add_request"
        if r.status is Status.DECODE:
            t = r.output_ids[-1] if r.output_ids else None
            if type(t) is not int or not (0 <= t < V):
                return f"last token {t!r} out of range"
        else:
            for t in r.prefill_ids[r.num_computed :]:
                if type(t) is not int or not (0 <= t < V):
                    return f"prompt token id {t!r} out of range [0, {V})"
        return None

    def _fail(self, r: Request, message: str, status: int = 500) -> RequestOutput:
        """r ends with finish_reason "error" (status 400: its own input failed it); its KV and
        drafter state are freed, everyone else goes on."""
        if r.finished:  # finished inside the failed step: its final output was never sent
            r.finish_reason = "error"
        else:
            self._finish(r, "error")
        self.runner.blocks.free(r.request_id)
        out = self._output(r, [], final=True)
        out.error = message
        out.error_status = status
        if status == 400:
            log.warning("request %s failed alone: %s", r.request_id, message)
        return out

    def _restore_contexts(self, batch: ScheduledBatch) -> None:
        """Requests admitted with a cached prefix skip its forward: the drafter (and the hidden
        capture) get that prefix's context from the tap states cached beside its blocks."""
        if not (self.speculating or self.capture is not None):
            return
        contexts = [self.taps.context(r.request_id, r.prefill_ids, n) for r, n in batch.admitted if n > 0]
        if contexts:
            self.speculation.observe(contexts)
            if self.capture is not None:
                self.capture.observe(contexts)

    # -- propose -----------------------------------------------------------------------------
    def _propose(self, batch: ScheduledBatch) -> StepProposal:
        if not batch.decodes:
            return StepProposal([], [])
        prefilling = len(self.running) - len(batch.decodes)
        load = self.load.snapshot(len(batch.decodes), len(self.waiting), batch.prefill_tokens, prefilling)
        room = self.cfg.max_num_batched_tokens - batch.prefill_tokens - len(batch.decodes)
        proposal = self.speculation.propose(batch.decodes, room, load)
        if proposal.decision is not None:
            self.metrics.record_policy(proposal.decision, load, self.speculation.priced_overhead)
        return proposal

    # -- verify ------------------------------------------------------------------------------
    def _verify(self, batch: ScheduledBatch, proposal: StepProposal) -> Verification:
        blocks = self.runner.blocks
        segments: list[Segment] = []
        checks: list[VerifyRequest] = []
        for i, r in enumerate(batch.decodes):
            drafts = proposal.drafts(i)
            toks = [r.output_ids[-1]] + drafts.tolist()
            blocks.append(r.request_id, len(toks))
            segments.append(Segment(r.request_id, toks, r.num_computed, 0))
            checks.append(
                VerifyRequest(
                    r.sampling,
                    r.generator,
                    drafts,
                    proposal.draft_probs(i),
                    self._context(r),
                    position=len(r.output_ids),  # a seeded request samples keyed by position
                )
            )
        for r, n in batch.prefills:
            blocks.append(r.request_id, n)
            # A resumed (preempted) request recomputes its prompt and output but the last
            # token, which it already has: it samples nothing.
            done = r.num_computed + n == r.num_prefill_tokens and not r.output_ids
            segments.append(
                Segment(
                    r.request_id,
                    r.prefill_ids[r.num_computed : r.num_computed + n],
                    r.num_computed,
                    n - 1 if done else n,
                )
            )
            if done:  # its last prompt row samples the first token
                checks.append(
                    VerifyRequest(
                        r.sampling,
                        r.generator,
                        torch.empty(0, dtype=torch.long),
                        None,
                        self._context(r),
                        position=len(r.output_ids),
                    )
                )
        branches = self._fork_branches(batch, proposal, segments, checks)
        t0 = time.perf_counter()
        fwd = self.runner.forward(segments, self.tap_layers)
        took = time.perf_counter() - t0
        self.metrics.record_forward(sum(len(s.token_ids) for s in segments), took)
        if not checks:
            return Verification(fwd, None, forward_seconds=took)
        return Verification(fwd, verify(fwd.logits, checks), branches, forward_seconds=took)

    def _fork_branches(
        self,
        batch: ScheduledBatch,
        proposal: StepProposal,
        segments: list[Segment],
        checks: list[VerifyRequest],
    ) -> dict[int, Branch]:
        """A segment and a verdict row of their own for each second block: a fork of the
        request's block table from its anchor on (`BlockManager.fork`), after everything else."""
        blocks = self.runner.blocks
        out: dict[int, Branch] = {}
        for i, r in enumerate(batch.decodes):
            alt = proposal.alternate(i)
            if alt is None:
                continue
            bid = f"{r.request_id}\x00branch"
            n = r.num_computed
            need = blocks.blocks_needed(n + 1 + len(alt)) - n // blocks.block_size
            if need > blocks.num_free_blocks:
                continue
            pair = blocks.fork(r.request_id, bid, n)
            self._open_branches.append(bid)
            if pair is not None:  # the shared positions of its partial block: KV and tap rows
                self.runner.copy_kv_block(*pair)
                self.taps.copy_block(*pair)
            toks = [r.output_ids[-1]] + alt.tolist()
            blocks.append(bid, len(toks))
            out[i] = Branch(bid, alt, len(segments), len(checks))
            segments.append(Segment(bid, toks, n, 0))
            checks.append(VerifyRequest(r.sampling, r.generator, alt, None, None))
        return out

    @staticmethod
    def _context(r: Request) -> TokenContext | None:
        """What r's penalties, logit bias and grammar read (None when it has none)."""
        ctx = TokenContext(r.prompt_ids, r.output_ids, r.constraint)
        return ctx if needs_processing(r.sampling, ctx) else None

    def _logprobs(
        self, r: Request, v: Verification, row: int, tokens: list[int]
    ) -> list[TokenLogprob] | None:
        """The target's raw log-probabilities of `tokens`, sampled at verify rows row.. of the
        step (the verdict's request row `row`): the same rows whether a token was an accepted
        draft, a correction or a bonus, so the values are those plain decoding gives."""
        if r.logprobs is None or v.result is None:
            return None
        start = int(v.result.offsets[row])
        logits = v.forward.logits[start : start + len(tokens)].float()
        lp = torch.log_softmax(logits, dim=-1)
        chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
        k = min(r.logprobs, lp.shape[1])
        top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
        text = self._token_text
        return [
            TokenLogprob(
                text(t),
                float(c),
                tuple(TopLogprob(int(i), text(int(i)), float(x)) for i, x in zip(ti, tv)),
            )
            for t, c, ti, tv in zip(tokens, chosen, top_i.tolist(), top_v.tolist())
        ]

    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    # -- commit ------------------------------------------------------------------------------
    def _commit(self, batch: ScheduledBatch, proposal: StepProposal, v: Verification) -> list[RequestOutput]:
        settled = self._settle(batch, proposal, v)
        contexts = settled.contexts
        if self.runner.blocks.enable_caching and self.tap_layers:
            contexts = self.taps.write(contexts, v.forward.hidden, v.forward.slots)
        self.speculation.observe(contexts)
        if contexts and self.capture is not None:
            self.capture.observe(contexts)
        now = time.monotonic()
        outputs = [self._fail(r, why, 400) for r, why in settled.faults]
        outputs += [self._emit(c, v, now) for c in settled.kept]
        self.metrics.record_step(self.snapshot())
        return outputs

    def _fault(self, r: Request, res: RejectionResult, row: int) -> str | None:
        """Why r's own input failed it this step (its processing at verdict row `row`, its
        grammar anywhere in the step), or None."""
        problem = res.faults.get(row)
        if problem is None and isinstance(r.constraint, GuardedConstraint) and r.constraint.error:
            problem = f"the grammar failed: {r.constraint.error}"
        return problem

    def _settle(self, batch: ScheduledBatch, proposal: StepProposal, v: Verification) -> Settled:
        """Apply the verdict to the engine's state: KV of rejected drafts rolled back, prefill
        progress, drafter feedback. A request whose own input failed it (`_fault`) touches
        nothing: it is failed alone after the others settled."""
        out = Settled()
        hidden = v.forward.hidden
        keep_context = self.speculating or self.capture is not None
        res = v.result
        for i, r in enumerate(batch.decodes):  # decodes are rows 0.. of the verdict
            verified = proposal.lengths[i]
            assert res is not None  # decodes always get a verdict
            b = v.branches.get(i)
            problem = self._fault(r, res, i)
            if problem is not None:
                if b is not None:
                    self.runner.blocks.free(b.request_id)
                    self._open_branches.remove(b.request_id)
                out.faults.append((r, problem))
                continue
            a = first = res.accepted(i)
            drafts, row, seg, alternate = proposal.drafts(i), i, i, None
            if b is not None:  # the longer accepted run of two blocks is kept
                alternate = (len(b.tokens), res.accepted(b.row))
                if alternate[1] > a:
                    self.runner.blocks.adopt(r.request_id, b.request_id)
                    drafts, row, seg, a = b.tokens, b.row, b.segment, alternate[1]
                else:
                    self.runner.blocks.free(b.request_id)
                self.metrics.record_second_block(row != i)
                self._open_branches.remove(b.request_id)
            accepted = drafts[:a].tolist() if a else []
            start = r.num_computed
            r.num_computed += 1 + a
            self.runner.blocks.truncate(r.request_id, r.num_computed)  # roll back rejected drafts
            # only now are these tokens committed: their full blocks may enter the prefix cache
            self.runner.blocks.commit(r.request_id, r.token_ids + accepted, r.num_computed)
            if keep_context:
                off = v.forward.token_offsets[seg]
                out.contexts.append(
                    AcceptedContext(
                        r.request_id,
                        [r.output_ids[-1]] + accepted,
                        start,
                        None if hidden is None else hidden[off : off + 1 + a],
                    )
                )
            booked = self.speculation.settle(r, verified, first, alternate)
            if booked is not None:
                self.metrics.record_round(*booked)
            if row != i:  # the second block's run was kept
                verified = len(drafts)
            provenance = round_provenance(a, verified if self.speculating else 0)
            out.kept.append(Committed(r, res.tokens(row), provenance, True, row))
        self._settle_prefills(batch, v, keep_context, out)
        return out

    def _settle_prefills(
        self, batch: ScheduledBatch, v: Verification, keep_context: bool, out: Settled
    ) -> None:
        """Prefill progress; a completed prompt's first token (its verdict rows follow the decodes')."""
        nd = len(batch.decodes)
        row = nd
        hidden = v.forward.hidden
        res = v.result
        for si, (r, n) in enumerate(batch.prefills):
            ids = r.prefill_ids
            done = r.num_computed + n == len(ids) and not r.output_ids
            problem = self._fault(r, res, row) if done and res is not None else None
            if problem is not None:
                out.faults.append((r, problem))
                row += 1
                continue
            if keep_context:
                off = v.forward.token_offsets[nd + si]
                out.contexts.append(
                    AcceptedContext(
                        r.request_id,
                        ids[r.num_computed : r.num_computed + n],
                        r.num_computed,
                        None if hidden is None else hidden[off : off + n],
                    )
                )
            r.num_computed += n
            self.runner.blocks.commit(r.request_id, ids, r.num_computed)
            if r.num_computed == len(ids):
                r.status = Status.DECODE
                if done:  # completed a prompt: its first token was sampled
                    assert res is not None
                    out.kept.append(Committed(r, res.tokens(row)[:1], round_provenance(0, 0), False, row))
                    row += 1

    def _emit(self, c: Committed, v: Verification, now: float) -> RequestOutput:
        """Append a request's kept tokens under its stop conditions; its delta for the client.
        What fails here (its stop strings, its grammar, its logprobs) fails it alone."""
        r = c.request
        try:
            logprobs = self._logprobs(r, v, c.row, c.tokens)
            appended = append_tokens(r, c.tokens, self.eos_ids)
            if r.constraint is not None and appended.token_ids:
                r.constraint.commit(appended.token_ids)
                if isinstance(r.constraint, GuardedConstraint) and r.constraint.error:
                    return self._fail(r, f"the grammar failed: {r.constraint.error}", 400)
        except Exception as exc:
            log.exception("request %s failed while committing its tokens", r.request_id)
            return self._fail(
                r, f"the request failed while committing its tokens: {type(exc).__name__}: {exc}"
            )
        if appended.finish_reason is not None:
            self._finish(r, appended.finish_reason)
        records = token_records(appended, c.provenance, logprobs)
        n = len(appended.token_ids)
        self.metrics.record_tokens(n)
        if c.decoding:
            self.metrics.record_realized(len(c.tokens))
        if r.first_token_time is None or r.last_token_time is None:
            r.first_token_time = now
            self.metrics.record_first_token(now - r.arrival_time, len(r.prompt_ids))
        else:
            self.metrics.record_inter_token(now - r.last_token_time, n)
        r.last_token_time = now
        return self._output(r, appended.token_ids, final=r.finished, tokens=records)

    def _finish(self, r: Request, reason: str) -> None:
        r.status = Status.FINISHED
        r.finish_reason = reason
        self.scheduler.remove(r)
        self.runner.blocks.free(r.request_id)
        self.speculation.free(r.request_id)
        self.metrics.record_finished(reason, time.monotonic() - r.arrival_time)

    def _output(
        self, r: Request, appended: list[int], final: bool, tokens: list[TokenRecord] | None = None
    ) -> RequestOutput:
        if final:
            self.requests.pop(r.request_id, None)
        return request_output(r, appended, final, self.drafter is not None, tokens)
