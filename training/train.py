"""Stage 2: train a DSpark (or DFlash: markov_rank 0) drafter from the cached target states.

The target stays frozen and absent: its taps and final hidden come from the cache, and its
embedding / LM head are shared with the drafter and frozen. Checkpoints every few steps make
a killed run resume where it stopped, with the same data order.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark_serve.drafter.dspark_model import (
    SHARED_PREFIXES,
    DSparkConfig,
    DSparkModel,
    draft_head,
    load_dspark,
    save_dspark,
)
from dspark_serve.drafter.dspark_model.modules import MarkovHead
from dspark_serve.training.cache import (
    CachedSequence,
    PaddedSequences,
    TrainBatch,
    anchored_batch,
    follow_anchors,
    load_cache,
    pad_sequences,
    sample_anchors,
)
from dspark_serve.training.loss import LossConfig, LossOutput, dspark_loss


@dataclass(frozen=True)
class TrainConfig:
    """Optimization of one drafter.

    steps: optimizer steps (DSpark and DFlash baselines use the same number).
    batch_seqs: sequences per step; num_anchors: random anchors per sequence.
    lr / warmup_ratio / weight_decay / max_grad_norm: AdamW with linear warmup + cosine decay.
    checkpoint_every: steps between resumable checkpoints.
    bf16: run matmuls under bfloat16 autocast (losses stay float32).
    init_from_target: copy the target's last decoder layers into the draft layers.
    seed: data order and anchor sampling.
    follow_fraction: share of each sequence's anchors moved to where the drafter's own greedy
        block from them stops (`follow_anchors`: the position serving drafts from next), so
        training sees the harder anchors serving visits; 0 = uniform anchors (DeepSpec). Costs
        one gradient-free drafter forward over the moved anchors per step.
    """

    steps: int = 400
    batch_seqs: int = 4
    num_anchors: int = 24
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    checkpoint_every: int = 25
    bf16: bool = True
    init_from_target: bool = True
    seed: int = 0
    follow_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_seqs", "num_anchors", "checkpoint_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not (self.lr > 0):
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not (0 <= self.warmup_ratio < 1):
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}")
        if self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm!r}")
        if not (0 <= self.follow_fraction <= 1):
            raise ValueError(f"follow_fraction must be in [0, 1], got {self.follow_fraction!r}")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    warm = max(1, int(cfg.warmup_ratio * cfg.steps))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def trainable_parameters(model: DSparkModel) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if not n.startswith(SHARED_PREFIXES)]


def trainable_state(model: DSparkModel) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.startswith(SHARED_PREFIXES)}


def build_draft_model(
    cfg: DSparkConfig, target: Any, init_from_target: bool, d2t: torch.Tensor | None = None
) -> DSparkModel:
    """A drafter sharing the target's (frozen) embedding and LM head (its kept rows, for a
    truncated vocabulary: `d2t` lists them, cfg.draft_vocab_size = len(d2t)).

    init_from_target: the draft layers start as copies of the target's last decoder layers
    (same shapes for Llama/Qwen targets), the final norm as the target's, and fc reads the
    deepest tap, so training starts from "the top of the target" instead of noise."""
    embed = target.get_input_embeddings()
    head = target.get_output_embeddings()
    embed.requires_grad_(False)
    head.requires_grad_(False)
    torch.manual_seed(0)
    if cfg.truncated:
        if d2t is None or d2t.numel() != cfg.draft_vocab_size:
            raise ValueError(f"a draft vocabulary of {cfg.draft_vocab_size} needs a d2t map of that size")
        head = draft_head(head, d2t)
    model = DSparkModel(cfg, embed_tokens=embed, lm_head=head)
    if model.d2t is not None and d2t is not None:
        model.d2t.copy_(d2t)
    if model.markov_head is not None:
        nn.init.zeros_(model.markov_head.markov_w2.weight)  # starts as DFlash
        nn.init.normal_(model.markov_head.markov_w1.weight, std=0.02)
    if init_from_target:
        tlayers = target.model.layers
        src = tlayers[len(tlayers) - cfg.num_hidden_layers :]
        with torch.no_grad():
            dst: Any
            for dst, s in zip(model.layers, src):
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    mine, theirs = getattr(dst.self_attn, name), getattr(s.self_attn, name)
                    if mine.weight.shape == theirs.weight.shape:
                        mine.weight.copy_(theirs.weight)
                for name in ("gate_proj", "up_proj", "down_proj"):
                    mine, theirs = getattr(dst.mlp, name), getattr(s.mlp, name)
                    if mine.weight.shape == theirs.weight.shape:
                        mine.weight.copy_(theirs.weight)
                dst.input_layernorm.weight.copy_(s.input_layernorm.weight)
                dst.post_attention_layernorm.weight.copy_(s.post_attention_layernorm.weight)
            model.norm.weight.copy_(target.model.norm.weight)
            d = cfg.hidden_size
            model.fc.weight.mul_(0.1)
            model.fc.weight[:, (cfg.num_taps - 1) * d :] += torch.eye(d)
            model.hidden_norm.weight.copy_(src[0].input_layernorm.weight)
    return model


def draft_model_from_checkpoint(path: str | Path, target: Any) -> DSparkModel:
    """A trainable drafter starting from an exported DeepSpec-format checkpoint (the shipped
    drafter, say) instead of the target's layers: its config, draft vocabulary and weights,
    in float32, sharing the target's frozen embedding and LM head as `build_draft_model`'s
    do. The optimizer and schedule start afresh (an export keeps neither)."""
    start = load_dspark(
        str(path),
        target_embed=target.get_input_embeddings(),
        target_lm_head=target.get_output_embeddings(),
    )
    d2t = None if start.d2t is None else start.d2t.clone()
    model = build_draft_model(start.config, target, init_from_target=False, d2t=d2t)
    state = trainable_state(start)
    mine = set(trainable_state(model))
    if set(state) != mine:
        raise ValueError(f"{str(path)!r} does not match its own config: {sorted(set(state) ^ mine)[:8]}")
    model.load_state_dict(state, strict=False)
    model.calibration = start.calibration
    return model


def grown_config(
    cfg: DSparkConfig, layers: int = 0, markov_rank: int = 0, markov_head_type: str = ""
) -> DSparkConfig:
    """cfg with more draft layers, a wider Markov head and/or a vanilla Markov head turned
    into a gated or recurrent one (0 / "": unchanged); never smaller, never back to vanilla."""
    new_layers = layers or cfg.num_hidden_layers
    new_rank = markov_rank or cfg.markov_rank
    new_kind = markov_head_type or cfg.markov_head_type
    if new_layers < cfg.num_hidden_layers:
        raise ValueError(f"grow to {layers!r} layers: the drafter already has {cfg.num_hidden_layers}")
    if new_rank < cfg.markov_rank or (new_rank and not cfg.has_markov):
        raise ValueError(f"grow the Markov rank to {markov_rank!r}: it is {cfg.markov_rank} (0 = no head)")
    if new_kind != cfg.markov_head_type and (cfg.markov_head_type != "vanilla" or not cfg.has_markov):
        raise ValueError(
            f"turn the Markov head into {markov_head_type!r}: only a vanilla head converts, "
            f"this one is {cfg.markov_head_type!r} with rank {cfg.markov_rank}"
        )
    return cfg.replace(num_hidden_layers=new_layers, markov_rank=new_rank, markov_head_type=new_kind)


# The recurrent head's bias is W2 tanh(o): a converted head reads o = EPS * W1[x] and writes
# W2 / EPS, which is W2 W1[x] to within EPS^2 |W1[x]|^3 / 3 (W1's entries are small).
RNN_CONVERT_EPS = 0.25


def _convert_markov_head(head: MarkovHead) -> None:
    """Give a freshly built gated / rnn head, its W1 and W2 copied from a vanilla head, the
    bias the vanilla head computed. gated: the gate starts at sigmoid(0) = 1/2 and W2
    doubles, exact. rnn: gate 1/2, the output reads EPS * W1[x] and W2 is divided by EPS
    (near exact); the candidate starts small and random so the state carries a signal that
    gradients can pick up, and the output's weights on the state and on h start at zero."""
    r = head.rank
    with torch.no_grad():
        if head.kind == "gated":
            head.gate_proj.weight.zero_()
            head.gate_proj.bias.zero_()
            head.markov_w2.weight.mul_(2.0)
        elif head.kind == "rnn":
            w, b = head.joint_proj.weight, head.joint_proj.bias  # [3r, 2r + d]: rows g | c | o
            gen = torch.Generator().manual_seed(0)
            w.zero_()
            b.zero_()
            w[r : 2 * r, r:].copy_(torch.randn(r, w.shape[1] - r, generator=gen) * 0.01)
            w[2 * r :, r : 2 * r].copy_(RNN_CONVERT_EPS * torch.eye(r))
            head.markov_w2.weight.div_(RNN_CONVERT_EPS)


