"""Decode and verify steps replayed as CUDA graphs (the fast forward with attention "triton").

A step whose every row needs logits (decode and verify segments, no prefill chunk) is padded to a
bucket of (tokens, segments), both powers of two, and replayed from the graph captured for that
bucket: one launch for the whole forward instead of hundreds, so the step is no longer bound by
Python and kernel launches. The graph reads its inputs from a static device buffer that each step
fills with one copy from pinned host memory (`VarlenLayout`: token ids, positions, cache slots,
the segments' rows, starts and block tables); the Triton kernel takes the variable lengths from
there, its grid fixed by the bucket. Padding tokens write their K/V to the cache's scratch slot
and belong to no segment; padding segments have no queries.

Graphs are captured on first use of a bucket, each logged with its time; capture stops once
`capture_budget_s` is spent (later buckets run eagerly), and a capture that fails leaves that
bucket eager, saying so. Prefill steps and shapes past the largest bucket run eagerly.

On a CPU (tests, Triton's interpreter) `EagerReplay` stands in for the capture: the same step
function over the same static buffers, run each time, which proves the buffers and the padding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from dspark_serve.ops.triton_attention import VarlenSegments
from dspark_serve.verifier.fast_plan import FastPlan, VarlenLayout
from dspark_serve.verifier.forward import ForwardOutput, Segment
from dspark_serve.verifier.forward_fast import FastForward

log = logging.getLogger(__name__)

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Padded token counts of a graphed step (segments are padded to a power of two too)."""

Outputs = tuple[torch.Tensor, torch.Tensor | None]  # logits [T, V], tap states [T, m * d] or None
Out = TypeVar("Out")
Key = TypeVar("Key", bound=Hashable)
G = TypeVar("G")


class Capture(Protocol):
    """How a step function becomes something to replay: -> a callable giving its outputs (the
    same tensors at every replay, overwritten by the next)."""

    def __call__(self, step: Callable[[], Out]) -> Callable[[], Out]: ...


