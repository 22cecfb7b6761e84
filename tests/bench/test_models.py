"""The random Qwen3-shaped targets the GPU suite times: greedy decoding far from ties, so a
speculative run keeps the plain run's continuation that the replay drafter replays."""

from __future__ import annotations

import torch

from bench.models import TargetShape, random_qwen3

# Qwen3-0.6B's width with fewer layers and a small vocabulary: wide enough that the plain init
# (every weight at one std) swamps the embedding, as it did for the GPU suite's shapes.
WIDE = TargetShape("wide", 1024, 8, 8, 4, 128, 3072, 2048, True, 1, (0,), 8)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0].float()


def test_the_top_logit_leads_by_far_more_than_rounding_moves_it():
    ids = torch.randint(0, WIDE.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    logits = _logits(random_qwen3(WIDE, "cpu", torch.bfloat16), ids)
    top = logits.topk(2, dim=-1).values
    # The residual keeps the token's embedding: the token itself is the greedy next token, and
    # its lead dwarfs bf16 rounding (0.5 at logits of 64-128) and any kernel's reordering.
    assert torch.equal(logits.argmax(-1), ids[0])
    assert (top[:, 0] - top[:, 1]).min().item() > 20.0
    # The plain init, which flipped between batch shapes on a GPU: near-ties.
    plain = _logits(random_qwen3(WIDE, "cpu", torch.bfloat16, out_std_scale=1.0), ids)
    top = plain.topk(2, dim=-1).values
    assert (top[:, 0] - top[:, 1]).min().item() < 1.0