def grow_draft_model(
    model: DSparkModel, target: Any, layers: int = 0, markov_rank: int = 0, markov_head_type: str = ""
) -> DSparkModel:
    """A bigger drafter that computes what `model` does, so that training its new capacity
    starts from where `model` stands instead of from scratch.

    New layers go on top of the old ones (before the final norm), initialised from the
    target's last layers as `build_draft_model`'s are, but with zero output projections
    (o_proj, down_proj): each is the identity on the residual stream until training grows it.
    A wider Markov head keeps the old rank's factors; the new rank's W1 columns start small
    and random and its W2 columns (and the confidence head's weights on them) at zero, so the
    bias and the confidence are unchanged while gradients reach the new columns. A vanilla
    head turned gated or recurrent keeps its bias (`_convert_markov_head`). With nothing to
    change (0, 0 and "", or what it has), `model` itself."""
    cfg = grown_config(model.config, layers, markov_rank, markov_head_type)
    if cfg == model.config:
        return model
    new = build_draft_model(cfg, target, init_from_target=True, d2t=model.d2t)
    state = trainable_state(model)
    with torch.no_grad():
        for name, p in trainable_state(new).items():
            if name not in state:  # a new layer, or a gated / rnn head's own projection
                if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                    p.zero_()
                continue
            src = state[name].to(p.dtype)
            if src.shape == p.shape:
                p.copy_(src)
            elif name.endswith(("markov_w2.weight", "confidence_head.proj.weight")):
                p.zero_()
                p[:, : src.shape[1]].copy_(src)
            elif name.endswith("markov_w1.weight"):
                p[:, : src.shape[1]].copy_(src)
            else:
                raise ValueError(f"cannot grow {name!r} from {tuple(src.shape)} to {tuple(p.shape)}")
    if cfg.markov_head_type != model.config.markov_head_type:
        assert new.markov_head is not None
        _convert_markov_head(new.markov_head)
    new.calibration = model.calibration
    return new