class CudaCapture:
    """torch.cuda.CUDAGraph over one memory pool shared by every bucket (they never run at once)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, step: Callable[[], Out]) -> Callable[[], Out]:
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, allocators settle
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()

        def replay() -> Out:
            graph.replay()
            return out

        return replay


class EagerReplay:
    """The CPU stand-in for a capture: the step function itself, run at every replay."""

    def __call__(self, step: Callable[[], Out]) -> Callable[[], Out]:
        return step


class CaptureBudget:
    """Graphs captured on first use of their bucket, within `budget_s` seconds of capture in
    all: past it, and where a capture fails, the bucket runs eagerly from then on (logged, the
    server goes on). `name` says whose graphs in the log."""

    def __init__(self, budget_s: float, name: str = "CUDA graphs") -> None:
        self.budget_s, self.spent_s, self.name = budget_s, 0.0, name

    def graph(self, graphs: dict[Key, G | None], key: Key, capture: Callable[[], G]) -> G | None:
        """graphs[key], captured now on its first use; None: the bucket runs eagerly."""
        if key in graphs:
            return graphs[key]
        if self.spent_s >= self.budget_s:
            graphs[key] = None
            log.info("%s: capture budget of %.0f s spent; %s runs eagerly", self.name, self.budget_s, key)
            return None
        t0 = time.perf_counter()
        try:
            graphs[key] = capture()
        except Exception as exc:  # the bucket runs eagerly; the server goes on
            graphs[key] = None
            log.warning("%s: capturing %s failed (%s); it runs eagerly", self.name, key, exc)
        took = time.perf_counter() - t0
        self.spent_s += took
        log.info(
            "%s: %s captured in %.2f s (%.1f s of %.0f s spent)",
            self.name,
            key,
            took,
            self.spent_s,
            self.budget_s,
        )
        return graphs[key]


def bucket_of(n: int, buckets: Sequence[int] = TOKEN_BUCKETS) -> int | None:
    """The smallest bucket holding n, None past the largest."""
    return next((b for b in buckets if b >= n), None)


@dataclass(frozen=True)
class BucketKey:
    tokens: int
    segments: int
    tall: bool  # some segment longer than the small attention tile holds (`tile_shape`)
    taps: tuple[int, ...]


@dataclass
class _Graph:
    staging: torch.Tensor  # the static int64 input buffer (`VarlenLayout`, padded to the bucket)
    replay: Callable[[], Outputs]


class GraphedForward:
    """A FastForward (attention "triton") whose decode and verify steps replay CUDA graphs."""

    def __init__(
        self,
        fast: FastForward,
        max_model_len: int,
        capture: Capture | None = None,
        capture_budget_s: float = 60.0,
    ) -> None:
        if fast.attention != "triton":
            raise ValueError(f"CUDA graphs need attention 'triton', got {fast.attention!r}")
        if fast.kv.scratch_slot is None:
            raise ValueError("CUDA graphs need a KV cache with a scratch block")
        self.fast, self.kv = fast, fast.kv
        self.width = -(-max_model_len // fast.kv.block_size) + 1
        self.capture = capture if capture is not None else CudaCapture()
        self.budget = CaptureBudget(capture_budget_s)
        self.graphs: dict[BucketKey, _Graph | None] = {}  # None: this bucket runs eagerly
        self.replays = 0
        fast.rope.ensure(max_model_len + 1)  # the graphs read the table: it must never move

    def describe(self) -> str:
        return self.fast.describe() + ", CUDA graphs"

    def uses_c_kernels(self) -> bool:
        return self.fast.uses_c_kernels()

    def _key(self, segments: Sequence[Segment], tap_layers: tuple[int, ...]) -> BucketKey | None:
        if not segments or self.fast.rope.dynamic or any(s.logits_from != 0 for s in segments):
            return None
        T = bucket_of(sum(len(s.token_ids) for s in segments))
        S = bucket_of(len(segments), tuple(1 << i for i in range(16)))
        if T is None or S is None or max(s.end_pos for s in segments) > (self.width - 1) * self.kv.block_size:
            return None
        group = self.fast.parts.num_heads // self.fast.parts.num_kv_heads
        tall = max(len(s.token_ids) for s in segments) * group > max(16, group)
        return BucketKey(T, min(S, T), tall, tuple(tap_layers))

    @torch.inference_mode()
    def __call__(self, segments: Sequence[Segment], tap_layers: tuple[int, ...] = ()) -> ForwardOutput:
        key = self._key(segments, tap_layers)
        graph = None if key is None else self._graph(key)
        if key is None or graph is None:
            return self.fast(segments, tap_layers)
        assert self.kv.scratch_slot is not None
        lay = VarlenLayout.of(
            segments, self.kv.block_size, key.tokens, key.segments, self.width, self.kv.scratch_slot
        )
        # every row has logits: the static logit rows (all of the bucket's) were set at capture,
        # and the step's own (its first rows) are the same numbers
        lay.to_device(self.kv.k.device, into=graph.staging[: len(lay.host)])
        logits, hidden = graph.replay()
        self.replays += 1
        T = sum(len(s.token_ids) for s in segments)
        rows = lay.rows
        slots = graph.staging[2 * key.tokens : 2 * key.tokens + T].clone()
        # copies: the graph's outputs are overwritten by the next replay
        taps = None if hidden is None else hidden[:T].clone()
        return ForwardOutput(logits[:T].clone(), rows.logits_offsets, taps, rows.token_offsets, slots)

    def _graph(self, key: BucketKey) -> _Graph | None:
        return self.budget.graph(self.graphs, key, lambda: self._capture(key))

    def _capture(self, key: BucketKey) -> _Graph:
        T, S, W = key.tokens, key.segments, self.width
        dev = self.kv.k.device
        sizes = [T, T, T, S + 1, S, S * W, T]
        staging = torch.zeros(sum(sizes), dtype=torch.long, device=dev)
        # a valid filler until the first real step: one segment holding every token at 0..T-1
        assert self.kv.scratch_slot is not None
        fill = [0] * T + list(range(T)) + [self.kv.scratch_slot] * T + [0] + [T] * S + [0] * S + [0] * (S * W)
        staging.copy_(torch.tensor(fill + list(range(T)), dtype=torch.long))
        ids, pos, slots, cu, starts, table, logit_rows = torch.split(staging, sizes)
        fast = self.fast
        rope = fast.rope
        assert rope.cos is not None and rope.sin is not None
        max_q = T if key.tall else 1

        def step() -> Outputs:
            assert rope.cos is not None and rope.sin is not None
            plan = FastPlan(
                ids=ids, slots=slots, cos=rope.cos[pos][:, None, :], sin=rope.sin[pos][:, None, :]
            )
            plan.varlen = VarlenSegments(cu, starts, table.view(S, W), T, max_q)
            plan.logit_rows = logit_rows
            h = fast.parts.embed(ids)
            x, hidden = fast.layers(h, plan, key.taps)
            return fast.weights.lm_head(x), hidden

        return _Graph(staging, self.capture(step))
