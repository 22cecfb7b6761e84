"""The drafter's block pass replayed as CUDA graphs (the fast backbone with the Triton kernels).

A proposal's block pass (`FastDraftBackbone.block_on_device`: the embedding, every draft layer
with its in-place attention over the context pools, the final norm) runs over fixed shapes: the
requests padded to a power of two, L block positions. Its inputs go to one static device buffer
in one copy from pinned host memory (`BlockLayout`: block ids, positions, the pool rows the
block's k/v go to, the attention kernel's segment arrays), and the graph captured for that
bucket replays the pass: one launch instead of a few dozen a layer, so drafting is no longer
bound by Python and kernel launches. Padding requests write their k/v to the context cache's
scratch slot and attend there only; their rows are dropped. For a batch whose every row drafts
greedily, unprocessed, the heads ride in the same graph (`Heads`: the LM head, the Markov
head's walk from each request's anchor, the confidence head's logits), so a proposal is one
replay and one copy of its tokens to the host.

The graphs read the pools and the rotary tables by address. Those grow by doubling (more
requests, longer contexts), rarely; when they have moved, every graph is dropped and captured
again on next use. Context rows waiting to be projected are absorbed before the pass (their
count varies step to step, which a graph cannot). Captures stop once `budget_s` is spent, and a
capture that fails leaves its bucket eager, saying so (`CaptureBudget`, the target's rule): the
caller then runs the eager pass.

On a CPU (tests, Triton's interpreter) `EagerReplay` stands in for the capture: the same step
function over the same static buffers, run each time, which proves the buffers and the padding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dspark_serve.drafter.dspark_model.fast import FastDraftBackbone
from dspark_serve.ops.triton_attention import VarlenSegments
from dspark_serve.verifier.cuda_graphs import Capture, CaptureBudget
from dspark_serve.verifier.fast_plan import host_ints_to

log = logging.getLogger(__name__)


def requests_bucket(n: int) -> int:
    """The padded request count of a graphed pass: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class DraftBucket:
    requests: int  # padded to a power of two
    length: int  # block positions run
    heads: bool = False  # the greedy heads in the same graph (`Heads`)


@dataclass(frozen=True)
class BlockOutputs:
    """A graphed pass's results for its B requests (copies: the graph's own are overwritten by
    the next replay). hidden: [B, L, d]; with the heads, tokens and prev_tokens [B, L] int64
    target ids and the raw confidence logits [B, L] float32 (None without a confidence head)."""

    hidden: torch.Tensor
    tokens: torch.Tensor | None = None
    prev_tokens: torch.Tensor | None = None
    confidence_logits: torch.Tensor | None = None


