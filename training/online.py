"""Train a DSpark drafter and its DFlash twin on one accelerator, the target's states computed on
the fly (`dspark-train train-online`).

The data are token ids only (gen-data's shards): each step draws a batch of sequences, runs the
frozen target over them once (its tap states and final hidden), and trains both drafters on the
same anchored blocks in the same order: the DSpark drafter (Markov head, confidence head reading
it) and its DFlash twin (no Markov head; every weight the two share starts equal). No cache of
target states is written: on a GPU the target's forward costs less than reading one back.

A run is bounded by `minutes` of wall time: before it runs out it checkpoints, calibrates both
drafters on held-out shards (Sequential Temperature Scaling) and exports them in DeepSpec's
format, each file at most `max_file_mib` (larger weights are split into indexed shards, which
the loader reads as they are). Checkpoints (`work/online.pt`) make a run cut short resume in a
later window with the same data order; `report.json` says where it stands.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dspark_serve.drafter.dspark_model import Calibration, DSparkConfig, DSparkModel
from dspark_serve.training.cache import CachedSequence, anchored_batch, pad_sequences, sample_anchors
from dspark_serve.training.calibrate import collect_confidences, fit_sts
from dspark_serve.training.data import Sample
from dspark_serve.training.export import export_drafter
from dspark_serve.training.loss import LossConfig
from dspark_serve.training.train import (
    TrainConfig,
    build_draft_model,
    forward_loss,
    lr_at,
    trainable_parameters,
    trainable_state,
)

NAMES = ("dspark", "dflash")


@dataclass(frozen=True)
class OnlineConfig:
    """A bounded run. minutes: wall time for the whole command, export included (the run stops
    training when what is left is the reserve for calibration and export); calibration_seqs:
    held-out sequences for calibration; max_file_mib: the largest file an export may hold."""

    train: TrainConfig
    minutes: float = 6.5
    reserve_minutes: float = 0.75
    calibration_seqs: int = 32
    max_file_mib: float = 16.0

    def __post_init__(self) -> None:
        if not (self.minutes > 0 and 0 <= self.reserve_minutes < self.minutes):
            raise ValueError(
                f"minutes must be > 0 and reserve_minutes in [0, minutes), got {self.minutes!r}, "
                f"{self.reserve_minutes!r}"
            )
        if self.max_file_mib <= 0 or self.calibration_seqs < 1:
            raise ValueError(
                f"max_file_mib must be > 0 and calibration_seqs >= 1, got {self.max_file_mib!r}, "
                f"{self.calibration_seqs!r}"
            )


@dataclass
class OnlineReport:
    """Where a run stands: steps done, each drafter's last losses and acceptance, the exports."""

    steps_done: int = 0
    steps_total: int = 0
    seconds: float = 0.0
    finished: bool = False
    last: dict[str, dict[str, float]] = field(default_factory=dict)
    exports: dict[str, str] = field(default_factory=dict)
    calibration: dict[str, list[float]] = field(default_factory=dict)
    device: str = ""


def twin_config(cfg: DSparkConfig) -> DSparkConfig:
    """The DFlash twin of a DSpark config: no Markov head, the confidence head on h alone."""
    return cfg.replace(markov_rank=0, confidence_head_with_markov=False)


def build_pair(
    cfg: DSparkConfig, target: Any, init_from_target: bool, d2t: torch.Tensor | None = None
) -> dict[str, DSparkModel]:
    """The DSpark drafter and its DFlash twin, every weight of the same name and shape equal
    (d2t: the kept ids of a truncated draft vocabulary, cfg.draft_vocab_size of them)."""
    dspark = build_draft_model(cfg, target, init_from_target, d2t)
    dflash = build_draft_model(twin_config(cfg), target, init_from_target, d2t)
    own = dflash.state_dict()
    shared = {k: v for k, v in dspark.state_dict().items() if k in own and own[k].shape == v.shape}
    dflash.load_state_dict(shared, strict=False)
    return {"dspark": dspark, "dflash": dflash}


@torch.no_grad()
def target_states(target: Any, samples: Sequence[Sample], tap_ids: Sequence[int]) -> list[CachedSequence]:
    """One batched forward of the frozen target over the samples (right-padded) -> each
    sequence's taps [L-1, m*d] and final hidden [L-1, d], on the target's device."""
    dev = next(target.parameters()).device
    seqs = [list(s.token_ids) for s in samples]
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    out = target(ids.to(dev), attention_mask=mask.to(dev), output_hidden_states=True, logits_to_keep=1)
    hs = out.hidden_states
    taps = torch.cat([hs[0 if t == -1 else t + 1] for t in tap_ids], -1)
    return [
        CachedSequence(
            ids[i, : len(s)], len(samples[i].prompt_ids), taps[i, : len(s) - 1], hs[-1][i, : len(s) - 1]
        )
        for i, s in enumerate(seqs)
    ]


