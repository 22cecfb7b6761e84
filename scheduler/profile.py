"""The SPS profile: how many target forward steps per second the machine does at each batch size
(in tokens). Measured once at start-up and cached per model, device and dtype."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dspark_serve.scheduler.block_manager import BlockManager
from dspark_serve.scheduler.policy import CostTable
from dspark_serve.verifier.model_runner import ModelRunner, Segment

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Bumped whenever the measurement method or the cache format changes, so stale cached tables
# are not reused.
PROFILE_VERSION = 6
# Tokens one request carries in the block-shaped part of the profile (anchor + drafts).
BLOCK_SIZES = (1, 2, 4, 8, 16, 32)
# What the cost depends on. Only these config fields enter the cache key: the whole config also
# carries the path it was loaded from, its dtype and library versions, which differ between a
# freshly converted model and its cached copy (and would make every start re-measure).
ARCH_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "sliding_window",
    "use_sliding_window",
)
CONTEXT_LENS = (128, 512)
# The grid: forwards of R requests carrying t tokens each (anchor + drafts), what a verify step
# at load costs (`CostTable.grid_*`); R * t stays within the decode profile's KV footprint.
GRID_REQUESTS = (1, 2, 4, 8, 16, 32)
GRID_TOKENS = (1, 2, 4, 8)
# Requests a decode-shaped profile forward spreads its tokens over (at most).
PROFILE_REQUESTS = 32
# On an accelerator the grid goes on to the largest batch the KV cache admits (up to this), so
# the table is measured, not extrapolated, where a GPU serves: a step of 256 requests costs
# far less than 8 steps of 32 there.
MAX_PROFILE_REQUESTS = 256


def profile_requests(runner: ModelRunner, context_lens: tuple[int, ...] = CONTEXT_LENS) -> int:
    """Requests the profile spreads its forwards over: PROFILE_REQUESTS on a CPU; on CUDA the
    largest power of two up to MAX_PROFILE_REQUESTS whose contexts and grid tokens fit the KV
    cache (at least PROFILE_REQUESTS)."""
    if runner.device.type != "cuda":
        return PROFILE_REQUESTS
    usable = runner.kv.num_blocks * runner.kv.block_size
    n = PROFILE_REQUESTS
    while 2 * n <= MAX_PROFILE_REQUESTS and 2 * n * (max(context_lens) + max(GRID_TOKENS) + 1) <= usable:
        n *= 2
    return n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(runner: ModelRunner, segs: list[Segment]) -> float:
    """Seconds one forward of `segs` takes."""
    _sync(runner.device)
    t0 = time.perf_counter()
    runner.forward(segs)
    _sync(runner.device)
    return time.perf_counter() - t0


class LaidOut(NamedTuple):
    """One profiled forward's segments, its KV laid out for them, and how to take that back."""

    segments: list[Segment]
    undo: Callable[[], None]


Shape = Callable[[], LaidOut]
"""Lays out the KV of one profiled forward shape and returns it (`LaidOut`)."""


class _Group:
    """Shapes timed at one context length over one set of scratch requests, in rounds."""

    def __init__(self, blocks: BlockManager, ids: list[str], ctx: int, shapes: Sequence[Shape]) -> None:
        self.blocks, self.ids, self.ctx, self.shapes = blocks, ids, ctx, shapes
        self.best = [float("inf")] * len(shapes)
        self.next = 0  # forwards timed so far (round * len(shapes) + shape)
        self.laid_out = False

    def lay_out(self) -> None:
        """The scratch requests' contexts (slots only: the KV content does not change a cost)."""
        if not self.laid_out:
            for rid in self.ids:
                self.blocks.append(rid, self.ctx)
            self.laid_out = True

    def release(self) -> None:
        if self.laid_out:
            for rid in self.ids:
                self.blocks.free(rid)
            self.laid_out = False


