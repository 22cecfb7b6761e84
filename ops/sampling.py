"""Logits -> probabilities -> tokens, batched over requests with per-request parameters.

The same processing shapes the target distribution p and (in the drafter) the draft
distribution q, so rejection sampling compares like with like.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dspark_serve.ops.cpu_kernels import argmax_rows, sample_rows
from dspark_serve.ops.sampling_params import SamplingParams

# Temperatures below this are greedy; matches SamplingParams.greedy.
GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters as tensors, built once per step.

    temperature: [N] float32, 0 = greedy.
    top_p:       [N] float32 in (0, 1], 1 = off.
    top_k:       [N] int64, 0 = off.
    min_p:       [N] float32 in [0, 1], 0 = off.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor | None = None

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu"
    ) -> SamplingTensors:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
        )

    def repeat_interleave(self, repeats: torch.Tensor | int) -> SamplingTensors:
        """Expand per-request rows to per-position rows (a request verifying l drafts has l+1)."""
        return SamplingTensors(
            temperature=self.temperature.repeat_interleave(repeats),
            top_p=self.top_p.repeat_interleave(repeats),
            top_k=self.top_k.repeat_interleave(repeats),
            min_p=None if self.min_p is None else self.min_p.repeat_interleave(repeats),
        )


def probs_from_logits(
    logits: torch.Tensor,  # [N, V] float
    temperature: torch.Tensor,  # [N] float, 0 = greedy
    top_p: torch.Tensor,  # [N] float in (0, 1], 1 = off
    top_k: torch.Tensor,  # [N] int64, 0 = off
    min_p: torch.Tensor | None = None,  # [N] float in [0, 1], 0 = off
) -> torch.Tensor:  # [N, V] float32, rows sum to 1
    """Apply temperature, min-p, top-k then top-p; greedy rows become one-hot on the argmax.

    Only the rows that actually filter pay for the sort over the vocabulary.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    device = logits.device
    temperature = temperature.to(device=device, dtype=torch.float32)
    top_p = top_p.to(device=device, dtype=torch.float32)
    top_k = top_k.to(device=device, dtype=torch.int64)

    greedy = temperature < GREEDY_EPS
    # Greedy rows divide by 1 here and are overwritten by a one-hot below.
    divisor = torch.where(greedy, torch.ones_like(temperature), temperature)
    plain = min_p is None or not bool((min_p > 0).any())
    if plain and not bool(((top_k > 0) & (top_k < vocab)).any() | (top_p < 1.0).any()):
        # Nothing to filter: the softmax widens the rows itself (one pass over the vocabulary
        # instead of a copy, a division and a softmax; dividing by 1 is exact, so skipped):
        # the same bits.
        if bool((divisor == 1.0).all()):
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            probs = torch.softmax(logits.float() / divisor.unsqueeze(1), dim=-1)
        return _one_hot_greedy(probs, logits, greedy)
    logits = logits.float()
    scaled = logits / divisor.unsqueeze(1)
    if min_p is not None:
        min_p = min_p.to(device=device, dtype=torch.float32)
        m_on = (min_p > 0) & ~greedy
        if bool(m_on.any()):
            rows = m_on.nonzero(as_tuple=True)[0]
            sub = scaled[rows]
            # p < min_p * p_max  <=>  logit < max logit + log(min_p)
            cut = sub.max(dim=-1, keepdim=True).values + min_p[rows].log().unsqueeze(1)
            scaled[rows] = sub.masked_fill(sub < cut, float("-inf"))

    k_on = (top_k > 0) & (top_k < vocab)
    p_on = top_p < 1.0
    filt = (k_on | p_on) & ~greedy
    if bool(filt.any()):
        rows = filt.nonzero(as_tuple=True)[0]
        scaled[rows] = _top_k_top_p(scaled[rows], top_k[rows], top_p[rows], k_on[rows], p_on[rows])
    return _one_hot_greedy(torch.softmax(scaled, dim=-1), logits, greedy)


def _one_hot_greedy(
    probs: torch.Tensor,  # [N, V] float32
    logits: torch.Tensor,  # [N, V] the raw logits
    greedy: torch.Tensor,  # [N] bool
) -> torch.Tensor:  # [N, V] float32: greedy rows one-hot on their argmax
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs)
        onehot.scatter_(1, argmax_rows(logits).unsqueeze(1), 1.0)
        probs = torch.where(greedy.unsqueeze(1), onehot, probs)
    return probs