class OnlineRun:
    """Both drafters, their optimizers and the data, stepped together."""

    def __init__(
        self,
        target: Any,
        cfg: DSparkConfig,
        run: OnlineConfig,
        loss: LossConfig,
        train: Sequence[Sample],
        held_out: Sequence[Sample],
        work: Path,
        d2t: torch.Tensor | None = None,
    ) -> None:
        usable = [s for s in train if len(s.token_ids) - len(s.prompt_ids) >= 2]
        if not usable:
            raise ValueError("no training sequence with a response of at least two tokens")
        self.target, self.cfg, self.run, self.loss = target, cfg, run, loss
        self.train, self.held_out, self.work = usable, list(held_out), work
        self.models = build_pair(cfg, target, run.train.init_from_target, d2t)
        # a truncated draft vocabulary scores against the target's whole head
        self.head = target.get_output_embeddings() if cfg.truncated else None
        dev = next(target.parameters()).device
        for m in self.models.values():
            m.to(dev)
        t = run.train
        self.opts = {
            n: torch.optim.AdamW(
                trainable_parameters(m), lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay
            )
            for n, m in self.models.items()
        }
        self.step = self._resume()

    @property
    def ckpt(self) -> Path:
        return self.work / "online.pt"

    def _resume(self) -> int:
        if not self.ckpt.exists():
            return 0
        ck = torch.load(self.ckpt, weights_only=False, map_location="cpu")
        for n, m in self.models.items():
            m.load_state_dict(ck["models"][n], strict=False)
            self.opts[n].load_state_dict(ck["optimizers"][n])
        return int(ck["step"])

    def checkpoint(self) -> None:
        tmp = self.ckpt.with_suffix(".tmp")
        torch.save(
            {
                "models": {n: trainable_state(m) for n, m in self.models.items()},
                "optimizers": {n: o.state_dict() for n, o in self.opts.items()},
                "step": self.step,
                "config": asdict(self.run.train),
            },
            tmp,
        )
        os.replace(tmp, self.ckpt)

    def one_step(self) -> dict[str, dict[str, float]]:
        """One optimizer step of each drafter on the same batch (drawn by the step's seed, so a
        resumed run sees the same data order)."""
        t = self.run.train
        gen = torch.Generator().manual_seed(t.seed * 1_000_003 + self.step)
        idx = torch.randint(len(self.train), (t.batch_seqs,), generator=gen).tolist()
        seqs = target_states(self.target, [self.train[i] for i in idx], self.cfg.target_layer_ids)
        padded = pad_sequences(seqs)
        anchors, valid = sample_anchors(padded.loss_mask, t.num_anchors, gen)
        batch = anchored_batch(padded, anchors, valid, self.cfg.block_size)
        lr = lr_at(self.step, t)
        stats = {}
        for n, model in self.models.items():
            model.train()
            for g in self.opts[n].param_groups:
                g["lr"] = lr
            out = forward_loss(model, batch, self.loss, t.bf16, self.head)
            self.opts[n].zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable_parameters(model), t.max_grad_norm)
            self.opts[n].step()
            stats[n] = {"loss": float(out.loss.detach()), "tau": float(out.tau), "ce": float(out.ce)}
        self.step += 1
        return stats

    def calibrate(self) -> dict[str, list[float]]:
        """Sequential Temperature Scaling of each drafter's confidences on held-out sequences."""
        seqs = []
        for i in range(0, min(len(self.held_out), self.run.calibration_seqs), 8):
            seqs += target_states(self.target, self.held_out[i : i + 8], self.cfg.target_layer_ids)
        seqs = [s for s in seqs if len(s.input_ids) - s.num_prompt >= 2]
        temps = {}
        for n, model in self.models.items():
            model.eval()
            if not seqs:
                continue
            s = collect_confidences(
                model, seqs, self.run.train.num_anchors, bf16=self.run.train.bf16, target_head=self.head
            )
            temps[n] = fit_sts(s.logits, s.prefix_labels, s.mask)
            model.calibration = Calibration(tuple(temps[n]))
        return temps

    def export(self, out: Path) -> dict[str, str]:
        paths = {}
        for n, model in self.models.items():
            dest = export_drafter(model, out / n, "bfloat16", {"steps": self.step, "drafter": n})
            split_weights(dest, self.run.max_file_mib)
            paths[n] = str(dest)
        return paths


