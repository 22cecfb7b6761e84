"""DeepSpec's DSpark objective, as pure functions.

Per supervised slot (anchor n, block position k = 1..bs):
    ce_k   = -log q_k(y_k)                      (y = the target's own next token, as written
                                                 in the data, or its argmax: `ce_labels`)
    l1_k   = ||q_k - p_k||_1                    (DeepSpec's total-variation term: the L1
                                                 distance, i.e. twice the TV distance)
    c*_k   = clamp(1 - 0.5 * ||q_k - p_k||_1)   (analytic acceptance rate, no gradient)
    bce_k  = BCE(sigmoid(conf_k), c*_k)
each weighted by w_k = exp(-(k - 1) / gamma) on valid slots, normalized by the sum of the
weights, and combined as ce_alpha * CE + l1_alpha * L1 + confidence_alpha * BCE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CE_LABELS = ("data", "argmax")


@dataclass(frozen=True)
class LossConfig:
    """Weights of the DSpark objective.

    ce_alpha: weight of the cross-entropy against the target's tokens (DeepSpec: 0.1).
    l1_alpha: weight of the ||q - p||_1 distribution term (DeepSpec: 0.9).
    confidence_alpha: weight of the confidence-head BCE (DeepSpec: 1.0).
    decay_gamma: position decay exp(-(k-1)/gamma); None = the block size; 0 = no decay.
    ce_labels: what the cross-entropy's labels are: "data", the tokens the target wrote (its
        greedy choice in a greedy pass, a sample in a sampled one; DeepSpec's), or "argmax",
        the target's most likely token at every slot (what greedy verification accepts, in
        sampled passes too).
    """

    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    confidence_alpha: float = 1.0
    decay_gamma: float | None = None
    ce_labels: str = "data"

    def __post_init__(self) -> None:
        for name in ("ce_alpha", "l1_alpha", "confidence_alpha"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
        if self.decay_gamma is not None and not (self.decay_gamma >= 0 and math.isfinite(self.decay_gamma)):
            raise ValueError(f"decay_gamma must be None or finite and >= 0, got {self.decay_gamma!r}")
        if self.ce_labels not in CE_LABELS:
            raise ValueError(f"ce_labels must be one of {CE_LABELS}, got {self.ce_labels!r}")

    def gamma(self, block_size: int) -> float:
        return float(block_size) if self.decay_gamma is None else float(self.decay_gamma)


@dataclass
class LossOutput:
    """The objective and its parts (scalars; `loss` carries the gradient).

    accept_rate: [bs] mean analytic acceptance c*_k per position over valid slots.
    tau: expected accepted length per block, 1 + sum_k prod_{i<=k} c*_i (teacher-forced):
        what sampling at temperature 1 accepts.
    greedy_tau: accepted length per block under greedy verification, 1 + the number of leading
        positions whose draft argmax is the target's argmax (teacher-forced): what temperature 0
        accepts.
    """

    loss: torch.Tensor
    ce: torch.Tensor
    l1: torch.Tensor
    confidence: torch.Tensor
    accept_rate: torch.Tensor
    tau: torch.Tensor
    greedy_tau: torch.Tensor


def position_weights(mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """mask: [..., bs] bool -> [..., bs] float32 weights exp(-(k-1)/gamma) on valid slots."""
    w = mask.to(torch.float32)
    if gamma > 0:
        k = torch.arange(mask.shape[-1], device=mask.device, dtype=torch.float32)
        w = w * torch.exp(-k / gamma)
    return w


def l1_distance(
    draft_probs: torch.Tensor, target_probs: torch.Tensor, d2t: torch.Tensor | None = None
) -> torch.Tensor:
    """||q - p||_1. draft_probs: [..., V'] over the draft vocabulary; target_probs: [..., V];
    d2t: [V'] target id of each draft id, or None when V' = V. Off the kept ids q is zero,
    so the distance there is the target mass the draft vocabulary misses."""
    if d2t is None:
        return (draft_probs - target_probs).abs().sum(-1)
    kept = target_probs[..., d2t]
    return (draft_probs - kept).abs().sum(-1) + (1.0 - kept.sum(-1)).clamp_min(0.0)


def acceptance_rate(
    draft_probs: torch.Tensor, target_probs: torch.Tensor, d2t: torch.Tensor | None = None
) -> torch.Tensor:
    """-> [...] c* = 1 - 0.5 * ||q - p||_1 in [0, 1] (shapes as `l1_distance`)."""
    return (1.0 - 0.5 * l1_distance(draft_probs, target_probs, d2t)).clamp(0.0, 1.0)


def _cross_entropy(
    logq: torch.Tensor, labels: torch.Tensor, w: torch.Tensor, d2t: torch.Tensor | None, vocab_size: int
) -> torch.Tensor:
    """Weighted mean of -log q(y) over the slots. Labels (target ids) are mapped to draft ids
    with a truncated vocabulary; a label outside it has no draft id and weighs nothing."""
    w_ce = w
    if d2t is not None:
        t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=labels.device)
        t2d[d2t.to(labels.device)] = torch.arange(d2t.numel(), device=labels.device)
        labels = t2d[labels]
        w_ce = w * (labels >= 0)
        labels = labels.clamp_min(0)
    ce = -torch.gather(logq, -1, labels.unsqueeze(-1)).squeeze(-1)
    return (ce * w_ce).sum() / w_ce.sum().clamp_min(1e-6)


@dataclass(frozen=True)
class AcceptanceMetrics:
    """Teacher-forced acceptance of a batch (no gradient); see `LossOutput`."""

    accept_rate: torch.Tensor
    tau: torch.Tensor
    greedy_tau: torch.Tensor


@torch.no_grad()
def acceptance_metrics(
    c_star: torch.Tensor, logq: torch.Tensor, top: torch.Tensor, mask: torch.Tensor, d2t: torch.Tensor | None
) -> AcceptanceMetrics:
    """c*_k per position, and the expected accepted length per block under sampled (c*) and
    greedy (draft argmax == target argmax) verification. top: the target's argmax ids."""
    m = mask.to(torch.float32)
    per_pos = (c_star * m).sum(dim=tuple(range(m.dim() - 1))) / m.sum(
        dim=tuple(range(m.dim() - 1))
    ).clamp_min(1.0)
    blocks = m[..., 0] > 0
    pick = logq.argmax(-1)
    if d2t is not None:
        pick = d2t.to(pick.device)[pick]
    hit = (pick == top).to(torch.float32) * m

    def per_block(rate: torch.Tensor) -> torch.Tensor:  # 1 + sum_k prod_{i<=k} rate_i
        return (rate.cumprod(-1).sum(-1) + 1.0)[blocks].mean() if blocks.any() else m.new_zeros(())

    return AcceptanceMetrics(per_pos, per_block(c_star * m), per_block(hit))


def dspark_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    confidence_logits: torch.Tensor | None,
    cfg: LossConfig,
    d2t: torch.Tensor | None = None,
) -> LossOutput:
    """The DSpark training objective.

    draft_logits: [B, N, bs, V'] drafter logits (Markov-corrected, teacher-forced) over the
        draft vocabulary (V' = V unless truncated).
    target_logits: [B, N, bs, V] the target's logits for the same slots (no gradient).
    labels: [B, N, bs] the target's tokens y_k (target ids); replaced by the target's argmax
        with cfg.ce_labels = "argmax".
    mask: [B, N, bs] bool, valid slots (a contiguous prefix of each block).
    confidence_logits: [B, N, bs] raw confidence-head outputs, or None (no head).
    d2t: [V'] target id of each draft id for a truncated vocabulary, else None. Labels
        outside it have no draft id: they are left out of the CE term (the L1 term and c*
        count the mass the draft vocabulary misses).
    """
    bs = draft_logits.shape[-2]
    w = position_weights(mask, cfg.gamma(bs))
    den = w.sum().clamp_min(1e-6)
    logq = draft_logits.float().log_softmax(-1)  # one normalization serves CE and q
    top = target_logits.argmax(-1)  # the target's greedy token: argmax labels, greedy hits
    labels = top if cfg.ce_labels == "argmax" else labels.long()
    ce_mean = _cross_entropy(logq, labels, w, d2t, target_logits.shape[-1])
    with torch.no_grad():
        p = target_logits.float().softmax(-1)
    l1 = l1_distance(logq.exp(), p, d2t)
    c_star = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
    l1_mean = (l1 * w).sum() / den
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), c_star, reduction="none")
        conf_mean = (bce * w).sum() / den
    else:
        conf_mean = ce_mean.new_zeros(())
    loss = cfg.ce_alpha * ce_mean + cfg.l1_alpha * l1_mean + cfg.confidence_alpha * conf_mean
    metrics = acceptance_metrics(c_star, logq, top, mask, d2t)
    return LossOutput(
        loss=loss,
        ce=ce_mean.detach(),
        l1=l1_mean.detach(),
        confidence=conf_mean.detach(),
        accept_rate=metrics.accept_rate,
        tau=metrics.tau,
        greedy_tau=metrics.greedy_tau,
    )