class TableMeasurement:
    """The cost table's forwards (`measure`), timed one at a time by `advance`.

    Each group's shapes are timed in turn, one forward each, for repeats + 1 rounds (the first
    warms up), and each shape keeps its fastest round. On a shared machine a slow spell then
    lands on a few samples of many shapes instead of every sample of a few (timed one shape
    after another, one spell would skew a whole point of the table), and noise only ever slows
    a forward, so the fastest is the machine's cost.

    Between two calls the owner may run forwards of its own (the engine serving requests, with
    the table measured in its idle gaps): `release` gives the scratch requests' KV slots back
    first, and the next `advance` lays them out again (bookkeeping only, never timed)."""

    def __init__(
        self,
        runner: ModelRunner,
        blocks: BlockManager,
        batch_sizes: tuple[int, ...] = BATCH_SIZES,
        context_lens: tuple[int, ...] = CONTEXT_LENS,
        repeats: int = 4,
        block_sizes: tuple[int, ...] = BLOCK_SIZES,
        grid_requests: tuple[int, ...] | None = None,
        grid_tokens: tuple[int, ...] = GRID_TOKENS,
        nreq: int | None = None,
    ) -> None:
        self.runner, self.repeats = runner, repeats
        self.batch_sizes, self.block_sizes, self.grid_tokens = batch_sizes, block_sizes, grid_tokens
        nreq = nreq or profile_requests(runner, context_lens)
        if grid_requests is None:  # powers of two up to the requests measured
            grid_requests = tuple(1 << i for i in range(nreq.bit_length()) if 1 << i <= nreq)
        self.requests = tuple(R for R in grid_requests if R <= nreq)
        grid = [(R, t) for R in self.requests for t in grid_tokens]
        decode_ctxs, block_ctxs = measured_contexts(runner, context_lens, batch_sizes, block_sizes, nreq)
        ids = [f"__profile{i}" for i in range(nreq)]
        self.decodes = [
            _Group(
                blocks,
                ids,
                ctx,
                [functools.partial(_decode_shape, blocks, ids, ctx, B) for B in batch_sizes]
                + [functools.partial(_spread_shape, blocks, ids[:R], ctx, t) for R, t in grid],
            )
            for ctx in decode_ctxs
        ]
        # ONE request carrying B tokens (anchor + drafts), what verification adds on top of a
        # decode: at low load this, not B decode requests, is what a block costs
        one = ["__profile_block"]
        self.singles = [
            _Group(
                blocks, one, ctx, [functools.partial(_spread_shape, blocks, one, ctx, B) for B in block_sizes]
            )
            for ctx in block_ctxs
        ]
        self._groups = self.decodes + self.singles
        self.forwards = sum((repeats + 1) * len(g.shapes) for g in self._groups)
        self.timed = 0  # forwards done (of `forwards`)
        self.seconds = 0.0  # spent in them and their layouts

    @property
    def done(self) -> bool:
        return self.timed >= self.forwards

    def advance(self) -> None:
        """Time the next forward (the first group not done yet)."""
        t0 = time.perf_counter()
        g = next(g for g in self._groups if g.next < (self.repeats + 1) * len(g.shapes))
        g.lay_out()
        rnd, i = divmod(g.next, len(g.shapes))
        segs, undo = g.shapes[i]()
        try:
            t = _timed(self.runner, segs)
        finally:
            undo()
        if rnd > 0:
            g.best[i] = min(g.best[i], t)
        g.next += 1
        self.timed += 1
        if g.next == (self.repeats + 1) * len(g.shapes):
            g.release()
        self.seconds += time.perf_counter() - t0

    def release(self) -> None:
        """Give the scratch requests' KV slots back (the owner runs its own forwards next)."""
        for g in self._groups:
            g.release()

    def result(self) -> dict[str, Any]:
        """The measured table (`measure`'s dict), once done."""
        assert self.done, "the measurement is not finished"
        nb = len(self.batch_sizes)
        by_ctx = {g.ctx: [1.0 / t for t in g.best[:nb]] for g in self.decodes}
        grid_by_ctx = {g.ctx: [1.0 / t for t in g.best[nb:]] for g in self.decodes}
        by_ctx_block = {g.ctx: [1.0 / t for t in g.best] for g in self.singles}
        return {
            "batch_sizes": list(self.batch_sizes),
            "steps_per_second": _merge(by_ctx, nb),
            "block_sizes": list(self.block_sizes),
            "block_steps_per_second": _merge(by_ctx_block, len(self.block_sizes)),
            "by_context": {str(k): v for k, v in by_ctx.items()},
            "block_by_context": {str(k): v for k, v in by_ctx_block.items()},
            **_grid(grid_by_ctx, self.requests, self.grid_tokens),
        }