@dataclass
class StepStats:
    step: int
    loss: float
    ce: float
    l1: float
    confidence: float
    tau: float
    accept_rate: list[float]
    lr: float
    seconds: float


def _autocast(model: DSparkModel, bf16: bool) -> torch.autocast:
    return torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16)


def block_hidden(model: DSparkModel, batch: TrainBatch) -> torch.Tensor:
    """The drafter's teacher-forced hidden states for every block of `batch`: [B, N, bs, d]."""
    dev = model.device
    ctx, ids = batch.context_hidden.to(dev), batch.input_ids.to(dev)
    return model.forward_train(ctx, ids, batch.anchors.to(dev), batch.anchor_valid.to(dev))


def forward_loss(
    model: DSparkModel,
    batch: TrainBatch,
    loss_cfg: LossConfig,
    bf16: bool,
    target_head: nn.Module | None = None,
) -> LossOutput:
    """One teacher-forced forward over a batch -> the DSpark objective. `target_head`: the
    target's full LM head (needed with a truncated draft vocabulary; default the drafter's)."""
    dev = model.device
    with _autocast(model, bf16):
        hidden = block_hidden(model, batch)
        prev = batch.prev_tokens.to(dev)
        draft_logits = model.block_logits(hidden, prev)
        conf = model.confidence_logits(hidden, prev)
        with torch.no_grad():
            target_logits = (target_head or model.lm_head)(
                batch.target_hidden.to(dev).to(model.dtype)
            ).float()
    return dspark_loss(
        draft_logits, target_logits, batch.labels.to(dev), batch.mask.to(dev), conf, loss_cfg, d2t=model.d2t
    )


