"""The engine step: schedule -> draft -> choose lengths -> verify -> update.

Single-threaded and synchronous; `scheduler.async_engine` runs it off the HTTP event loop.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from drafter.base import AcceptedContext, DraftProposal, DraftRequest, Drafter
from scheduler.client import EngineError, TokenRecord, round_provenance
from scheduler.config import SchedulerConfig
from scheduler.detokenizer import IncrementalDetokenizer
from scheduler.gate import DraftGate
from scheduler.load import LoadMonitor
from scheduler.policy import CostTable, LoadState, Policy, PolicyInput, parse_policy
from scheduler.request import Request, RequestOutput, Status
from verifier.model_runner import ForwardOutput, ModelRunner, Segment
from verifier.rejection import RejectionResult, rejection_sample
from verifier.sampling import SamplingTensors, probs_from_logits

log = logging.getLogger(__name__)

# Used only when no profile was measured (tests, policies that ignore cost): SPS flat to 8
# tokens, then falling as on a compute-bound machine.
DEFAULT_COST = CostTable((1, 8, 64, 512), (100.0, 100.0, 40.0, 6.0))


class RequestRejected(EngineError):
    """A request the engine cannot take (too long, queue full); carries an HTTP status."""


@dataclass
class ScheduledBatch:
    """The requests that run in one step: decodes (anchor + drafts) and prefill chunks."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk tokens)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


@dataclass
class Verification:
    """The target's verdict for one step."""

    forward: ForwardOutput
    result: RejectionResult | None      # rows: decodes then completing prefills
    sampled_rows: list[Request]         # requests in result row order


