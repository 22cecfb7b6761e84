"""Lossless speculative verification: accept / reject draft tokens against the target.

One pure, batched function. The output of every row is distributed exactly as tokens
sampled one by one from the target (Leviathan et al. 2023, Chen et al. 2023), provided the
number of drafts a row verifies was decided without looking at those drafts' own values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from verifier.sampling import sample_from_uniforms

# Below this residual mass p and q are equal up to rounding; sample from p instead.
RESIDUAL_EPS = 1e-6


@dataclass
class RejectionResult:
    """What verification produced for each row.

    output_tokens: [B, K+1] int64, the row's new tokens left-aligned, padded with -1:
        the num_accepted accepted drafts, then one recovered or bonus token.
    num_accepted:  [B] int64, accepted draft tokens (0..num_draft).
    num_output:    [B] int64, = num_accepted + 1 (every round yields at least one token).
    """

    output_tokens: torch.Tensor
    num_accepted: torch.Tensor
    num_output: torch.Tensor


def rejection_sample(
    target_probs: torch.Tensor,  # [B, K+1, V] float, processed target p at each draft position + bonus
    draft_tokens: torch.Tensor,  # [B, K] int64, padded (any value) beyond num_draft
    draft_probs: torch.Tensor | None,  # [B, K, V] float, draft q each token was sampled from; None = one-hot
    num_draft: torch.Tensor,  # [B] int64, drafts row b really verifies, 0..K
    generators: Sequence[torch.Generator | None] | None = None,  # B entries
    draft_deterministic: torch.Tensor | None = None,  # [B] bool, rows whose q is one-hot on the draft
) -> RejectionResult:
    """Verify a padded batch of draft blocks.

    For row b and draft position k < num_draft[b] (p = target_probs[b, k], q = draft q_k):

    - accepted token: draft x_k is kept with probability min(1, p(x_k) / q(x_k)), in order,
      while every earlier draft was kept;
    - recovered token: at the first rejection k, one token is sampled from
      norm(max(0, p - q)) and the row stops (if that residual has ~no mass, p == q up to
      rounding and p is used);
    - bonus token: if all num_draft[b] drafts are accepted, one token is sampled from
      target_probs[b, num_draft[b]].

    q is one-hot on the draft token when draft_probs is None or the row is flagged
    deterministic (n-gram lookup, greedy drafting); then acceptance is with probability
    p(x_k) and the residual is p with x_k removed. With a greedy (one-hot) target this is
    exactly "accept while draft == argmax, then emit the argmax".

    Randomness: row b draws num_draft[b] + 1 uniforms from generators[b] (or the global RNG
    when None), so a seeded row does not depend on what else is in the batch.
    """
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, K+1, V], got shape {tuple(target_probs.shape)}")
    b, k1, vocab = target_probs.shape
    k = k1 - 1
    device = target_probs.device
    if k < 0:
        raise ValueError("target_probs needs at least the bonus position (K+1 >= 1)")
    if tuple(draft_tokens.shape) != (b, k):
        raise ValueError(f"draft_tokens must be [{b}, {k}], got shape {tuple(draft_tokens.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (b, k, vocab):
        raise ValueError(f"draft_probs must be [{b}, {k}, {vocab}], got shape {tuple(draft_probs.shape)}")
    if tuple(num_draft.shape) != (b,):
        raise ValueError(f"num_draft must be [{b}], got shape {tuple(num_draft.shape)}")
    if generators is not None and len(generators) != b:
        raise ValueError(f"{b} rows but {len(generators)} generators")
    n_list = [int(n) for n in num_draft.tolist()]
    bad = [n for n in n_list if n < 0 or n > k]
    if bad:
        raise ValueError(f"num_draft values must be in [0, {k}], got {bad}")

    nd = num_draft.to(device=device, dtype=torch.long)
    rows = torch.arange(b, device=device)
    u = _uniforms(n_list, k, generators, device)  # [B, K+1]; column K drives the final draw
    positions = torch.arange(k, device=device).unsqueeze(0)  # [1, K]
    valid = positions < nd.unsqueeze(1)  # [B, K]
    tokens = draft_tokens.to(device=device, dtype=torch.long).clamp(0, vocab - 1)  # padding -> any id
    det = None if draft_deterministic is None else draft_deterministic.to(device=device, dtype=torch.bool)

    # Acceptance: u < p/q  <=>  u * q < p (no division, q = 0 cannot blow up).
    p_tok = target_probs[:, :k].gather(2, tokens.unsqueeze(2)).squeeze(2).float()  # [B, K]
    if draft_probs is None:
        q_tok = torch.ones_like(p_tok)
    else:
        q_tok = draft_probs.gather(2, tokens.unsqueeze(2)).squeeze(2).float()
        if det is not None:
            q_tok = torch.where(det.unsqueeze(1), torch.ones_like(q_tok), q_tok)
    accept = valid & (u[:, :k] * q_tok < p_tok)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]: length of the accepted prefix
    rejected = num_accepted < nd

    # Recovered and bonus tokens both sit at position num_accepted: sample from the residual
    # where the row was rejected there, from p itself where it ran out of drafts.
    p_final = target_probs[rows, num_accepted].float()  # [B, V]
    final_dist = p_final
    if k > 0 and bool(rejected.any()):
        pos = num_accepted.clamp(max=k - 1)
        onehot = torch.zeros_like(p_final).scatter_(1, tokens[rows, pos].unsqueeze(1), 1.0)
        if draft_probs is None:
            q_final = onehot
        else:
            q_final = draft_probs[rows, pos].float()
            if det is not None:
                q_final = torch.where(det.unsqueeze(1), onehot, q_final)
        residual = (p_final - q_final).clamp_min(0.0)
        use_residual = rejected & (residual.sum(dim=1) > RESIDUAL_EPS)
        final_dist = torch.where(use_residual.unsqueeze(1), residual, p_final)
    final_tokens = sample_from_uniforms(final_dist, u[:, k])  # [B]

    output = torch.where(positions < num_accepted.unsqueeze(1), tokens, torch.full_like(tokens, -1))
    output = torch.cat([output, torch.full((b, 1), -1, dtype=torch.long, device=device)], dim=1)
    output.scatter_(1, num_accepted.unsqueeze(1), final_tokens.unsqueeze(1))
    return RejectionResult(output_tokens=output, num_accepted=num_accepted, num_output=num_accepted + 1)


def _uniforms(
    n_list: list[int],
    k: int,
    generators: Sequence[torch.Generator | None] | None,
    device: torch.device,
) -> torch.Tensor:  # [B, K+1]
    """Acceptance uniforms in columns [0, n), the final draw's uniform in column K."""
    b = len(n_list)
    if generators is None:
        return torch.rand(b, k + 1, device=device)
    if any(g is None for g in generators):
        u = torch.rand(b, k + 1, device=device)  # global RNG for rows without a generator
    else:
        u = torch.zeros(b, k + 1, device=device)
    for r, (n, g) in enumerate(zip(n_list, generators)):
        if g is None:
            continue
        draws = torch.rand(n + 1, generator=g, device=g.device).to(device)
        u[r, :n] = draws[:n]
        u[r, k] = draws[n]
    return u