def _top_k_top_p(
    logits: torch.Tensor,  # [M, V] float32, temperature already applied
    top_k: torch.Tensor,  # [M] int64
    top_p: torch.Tensor,  # [M] float32
    k_on: torch.Tensor,  # [M] bool
    p_on: torch.Tensor,  # [M] bool
) -> torch.Tensor:  # [M, V] float32, removed tokens at -inf
    """Mask by rank (exactly k kept, ties broken by sort order) then by nucleus mass."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
    k = torch.where(k_on, top_k, torch.full_like(top_k, vocab))
    remove = rank >= k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))

    # Nucleus: keep a token while the mass strictly before it is < top_p (so the smallest set
    # reaching top_p is kept, and the top token always survives).
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    p = torch.where(p_on, top_p, torch.ones_like(top_p))
    remove_p = (mass_before >= p.unsqueeze(1)) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(remove_p, float("-inf"))

    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def sample_from_uniforms(
    probs: torch.Tensor,  # [N, V] float, rows need not be normalised
    u: torch.Tensor,  # [N] float in [0, 1)
) -> torch.Tensor:  # [N] int64
    """Inverse-CDF draw: the first token whose cumulative mass exceeds u * total.

    One uniform per row, so a seeded row consumes its generator the same way whatever
    else is in the batch. Zero-probability tokens can never be returned. float32 CPU rows
    take the C kernel (`cpu_kernels.sample_rows`: the mass summed in double, block by block,
    one pass instead of a cumulative sum over every entry and a search); elsewhere torch's.
    """
    drawn = sample_rows(probs, u)
    if drawn is not None:
        return drawn
    dtype = torch.float32 if probs.device.type == "mps" else torch.float64
    cdf = torch.cumsum(probs, dim=-1, dtype=dtype)  # [N, V]
    total = cdf[:, -1]
    # x < total, even where u * total rounds up to it: then the first token whose cdf exceeds x
    # (searchsorted, right) has mass (its cdf rose past x), and the last token with mass (cdf ==
    # total) bounds it. No row needs a second look, so nothing here waits on the device.
    x = torch.minimum(
        u.to(device=probs.device, dtype=dtype) * total, torch.nextafter(total, torch.zeros_like(total))
    )
    idx = torch.searchsorted(cdf, x.unsqueeze(1), right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[1] - 1)  # a row with no mass at all (never sampled)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of splitmix64 (Steele et al.): a bijective 64-bit mix, every output bit
    depending on every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_uniforms(seed: int, positions: Sequence[int]) -> torch.Tensor:  # [n] float64 in [0, 1)
    """The uniform a seeded request samples output position t with: a hash of (seed, t), not
    a draw from a stream. Plain decoding and speculation sample every position with the same
    uniform (speculation keeps a draft only where it equals that sample, `verify.py`), so a
    seeded request's output is plain decoding's whatever was drafted and verified."""
    key = _splitmix64(seed & _MASK64)
    return torch.tensor(
        [(_splitmix64(key ^ _splitmix64(t & _MASK64)) >> 11) * 2.0**-53 for t in positions],
        dtype=torch.float64,
    )


def draw_uniforms(
    n_per_row: Sequence[int],
    generators: Sequence[torch.Generator | None],
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """Row r gets n_per_row[r] uniforms from its own generator (or the global RNG)."""
    if len(n_per_row) != len(generators):
        raise ValueError(f"{len(n_per_row)} row counts but {len(generators)} generators")
    out: list[torch.Tensor] = []
    for n, g in zip(n_per_row, generators):
        if g is None:
            out.append(torch.rand(n, device=device))
        else:
            out.append(torch.rand(n, generator=g, device=g.device).to(device))
    return out


def sample(
    probs: torch.Tensor,  # [N, V] float
    generators: Sequence[torch.Generator | None] | None = None,
) -> torch.Tensor:  # [N] int64
    """One token per row; rows with a generator are reproducible on their own."""
    n = probs.shape[0]
    if generators is None or all(g is None for g in generators):
        u = torch.rand(n, device=probs.device)
    else:
        if len(generators) != n:
            raise ValueError(f"{n} rows but {len(generators)} generators")
        u = torch.cat(draw_uniforms([1] * n, generators, probs.device))
    return sample_from_uniforms(probs, u)


def token_logprobs(
    probs: torch.Tensor,  # [N, V] float
    tokens: torch.Tensor,  # [N] int64
) -> torch.Tensor:  # [N] float32
    """log p(token) under the given (target) distribution; -inf where p is 0."""
    return probs.gather(1, tokens.unsqueeze(1)).squeeze(1).float().log()