def split_weights(dest: Path, max_mib: float) -> None:
    """An export's model.safetensors, when larger than max_mib, as indexed shards of at most
    that size each (`model.safetensors.index.json`, the layout the loader reads)."""
    single = dest / "model.safetensors"
    limit = int(max_mib * 2**20)
    if not single.exists() or single.stat().st_size <= limit:
        return
    tensors = load_file(str(single))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    room = limit - min(2**16, limit // 4)  # the rest for each file's header
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if n > room:
            raise ValueError(f"tensor {name!r} ({n} bytes) alone exceeds {max_mib} MiB")
        if size + n > room and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dest / fname))
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    single.unlink()


def run_online(
    target: Any,
    cfg: DSparkConfig,
    run: OnlineConfig,
    loss: LossConfig,
    train: Sequence[Sample],
    held_out: Sequence[Sample],
    work: str | os.PathLike,
    out: str | os.PathLike,
    progress: Callable[[int, dict[str, dict[str, float]]], None] | None = None,
    d2t: torch.Tensor | None = None,
) -> OnlineReport:
    """Train until run.train.steps or the time budget's reserve, checkpoint, calibrate, export;
    `report.json` in `out` says where it stands (a later call resumes from the checkpoint)."""
    t0 = time.monotonic()
    work_dir, out_dir = Path(work), Path(out)
    work_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = OnlineRun(target, cfg, run, loss, train, held_out, work_dir, d2t)
    report = OnlineReport(steps_total=run.train.steps, device=str(next(target.parameters()).device))
    stop_at = 60 * (run.minutes - run.reserve_minutes)
    step_s = 0.0
    with open(work_dir / "log.jsonl", "a") as log:
        while state.step < run.train.steps and time.monotonic() - t0 + step_s < stop_at:
            s0 = time.monotonic()
            stats = state.one_step()
            step_s = max(step_s * 0.9, time.monotonic() - s0)  # the next step must fit too
            report.last = stats
            log.write(
                json.dumps({"step": state.step, **stats, "seconds": round(time.monotonic() - s0, 3)}) + "\n"
            )
            log.flush()
            if progress:
                progress(state.step, stats)
            if state.step % run.train.checkpoint_every == 0:
                state.checkpoint()
    state.checkpoint()
    report.calibration = state.calibrate()
    report.exports = state.export(out_dir)
    report.steps_done = state.step
    report.finished = state.step >= run.train.steps
    report.seconds = round(time.monotonic() - t0, 2)
    (out_dir / "report.json").write_text(json.dumps(asdict(report), indent=1))
    if not all(math.isfinite(v["loss"]) for v in report.last.values()):
        raise RuntimeError(f"training diverged: {report.last}")
    return report


def read_samples(
    data_dirs: Sequence[str | os.PathLike], holdout_every: int
) -> tuple[list[Sample], list[Sample]]:
    """gen-data's token shards of every folder -> (training samples, held-out samples)."""
    from dspark_serve.training.data import is_holdout, read_token_shard, shard_index, shard_paths

    train: list[Sample] = []
    held: list[Sample] = []
    for folder in data_dirs:
        for path in shard_paths(folder):
            samples, _ = read_token_shard(path)
            (held if is_holdout(shard_index(path), holdout_every) else train).extend(samples)
    return train, held


def tiny_setup(seed: int = 0) -> tuple[Any, list[Sample], list[Sample]]:
    """The tiny mode's target (a random 4-layer Qwen3) and data (sequences it continues with a
    repeating pattern, so a drafter has something to learn), for the CI test on a CPU."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=300,
        tie_word_embeddings=True,
    )
    target = Qwen3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)

    def sample(i: int) -> Sample:
        prompt = torch.randint(20, 300, (6,), generator=gen).tolist()
        period = torch.randint(20, 300, (3 + i % 3,), generator=gen).tolist()
        return Sample(prompt, (period * 8)[:20])

    return target, [sample(i) for i in range(48)], [sample(i) for i in range(48, 56)]


def sample_vocabulary(samples: Sequence[Sample], size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """`draft_vocabulary` of token-id samples: the `size` ids their responses use most."""
    from dspark_serve.training.train import draft_vocabulary

    seqs = [
        CachedSequence(torch.tensor(s.token_ids), len(s.prompt_ids), torch.empty(0), torch.empty(0))
        for s in samples
    ]
    return draft_vocabulary(seqs, size, always)
