"""Stage 3: Sequential Temperature Scaling (STS) of the confidence head, and the metrics
that judge it (ECE, AUC of the cumulative survival per position).

The quantity the scheduler uses is the prefix survival a_k = prod_{i<=k} c_i, so that is what
is calibrated: for k = 1..bs in order, one temperature T_k (c_k = sigmoid(logit_k / T_k)) is
picked from a grid to minimize the ECE of a_k, with T_1..T_{k-1} already fixed.
Labels may be binary (did the prefix survive verification) or soft (the teacher-forced
expected survival prod c*_i); ECE and AUC accept both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark_serve.training.plots import save_png


@dataclass(frozen=True)
class STSConfig:
    """Grid of the temperature search.

    t_min / t_max / num: log-spaced candidate temperatures.
    num_bins: equal-width bins of the ECE.
    """

    t_min: float = 0.05
    t_max: float = 20.0
    num: int = 161
    num_bins: int = 20

    def __post_init__(self) -> None:
        if not (0 < self.t_min < self.t_max):
            raise ValueError(f"need 0 < t_min < t_max, got {self.t_min!r}, {self.t_max!r}")
        if self.num < 2:
            raise ValueError(f"num must be >= 2, got {self.num!r}")
        if self.num_bins < 1:
            raise ValueError(f"num_bins must be >= 1, got {self.num_bins!r}")

    def grid(self) -> torch.Tensor:
        return torch.logspace(
            torch.log10(torch.tensor(self.t_min)),
            torch.log10(torch.tensor(self.t_max)),
            self.num,
            dtype=torch.float64,
        )


@dataclass
class PositionMetrics:
    """Calibration of the cumulative survival at one block position (0-based)."""

    position: int
    count: int
    ece: float
    auc: float
    pred_mean: float
    target_mean: float
    reliability: list[dict] = field(default_factory=list)


def ece(pred: torch.Tensor, target: torch.Tensor, num_bins: int = 20) -> float:
    """pred, target: [n] in [0, 1] -> expected calibration error (equal-width bins,
    |mean pred - mean target| weighted by bin mass)."""
    if pred.numel() == 0:
        return float("nan")
    pred, target = pred.double().reshape(-1), target.double().reshape(-1)
    idx = (pred * num_bins).long().clamp(0, num_bins - 1)
    sp = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, idx, pred)
    st = torch.zeros(num_bins, dtype=torch.float64).index_add_(0, idx, target)
    return float((sp - st).abs().sum() / pred.numel())


def auc(pred: torch.Tensor, target: torch.Tensor) -> float:
    """pred: [n] scores; target: [n] in [0, 1] (soft labels count as fractional positives
    and negatives) -> P(score of a positive > score of a negative), ties counted half."""
    pred, target = pred.double().reshape(-1), target.double().reshape(-1)
    pos_w, neg_w = target, 1.0 - target
    if pos_w.sum() <= 0 or neg_w.sum() <= 0:
        return float("nan")
    uniq, inv = torch.unique(pred, return_inverse=True)
    pos = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, pos_w)
    neg = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, neg_w)
    neg_below = torch.cumsum(neg, 0) - neg
    pairs = (pos * neg_below).sum() + 0.5 * (pos * neg).sum()
    return float(pairs / (pos_w.sum() * neg_w.sum()))


def cumulative_survival(logits: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [M, bs] raw confidence logits; temperatures: [bs] or None -> a: [M, bs]."""
    z = logits.double()
    if temperatures is not None:
        z = z / temperatures.double().to(z.device)
    return torch.sigmoid(z).cumprod(-1)


def fit_sts(
    logits: torch.Tensor, prefix_labels: torch.Tensor, mask: torch.Tensor, cfg: STSConfig = STSConfig()
) -> list[float]:
    """Sequential Temperature Scaling.

    logits: [M, bs] raw confidence logits; prefix_labels: [M, bs] survival of the prefix up to
    k (binary or soft); mask: [M, bs] bool slots that count -> temperatures [bs]."""
    bs = logits.shape[-1]
    grid = cfg.grid()
    temps: list[float] = []
    prefix = torch.ones(logits.shape[0], dtype=torch.float64)
    for k in range(bs):
        m = mask[:, k]
        if not bool(m.any()):
            temps.append(1.0)
            continue
        z = logits[m, k].double()
        base = prefix[m]
        y = prefix_labels[m, k].double()
        errs = torch.tensor([ece(base * torch.sigmoid(z / t), y, cfg.num_bins) for t in grid])
        best = float(grid[int(errs.argmin())])
        temps.append(best)
        prefix = prefix * torch.sigmoid(logits[:, k].double() / best)
    return temps