class Heads(Protocol):
    """The greedy heads over a block (`DSparkDrafter`'s): hidden [R, L, d], anchor [R] int64 ->
    (tokens, prev tokens) [R, L] int64 target ids and raw confidence logits [R, L] or None, with
    no host synchronisation (a CUDA graph captures it)."""

    def __call__(
        self, hidden: torch.Tensor, anchor: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


@dataclass(frozen=True)
class BlockLayout:
    """One graphed pass's inputs as one int64 host list, in the order of `sizes`: block ids and
    positions [R * L], the flat pool rows the block's k/v go to [R * L], the segments' first
    query rows [R + 1], their context lengths [R] and block tables [R, per] (a slot's whole run
    of pool blocks), the anchors the heads walk from [R], R the bucket's padded request
    count."""

    host: list[int]
    requests: int
    length: int
    per: int

    @property
    def sizes(self) -> list[int]:
        n, R = self.requests * self.length, self.requests
        return [n, n, n, R + 1, R, R * self.per, R]

    @classmethod
    def of(
        cls,
        ids: Sequence[Sequence[int]],
        starts: Sequence[int],
        slots: Sequence[int],
        bucket: DraftBucket,
        capacity: int,
        scratch: int,
        pad_id: int,
        anchors: Sequence[int] = (),
    ) -> BlockLayout:
        """ids: each request's block (anchor and mask ids, `bucket.length` each); starts: its
        context length (where its block sits); slots: its pool slot; anchors: the target ids
        its heads walk from (none: zeros). Padding requests sit in the scratch slot at position
        0."""
        R, L = bucket.requests, bucket.length
        pad = R - len(ids)
        bs = capacity & -capacity  # the pools' block-table run, as `PoolSegments`
        per = capacity // bs
        starts = [*starts, *([0] * pad)]
        slots = [*slots, *([scratch] * pad)]
        tokens = [t for row in ids for t in row] + [pad_id] * (pad * L)
        positions = [p for s in starts for p in range(s, s + L)]
        rows = [slot * capacity + p for slot, s in zip(slots, starts) for p in range(s, s + L)]
        cu = list(range(0, (R + 1) * L, L))
        table = [slot * per + j for slot in slots for j in range(per)]
        anchor = [*anchors, *([0] * (R - len(anchors)))]
        return cls(tokens + positions + rows + cu + starts + table + anchor, R, L, per)

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """ids, positions, rows, cu_q, starts, table [R, per], anchors over a buffer of this
        layout."""
        ids, pos, rows, cu, starts, table, anchors = torch.split(flat, self.sizes)
        return ids, pos, rows, cu, starts, table.view(self.requests, self.per), anchors


GraphOut = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


@dataclass
class _Graph:
    staging: torch.Tensor  # the static int64 input buffer (`BlockLayout`)
    replay: Callable[[], GraphOut]  # -> `BlockOutputs`' fields over R rows, overwritten next replay


class GraphedBlock:
    """`FastDraftBackbone.block_on_device` (Triton kernels) replayed per `DraftBucket`."""

    def __init__(
        self, backbone: FastDraftBackbone, capture: Capture, max_requests: int = 256, budget_s: float = 30.0
    ) -> None:
        if not backbone.triton:
            raise ValueError("the drafter's CUDA graphs need its Triton kernels")
        self.backbone, self.capture = backbone, capture
        self.max_requests = max_requests
        self.budget = CaptureBudget(budget_s, "drafter CUDA graphs")
        self.graphs: dict[DraftBucket, _Graph | None] = {}  # None: this bucket runs eagerly
        self._address: tuple[int, ...] = ()  # of what the graphs read: pools, rotary tables
        self.replays = self.captures = self.drops = 0

    def _addresses(self, k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor]) -> tuple[int, ...]:
        rope = self.backbone.rope
        return (
            *(p.data_ptr() for p in (*k_pools, *v_pools)),
            *k_pools[0].shape[:2],
            rope.cos.data_ptr(),
            rope.sin.data_ptr(),
        )

    @torch.inference_mode()
    def __call__(
        self,
        ids: Sequence[Sequence[int]],
        starts: Sequence[int],
        slots: Sequence[int],
        k_pools: Sequence[torch.Tensor],
        v_pools: Sequence[torch.Tensor],
        scratch: int,
        pad_id: int,
        heads: Heads | None = None,
        anchors: Sequence[int] = (),
    ) -> BlockOutputs | None:
        """The block pass of these requests (as `forward_block_in_place` without context rows;
        the pools hold room for every block), with `heads` walked from `anchors` in the same
        graph where given -> `BlockOutputs`, or None where no graph serves it (more requests
        than `max_requests`, a bucket left eager): the caller runs the eager pass."""
        B, L = len(ids), len(ids[0])
        if B > self.max_requests:
            return None
        self.backbone.rope.upto(max(starts) + L)  # grown before the address check
        address = self._addresses(k_pools, v_pools)
        if address != self._address:
            if self.graphs:
                self.drops += 1
                log.info(
                    "drafter CUDA graphs: the pools or rotary tables moved; %d graphs dropped",
                    len(self.graphs),
                )
            self.graphs.clear()
            self._address = address
        bucket = DraftBucket(requests_bucket(B), L, heads is not None)

        def capture() -> _Graph:
            graph = self._capture(bucket, list(k_pools), list(v_pools), scratch, pad_id, heads)
            self.captures += 1
            return graph

        graph = self.budget.graph(self.graphs, bucket, capture)
        if graph is None:
            return None
        capacity = k_pools[0].shape[1]
        lay = BlockLayout.of(ids, starts, slots, bucket, capacity, scratch, pad_id, anchors)
        host_ints_to(lay.host, graph.staging.device, into=graph.staging)
        out = graph.replay()
        self.replays += 1
        # copies: the graph's outputs are overwritten by the next replay
        hidden, tokens, prev, conf = (None if t is None else t[:B].clone() for t in out)
        assert hidden is not None
        return BlockOutputs(hidden, tokens, prev, conf)

    def _capture(
        self,
        bucket: DraftBucket,
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        scratch: int,
        pad_id: int,
        heads: Heads | None,
    ) -> _Graph:
        R, L = bucket.requests, bucket.length
        fb = self.backbone
        capacity = k_pools[0].shape[1]
        # a valid filler until the first real pass: every request padding, in the scratch slot
        lay = BlockLayout.of([], [], [], bucket, capacity, scratch, pad_id)
        staging = torch.tensor(lay.host, dtype=torch.long, device=fb.device)
        ids, pos, rows, cu, starts, table, anchors = lay.views(staging)
        weight = fb.embed.weight
        rope = fb.rope

        def step() -> GraphOut:
            x = weight.index_select(0, ids).view(R, L, weight.shape[1]).to(fb.dtype)
            shape = (R, L, 1, fb.D)
            cos = rope.cos.index_select(0, pos).view(shape)
            sin = rope.sin.index_select(0, pos).view(shape)
            varlen = VarlenSegments(cu, starts, table, R * L, L)
            hidden = fb.block_on_device(x, cos, sin, k_pools, v_pools, rows, varlen)
            if heads is None:
                return hidden, None, None, None
            return (hidden, *heads(hidden, anchors))

        return _Graph(staging, self.capture(step))