@torch.no_grad()
def greedy_hits(model: DSparkModel, batch: TrainBatch, bf16: bool) -> torch.Tensor:
    """-> [B, N, bs] bool: the drafter's teacher-forced argmax (as a target id) equals the
    label, on valid slots."""
    dev = model.device
    with _autocast(model, bf16):
        hidden = block_hidden(model, batch)
        pick = model.block_logits(hidden, batch.prev_tokens.to(dev)).argmax(-1)
    return ((model.to_target_ids(pick) == batch.labels.to(dev)) & batch.mask.to(dev)).cpu()


def followed_batch(
    model: DSparkModel,
    padded: PaddedSequences,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    slots: torch.Tensor,
    bf16: bool,
) -> TrainBatch:
    """The batch with the anchors in `slots` ([n] indices into N) replaced by their follow
    anchors under the current drafter (an invalid follow anchor keeps the uniform one)."""
    bs = model.config.block_size
    picked = anchored_batch(padded, anchors[:, slots], anchor_valid[:, slots], bs)
    hits = greedy_hits(model, picked, bf16)
    nxt, ok = follow_anchors(picked.anchors, picked.anchor_valid, hits, padded.loss_mask)
    anchors, anchor_valid = anchors.clone(), anchor_valid.clone()
    anchors[:, slots] = torch.where(ok, nxt, anchors[:, slots])
    return anchored_batch(padded, anchors, anchor_valid, bs)


def training_batch(
    model: DSparkModel, seqs: Sequence[CachedSequence], cfg: TrainConfig, gen: torch.Generator
) -> TrainBatch:
    """One step's batch: uniform anchors, a `follow_fraction` share of them followed."""
    padded = pad_sequences(seqs)
    anchors, valid = sample_anchors(padded.loss_mask, cfg.num_anchors, gen)
    n = round(cfg.follow_fraction * cfg.num_anchors)
    if n == 0:
        return anchored_batch(padded, anchors, valid, model.config.block_size)
    slots = torch.randperm(cfg.num_anchors, generator=gen)[:n]
    return followed_batch(model, padded, anchors, valid, slots, cfg.bf16)


@dataclass
class HeldOutStats:
    """Teacher-forced acceptance on held-out sequences at one checkpoint (no gradient).

    tau: mean expected tokens per block (1 + sum_k prod_{i<=k} c*_i); accept_rate: mean c*_k
    per draft position k; blocks: how many (sequence, anchor) blocks were scored; greedy_tau:
    mean tokens per block under greedy verification (leading argmax matches + 1);
    follow_greedy_tau: the same at the follow anchors of those blocks (where the drafter's own
    greedy block stops, the anchors serving drafts from after its first step), which is
    what greedy serving's acceptance length tracks."""

    step: int
    tau: float
    accept_rate: list[float]
    blocks: int
    greedy_tau: float = 0.0
    follow_greedy_tau: float = 0.0


