"""The target's states for training, cached once in fp16, and random-anchor batches from them.

A cache shard holds, per sequence: token ids [L], the prompt length, the concatenated tap
hidden states [L-1, m*d] and the final-norm hidden [L-1, d] (logits = the frozen LM head
applied to it) for every position but the last.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dspark_serve.training.data import (
    SHARD_PATTERN,
    Sample,
    is_holdout,
    read_token_shard,
    save_atomic,
    shard_index,
    shard_paths,
)


@dataclass
class CachedSequence:
    """One sequence with its target states.

    input_ids: [L] int64; num_prompt: prompt length (positions >= it are the response);
    taps: [L-1, m*d] fp16; last: [L-1, d] fp16.
    """

    input_ids: torch.Tensor
    num_prompt: int
    taps: torch.Tensor
    last: torch.Tensor


@dataclass
class TrainBatch:
    """A padded batch with sampled anchors (DeepSpec semantics).

    input_ids: [B, S] int64; context_hidden: [B, S, m*d]; anchors: [B, N] int64;
    anchor_valid: [B, N] bool; labels: [B, N, bs] int64 (tokens anchor+1..anchor+bs);
    prev_tokens: [B, N, bs] (anchor, labels[..., :-1]); mask: [B, N, bs] bool (valid,
    contiguous); target_hidden: [B, N, bs, d] final-norm target hidden predicting each label.
    """

    input_ids: torch.Tensor
    context_hidden: torch.Tensor
    anchors: torch.Tensor
    anchor_valid: torch.Tensor
    labels: torch.Tensor
    prev_tokens: torch.Tensor
    mask: torch.Tensor
    target_hidden: torch.Tensor


def load_cache(
    cache_dir: str | os.PathLike, holdout: bool | None, holdout_every: int
) -> list[CachedSequence]:
    """Every cached sequence of the chosen split (holdout None = all)."""
    out = []
    for path in shard_paths(cache_dir):
        if holdout is not None and is_holdout(shard_index(path), holdout_every) != holdout:
            continue
        # Memory-mapped: the page cache holds the tap states, so data larger than RAM still trains.
        shard = torch.load(path, mmap=True)
        for ids, n_p, taps, last in zip(
            shard["input_ids"], shard["num_prompt"], shard["taps"], shard["last"]
        ):
            if len(ids) - n_p >= 2:  # at least one anchor with a label
                out.append(CachedSequence(ids, int(n_p), taps, last))
    return out


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors per sequence, sorted.

    loss_mask: [B, S] bool (response positions) -> anchors [B, N] int64, valid [B, N] bool.
    An anchor a is a candidate when a and a+1 are both supervised; with fewer candidates than
    N, the remaining slots are invalid (anchor 0)."""
    bsz, seq = loss_mask.shape
    cand = torch.zeros_like(loss_mask)
    cand[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    keys = torch.rand(bsz, seq, generator=generator)
    keys = torch.where(cand, keys, torch.full_like(keys, 2.0))
    order = keys.argsort(dim=1)[:, :num_anchors]
    valid = torch.gather(cand, 1, order)
    if order.shape[1] < num_anchors:
        pad = num_anchors - order.shape[1]
        order = torch.cat([order, order.new_zeros(bsz, pad)], 1)
        valid = torch.cat([valid, valid.new_zeros(bsz, pad)], 1)
    anchors = torch.where(valid, order, torch.zeros_like(order))
    # Sort valid anchors first, ascending (invalid slots go last).
    key = torch.where(valid, anchors, torch.full_like(anchors, seq + 1))
    idx = key.argsort(dim=1)
    return torch.gather(anchors, 1, idx), torch.gather(valid, 1, idx)


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, loss_mask: [B, S]; anchors, anchor_valid: [B, N]
    -> labels [B, N, bs], mask [B, N, bs] (contiguous valid prefix), label positions [B, N, bs]."""
    seq = input_ids.shape[1]
    pos = anchors.unsqueeze(-1) + torch.arange(1, block_size + 1)
    safe = pos.clamp(max=seq - 1)
    n = anchors.shape[1]
    labels = torch.gather(input_ids.unsqueeze(1).expand(-1, n, -1), 2, safe)
    ok = (pos < seq) & torch.gather(loss_mask.unsqueeze(1).expand(-1, n, -1), 2, safe)
    ok = ok & anchor_valid.unsqueeze(-1)
    mask = ok.to(torch.int32).cumprod(-1).bool()
    return labels, mask, safe


@dataclass
class PaddedSequences:
    """Cached sequences padded to one length, before anchors are chosen.

    input_ids: [B, S] int64; loss_mask: [B, S] bool (response positions); context_hidden:
    [B, S, m*d] taps; last: [B, S, d] final-norm target hidden (position j predicts j+1).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    context_hidden: torch.Tensor
    last: torch.Tensor


def pad_sequences(seqs: Sequence[CachedSequence]) -> PaddedSequences:
    bsz = len(seqs)
    seq = max(len(s.input_ids) for s in seqs)
    md, d = seqs[0].taps.shape[1], seqs[0].last.shape[1]
    input_ids = torch.zeros(bsz, seq, dtype=torch.long)
    loss_mask = torch.zeros(bsz, seq, dtype=torch.bool)
    ctx = torch.zeros(bsz, seq, md, dtype=seqs[0].taps.dtype)
    last = torch.zeros(bsz, seq, d, dtype=seqs[0].last.dtype)
    for b, s in enumerate(seqs):
        n = len(s.input_ids)
        input_ids[b, :n] = s.input_ids
        loss_mask[b, s.num_prompt : n] = True
        ctx[b, : n - 1] = s.taps
        last[b, : n - 1] = s.last
    return PaddedSequences(input_ids, loss_mask, ctx, last)


def anchored_batch(
    padded: PaddedSequences, anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int
) -> TrainBatch:
    """The training batch for chosen anchors: anchors, anchor_valid [B, N]."""
    input_ids, d = padded.input_ids, padded.last.shape[-1]
    labels, mask, safe = block_targets(input_ids, padded.loss_mask, anchors, anchor_valid, block_size)
    prev = torch.cat([torch.gather(input_ids, 1, anchors).unsqueeze(-1), labels[..., :-1]], -1)
    # The target's hidden at position j predicts token j+1.
    src = (safe - 1).clamp(min=0)
    target_hidden = torch.gather(
        padded.last.unsqueeze(1).expand(-1, anchors.shape[1], -1, -1),
        2,
        src.unsqueeze(-1).expand(-1, -1, -1, d),
    )
    return TrainBatch(
        input_ids=input_ids,
        context_hidden=padded.context_hidden,
        anchors=anchors,
        anchor_valid=anchor_valid,
        labels=labels,
        prev_tokens=prev,
        mask=mask,
        target_hidden=target_hidden,
    )


def make_batch(
    seqs: Sequence[CachedSequence],
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
) -> TrainBatch:
    """Pad `seqs` to one length and sample `num_anchors` anchors in each."""
    padded = pad_sequences(seqs)
    anchors, valid = sample_anchors(padded.loss_mask, num_anchors, generator)
    return anchored_batch(padded, anchors, valid, block_size)


def follow_anchors(
    anchors: torch.Tensor, anchor_valid: torch.Tensor, hits: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where serving drafts next after each block: the position after the block's leading hits.

    anchors, anchor_valid: [B, N]; hits: [B, N, bs] bool (the drafter's greedy token equals the
    label, on valid slots); loss_mask: [B, S] -> anchors [B, N] int64, valid [B, N] bool.
    A block from anchor a whose first m drafts match stops at a + 1 + m: the token there is the
    target's own (its correction, or the bonus after a full block), and the next block is
    drafted from it. Such anchors follow a token the drafter missed, so they are harder than
    uniform ones; serving visits them on every step but the first. A follow anchor is valid
    when it and the next position are both supervised.
    """
    seq = loss_mask.shape[1]
    m = hits.to(torch.int64).cumprod(-1).sum(-1)
    nxt = anchors + 1 + m
    safe = nxt.clamp(max=seq - 2)
    ok = anchor_valid & (nxt < seq - 1)
    ok = ok & torch.gather(loss_mask, 1, safe) & torch.gather(loss_mask, 1, safe + 1)
    return torch.where(ok, safe, torch.zeros_like(safe)), ok


@torch.no_grad()
def target_states(model, token_ids: list[int], tap_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One full-sequence target forward -> taps [L-1, m*d] fp16, last [L-1, d] fp16."""
    dev = next(model.parameters()).device
    out = model(torch.tensor([token_ids], device=dev), output_hidden_states=True, logits_to_keep=1)
    hs = out.hidden_states
    taps = torch.cat([hs[0 if i == -1 else i + 1][0, :-1] for i in tap_ids], -1)
    return taps.to(torch.float16).cpu(), hs[-1][0, :-1].to(torch.float16).cpu()


def run_cache_target(
    out_dir: str | os.PathLike,
    model,
    tap_ids: Sequence[int],
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Cache target states for every data shard that has no cache shard yet."""
    data_dir, cache_dir = Path(out_dir) / "data", Path(out_dir) / "cache"
    cache_dir.mkdir(parents=True, exist_ok=True)
    paths = shard_paths(data_dir)
    for i, path in enumerate(paths):
        cpath = cache_dir / SHARD_PATTERN.format(shard_index(path))
        if not cpath.exists():
            samples = _shard_samples(path)
            taps, last = zip(*[target_states(model, s.token_ids, tap_ids) for s in samples])
            save_atomic(
                {
                    "tap_ids": list(tap_ids),
                    "input_ids": [torch.tensor(s.token_ids) for s in samples],
                    "num_prompt": [len(s.prompt_ids) for s in samples],
                    "taps": list(taps),
                    "last": list(last),
                },
                cpath,
            )
        if progress:
            progress(i + 1, len(paths))
    return len(paths)


def _shard_samples(path: Path) -> list[Sample]:
    return read_token_shard(path)[0]
