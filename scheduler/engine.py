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
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty", 400, "messages")
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
        req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.stop)
        self.waiting.append(req)
        self.requests[req.request_id] = req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, "abort")
        return self._output(req, [], final=True)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self._schedule()
        if not batch:
            return []
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
        probs = probs_from_logits(fwd.logits, *_rows(st, torch.tensor([n + 1 for n in nd])))
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