@torch.no_grad()
def evaluate_held_out(
    model: DSparkModel,
    seqs: Sequence[CachedSequence],
    num_anchors: int,
    loss_cfg: LossConfig,
    bf16: bool,
    step: int,
    target_head: nn.Module | None = None,
    batch_seqs: int = 4,
) -> HeldOutStats:
    """The same teacher-forced metrics training logs, on sequences it never trains on, with
    anchors fixed by a seed independent of the step (so checkpoints are scored alike)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(12345)
    taus: list[tuple[float, float, int]] = []  # (tau, greedy tau, blocks) per batch
    follow: list[tuple[float, int]] = []  # (greedy tau, blocks) at the follow anchors
    rates: list[tuple[torch.Tensor, int]] = []
    bs = model.config.block_size
    for i in range(0, len(seqs), batch_seqs):
        padded = pad_sequences(list(seqs[i : i + batch_seqs]))
        batch = anchored_batch(padded, *sample_anchors(padded.loss_mask, num_anchors, gen), bs)
        out = forward_loss(model, batch, loss_cfg, bf16, target_head)
        n = int(batch.anchor_valid.sum())
        taus.append((float(out.tau), float(out.greedy_tau), n))
        rates.append((out.accept_rate.detach().float().cpu(), n))
        hits = greedy_hits(model, batch, bf16)
        nxt, ok = follow_anchors(batch.anchors, batch.anchor_valid, hits, padded.loss_mask)
        if ok.any():
            fol = forward_loss(model, anchored_batch(padded, nxt, ok, bs), loss_cfg, bf16, target_head)
            follow.append((float(fol.greedy_tau), int(ok.sum())))
    model.train(was_training)
    blocks = sum(n for _, _, n in taus)
    total = blocks or 1
    rate = sum((r * n for r, n in rates), torch.zeros(bs)) / total
    return HeldOutStats(
        step=step,
        tau=sum(t * n for t, _, n in taus) / total,
        accept_rate=[round(float(x), 4) for x in rate],
        blocks=blocks,
        greedy_tau=sum(g * n for _, g, n in taus) / total,
        follow_greedy_tau=sum(g * n for g, n in follow) / max(1, sum(n for _, n in follow)),
    )


def _resume(model: DSparkModel, opt: torch.optim.Optimizer, ckpt_path: Path) -> int:
    """Load the run's checkpoint when there is one; returns the step to start from."""
    if not ckpt_path.exists():
        return 0
    ck = torch.load(ckpt_path, weights_only=False)
    model.load_state_dict(ck["model"], strict=False)
    opt.load_state_dict(ck["optimizer"])
    return int(ck["step"])


def _train_step(
    model: DSparkModel,
    data: Sequence[CachedSequence],
    cfg: TrainConfig,
    loss_cfg: LossConfig,
    opt: torch.optim.Optimizer,
    step: int,
    target_head: nn.Module | None,
) -> StepStats:
    """One optimizer step on a batch drawn from a generator seeded by the step, so a resumed
    run sees the same data order."""
    t0 = time.time()
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # resumable data order
    idx = torch.randint(len(data), (cfg.batch_seqs,), generator=gen).tolist()
    batch = training_batch(model, [data[i] for i in idx], cfg, gen)
    lr = lr_at(step, cfg)
    for g in opt.param_groups:
        g["lr"] = lr
    out = forward_loss(model, batch, loss_cfg, cfg.bf16, target_head)
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable_parameters(model), cfg.max_grad_norm)
    opt.step()
    return StepStats(
        step=step + 1,
        loss=float(out.loss.detach()),
        ce=float(out.ce),
        l1=float(out.l1),
        confidence=float(out.confidence),
        tau=float(out.tau),
        accept_rate=[round(float(a), 4) for a in out.accept_rate],
        lr=lr,
        seconds=time.time() - t0,
    )