def position_metrics(
    survival: torch.Tensor, prefix_labels: torch.Tensor, mask: torch.Tensor, num_bins: int = 20
) -> list[PositionMetrics]:
    """survival, prefix_labels: [M, bs]; mask: [M, bs] bool -> one PositionMetrics per position."""
    out = []
    for k in range(survival.shape[-1]):
        m = mask[:, k]
        p, y = survival[m, k].double(), prefix_labels[m, k].double()
        rel = []
        if p.numel():
            idx = (p * num_bins).long().clamp(0, num_bins - 1)
            for b in range(num_bins):
                sel = idx == b
                if bool(sel.any()):
                    rel.append(
                        {
                            "range": [b / num_bins, (b + 1) / num_bins],
                            "count": int(sel.sum()),
                            "avg_pred": float(p[sel].mean()),
                            "avg_target": float(y[sel].mean()),
                        }
                    )
        out.append(
            PositionMetrics(
                position=k,
                count=int(p.numel()),
                ece=ece(p, y, num_bins),
                auc=auc(p, y) if p.numel() else float("nan"),
                pred_mean=float(p.mean()) if p.numel() else float("nan"),
                target_mean=float(y.mean()) if p.numel() else float("nan"),
                reliability=rel,
            )
        )
    return out


def pooled_ece(metrics: list[PositionMetrics]) -> float:
    """Count-weighted mean of the per-position ECE."""
    n = sum(m.count for m in metrics if m.count)
    return sum(m.ece * m.count for m in metrics if m.count) / n if n else float("nan")


def plot_reliability(
    before: list[PositionMetrics], after: list[PositionMetrics], title: str, path: str
) -> None:
    """One panel per position: observed vs predicted survival, before and after STS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(before)
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.4 * rows), squeeze=False)
    for k in range(rows * cols):
        ax = axes[k // cols][k % cols]
        if k >= n:
            ax.axis("off")
            continue
        ax.plot([0, 1], [0, 1], "--", color="0.6", lw=1)
        for ms, color, label in ((before, "C3", "raw"), (after, "C0", "STS")):
            rel = ms[k].reliability
            ax.plot(
                [r["avg_pred"] for r in rel],
                [r["avg_target"] for r in rel],
                "o-",
                ms=3,
                color=color,
                label=f"{label} ECE={ms[k].ece:.3f}",
            )
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"position {k + 1}  AUC={after[k].auc:.3f}", fontsize=9)
        ax.set_xlabel("predicted prefix survival", fontsize=8)
        ax.set_ylabel("observed", fontsize=8)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.25)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


@dataclass
class ConfidenceSamples:
    """Teacher-forced confidences on held-out blocks.

    logits: [M, bs] raw confidence logits; prefix_labels: [M, bs] expected prefix survival
    prod_{i<=k} c*_i; mask: [M, bs] bool valid slots.
    """

    logits: torch.Tensor
    prefix_labels: torch.Tensor
    mask: torch.Tensor


@torch.no_grad()
def collect_confidences(
    model, seqs, num_anchors: int, seed: int = 0, bf16: bool = True, target_head=None
) -> ConfidenceSamples:
    """Run the drafter teacher-forced over held-out cached sequences (one at a time).
    `target_head`: the target's full LM head (default the drafter's, when not truncated)."""
    from dspark_serve.training.cache import make_batch
    from dspark_serve.training.loss import acceptance_rate
    from dspark_serve.training.train import block_hidden

    gen = torch.Generator().manual_seed(seed)
    bs = model.config.block_size
    logits, labels, masks = [], [], []
    dev = model.device
    for s in seqs:
        batch = make_batch([s], num_anchors, bs, gen)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            hidden = block_hidden(model, batch)
            prev = batch.prev_tokens.to(dev)
            q = model.block_logits(hidden, prev).float().softmax(-1)
            conf = model.confidence_logits(hidden, prev)
            p = (
                (target_head or model.lm_head)(batch.target_hidden.to(dev).to(model.dtype))
                .float()
                .softmax(-1)
            )
        c_star = acceptance_rate(q, p, model.d2t) * batch.mask.to(dev)
        keep = batch.anchor_valid[0]
        logits.append(conf[0][keep].float().cpu())
        labels.append(c_star[0][keep].double().cumprod(-1).cpu())
        masks.append(batch.mask[0][keep])
    return ConfidenceSamples(torch.cat(logits), torch.cat(labels), torch.cat(masks))
