"""The fast forward's plan of one step: every index tensor its layers share (token positions,
cache slots, rotary rows, attention masks, the block lists attention reads), built from the
segments' block tables with tensor ops, not loops over tokens."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dspark_serve.ops.triton_attention import VarlenSegments
from dspark_serve.verifier.fast_weights import RopeTable
from dspark_serve.verifier.forward import SMALL_SEGMENT, RowLayout, Segment

# (rows, query counts, start positions, block table [G, nblk]) of the paged kernel's pieces
PagedPieces = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class FastPlan:
    ids: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache slot of each new token
    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor  # [T, 1, D] (sign of rotate_half folded in)
    # decode/verify segments (<= SMALL_SEGMENT tokens), attended in one call per layer
    g_count: int = 0
    g_q: int = 0  # padded queries per segment
    g_row0: int = -1  # >= 0: rows [g_row0, g_row0 + G*Q) in order
    g_rows: torch.Tensor | None = None  # else [G, Q] flat row per query (pad -> 0)
    g_valid: torch.Tensor | None = None  # [G, Q] bool (with g_rows)
    g_blocks: torch.Tensor | None = None  # [G * nblk] block ids (pad -> 0)
    g_nblk: int = 0
    # [G, 1, Q, keys]: bool for SDPA, additive 0 / -inf in the model dtype for the matmul
    # attention; None: every key (one 1-token segment)
    g_mask: torch.Tensor | None = None
    # One segment alone (G == 1): its blocks as a view when they are consecutive in the pool
    # (no gather), and exactly its keys (no padding to whole blocks to mask away).
    g_first: int = -1  # >= 0: its blocks are g_first .. g_first + nblk - 1
    g_keys: int = 0  # > 0: attend to keys [0, g_keys) only
    # attention "paged": the C kernel reads the cache in place; int32 [G] rows, counts and start
    # positions of every segment's pieces (<= SMALL_SEGMENT queries each) and their [G, nblk]
    # block table (None: not this path)
    p_segments: PagedPieces | None = None
    # (row0, n, start, blocks [nb] | None, mask | None) per segment longer than SMALL_SEGMENT
    # (attention "sdpa" and "matmul": gathered blocks, then SDPA)
    big: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)
    # attention "triton": every segment in one launch, reading its block table in place
    varlen: VarlenSegments | None = None
    logit_rows: torch.Tensor | None = None
    logits_offsets: list[int] = field(default_factory=list)
    token_offsets: list[int] = field(default_factory=list)


@dataclass
class _Shape:
    """The step's segments as numbers: lengths, start positions, first rows, end positions,
    blocks touched, and the padded block table [S, max blocks]."""

    segments: Sequence[Segment]
    lens: list[int]
    starts: list[int]
    row0: list[int]
    ends: list[int]
    nblks: list[int]
    table: torch.Tensor

    @classmethod
    def of(cls, segments: Sequence[Segment], bs: int) -> _Shape:
        lens = [len(s.token_ids) for s in segments]
        starts = [s.start_pos for s in segments]
        ends = [a + n for a, n in zip(starts, lens)]
        nblks = [-(-e // bs) for e in ends]
        maxblk = max(nblks)
        rows = [list(s.blocks[:nb]) + [0] * (maxblk - nb) for s, nb in zip(segments, nblks)]
        table = torch.tensor(rows, dtype=torch.long).reshape(len(segments), maxblk)
        row0 = list(itertools.accumulate(lens, initial=0))[:-1]
        return cls(segments, lens, starts, row0, ends, nblks, table)


class FastPlanner:
    """Builds a step's `FastPlan` for one attention kind ("paged", "sdpa" or "matmul")."""

    def __init__(self, attention: str, block_size: int, rope: RopeTable, dtype: torch.dtype) -> None:
        self.attention, self.bs, self.rope, self.dtype = attention, block_size, rope, dtype
        self.device = rope.parts.device

    def __call__(self, segments: Sequence[Segment]) -> FastPlan:
        if self.attention == "triton":
            return self._varlen(segments)
        sh = _Shape.of(segments, self.bs)
        lens_t = torch.tensor(sh.lens)
        seg_of = torch.repeat_interleave(torch.arange(len(segments)), lens_t)
        pos = torch.tensor(sh.starts)[seg_of] + torch.arange(len(seg_of)) - torch.tensor(sh.row0)[seg_of]
        slots = sh.table[seg_of, pos // self.bs] * self.bs + pos % self.bs
        ids = torch.tensor(list(itertools.chain.from_iterable(s.token_ids for s in segments)))
        cos, sin = self.rope.rows(pos, max(sh.ends))
        dev = self.device
        plan = FastPlan(ids=ids.to(dev), slots=slots.to(dev), cos=cos[:, None, :], sin=sin[:, None, :])
        if self.attention == "paged":
            plan.p_segments = self._paged_pieces(sh)
        else:
            small = [i for i, n in enumerate(sh.lens) if n <= SMALL_SEGMENT]
            if small:
                self._group(plan, sh, small)
            self._big(plan, sh)
        layout = RowLayout.of(segments)
        plan.token_offsets, plan.logits_offsets = layout.token_offsets, layout.logits_offsets
        if layout.logit_rows:
            plan.logit_rows = torch.tensor(layout.logit_rows, device=dev)
        return plan

    def _varlen(self, segments: Sequence[Segment]) -> FastPlan:
        """The plan of attention "triton", built without reading the device: every index the
        layers read goes to the device in one copy (`VarlenLayout`)."""
        lay = VarlenLayout.of(segments, self.bs)
        flat = lay.to_device(self.device)
        ids, pos, slots, cu, starts, table, logit_rows = lay.views(flat)
        cos, sin = self.rope.rows(pos, lay.max_end)
        plan = FastPlan(ids=ids, slots=slots, cos=cos[:, None, :], sin=sin[:, None, :])
        plan.varlen = VarlenSegments(cu, starts, table, lay.tokens, lay.max_query_len)
        rows = lay.rows
        plan.token_offsets, plan.logits_offsets = rows.token_offsets, rows.logits_offsets
        if rows.logit_rows:
            plan.logit_rows = logit_rows
        return plan

    @staticmethod
    def _paged_pieces(sh: _Shape) -> PagedPieces:
        """Every segment reads the cache in place, prefill chunks too: a long one is cut into
        pieces of SMALL_SEGMENT queries (each attends to the keys before it and its own, through
        the segment's block table), which bounds the kernel's score buffers and gives the
        threads work items even for one long chunk."""
        piece_of = [(i, a) for i in range(len(sh.lens)) for a in range(0, sh.lens[i], SMALL_SEGMENT)]
        seg = torch.tensor([i for i, _ in piece_of])
        off = torch.tensor([a for _, a in piece_of], dtype=torch.int32)
        return (
            torch.tensor(sh.row0, dtype=torch.int32)[seg] + off,
            (torch.tensor(sh.lens, dtype=torch.int32)[seg] - off).clamp_(max=SMALL_SEGMENT),
            torch.tensor(sh.starts, dtype=torch.int32)[seg] + off,
            sh.table[seg].to(torch.int32).contiguous(),
        )

    def _group(self, plan: FastPlan, sh: _Shape, small: list[int]) -> None:
        """Short segments attended together: padded to the longest, over their gathered blocks
        (or, one segment alone on consecutive blocks, a view of the pool)."""
        bs, dev = self.bs, self.device
        G = len(small)
        Q = max(sh.lens[i] for i in small)
        nb = max(sh.nblks[i] for i in small)
        sel = torch.tensor(small)
        plan.g_count, plan.g_q, plan.g_nblk = G, Q, nb
        plan.g_blocks = sh.table[sel, :nb].reshape(-1).to(dev)
        qpos = torch.tensor(sh.starts)[sel][:, None] + torch.arange(Q)[None, :]  # [G, Q]
        valid = torch.arange(Q)[None, :] < torch.tensor(sh.lens)[sel][:, None]
        mask = torch.arange(nb * bs)[None, None, :] <= qpos[:, :, None]
        mask[:, :, 0] |= ~valid  # padded query rows see key 0
        if G == 1:
            blocks = list(sh.segments[small[0]].blocks[:nb])
            if blocks == list(range(blocks[0], blocks[0] + nb)):
                plan.g_first = blocks[0]
            plan.g_keys = sh.ends[small[0]]
            mask = mask[:, :, : plan.g_keys]
        if not (G == 1 and Q == 1):
            if self.attention == "matmul":  # additive: one in-place add per layer
                bias = torch.zeros(mask.shape, dtype=self.dtype).masked_fill_(~mask, float("-inf"))
                plan.g_mask = bias[:, None].to(dev)
            else:
                plan.g_mask = mask[:, None].to(dev)
        if all(sh.lens[i] == Q for i in small) and small == list(range(small[0], small[-1] + 1)):
            plan.g_row0 = sh.row0[small[0]]
        else:
            rows = torch.tensor(sh.row0)[sel][:, None] + torch.arange(Q)[None, :]
            plan.g_rows = torch.where(valid, rows, 0).to(dev)
            plan.g_valid = valid.to(dev)

    def _big(self, plan: FastPlan, sh: _Shape) -> None:
        """Segments longer than SMALL_SEGMENT: one SDPA call each; a sequence's first chunk
        attends to its own new keys only (no cache read)."""
        for i, n in enumerate(sh.lens):
            if n <= SMALL_SEGMENT:
                continue
            st = sh.starts[i]
            if st == 0:
                plan.big.append((sh.row0[i], n, 0, None, None))
                continue
            causal = torch.arange(sh.nblks[i] * self.bs)[None, :] <= torch.arange(st, st + n)[:, None]
            blocks = sh.table[i, : sh.nblks[i]].to(self.device)
            plan.big.append((sh.row0[i], n, st, blocks, causal.to(self.device)))


@dataclass
class VarlenLayout:
    """A step's indices for attention "triton", laid out on the host as one int64 buffer: token
    ids, positions, cache slots [tokens]; the segments' first rows [segments + 1], start
    positions [segments] and block tables [segments, width]; the logit rows.

    Padded (a CUDA graph's bucket of `tokens` and `segments`): padding tokens are id 0 at
    position 0, their K/V written to `scratch_slot` (a cache slot no request owns) and in no
    segment; padding segments have no queries."""

    host: list[int]
    tokens: int
    segments: int
    width: int
    rows: RowLayout
    max_query_len: int
    max_end: int

    @classmethod
    def of(
        cls,
        segments: Sequence[Segment],
        bs: int,
        tokens: int = 0,
        num_segments: int = 0,
        width: int = 0,
        scratch_slot: int = 0,
    ) -> VarlenLayout:
        lens = [len(s.token_ids) for s in segments]
        real, S = sum(lens), len(segments)
        T, S_pad = max(tokens, real), max(num_segments, S)
        W = width or max(-(-s.end_pos // bs) for s in segments)
        pad = T - real
        ids = [t for s in segments for t in s.token_ids] + [0] * pad
        pos = [p for s in segments for p in range(s.start_pos, s.end_pos)] + [0] * pad
        slots = [s.blocks[p // bs] * bs + p % bs for s in segments for p in range(s.start_pos, s.end_pos)]
        slots += [scratch_slot] * pad
        cu = list(itertools.accumulate(lens, initial=0)) + [real] * (S_pad - S)
        starts = [s.start_pos for s in segments] + [0] * (S_pad - S)
        table = [b for s in segments for b in (*s.blocks[:W], *[0] * (W - len(s.blocks[:W])))]
        table += [0] * (W * (S_pad - S))
        rows = RowLayout.of(segments)
        host = list(itertools.chain(ids, pos, slots, cu, starts, table, rows.logit_rows))
        return cls(host, T, S_pad, W, rows, max(lens), max(s.end_pos for s in segments))

    @property
    def sizes(self) -> list[int]:
        T, S = self.tokens, self.segments
        return [T, T, T, S + 1, S, S * self.width, len(self.rows.logit_rows)]

    def to_device(self, device: torch.device, into: torch.Tensor | None = None) -> torch.Tensor:
        """The buffer on `device` (into `into`, a static buffer, when given): `host_ints_to`."""
        return host_ints_to(self.host, device, into)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """ids, positions, slots, first rows, starts, block table [segments, width], logit rows."""
        parts = list(torch.split(flat, self.sizes))
        parts[5] = parts[5].view(self.segments, self.width)
        return parts


def host_ints_to(
    values: Sequence[int], device: torch.device, into: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 values on `device` (into `into`, a static buffer of exactly their length, when
    given), copied from pinned memory without waiting on a CUDA device (torch's pinned-memory
    cache keeps the host buffer until the copy has run)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    if into is not None:
        return into.copy_(host, non_blocking=True)
    return host.to(device, non_blocking=True)