class HiddenCapture(Protocol):
    """Receives the target's hidden states of every token it commits (training-data
    generation: the tap states the drafter learns from, captured in the serving pass)."""

    layers: tuple[int, ...]

    def observe(self, contexts: list[AcceptedContext]) -> None: ...


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer, sched: SchedulerConfig,
                 max_model_len: int, drafter: Drafter | None = None,
                 cost_table: CostTable | None = None, metrics=None,
                 capture: HiddenCapture | None = None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.cfg = sched
        self.max_model_len = max_model_len
        self.drafter = drafter
        policy = sched.verify_policy
        if policy == "auto":
            policy = "dspark" if drafter is not None else "none"
        self.cost_table = cost_table
        self.metrics = metrics
        self.capture = capture
        self._use_policy(policy)
        if capture is not None and self.speculating:
            raise ValueError("hidden-state capture runs with plain decoding (drafter none)")
        self.load = LoadMonitor(runner)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.reserved_blocks = 0
        self.eos_ids = self._eos_ids(runner.model, tokenizer)
        self.vocab_size = int(runner.embed.num_embeddings)

    @property
    def speculating(self) -> bool:
        """A drafter is loaded and the policy may verify drafts (policy `none` = plain decoding)."""
        return self.drafter is not None and self.policy.name != "none"

    @property
    def tap_layers(self) -> tuple[int, ...]:
        if self.speculating:
            return tuple(self.drafter.tap_layers)
        return tuple(self.capture.layers) if self.capture is not None else ()

    def set_policy(self, spec: str) -> None:
        """Switch the verification policy (only between requests: drafter state is per request)."""
        if self.running or self.waiting:
            raise RuntimeError("set_policy needs an idle engine")
        self._use_policy(spec)

    def _use_policy(self, spec: str) -> None:
        self.policy: Policy = parse_policy(spec)
        # The load-aware policy also decides whether drafting pays at all (scheduler/gate.py).
        self.gate = DraftGate() if (self.drafter is not None and self.cfg.draft_gate
                                    and self.policy.name == "dspark") else None

    @staticmethod
    def _eos_ids(model, tokenizer) -> frozenset[int]:
        ids = set()
        for src in (getattr(model, "generation_config", None), model.config, tokenizer):
            e = getattr(src, "eos_token_id", None)
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, (list, tuple)):
                ids.update(int(x) for x in e)
        return frozenset(ids)

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
            raise RequestRejected(f"max_tokens must be a positive integer, got {req.max_tokens!r}",
                                  400, "max_tokens")
        if any(type(t) is not int for t in req.stop_token_ids):
            raise RequestRejected("stop token ids must be integers", 400, "stop")
        if not all(isinstance(s, str) for s in req.stop):
            raise RequestRejected("stop must be strings", 400, "stop")
        sp = req.sampling
        if sp.seed is not None and req.generator is None:
            raise RequestRejected("a seeded request needs its generator", 400, "seed")
        try:  # the sampling parameters must fit the tensors the step builds from them
            SamplingTensors.from_params([sp], torch.device("cpu"))
        except (ValueError, TypeError, RuntimeError, OverflowError) as exc:
            raise RequestRejected(f"sampling parameters out of range: {exc}", 400) from exc
        if n + req.max_tokens > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n + req.max_tokens} tokens ({n} in the messages, {req.max_tokens} in "
                f"the completion). Please reduce the length of the messages or completion.",
                400, "max_tokens")
        if self.runner.blocks.blocks_needed(n + req.max_tokens) > self.runner.blocks.num_blocks:
            raise RequestRejected("the request needs more KV cache than the server has", 400, "max_tokens")
        if len(self.waiting) >= self.cfg.max_waiting:
            raise RequestRejected("the server is at capacity; retry later", 429)
        try:
            req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.stop)
        except Exception as exc:  # the tokenizer cannot decode this prompt's ids
            raise RequestRejected(f"the prompt cannot be decoded: {exc}", 400, "prompt") from exc
        self.waiting.append(req)
        self.requests[req.request_id] = req
        self._record_load()

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")
        self._record_load()  # /metrics must not show it running after the last abort
        return self._output(req, [], final=True)

    def _record_load(self) -> None:
        if self.metrics is not None:
            self.metrics.record_step(self)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step. Never raises because of one request: a request found invalid before any
        state changed is failed alone; an error later in the step fails the step's batch
        (their KV and drafter state freed, finish_reason "error"), and everyone else goes on."""
        batch = self._schedule()
        if not batch:
            return []
        failed = []
        for r in [r for r in batch.decodes + [r for r, _ in batch.prefills] if self._invalid(r)]:
            log.error("request %s failed its pre-step check: %s", r.request_id, self._invalid(r))
            failed.append(self._fail(r, f"invalid request state: {self._invalid(r)}"))
        if failed:
            batch = ScheduledBatch([r for r in batch.decodes if not r.finished],
                                   [(r, n) for r, n in batch.prefills if not r.finished])
            if not batch:
                return failed
        try:
            return failed + self._step(batch)
        except Exception:
            log.exception("engine step failed; failing its %d requests",
                          len(batch.decodes) + len(batch.prefills))
            victims = batch.decodes + [r for r, _ in batch.prefills]
            out = failed + [self._fail(r, "internal error while generating") for r in victims
                            if not r.finished or r.request_id in self.requests]
            self._record_load()
            return out

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
            for t in r.prompt_ids[r.num_computed:]:
                if type(t) is not int or not (0 <= t < V):
                    return f"prompt token id {t!r} out of range [0, {V})"
        return None

    def _fail(self, r: Request, message: str) -> RequestOutput:
        if r.finished:  # finished inside the failed step: its final output was never sent
            r.finish_reason = "error"
        else:
            self._finish(r, "error")
        self.runner.blocks.free(r.request_id)
        out = self._output(r, [], final=True)
        out.error = message
        return out

    def _step(self, batch: ScheduledBatch) -> list[RequestOutput]:
        t0 = time.perf_counter()
        drafting = self._gate_open(batch)
        if drafting:
            proposals = self._draft(batch.decodes)
        else:
            # Seeded requests keep drafting: the gate follows timings, and a seeded request's
            # output must not depend on them.
            seeded = [r for r in batch.decodes if r.sampling.seed is not None]
            proposals = self._no_drafts(batch.decodes)
            if seeded:
                idx = {r.request_id: i for i, r in enumerate(batch.decodes)}
                for r, p in zip(seeded, self._draft(seeded)):
                    proposals[idx[r.request_id]] = p
        lengths = self._choose_lengths(batch, proposals)
        verification = self._verify(batch, proposals, lengths)
        outputs = self._update(batch, proposals, lengths, verification)
        mixed = not drafting and any(len(p) for p in proposals)
        if self.gate is not None and batch.decodes and not batch.prefills and not mixed:
            # Only pure decode steps are comparable: a prefill chunk would dominate the time.
            decoding = {r.request_id for r in batch.decodes}
            made = sum(len(o.token_ids) for o in outputs if o.request_id in decoding)
            self.gate.record(len(batch.decodes), drafting, made, time.perf_counter() - t0)
        return outputs

    def _gate_open(self, batch: ScheduledBatch) -> bool:
        if self.gate is None or not batch.decodes:
            return True
        return self.gate.should_draft(len(batch.decodes))

    @staticmethod
    def _no_drafts(decodes: list[Request]) -> list[DraftProposal]:
        return [DraftProposal(tokens=torch.empty(0, dtype=torch.long)) for _ in decodes]

    def _schedule(self) -> ScheduledBatch:
        blocks = self.runner.blocks
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            need = blocks.blocks_needed(len(req.prompt_ids) + req.max_tokens)
            # Reserve the request's whole worst case up front: it can then never run out of
            # KV mid-way, so nothing is ever preempted and the process never over-commits.
            if self.reserved_blocks + need > blocks.num_blocks:
                break
            self.waiting.popleft()
            req.reserved_blocks = need
            self.reserved_blocks += need
            req.status = Status.PREFILL
            self.running.append(req)
        batch = ScheduledBatch(decodes=[r for r in self.running if r.status is Status.DECODE])
        budget = self.cfg.max_num_batched_tokens - len(batch.decodes)
        if self.speculating:
            # leave room for the drafts the policy may admit
            budget -= len(batch.decodes) * min(2, self.drafter.block_size)
        for r in self.running:
            if r.status is Status.PREFILL and budget > 0:
                chunk = min(len(r.prompt_ids) - r.num_computed, budget)
                batch.prefills.append((r, chunk))
                budget -= chunk
        return batch

    def _max_draft(self, r: Request) -> int:
        cap = min(self.drafter.block_size, r.max_tokens - len(r.output_ids) - 1,
                  self.max_model_len - r.num_tokens - 1)
        if self.policy.name == "dspark" and self.cfg.draft_headroom and r.last_budget is not None:
            # Skip positions the policy will not admit: it gave this request `last_budget`
            # drafts a step ago, and load moves slowly. Fixed before any draft of this step
            # is sampled, so it cannot bias the output.
            cap = min(cap, r.last_budget + self.cfg.draft_headroom)
        return max(0, cap)

    def _draft(self, decodes: list[Request]) -> list[DraftProposal]:
        proposals = self._no_drafts(decodes)
        if not self.speculating or not decodes:
            return proposals
        views = [DraftRequest(r.request_id, r.token_ids, len(r.prompt_ids), r.sampling,
                              r.generator, self._max_draft(r)) for r in decodes]
        todo = [i for i, v in enumerate(views) if v.max_draft > 0]
        if todo:
            for i, p in zip(todo, self.drafter.propose([views[i] for i in todo])):
                proposals[i] = p
        return proposals

    def _choose_lengths(self, batch: ScheduledBatch, proposals: list[DraftProposal]) -> list[int]:
        if not proposals:
            return []
        # The forward's token budget is a hard cap. It is applied to the per-request maxima
        # *before* the policy, from quantities that do not depend on the drafted tokens, so
        # which drafts get verified stays causal (no bias).
        caps = [len(p) for p in proposals]
        room = self.cfg.max_num_batched_tokens - batch.prefill_tokens - len(proposals)
        if sum(caps) > room:
            share, extra = divmod(max(room, 0), len(caps))
            caps = [min(c, share + (i < extra)) for i, c in enumerate(caps)]
        inp = PolicyInput(confidences=[p.confidences for p in proposals], max_lengths=caps)
        snap = self.load.snapshot(len(batch.decodes), len(self.waiting))
        load = LoadState(num_running=snap.num_running, num_waiting=snap.num_waiting,
                         prefill_tokens=batch.prefill_tokens, kv_usage=min(1.0, snap.kv_usage))
        decision = self.policy(inp, self.cost_table or DEFAULT_COST, load)
        lengths = list(decision.lengths)
        for r, l in zip(batch.decodes, lengths):
            r.last_budget = l
        if getattr(self.drafter, "online_confidence", False) and self.policy.name != "none":
            # Exploration on a fixed schedule: it depends on the step count only, never on the
            # drafted tokens, so it cannot bias the output.
            for i, r in enumerate(batch.decodes):
                if caps[i] > 0 and r.spec.steps % self.cfg.explore_every == 0:
                    lengths[i] = max(lengths[i], 1)
        if self.metrics is not None:
            self.metrics.record_policy(decision, snap)
        return lengths

    def _verify(self, batch: ScheduledBatch, proposals: list[DraftProposal],
                lengths: list[int]) -> Verification:
        blocks = self.runner.blocks
        segments: list[Segment] = []
        for r, p, l in zip(batch.decodes, proposals, lengths):
            toks = [r.output_ids[-1]] + p.tokens[:l].tolist()
            blocks.append(r.request_id, len(toks))
            segments.append(Segment(r.request_id, toks, r.num_computed, 0))
        completing: list[Request] = []
        for r, n in batch.prefills:
            blocks.append(r.request_id, n)
            done = r.num_computed + n == len(r.prompt_ids)
            segments.append(Segment(r.request_id, r.prompt_ids[r.num_computed:r.num_computed + n],
                                    r.num_computed, n - 1 if done else n))
            if done:
                completing.append(r)
        t0 = time.perf_counter()
        fwd = self.runner.forward(segments, self.tap_layers)
        if self.metrics is not None:
            self.metrics.record_forward(sum(len(s.token_ids) for s in segments), time.perf_counter() - t0)
        rows = batch.decodes + completing
        if not rows:
            return Verification(fwd, None, [])
        nd = lengths + [0] * len(completing)
        K = max(nd)
        R, V = len(rows), fwd.logits.shape[-1]
        # Target p for every logit row at once (each request's params repeated over its rows).
        st = SamplingTensors.from_params([r.sampling for r in rows], fwd.logits.device)
        probs = probs_from_logits(fwd.logits, *_rows(st, torch.tensor([n + 1 for n in nd],
                                                                       device=fwd.logits.device)))
        target = probs.new_zeros(R, K + 1, V)
        draft_tokens = torch.zeros(R, K, dtype=torch.long)
        draft_probs = None
        deterministic = torch.ones(R, dtype=torch.bool)
        if K > 0 and any(p.probs is not None for p in proposals):
            draft_probs = probs.new_zeros(R, K, V)
        off = 0
        for i, n in enumerate(nd):
            target[i, :n + 1] = probs[off:off + n + 1]
            off += n + 1
            if i < len(proposals) and n > 0:
                p = proposals[i]
                draft_tokens[i, :n] = p.tokens[:n]
                if p.probs is not None and draft_probs is not None:
                    draft_probs[i, :n] = p.probs[:n]
                    deterministic[i] = False
        result = rejection_sample(target, draft_tokens, draft_probs, torch.tensor(nd),
                                  [r.generator for r in rows], draft_deterministic=deterministic)
        # One device-to-host copy per step: _update reads the result row by row.
        result = RejectionResult(result.output_tokens.cpu(), result.num_accepted.cpu(),
                                 result.num_output.cpu())
        return Verification(fwd, result, rows)

    def _update(self, batch: ScheduledBatch, proposals: list[DraftProposal], lengths: list[int],
                v: Verification) -> list[RequestOutput]:
        now = time.monotonic()
        contexts: list[AcceptedContext] = []
        new_tokens: dict[str, list[int]] = {}
        provenance: dict[str, list[tuple[str, int | None]]] = {}
        row_of = {r.request_id: i for i, r in enumerate(v.sampled_rows)}
        hidden = v.forward.hidden
        keep_context = self.speculating or self.capture is not None
        for si, (r, p, l) in enumerate(zip(batch.decodes, proposals, lengths)):
            i = row_of[r.request_id]
            a = int(v.result.num_accepted[i])
            toks = v.result.output_tokens[i, :a + 1].tolist()
            start = r.num_computed
            r.num_computed += 1 + a
            self.runner.blocks.truncate(r.request_id, r.num_computed)   # roll back rejected drafts
            if keep_context:
                off = v.forward.token_offsets[si]
                contexts.append(AcceptedContext(
                    r.request_id, [r.output_ids[-1]] + p.tokens[:a].tolist(), start,
                    None if hidden is None else hidden[off:off + 1 + a]))
            if self.speculating:
                if l > 0:
                    self.drafter.observe_acceptance(r.request_id, l, a)
                    r.spec.rounds += 1
                    r.spec.drafted += l
                    r.spec.accepted += a
                    if self.metrics is not None:
                        self.metrics.record_round(l, a)
            r.spec.steps += 1
            new_tokens[r.request_id] = toks
            provenance[r.request_id] = round_provenance(a, l if self.speculating else 0)
        nd = len(batch.decodes)
        for si, (r, n) in enumerate(batch.prefills):
            if keep_context:
                off = v.forward.token_offsets[nd + si]
                contexts.append(AcceptedContext(
                    r.request_id, r.prompt_ids[r.num_computed:r.num_computed + n], r.num_computed,
                    None if hidden is None else hidden[off:off + n]))
            r.num_computed += n
            if r.request_id in row_of:
                r.status = Status.DECODE
                i = row_of[r.request_id]
                new_tokens[r.request_id] = v.result.output_tokens[i, :1].tolist()
                provenance[r.request_id] = round_provenance(0, 0)
        if contexts and self.speculating:
            self.drafter.observe(contexts)
        if contexts and self.capture is not None:
            self.capture.observe(contexts)
        outputs = []
        decode_ids = {r.request_id for r in batch.decodes}
        for rid, toks in new_tokens.items():
            r = self.requests[rid]
            pieces: list[str] = []
            appended = self._append_tokens(r, toks, pieces)
            records = [TokenRecord(t, text, kind, pos)
                       for t, text, (kind, pos) in zip(appended, pieces, provenance[rid])]
            if self.metrics is not None:
                self.metrics.record_tokens(len(appended))
                if rid in decode_ids:
                    self.metrics.realized.labels(**self.metrics.labels).inc(len(toks))
            if r.first_token_time is None:
                r.first_token_time = now
                if self.metrics is not None:
                    self.metrics.record_first_token(r, now)
            elif self.metrics is not None:
                self.metrics.record_inter_token(now - r.last_token_time, len(appended))
            r.last_token_time = now
            outputs.append(self._output(r, appended, final=r.finished, tokens=records))
        if self.metrics is not None:
            self.metrics.record_step(self)
        return outputs

    def _append_tokens(self, r: Request, toks: list[int], pieces: list[str] | None = None) -> list[int]:
        """Append a round's tokens one by one, honouring EOS, stop strings and max_tokens
        exactly: nothing after the stop point is kept or returned. `pieces`, when given,
        receives the text each appended token added."""
        appended = []
        for t in toks:
            if (t in self.eos_ids and not r.ignore_eos) or t in r.stop_token_ids:
                self._finish(r, "stop")
                break
            r.output_ids.append(t)
            appended.append(t)
            before = len(r.detok.text)
            stopped = r.detok.add(t)
            if pieces is not None:
                pieces.append(r.detok.text[before:])
            if stopped:
                self._finish(r, "stop")
                break
            if len(r.output_ids) >= r.max_tokens:
                self._finish(r, "length")
                break
        return appended

    def _finish(self, r: Request, reason: str) -> None:
        r.status = Status.FINISHED
        r.finish_reason = reason
        if r in self.running:
            self.running.remove(r)
            self.reserved_blocks -= r.reserved_blocks
        self.runner.blocks.free(r.request_id)
        if self.drafter is not None:
            self.drafter.free(r.request_id)
        if self.metrics is not None:
            self.metrics.record_finished(r)

    def _output(self, r: Request, appended: list[int], final: bool,
                tokens: list[TokenRecord] | None = None) -> RequestOutput:
        text = r.detok.flush(final) if r.detok is not None else ""
        if final:
            self.requests.pop(r.request_id, None)
        return RequestOutput(
            request_id=r.request_id, text=text, token_ids=appended, finished=final,
            finish_reason=r.finish_reason, prompt_tokens=len(r.prompt_ids),
            completion_tokens=len(r.output_ids),
            spec=r.spec if self.drafter is not None else None, tokens=tokens or [])


def _rows(st: SamplingTensors, repeats: torch.Tensor):
    e = st.repeat_interleave(repeats)
    return e.temperature, e.top_p, e.top_k