def _save_checkpoint(
    model: DSparkModel, opt: torch.optim.Optimizer, cfg: TrainConfig, step: int, work: Path
) -> None:
    """The resumable checkpoint (written then renamed), and the weights alone of this step,
    so runs can be compared at an equal step."""
    ckpt_path = work / "ckpt.pt"
    tmp = ckpt_path.with_suffix(".tmp")
    torch.save(
        {
            "model": trainable_state(model),
            "optimizer": opt.state_dict(),
            "step": step,
            "train_config": asdict(cfg),
        },
        tmp,
    )
    os.replace(tmp, ckpt_path)
    torch.save(trainable_state(model), work / f"weights_step{step}.pt")


def run_train(
    model: DSparkModel,
    data: Sequence[CachedSequence],
    cfg: TrainConfig,
    loss_cfg: LossConfig,
    work_dir: str | os.PathLike,
    progress: Callable[[StepStats], None] | None = None,
    target_head: nn.Module | None = None,
    held_out: Sequence[CachedSequence] = (),
) -> list[StepStats]:
    """Train (resuming from `work_dir/ckpt.pt` when present); returns this run's step stats.
    With `held_out` sequences, every checkpoint also logs their teacher-forced acceptance
    (a `{"held_out": ...}` line in log.jsonl), so overfitting shows as training goes."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    opt = torch.optim.AdamW(
        trainable_parameters(model), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
    )
    start = _resume(model, opt, work / "ckpt.pt")
    history: list[StepStats] = []
    model.train()
    with open(work / "log.jsonl", "a") as log:
        for step in range(start, cfg.steps):
            stats = _train_step(model, data, cfg, loss_cfg, opt, step, target_head)
            history.append(stats)
            log.write(json.dumps(asdict(stats)) + "\n")
            log.flush()
            if progress:
                progress(stats)
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                _save_checkpoint(model, opt, cfg, step + 1, work)
                if held_out:
                    ho = evaluate_held_out(
                        model, held_out, cfg.num_anchors, loss_cfg, cfg.bf16, step + 1, target_head
                    )
                    log.write(json.dumps({"held_out": asdict(ho)}) + "\n")
                    log.flush()
    model.eval()
    return history


def load_step_weights(model: DSparkModel, work_dir: str | os.PathLike, step: int) -> None:
    """Load the weights a run saved at checkpoint `step`."""
    path = Path(work_dir) / f"weights_step{step}.pt"
    if not path.exists():
        raise ValueError(f"no weights saved at step {step!r} in {str(work_dir)!r}")
    model.load_state_dict(torch.load(path), strict=False)


def save_final(model: DSparkModel, work_dir: str | os.PathLike) -> Path:
    """The trained drafter in DeepSpec format (without the shared embedding / LM head)."""
    path = Path(work_dir) / "final"
    save_dspark(model, str(path))
    return path


def draft_vocabulary(seqs: Sequence[CachedSequence], size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` target ids the target writes most often in its responses (plus `always`,
    e.g. end-of-turn), ascending: the kept ids of a truncated draft vocabulary (d2t)."""
    counts: dict[int, int] = {}
    for s in seqs:
        for t in s.input_ids[s.num_prompt :].tolist():
            counts[t] = counts.get(t, 0) + 1
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    keep = list(dict.fromkeys([int(t) for t in always] + ranked))[:size]
    return torch.tensor(sorted(keep), dtype=torch.long)


def vocabulary_coverage(seqs: Sequence[CachedSequence], d2t: torch.Tensor) -> float:
    """Fraction of response tokens inside the kept ids."""
    kept = set(d2t.tolist())
    total = hit = 0
    for s in seqs:
        resp = s.input_ids[s.num_prompt :].tolist()
        total += len(resp)
        hit += sum(t in kept for t in resp)
    return hit / max(total, 1)


def load_train_data(out_dir: str | os.PathLike, holdout_every: int) -> list[CachedSequence]:
    return load_cache(Path(out_dir) / "cache", holdout=False, holdout_every=holdout_every)