def measured_contexts(
    runner: ModelRunner,
    context_lens: tuple[int, ...] = CONTEXT_LENS,
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
    block_sizes: tuple[int, ...] = BLOCK_SIZES,
    nreq: int = PROFILE_REQUESTS,
) -> tuple[list[int], list[int]]:
    """The context lengths `measure` times decode-shaped and block-shaped forwards at, with this
    runner's KV pool: a pool too small for `nreq` requests of a context shrinks it (to 1 at
    worst, a table that prices every step as if its context were empty)."""
    usable = runner.kv.num_blocks * runner.kv.block_size
    # tokens a request may carry on top of its context (beyond 32 requests: the most a decode
    # or grid shape gives one request, not the whole batch)
    extra = max(batch_sizes) if nreq <= PROFILE_REQUESTS else max(-(-max(batch_sizes) // nreq), *GRID_TOKENS)
    decode = [
        ctx if nreq * (ctx + extra) <= usable else max(1, usable // nreq - extra) for ctx in context_lens
    ]
    block = [min(ctx, max(1, usable - max(block_sizes))) for ctx in context_lens]
    return decode, block


def measure(runner: ModelRunner, **shapes: Any) -> dict[str, Any]:
    """Time decode-shaped forwards of B tokens spread over up to 32 requests of a given context
    length, grid-shaped ones (R of those requests carrying t tokens each) and block-shaped ones
    (one request carrying B tokens), in interleaved rounds (`TableMeasurement`, whose keyword
    arguments `shapes` are: batch_sizes, context_lens, repeats, ...), all at once.
    Returns {"batch_sizes", "steps_per_second", "block_sizes", "block_steps_per_second",
    "grid_requests", "grid_tokens", "grid_steps_per_second", "by_context", "block_by_context"}."""
    # the engine is not built yet (or is idle): a scratch allocator over the whole cache
    blocks = BlockManager(runner.kv.num_blocks, runner.kv.block_size)
    m = TableMeasurement(runner, blocks, **shapes)
    while not m.done:
        m.advance()
    return m.result()


def probe(runner: ModelRunner) -> dict[str, Any]:
    """A provisional table from a short probe: what the engine serves on while the full table is
    measured in its idle gaps. The shapes one request and a light load take, at one context
    length, timed once after a warm-up; the policy interpolates between them and extrapolates
    past them along the last segment's slope (`CostTable`). Noisier than the full table, and
    corrected online like it (`scheduler/correction.py`)."""
    t0 = time.perf_counter()
    raw = measure(
        runner,
        batch_sizes=(1, 4, 16, 64),
        context_lens=(128,),
        repeats=1,
        block_sizes=(1, 2, 4, 8, 16),
        grid_requests=(1, 4, 16),
        grid_tokens=(1, 2, 4),
    )
    raw["seconds"] = time.perf_counter() - t0
    return raw


def _decode_shape(blocks: BlockManager, ids: list[str], ctx: int, B: int) -> LaidOut:
    """B tokens spread as evenly as they go over the first min(B, len(ids)) requests. The
    prefix KV content does not change the cost, so it is left as is (no prefill)."""
    r = min(B, len(ids))
    per = [B // r + (1 if i < B % r else 0) for i in range(r)]
    segs = []
    for rid, n in zip(ids, per):
        blocks.append(rid, n)
        segs.append(blocks.segment(rid, [0] * n, ctx, 0))
    return LaidOut(segs, functools.partial(_cut_back, blocks, ids[:r], ctx))


def _spread_shape(blocks: BlockManager, ids: list[str], ctx: int, t: int) -> LaidOut:
    """Each of `ids` carrying t tokens."""
    for rid in ids:
        blocks.append(rid, t)
    segs = [blocks.segment(rid, [0] * t, ctx, 0) for rid in ids]
    return LaidOut(segs, functools.partial(_cut_back, blocks, ids, ctx))


def _cut_back(blocks: BlockManager, ids: list[str], ctx: int) -> None:
    for rid in ids:
        blocks.truncate(rid, ctx)


def _grid(
    by_ctx: dict[int, list[float]], requests: tuple[int, ...], tokens: tuple[int, ...]
) -> dict[str, Any]:
    """The grid's SPS rows (one per request count, `tokens` across): the median over context
    lengths, made non-increasing along each row and down each column (more tokens, or more
    requests, never make a forward faster; where a smaller shape measured slower, it was the
    unlucky sample and is raised to the bigger one's speed, as in `_merge`)."""
    n = len(tokens)
    flat = [statistics.median(v[i] for v in by_ctx.values()) for i in range(len(requests) * n)]
    rows = [flat[i * n : (i + 1) * n] for i in range(len(requests))]
    for i in range(len(requests) - 1, -1, -1):
        for j in range(n - 1, -1, -1):
            if j + 1 < n:
                rows[i][j] = max(rows[i][j], rows[i][j + 1])
            if i + 1 < len(requests):
                rows[i][j] = max(rows[i][j], rows[i + 1][j])
    return {"grid_requests": list(requests), "grid_tokens": list(tokens), "grid_steps_per_second": rows}


def _merge(by_ctx: dict[int, list[float]], n: int) -> list[float]:
    """The median over context lengths at each B, made non-increasing (a bigger batch is
    never faster). Noise only slows a forward, so where a smaller batch measured slower than a
    bigger one, the smaller one was the unlucky sample: it is raised to the bigger one's speed
    (lowering every bigger batch to it instead would carry one slow sample up the table)."""
    merged = [statistics.median(v[i] for v in by_ctx.values()) for i in range(n)]
    for i in range(n - 2, -1, -1):
        merged[i] = max(merged[i], merged[i + 1])
    return merged


def cache_key(model_name: str, config: Any, device: torch.device, dtype: torch.dtype) -> str:
    arch = {f: getattr(config, f, None) for f in ARCH_FIELDS}
    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    threads = torch.get_num_threads() if device.type == "cpu" else None
    ident = json.dumps(
        [model_name, arch, hw, threads, str(dtype), torch.__version__, BATCH_SIZES, PROFILE_VERSION],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _checksum(raw: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


def read_cached(path: Path) -> dict[str, Any] | None:
    """The cached profile at `path`, or None when it is missing or damaged (truncated, edited,
    another format): a damaged cache is never trusted, it is measured again."""
    try:
        doc = json.loads(path.read_text())
        raw = doc["profile"]
        if doc.get("sha256") != _checksum(raw):
            raise ValueError("checksum mismatch")
        CostTable.from_dict(raw)
        return dict(raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("cached cost table %s is damaged (%s); measuring again", path.name, exc)
        return None


def write_cached(path: Path, raw: dict[str, Any]) -> None:
    """Write atomically: a temporary file, then a rename, so a kill never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"profile": raw, "sha256": _checksum(raw)}, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def table_path(runner: ModelRunner, model_name: str, cache_dir: Path) -> Path:
    """Where this runner's measured table is cached. The forward's kernels change the costs (a
    table measured with others is not reused), and so do the contexts it can be measured at (a
    runner with a small KV pool, a test's, must not hand its table to a server's)."""
    nreq = profile_requests(runner)
    contexts = measured_contexts(runner, nreq=nreq)
    signature = f"{model_name}|{runner.cost_signature()}|contexts {contexts}" + (
        f"|requests {nreq}" if nreq != PROFILE_REQUESTS else ""
    )
    key = cache_key(signature, runner.config, runner.device, runner.dtype)
    return Path(cache_dir) / "cost-tables" / f"{model_name}-{runner.device.type}-{key}.json"


def save_measured(path: Path | None, raw: dict[str, Any]) -> None:
    """Cache a measured table (a read-only cache is logged, not fatal)."""
    if path is None:
        return
    try:
        write_cached(path, raw)
    except OSError as exc:
        log.warning("could not cache the cost table: %s", exc)


def load_or_profile(
    runner: ModelRunner, model_name: str, cache_dir: Path | None, reprofile: bool = False
) -> tuple[CostTable, dict[str, Any], str]:
    """Return (table, raw profile, source) where source says whether it was cached or measured."""
    path = None if cache_dir is None else table_path(runner, model_name, cache_dir)
    raw = None if path is None or reprofile else read_cached(path)
    if raw is not None:
        assert path is not None
        return CostTable.from_dict(raw), raw, f"cached {path.name}"
    log.info("measuring the cost table (first start on this machine; cached afterwards)")
    t0 = time.perf_counter()
    raw = measure(runner)
    raw["seconds"] = time.perf_counter() - t0
    save_measured(path, raw)
    return CostTable.from_dict(raw), raw, f"measured in {raw['seconds']:.1f}s"


def format_table(raw: dict[str, Any]) -> str:
    lines = ["  B(tokens)  steps/s  tokens/s   (B decode requests)"]
    for b, s in zip(raw["batch_sizes"], raw["steps_per_second"]):
        lines.append(f"  {b:9d}  {s:7.1f}  {b * s:8.0f}")
    if raw.get("block_sizes"):
        lines.append("  B(tokens)  steps/s             (one request, B tokens)")
        for b, s in zip(raw["block_sizes"], raw["block_steps_per_second"]):
            lines.append(f"  {b:9d}  {s:7.1f}")
    if raw.get("grid_requests"):
        toks = raw["grid_tokens"]
        lines.append("  requests  " + " ".join(f"t={t:<5d}" for t in toks) + " (steps/s, t tokens each)")
        for r, row in zip(raw["grid_requests"], raw["grid_steps_per_second"]):
            lines.append(f"  {r:8d}  " + " ".join(f"{s:7.1f}" for s in row))
    return "\n".join(lines)
