"""Serving-side DSpark / DFlash drafter: per-request context KV cache + one batched block forward.

The drafter keeps, per request and per draft layer, the K/V of the target's projected hidden
states at every accepted position (DeepSpec's KV injection). Drafting a block never writes
into that cache: the block's own K/V live only for the forward, so nothing needs rolling back
when drafts are rejected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dspark_serve.drafter.base import AcceptedContext, DraftProposal, DraftRequest, TapRows
from dspark_serve.drafter.dspark_model import DSparkModel, load_dspark
from dspark_serve.drafter.dspark_model.fast import (
    ContextRows,
    FastConfidence,
    FastDraftBackbone,
    GreedyMarkov,
    GreedyTail,
    prepacked_linears_pay,
)
from dspark_serve.drafter.dspark_model.fast import applies as fast_backbone_applies
from dspark_serve.drafter.dspark_model.graphs import BlockOutputs, GraphedBlock
from dspark_serve.drafter.online_calibration import BucketedCalibrator, sampling_bucket
from dspark_serve.ops.cpu_kernels import SmallGemmLinear, load_kernels
from dspark_serve.ops.processors import needs_processing
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.verifier.cuda_graphs import CudaCapture, EagerReplay

log = logging.getLogger(__name__)
GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class DSparkDrafterConfig:
    """How a DSpark-family drafter is served.

    block_size: tokens drafted per block; None = the checkpoint's. At most the checkpoint's.
    trim_block: run only the block positions a step can use: the longest draft any request may
        verify (`DraftRequest.max_draft`, fixed before drafting) plus one spare, not the whole
        block. The block attends to itself whole, so a trimmed block is a slightly different
        (still lossless) proposal, of slightly lower acceptance on the embedded drafter
        (bench/acceptance.py measures it), for a drafter forward over a few positions instead of
        the whole block when load keeps budgets short.
    online_calibration: refit the confidence head's per-position temperatures from
        verification outcomes while serving (drafter/online_calibration.py).
    max_pending: positions of a request whose tap states may wait, unprojected, as copies for
        its next draft (the context is absorbed lazily); beyond this they are projected at
        once. Positions whose states the engine keeps readable (`AcceptedContext.stored`: the
        prefix cache's tap rows) wait without a copy and without this bound.
    absorb_apart: more pending positions than this (over the requests of one proposal) are
        projected on their own, k and v only, before the block's pass, instead of riding in
        it (where the layers compute their queries too, and past a few rows the C driver gives
        way to the Python loop). Apart is the cheaper for many positions, riding along for a
        few; the default sits between.
    cuda_graphs: replay the block pass as CUDA graphs, one per (requests padded to a power of
        two, block length), where the backbone runs the Triton kernels
        (drafter/dspark_model/graphs.py); pending context is then absorbed before the pass.
    graph_budget_s: seconds of capture at most (later buckets run eagerly).
    """

    block_size: int | None = None
    trim_block: bool = True
    initial_capacity: int = 256
    online_calibration: bool = True
    max_pending: int = 256
    absorb_apart: int = 64
    cuda_graphs: bool = False
    graph_budget_s: float = 30.0

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size!r}")
        if self.initial_capacity <= 0:
            raise ValueError(f"initial_capacity must be > 0, got {self.initial_capacity!r}")
        if self.max_pending <= 0:
            raise ValueError(f"max_pending must be > 0, got {self.max_pending!r}")
        if self.absorb_apart < 0:
            raise ValueError(f"absorb_apart must be >= 0, got {self.absorb_apart!r}")
        if self.graph_budget_s < 0:
            raise ValueError(f"graph_budget_s must be >= 0, got {self.graph_budget_s!r}")


class ContextKVCache:
    """Context K/V of every request, per draft layer, in slot-major pools.

    k[l], v[l]: [num_slots, capacity, Hkv, D]. A request owns one slot; its first
    `length` entries are the K/V of positions 0..length-1. Both dimensions grow by
    doubling, so appends are amortized O(1) and a batch of consecutive slots is a view.
    scratch: the last slot is never a request's (`scratch_slot`): where the padding rows of a
    CUDA-graphed block pass write (drafter/dspark_model/graphs.py)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        capacity: int = 256,
        slots: int = 4,
        scratch: bool = False,
    ):
        self.num_layers, self.shape = num_layers, (num_kv_heads, head_dim)
        self.device, self.dtype = device, dtype
        self.reserved = 1 if scratch else 0
        slots = max(slots, 1) + self.reserved
        self.k = [self._empty(slots, capacity) for _ in range(num_layers)]
        self.v = [self._empty(slots, capacity) for _ in range(num_layers)]
        self.slot_of: dict[str, int] = {}
        self.lengths: list[int] = [0] * slots
        self._free: list[int] = list(range(slots - 1 - self.reserved, -1, -1))

    def _empty(self, slots: int, capacity: int) -> torch.Tensor:
        return torch.zeros(slots, capacity, *self.shape, device=self.device, dtype=self.dtype)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def scratch_slot(self) -> int | None:
        return self.num_slots - 1 if self.reserved else None

    def length(self, request_id: str) -> int:
        slot = self.slot_of.get(request_id)
        return 0 if slot is None else self.lengths[slot]

    def slot(self, request_id: str) -> int:
        """The request's slot, allocated on first use."""
        if request_id in self.slot_of:
            return self.slot_of[request_id]
        if not self._free:  # twice the requests' slots, the scratch slot kept beside them
            self._grow(2 * (self.num_slots - self.reserved) + self.reserved, self.capacity)
        slot = self._free.pop()
        self.slot_of[request_id] = slot
        self.lengths[slot] = 0
        return slot

    def reserve(self, length: int) -> None:
        """Make room for `length` positions in every slot."""
        if length > self.capacity:
            cap = self.capacity
            while cap < length:
                cap *= 2
            self._grow(self.num_slots, cap)

    def _grow(self, slots: int, capacity: int) -> None:
        old_slots, old_cap = self.num_slots, self.capacity
        for pools in (self.k, self.v):
            for i, pool in enumerate(pools):
                new = self._empty(slots, capacity)
                new[:old_slots, :old_cap] = pool
                pools[i] = new
        self.lengths += [0] * (slots - old_slots)
        # the old scratch slot (the last) becomes a request's; the new last is the scratch
        hi, lo = slots - 1 - self.reserved, old_slots - self.reserved
        self._free = list(range(hi, lo - 1, -1)) + self._free

    def write(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """slots, positions: [n] int64; k, v: [n, Hkv, D]."""
        self.k[layer][slots, positions] = k.to(self.dtype)
        self.v[layer][slots, positions] = v.to(self.dtype)

    def gather(self, slots: list[int]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """-> per layer (k, v) [B, Lmax, Hkv, D] and the valid mask [B, Lmax] bool."""
        host_lengths = [self.lengths[s] for s in slots]
        lengths = torch.tensor(host_lengths, device=self.device)
        lmax = max(host_lengths, default=0)  # from the host list: no device sync
        lo = slots[0] if slots else 0
        if slots == list(range(lo, lo + len(slots))):
            kv = [
                (k[lo : lo + len(slots), :lmax], v[lo : lo + len(slots), :lmax])
                for k, v in zip(self.k, self.v)
            ]
        else:
            idx = torch.tensor(slots, device=self.device)
            kv = [(k[idx, :lmax], v[idx, :lmax]) for k, v in zip(self.k, self.v)]
        mask = torch.arange(lmax, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)
        return kv, mask

    def free(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.lengths[slot] = 0
            self._free.append(slot)


def _prepack_linears(model: DSparkModel, skip: tuple[nn.Module, ...] = ()) -> None:
    """On a CPU (`prepacked_linears_pay`): every Linear's weight (outside the `skip` modules)
    packed once, as the target's fast forward does (the C kernel where it builds, else oneDNN's
    blocked layout for bf16; nn.Linear would reorder it on every call, and the drafter's small
    matmuls are dominated by that). Serving only: the module must not train afterwards (its
    packed copy would go stale)."""
    from dspark_serve.ops.linear import make_linear

    if not prepacked_linears_pay(model.dtype, model.device):
        return
    skipped = {id(m) for s in skip for m in s.modules()}
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m) not in skipped:
            m.forward = _Packed(m, make_linear(m.weight.detach(), m.bias, "auto", "none"))  # type: ignore[method-assign,assignment]


class _Packed:
    """A prepacked linear taking [..., in] like nn.Linear (oneDNN's op takes 2-D input)."""

    def __init__(self, module: nn.Linear, linear: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.module, self.linear = module, linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return F.linear(x, self.module.weight, self.module.bias)
        lead = x.shape[:-1]
        return self.linear(x.reshape(-1, x.shape[-1])).view(*lead, -1)


@dataclass
class _Stored:
    """Positions start .. start + n - 1 of a request whose tap states stay readable in `rows`."""

    rows: TapRows
    start: int
    n: int

    @property
    def shape(self) -> tuple[int]:
        return (self.n,)

    def __getitem__(self, s: slice) -> _Stored:  # only [:keep]
        return _Stored(self.rows, self.start, len(range(self.n)[s]))

    def read(self, request_id: str) -> torch.Tensor:
        return self.rows.rows_of(request_id, self.start, self.start + self.n)


@dataclass
class _PendingRows:
    """Pending tap states taken for projection: hidden [T, m * d]; slots, positions [T] int64."""

    hidden: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor


@dataclass
class _Pending:
    """Tap states of positions start .. end - 1 of one request, not yet projected: copies, or
    where the engine keeps them (`_Stored`, no copy)."""

    start: int
    hidden: list[torch.Tensor | _Stored] = field(default_factory=list)  # [n_i, m * d] chunks, in order
    end: int = -1
    copied: int = 0  # positions held as copies (what max_pending bounds)

    def __post_init__(self) -> None:
        self.end = self.start

    def truncate(self, pos: int) -> None:
        """Keep positions < pos (a rollback re-sends them from pos on)."""
        while self.hidden and self.end > pos:
            last = self.hidden.pop()
            n = last.shape[0]
            keep = max(0, n - (self.end - pos))
            self.end -= n
            self.copied -= n if isinstance(last, torch.Tensor) else 0
            if keep:
                self.append(last[:keep])

    def append(self, hidden: torch.Tensor | _Stored) -> None:
        self.hidden.append(hidden)
        self.end += hidden.shape[0]
        self.copied += hidden.shape[0] if isinstance(hidden, torch.Tensor) else 0


class DraftContexts:
    """Every request's drafter context: the context K/V pools (`ContextKVCache`) and the tap
    states observed but not yet projected into them (`_Pending`), absorbed lazily, in one batch
    across the requests that next draft. The projection runs through the backbone the caller
    passes (the drafter's)."""

    def __init__(self, model: DSparkModel, name: str, capacity: int, scratch: bool = False) -> None:
        mc = model.config
        self.model, self.name = model, name
        self.tap_layers: tuple[int, ...] = tuple(mc.target_layer_ids)
        self.cache = ContextKVCache(
            mc.num_hidden_layers,
            mc.num_key_value_heads,
            mc.head_dim,
            model.device,
            model.dtype,
            capacity=capacity,
            scratch=scratch,
        )
        # per request: tap states observed but not yet projected into the context K/V
        self.pending: dict[str, _Pending] = {}
        # seconds one pending position costs to absorb (a moving average over absorptions of
        # at least `absorb_apart` positions, where the cost is the rows', not the dispatch's)
        self.row_seconds: float | None = None

    def observe(
        self, contexts: list[AcceptedContext], max_pending: int, absorb: Callable[[list[str]], None]
    ) -> None:
        """See `DSparkDrafter.observe`; a request holding max_pending copied positions is
        absorbed at once."""
        for ctx in contexts:
            n = len(ctx.token_ids)
            if n == 0:
                continue
            pend = self._pending_from(ctx, n)
            if ctx.stored is not None:  # read back when absorbed: no copy, no memory bound
                pend.append(_Stored(ctx.stored, ctx.start_pos, n))
            else:
                assert ctx.hidden is not None  # checked by _pending_from
                # A copy: a view would keep the whole step's tap tensor alive while it waits.
                pend.append(ctx.hidden.clone())
            if pend.copied >= max_pending:
                absorb([ctx.request_id])  # bounds the memory pending copies take

    def _pending_from(self, ctx: AcceptedContext, n: int) -> _Pending:
        """The request's pending states, cut back to where this context starts (a new run of
        them where it starts before what waits); a context after what is held is an error."""
        if ctx.hidden is None and ctx.stored is None:
            raise ValueError(
                f"{self.name} drafter needs hidden states for request "
                f"{ctx.request_id!r} (tap layers {self.tap_layers})"
            )
        if ctx.hidden is not None and ctx.hidden.shape[0] != n:
            raise ValueError(
                f"request {ctx.request_id!r}: hidden has {ctx.hidden.shape[0]} rows for {n} tokens"
            )
        pend = self.pending.get(ctx.request_id)
        held = pend.end if pend is not None else self.cache.length(ctx.request_id)
        if ctx.start_pos > held:
            raise ValueError(
                f"request {ctx.request_id!r}: context starts at {ctx.start_pos} but "
                f"only {held} positions are held"
            )
        if pend is None or ctx.start_pos < pend.start:
            pend = self.pending[ctx.request_id] = _Pending(ctx.start_pos)
        pend.truncate(ctx.start_pos)
        return pend

    def take(self, request_ids: list[str]) -> _PendingRows | None:
        """The pending tap states of these requests, in one batch across requests, counted into
        their context from here on (the caller projects them); None when none wait."""
        slots: list[int] = []
        positions: list[int] = []
        hiddens: list[torch.Tensor] = []
        for rid in request_ids:
            pend = self.pending.pop(rid, None)
            if pend is None or pend.end == pend.start:
                continue
            slot = self.cache.slot(rid)
            self.cache.reserve(pend.end)
            self.cache.lengths[slot] = pend.end
            slots += [slot] * (pend.end - pend.start)
            positions += range(pend.start, pend.end)
            first = pend.hidden[0]
            if isinstance(first, _Stored) and all(
                isinstance(h, _Stored) and h.rows is first.rows for h in pend.hidden
            ):  # consecutive positions kept in one place: read back at once
                hiddens.append(first.rows.rows_of(rid, pend.start, pend.end))
            else:
                hiddens.extend(h if isinstance(h, torch.Tensor) else h.read(rid) for h in pend.hidden)
        if not hiddens:
            return None
        dev = self.model.device
        hidden = hiddens[0].to(dev) if len(hiddens) == 1 else torch.cat([h.to(dev) for h in hiddens])
        return _PendingRows(hidden, torch.tensor(slots, device=dev), torch.tensor(positions, device=dev))

    def pending_rows(self, request_ids: list[str]) -> int:
        """Positions of these requests waiting to be projected."""
        return sum(p.end - p.start for p in map(self.pending.get, request_ids) if p is not None)

    def catch_up_seconds(self, request_ids: list[str]) -> float | None:
        n = self.pending_rows(request_ids)
        if n == 0:
            return 0.0
        return None if self.row_seconds is None else n * self.row_seconds

    @torch.no_grad()
    def absorb(
        self, request_ids: list[str], backbone: DSparkModel | FastDraftBackbone, absorb_apart: int
    ) -> None:
        """Project the pending tap states of these requests into their context K/V, in one
        batch across requests; the cost per position is measured from absorb_apart rows on."""
        t0 = time.perf_counter()
        rows = self.take(request_ids)
        if rows is None:
            return
        feats = backbone.project_context(rows.hidden)  # [T, d]
        for layer in range(len(self.model.layers)):
            k, v = backbone.context_kv(layer, feats, rows.positions)
            self.cache.write(layer, rows.slots, rows.positions, k, v)
        n = rows.positions.shape[0]
        if n >= max(1, absorb_apart):
            if rows.positions.is_cuda:
                torch.cuda.synchronize(rows.positions.device)
            per = (time.perf_counter() - t0) / n
            old = self.row_seconds
            self.row_seconds = per if old is None else 0.5 * (old + per)

    def anchored_slots(self, requests: list[DraftRequest]) -> list[int]:
        """Each request's slot, once its context holds every position before its anchor."""
        slots = []
        for req in requests:
            start = len(req.token_ids) - 1
            if start < 0:
                raise ValueError(f"request {req.request_id!r} has no tokens to anchor a block")
            cached = self.cache.length(req.request_id)
            if cached != start:
                raise ValueError(
                    f"request {req.request_id!r}: drafter context holds {cached} "
                    f"positions, the anchor sits at {start}; observe() must be fed "
                    "every kept token before propose()"
                )
            slots.append(self.cache.slot(req.request_id))
        return slots

    def free(self, request_id: str) -> None:
        self.cache.free(request_id)
        self.pending.pop(request_id, None)


class DraftConfidence:
    """The confidence head's c_k for a proposal: raw logits (the module's, or `FastConfidence`'s
    on a CPU), calibrated by the checkpoint's temperatures or refit online from verification
    outcomes (`OnlineCalibrator`)."""

    def __init__(
        self, model: DSparkModel, fast: FastConfidence | None, config: DSparkDrafterConfig, bs: int
    ) -> None:
        self.model, self.fast = model, fast
        self.calibrator: BucketedCalibrator | None = None
        if config.online_calibration and model.confidence_head is not None:
            offline = model.calibration.temperatures if model.calibration is not None else None
            self.calibrator = BucketedCalibrator(bs, offline)
        # per request: the raw confidence logits and the confidences used in its last proposal,
        # and the sampling bucket they were calibrated in
        self.last: dict[str, tuple[list[float], list[float], str]] = {}

    def of_block(
        self, hidden: torch.Tensor, prev: torch.Tensor, batch: list[DraftRequest], lengths: list[int]
    ) -> list[torch.Tensor] | None:
        """c_k per request: the offline-calibrated head, or the online calibrator's fit (which
        only ever learned from earlier rounds)."""
        if self.fast is not None:
            logits: torch.Tensor | None = self.fast(hidden, prev)
        else:
            logits = self.model.confidence_logits(hidden, prev)
        return self.calibrate(logits, batch, lengths)

    def calibrate(
        self, logits: torch.Tensor | None, batch: list[DraftRequest], lengths: list[int]
    ) -> list[torch.Tensor] | None:
        """Raw confidence logits [B, K] -> c_k per request (offline temperatures, or the online
        fit)."""
        if logits is None:
            return None
        if self.calibrator is None:
            conf = self.model.calibrated(logits).float().cpu()
            return [conf[j, :k] for j, k in enumerate(lengths)]
        raw = logits.float().cpu().tolist()
        out = []
        for j, (r, k) in enumerate(zip(batch, lengths)):
            bucket = sampling_bucket(r.target_sampling)
            used = self.calibrator.calibrate(raw[j][:k], bucket)
            self.last[r.request_id] = (raw[j][:k], used, bucket)
            out.append(torch.tensor(used, dtype=torch.float32))
        return out

    def observe_acceptance(self, request_id: str, proposed: int, accepted: int) -> None:
        last = self.last.pop(request_id, None)
        if self.calibrator is not None and last is not None and proposed > 0:
            self.calibrator.record(last[0], last[1], proposed, accepted, last[2])


@dataclass(frozen=True)
class _GreedyPaths:
    """All-greedy blocks of a few rows on a CPU: the Markov head's walk in one C call; in bf16
    with the packed LM head, the head, the walk and the confidences in one C call."""

    walk: GreedyMarkov | None = None
    tail: GreedyTail | None = None


def _greedy_paths(model: DSparkModel, fast_backbone: bool, confidence: FastConfidence | None) -> _GreedyPaths:
    head = model.markov_head
    if head is None or not GreedyMarkov.applies(head, model.dtype, model.device):
        return _GreedyPaths()
    lib = load_kernels()
    assert lib is not None
    walk = GreedyMarkov(lib, head, model.d2t)
    packed_head = getattr(model.lm_head.forward, "linear", None)  # `_Packed` by _prepack_linears
    if fast_backbone and model.dtype == torch.bfloat16 and isinstance(packed_head, SmallGemmLinear):
        try:
            return _GreedyPaths(walk, GreedyTail(lib, packed_head, walk, confidence))
        except ValueError:  # a head with a bias
            pass
    return _GreedyPaths(walk)


class DSparkDrafter:
    """DSpark (Markov + confidence heads) or DFlash (parallel only) behind the Drafter API."""

    online_confidence = False  # its confidences come from its heads (recalibrated by `calibrator`)

    def __init__(self, model: DSparkModel, config: DSparkDrafterConfig, name: str):
        trained = model.config.block_size
        bs = config.block_size or trained
        if bs > trained:
            raise ValueError(f"block_size {bs!r} exceeds the checkpoint's block_size {trained}")
        self.name = name
        self.model = model.eval()
        # On a CPU: the layers run through fused, packed copies (fast.py), on CUDA through
        # fused copies and the target's Triton kernels; the heads keep their modules (packed
        # in place on a CPU).
        self.backbone: DSparkModel | FastDraftBackbone = model
        if fast_backbone_applies(model):
            self.backbone = FastDraftBackbone(model)
        fast = self.backbone is not model
        _prepack_linears(self.model, skip=(model.layers, model.fc) if fast else ())
        # on a CPU: the confidence head's logits from a per-token table and one small product
        on_cpu = model.device.type == "cpu"
        fast_confidence = (
            FastConfidence(model) if fast and on_cpu and model.confidence_head is not None else None
        )
        greedy = _greedy_paths(model, fast, fast_confidence)
        self._greedy, self._tail = greedy.walk, greedy.tail
        self.config = config
        self.block_size = bs
        self.tap_layers: tuple[int, ...] = tuple(model.config.target_layer_ids)
        self.graphs: GraphedBlock | None = None
        if config.cuda_graphs and isinstance(self.backbone, FastDraftBackbone) and self.backbone.triton:
            capture = CudaCapture() if model.device.type == "cuda" else EagerReplay()
            self.graphs = GraphedBlock(self.backbone, capture, budget_s=config.graph_budget_s)
        elif config.cuda_graphs:
            log.info("%s drafter: no CUDA graphs (its backbone does not run the Triton kernels)", name)
        self.contexts = DraftContexts(model, name, config.initial_capacity, scratch=self.graphs is not None)
        self.cache = self.contexts.cache
        self.confidence = DraftConfidence(model, fast_confidence, config, bs)
        self.calibrator = self.confidence.calibrator

    @property
    def _pending(self) -> dict[str, _Pending]:
        """The requests' pending tap states (`DraftContexts.pending`)."""
        return self.contexts.pending

    # -- context ------------------------------------------------------------------------

    def observe(self, contexts: list[AcceptedContext]) -> None:
        """Take the kept tokens' tap states; they are projected into the context K/V only when
        the request next drafts (`DraftContexts.absorb`), batched with everything pending then.
        While the draft gate keeps drafting off (high load), steps pay nothing here, and a
        request that finishes without drafting again never pays at all.

        A context starting before what is held (cached + pending) replaces from there on (the
        target rolled back); one starting after it is a gap and an error."""
        self.contexts.observe(contexts, self.config.max_pending, self._absorb)

    def _absorb(self, request_ids: list[str]) -> None:
        self.contexts.absorb(request_ids, self.backbone, self.config.absorb_apart)

    def catch_up_seconds(self, request_ids: list[str]) -> float | None:
        return self.contexts.catch_up_seconds(request_ids)

    # -- drafting -----------------------------------------------------------------------

    @torch.no_grad()
    def block_hidden(self, requests: list[DraftRequest], length: int | None = None) -> torch.Tensor:
        """Final hidden states of each request's block: [B, L, d], L = length (at most the
        block size; None: the block size): the anchor and L - 1 mask positions. Pending context
        is absorbed first, or, where the fast backbone reads the pools in place (and no CUDA
        graph replays the pass), in the block's own pass (`ContextRows`)."""
        block = self._block(requests, length)
        if self.graphs is not None:
            out = self._replay(block)
            if out is not None:
                return out.hidden
        return self._eager_pass(block)

    def _block(self, requests: list[DraftRequest], length: int | None) -> _Block:
        """A proposal's block made ready for its pass: context absorbed (or taken to ride in
        the pass), slots anchored, room reserved in the pools."""
        L = self.block_size if length is None else max(1, min(length, self.block_size))
        in_place = isinstance(self.backbone, FastDraftBackbone) and self.backbone.reads_pools_in_place
        pending = None
        rids = [r.request_id for r in requests]
        if in_place and self.graphs is None and self.contexts.pending_rows(rids) <= self.config.absorb_apart:
            pending = self.contexts.take(rids)  # projected in the block's own pass
        else:
            self._absorb(rids)
        slots = self.contexts.anchored_slots(requests)
        starts = [len(r.token_ids) - 1 for r in requests]
        mask_id = self.model.config.mask_token_id
        ids = [[r.token_ids[-1]] + [mask_id] * (L - 1) for r in requests]  # [anchor, mask, ...]
        if in_place:
            self.cache.reserve(max(starts) + L)  # room for the block's own k/v
        return _Block(ids, starts, slots, pending, in_place)

    def _replay(self, block: _Block, greedy_heads: bool = False) -> BlockOutputs | None:
        """The block's pass from a CUDA graph (`GraphedBlock`), the greedy heads in it where
        asked; None where no graph serves it."""
        assert self.graphs is not None
        scratch = self.cache.scratch_slot
        assert scratch is not None  # the cache keeps one where graphs run
        mask_id = self.model.config.mask_token_id
        heads = self._greedy_heads if greedy_heads else None
        anchors = [row[0] for row in block.ids]
        c = self.cache
        return self.graphs(block.ids, block.starts, block.slots, c.k, c.v, scratch, mask_id, heads, anchors)

    def _eager_pass(self, block: _Block) -> torch.Tensor:
        dev = self.model.device
        ids = torch.tensor(block.ids, dtype=torch.long, device=dev)
        L = len(block.ids[0])
        pos = torch.tensor([range(s, s + L) for s in block.starts], dtype=torch.long, device=dev)
        if block.in_place:
            assert isinstance(self.backbone, FastDraftBackbone)
            context = None
            if block.pending is not None:
                feats = self.backbone.project_context(block.pending.hidden)
                context = ContextRows(feats, block.pending.slots, block.pending.positions)
            return self.backbone.forward_block_in_place(
                ids, pos, self.cache.k, self.cache.v, block.slots, block.starts, context
            )
        ctx_kv, ctx_mask = self.cache.gather(block.slots)
        return self.backbone.forward_block(ids, pos, ctx_kv, ctx_mask)

    def _greedy_heads(
        self, hidden: torch.Tensor, anchor: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`Heads` for the graphed pass: the LM head, the Markov head's greedy walk from each
        anchor (`sample_block`'s own, every row greedy and unprocessed) and the confidence
        head's raw logits, all on the device. hidden: [R, L, d]; anchor: [R]."""
        m = self.model
        greedy = [GREEDY] * hidden.shape[0]
        walked = m.sample_block(m.lm_head(hidden), anchor, greedy, [None] * len(greedy), hidden)
        return walked.tokens, walked.prev_tokens, m.confidence_logits(hidden, walked.prev_tokens)

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        out: list[DraftProposal | None] = [
            None if r.max_draft > 0 else DraftProposal(tokens=torch.empty(0, dtype=torch.long))
            for r in requests
        ]
        live = [i for i, r in enumerate(requests) if r.max_draft > 0]
        if not live:
            return out  # type: ignore[return-value]  # every request drafts nothing
        batch = [requests[i] for i in live]
        lengths = [min(self.block_size, r.max_draft) for r in batch]
        kmax = max(lengths)
        # A trimmed block: the positions no request may use are not run (one spare kept).
        trim = kmax + 1 if self.config.trim_block else None
        drafted = self._graphed(batch, trim, kmax, lengths)
        if drafted is None:
            # contiguous: a strided [B, k, d] input sends nn.Linear down a batched-matmul
            # path that copies the LM head's weight once per request.
            hidden = self.block_hidden(batch, trim)[:, :kmax].contiguous()
            drafted = self._draft(hidden, batch, lengths)
        for j, (i, r) in enumerate(zip(live, batch)):
            k = lengths[j]
            probs = drafted.probs
            conf = None if drafted.confidences is None else drafted.confidences[j]
            out[i] = DraftProposal(
                tokens=drafted.tokens[j, :k],
                probs=None
                if probs is None or r.sampling.greedy
                else self.model.to_target_probs(probs[j, :k]),
                confidences=conf,
            )
        return out  # type: ignore[return-value]  # every request has its proposal now

    def _graphed(
        self, batch: list[DraftRequest], trim: int | None, kmax: int, lengths: list[int]
    ) -> _Drafted | None:
        """A batch drafting greedily, unprocessed, where CUDA graphs run: its block pass and
        heads in one replay (the walk over the trimmed block's positions is the walk over its
        first kmax). None elsewhere, or where no graph serves it."""
        if self.graphs is None or not all(
            r.sampling.greedy and not needs_processing(r.sampling, r.context()) for r in batch
        ):
            return None
        out = self._replay(self._block(batch, trim), greedy_heads=True)
        if out is None or out.tokens is None:
            return None
        logits = None if out.confidence_logits is None else out.confidence_logits[:, :kmax]
        return _Drafted(out.tokens[:, :kmax].cpu(), None, self.confidence.calibrate(logits, batch, lengths))

    def _draft(self, hidden: torch.Tensor, batch: list[DraftRequest], lengths: list[int]) -> _Drafted:
        """The block's tokens from its hidden states: in one C call (`GreedyTail`) for a few
        all-greedy unprocessed rows, else the LM head and `sample_block`; with their confidences."""
        contexts = [r.context() for r in batch]
        tail = None
        if self._tail is not None and all(
            r.sampling.greedy and not needs_processing(r.sampling, c) for r, c in zip(batch, contexts)
        ):
            tail = self._tail(hidden, [r.token_ids[-1] for r in batch])
        if tail is not None:
            tokens, _, logits = tail
            return _Drafted(tokens, None, self.confidence.calibrate(logits, batch, lengths))
        base = self.model.lm_head(hidden)
        anchors = torch.tensor([r.token_ids[-1] for r in batch], dtype=torch.long, device=self.model.device)
        drafted = self.model.sample_block(
            base,
            anchors,
            [r.sampling for r in batch],
            [r.generator for r in batch],
            hidden,
            contexts,
            self._greedy,
        )
        conf = self.confidence.of_block(hidden, drafted.prev_tokens, batch, lengths)
        # Tokens and confidences go to the host once per step (the engine and the policy
        # read them there); per-request slices of device tensors would sync per request.
        return _Drafted(drafted.tokens.cpu(), drafted.probs, conf)

    def observe_acceptance(self, request_id: str, proposed: int, accepted: int) -> None:
        """Verification outcome of the request's last proposal: feeds online calibration."""
        self.confidence.observe_acceptance(request_id, proposed, accepted)

    def free(self, request_id: str) -> None:
        self.contexts.free(request_id)
        self.confidence.last.pop(request_id, None)


@dataclass(frozen=True)
class _Block:
    """A proposal's block ready for its pass (`DSparkDrafter._block`): each request's ids
    [anchor, mask, ...], context length and pool slot; the pending context riding in the pass
    (None: absorbed already); in_place: the backbone reads the pools where they lie."""

    ids: list[list[int]]
    starts: list[int]
    slots: list[int]
    pending: _PendingRows | None
    in_place: bool


@dataclass(frozen=True)
class _Drafted:
    """A batch's drafts: tokens [B, K] int64 on the host, the distributions they were drawn
    from ([B, K, V'], None when every row is greedy) and c_k per request (None: no head)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidences: list[torch.Tensor] | None


def _build(
    name: str,
    use_markov: bool,
    path: str,
    target_model: Any = None,
    block_size: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    online_calibration: bool = True,
    cuda_graphs: bool = False,
) -> DSparkDrafter:
    embed = head = None
    if target_model is not None:
        embed = target_model.get_input_embeddings()
        head = target_model.get_output_embeddings()
        ref = embed.weight
        device = device if device is not None else ref.device
        dtype = dtype if dtype is not None else ref.dtype
    cfg = DSparkDrafterConfig(
        block_size=block_size, online_calibration=online_calibration, cuda_graphs=cuda_graphs
    )
    model = load_dspark(
        path,
        embed,
        head,
        device=device or "cpu",
        dtype=dtype or torch.float32,
        drop_markov_head=not use_markov,
    )
    return DSparkDrafter(model, cfg, name)


def build_dspark(
    path: str,
    target_model: Any = None,
    block_size: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    online_calibration: bool = True,
    cuda_graphs: bool = False,
) -> DSparkDrafter:
    """DSpark drafter from a DeepSpec checkpoint; embed/LM head shared with `target_model`;
    cuda_graphs: its block pass replayed as CUDA graphs (`DSparkDrafterConfig`)."""
    return _build(
        "dspark", True, path, target_model, block_size, device, dtype, online_calibration, cuda_graphs
    )


def build_dflash(
    path: str,
    target_model: Any = None,
    block_size: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    online_calibration: bool = True,
    cuda_graphs: bool = False,
) -> DSparkDrafter:
    """DFlash: the same backbone without the Markov head (ignored if the checkpoint has one)."""
    return _build(
        "dflash", False, path, target_model, block_size, device, dtype, online_calibration, cuda_graphs
    )
