"""Statistical tests build their rounds as padded [B, K+1, V] blocks (easy to write by hand);
this runs the flat `rejection_sample` on them and pads its output back to [B, K+1]."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_serve.verifier.rejection import rejection_sample


@dataclass
class PaddedResult:
    output_tokens: torch.Tensor  # [B, K+1] int64, new tokens left-aligned, -1 after
    num_accepted: torch.Tensor  # [B] int64
    num_output: torch.Tensor  # [B] int64


def padded_rejection_sample(
    target_probs: torch.Tensor,  # [B, K+1, V]
    draft_tokens: torch.Tensor,  # [B, K], any value beyond num_draft
    draft_probs: torch.Tensor | None,  # [B, K, V] or None
    num_draft: torch.Tensor,  # [B] int64, 0..K
    generators=None,
    draft_deterministic: torch.Tensor | None = None,  # [B] bool
) -> PaddedResult:
    b, k1, _ = target_probs.shape
    nd = num_draft.to(torch.long)
    verify_rows = torch.arange(k1) < (nd + 1).unsqueeze(1)  # [B, K+1]
    draft_rows = torch.arange(k1 - 1) < nd.unsqueeze(1)  # [B, K]
    res = rejection_sample(
        target_probs[verify_rows],
        draft_tokens[draft_rows],
        None if draft_probs is None else draft_probs[draft_rows],
        nd,
        generators,
        draft_deterministic,
    )
    assert res.output_tokens.shape == (int((nd + 1).sum()),)  # flat: no padding inside
    out = torch.full((b, k1), -1, dtype=torch.long, device=res.output_tokens.device)
    out[verify_rows.to(out.device)] = res.output_tokens
    return PaddedResult(out, res.num_accepted, res.num_output)
