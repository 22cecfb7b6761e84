"""Acceptance length and confidence calibration of drafters on the dev prompt sets.

A single-request speculative loop on the HF target (KV cache, rollback by cropping): the
drafter proposes a block, the target verifies it in one forward, and tokens are accepted
losslessly (greedy: draft == argmax; sampled: min(1, p/q) with the residual on rejection).
Per round it records the accepted length and, for drafters with a confidence head, the raw
confidence logits and which prefixes survived, so ECE/AUC before and after calibration can be
measured on real verification outcomes.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from dspark_serve.drafter.dspark_model import DSparkModel
from dspark_serve.drafter.ngram import lookup_continuation


@dataclass
class Proposal:
    """tokens: [K] int64; probs: [K, V] draft distributions or None (one-hot);
    conf_logits: [K] raw confidence logits or None."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    conf_logits: torch.Tensor | None


class EvalDrafter(Protocol):
    block_size: int
    tap_ids: tuple[int, ...]

    def reset(self) -> None: ...

    def observe(self, taps: torch.Tensor | None, start_pos: int, tokens: list[int]) -> None: ...

    def propose(
        self, history: list[int], pos: int, k: int, temperature: float, gen: torch.Generator
    ) -> Proposal: ...


class NeuralDrafter:
    """DSpark / DFlash through DSparkModel's serving forward, with an incremental context."""

    def __init__(self, model: DSparkModel):
        self.model = model
        self.block_size = model.config.block_size
        self.tap_ids = tuple(model.config.target_layer_ids)
        self.reset()

    def reset(self) -> None:
        self.kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.model.layers]

    @torch.no_grad()
    def observe(self, taps: torch.Tensor | None, start_pos: int, tokens: list[int]) -> None:
        if taps is None:
            raise ValueError("the DSpark evaluation needs the target's tap hidden states")
        feats = self.model.project_context(taps.unsqueeze(0))
        pos = torch.arange(start_pos, start_pos + taps.shape[0]).unsqueeze(0)
        for i in range(len(self.model.layers)):
            self.kv[i].append(self.model.context_kv(i, feats, pos))

    @torch.no_grad()
    def propose(
        self, history: list[int], pos: int, k: int, temperature: float, gen: torch.Generator
    ) -> Proposal:
        from dspark_serve.ops.sampling_params import SamplingParams

        m = self.model
        anchor = torch.tensor([history[-1]])
        ids = m.block_input_ids(anchor)
        positions = torch.arange(pos, pos + self.block_size).unsqueeze(0)
        ctx = [(torch.cat([a for a, _ in kv], 1), torch.cat([b for _, b in kv], 1)) for kv in self.kv]
        ctx_mask = torch.ones(1, ctx[0][0].shape[1], dtype=torch.bool)
        hidden = m.forward_block(ids, positions, ctx, ctx_mask)[:, :k]
        block = m.sample_block(
            m.lm_head(hidden), anchor, [SamplingParams(temperature=temperature)], [gen], hidden
        )
        conf = m.confidence_logits(hidden, block.prev_tokens)
        probs = None if temperature == 0 or block.probs is None else m.to_target_probs(block.probs[0])
        return Proposal(block.tokens[0], probs, None if conf is None else conf[0].float())


class NgramEvalDrafter:
    """Prompt lookup (no weights, deterministic drafts)."""

    def __init__(self, block_size: int, max_ngram: int = 4, min_ngram: int = 1):
        self.block_size, self.max_ngram, self.min_ngram = block_size, max_ngram, min_ngram
        self.tap_ids: tuple[int, ...] = ()

    def reset(self) -> None:
        pass

    def observe(self, taps, start_pos, tokens) -> None:
        pass

    def propose(self, history, pos, k, temperature, gen) -> Proposal:
        cont = lookup_continuation(np.asarray(history, dtype=np.int64), self.max_ngram, self.min_ngram, k)
        return Proposal(torch.as_tensor(cont, dtype=torch.long), None, None)


@dataclass
class RunStats:
    """Per-round outcomes of one or more generations.

    accepted: accepted drafts per round; proposed: drafts proposed per round.
    conf_logits / prefix: per round, raw confidence logits [K] and prefix survival [K] (0/1).
    """

    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    conf_logits: list[list[float]] = field(default_factory=list)
    prefix: list[list[int]] = field(default_factory=list)
    new_tokens: int = 0
    seconds: float = 0.0
    generated: list[int] = field(default_factory=list)

    def merge(self, other: RunStats) -> None:
        self.accepted += other.accepted
        self.proposed += other.proposed
        self.conf_logits += other.conf_logits
        self.prefix += other.prefix
        self.new_tokens += other.new_tokens
        self.seconds += other.seconds
        self.generated += other.generated

    @property
    def acceptance_length(self) -> float:
        """tau: tokens per target forward, the bonus token included."""
        return float(np.mean(self.accepted) + 1.0) if self.accepted else float("nan")

    def conditional_acceptance(self, block_size: int) -> list[float]:
        """P(draft k accepted | drafts < k accepted), over rounds that proposed k drafts."""
        acc, prop = np.asarray(self.accepted), np.asarray(self.proposed)
        out = []
        for k in range(1, block_size + 1):
            reach = (prop >= k) & (acc >= k - 1)
            out.append(float((acc[reach] >= k).mean()) if reach.any() else float("nan"))
        return out


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits: [..., V] -> target distribution at `temperature` (> 0)."""
    return torch.softmax(logits.float() / temperature, -1)


def _next_token(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> int:
    """The target's token from one row of logits: argmax when greedy, else a draw."""
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(_probs(logits, temperature), 1, generator=gen))


@dataclass(frozen=True)
class Verdict:
    """One round's verification: the leading drafts accepted, and the target's own token
    after them (the bonus, or the residual draw that replaces the first rejected draft)."""

    accepted: int
    bonus: int


def verify_greedy(drafts: list[int], logits: torch.Tensor) -> Verdict:
    """Drafts are accepted while they equal the target's argmax. logits: [K+1, V]."""
    target_tok = logits.argmax(-1)
    n = 0
    while n < len(drafts) and drafts[n] == int(target_tok[n]):
        n += 1
    return Verdict(n, int(target_tok[n]))


def verify_sampled(
    drafts: list[int], logits: torch.Tensor, prop: Proposal, temperature: float, gen: torch.Generator
) -> Verdict:
    """Lossless rejection sampling: draft d is kept with probability min(1, p(d) / q(d)) (q
    one-hot for drafters without distributions); the first rejected one is replaced by a draw
    from the residual max(p - q, 0), and a fully accepted block gets a bonus draw from p."""
    p = _probs(logits, temperature)
    n = 0
    while n < len(drafts):
        d = drafts[n]
        qd = 1.0 if prop.probs is None else float(prop.probs[n, d])
        if float(torch.rand((), generator=gen)) < min(1.0, float(p[n, d]) / max(qd, 1e-20)):
            n += 1
            continue
        q = torch.zeros_like(p[n])
        if prop.probs is None:
            q[d] = 1.0
        else:
            q = prop.probs[n].float()
        resid = (p[n] - q).clamp_min(0)
        resid = resid / resid.sum() if float(resid.sum()) > 0 else p[n]
        return Verdict(n, int(torch.multinomial(resid, 1, generator=gen)))
    return Verdict(n, int(torch.multinomial(p[n], 1, generator=gen)))


def verify(
    drafts: list[int], logits: torch.Tensor, prop: Proposal, temperature: float, gen: torch.Generator
) -> Verdict:
    """The target's verdict on a block: greedy at temperature 0, else rejection sampling."""
    if temperature == 0:
        return verify_greedy(drafts, logits)
    return verify_sampled(drafts, logits, prop, temperature, gen)


def _taps_of(o, n: int, taps_idx: list[int]) -> torch.Tensor | None:
    """The first n positions' tap hidden states of a target output (None: no taps wanted)."""
    if not taps_idx:
        return None
    return torch.cat([o.hidden_states[i][0, :n] for i in taps_idx], -1)


def _record_round(stats: RunStats, prop: Proposal, drafts: list[int], accepted: int) -> None:
    if drafts:
        stats.accepted.append(accepted)
        stats.proposed.append(len(drafts))
    if prop.conf_logits is not None and drafts:
        stats.conf_logits.append(prop.conf_logits[: len(drafts)].tolist())
        stats.prefix.append([1 if j < accepted else 0 for j in range(len(drafts))])


def _round_tokens(drafts: list[int], verdict: Verdict, eos_id: int) -> list[int]:
    """The tokens a round adds: the accepted drafts and the target's own token, cut after
    an end of sequence."""
    new = drafts[: verdict.accepted] + [verdict.bonus]
    if eos_id in new:
        new = new[: new.index(eos_id) + 1]
    return new


@torch.no_grad()
def speculative_generate(
    target,
    drafter: EvalDrafter,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float,
    eos_id: int,
    seed: int = 0,
) -> RunStats:
    """Lossless speculative decoding of one prompt; returns its round statistics."""
    from transformers import DynamicCache

    t0 = time.time()
    gen = torch.Generator().manual_seed(seed)
    stats = RunStats()
    taps_idx = [0 if i == -1 else i + 1 for i in drafter.tap_ids]
    want_hidden = bool(taps_idx)
    cache = DynamicCache()
    drafter.reset()
    out = target(
        torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True, output_hidden_states=want_hidden
    )
    drafter.observe(_taps_of(out, len(prompt_ids), taps_idx), 0, list(prompt_ids))
    x = _next_token(out.logits[0, -1], temperature, gen)
    history = list(prompt_ids) + [x]
    produced = 1
    pos = len(prompt_ids)  # position of the anchor x
    while produced < max_new_tokens and x != eos_id:
        k = min(drafter.block_size, max_new_tokens - produced - 1)
        prop = drafter.propose(history, pos, k, temperature, gen)
        drafts = prop.tokens.tolist()[:k]
        fed = torch.tensor([[x] + drafts])
        o = target(fed, past_key_values=cache, use_cache=True, output_hidden_states=want_hidden)
        logits = o.logits[0].float()  # [K+1, V]; row j predicts the token after fed[j]
        verdict = verify(drafts, logits, prop, temperature, gen)
        n = verdict.accepted
        extra = cache.get_seq_length() - (pos + 1 + n)
        if extra > 0:  # negative = tokens to drop (the form every transformers version accepts)
            cache.crop(-extra)
        drafter.observe(_taps_of(o, n + 1, taps_idx), pos, [x] + drafts[:n])
        _record_round(stats, prop, drafts, n)
        new = _round_tokens(drafts, verdict, eos_id)
        history += new
        produced += len(new)
        x = history[-1]
        pos += n + 1
    stats.new_tokens = produced
    stats.generated = history[len(prompt_ids) :]
    stats.seconds = time.time() - t0
    return stats


def confidence_arrays(stats: RunStats, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad per-round confidence records -> logits [R, bs], prefix labels [R, bs], mask [R, bs]."""
    r = len(stats.conf_logits)
    logits = torch.zeros(r, block_size, dtype=torch.float64)
    labels = torch.zeros(r, block_size, dtype=torch.float64)
    mask = torch.zeros(r, block_size, dtype=torch.bool)
    for i, (c, y) in enumerate(zip(stats.conf_logits, stats.prefix)):
        logits[i, : len(c)] = torch.tensor(c, dtype=torch.float64)
        labels[i, : len(y)] = torch.tensor(y, dtype=torch.float64)
        mask[i, : len(c)] = True
    return logits, labels, mask


def dataset_name(path: str | Path) -> str:
    stem = Path(path).name.split(".jsonl")[0]
    return stem.removeprefix("dev-")


def finite(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), 4)


def to_jsonable(obj):
    if isinstance(obj, float):
        return finite(obj)
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj


def write_json(path: str | Path, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(to_jsonable(payload), indent=1))


def summarize_positions(metrics) -> list[dict]:
    return [{k: v for k, v in asdict(m).items() if k != "reliability"} for m in metrics]


def _stats_from_json(d: dict) -> RunStats:
    return RunStats(**d)


@dataclass(frozen=True)
class EvalJob:
    """One evaluation run: a drafter on one dev set at one temperature."""

    dataset: str  # the dev set's file
    temperature: float
    drafter: str

    @property
    def name(self) -> str:
        return dataset_name(self.dataset)


def _dev_files(datasets: Sequence[str] | None) -> list[str]:
    """The dev sets asked for, or every vendored one."""
    from dspark_serve.training.data import dev_sets

    files = list(datasets) if datasets else [str(f) for f in dev_sets().values()]
    if not files:
        raise ValueError("no dev datasets found")
    return files


def _load_eval_drafters(target, drafters: dict[str, str], ngram: bool):
    """The checkpoints as DSparkModels sharing the target's embedding and head, and every
    drafter to evaluate (prompt lookup too, with ngram, at the largest block size)."""
    from dspark_serve.drafter.dspark_model import load_dspark

    hf = target.model
    models = {
        name: load_dspark(
            path, target_embed=hf.get_input_embeddings(), target_lm_head=hf.get_output_embeddings()
        )
        for name, path in drafters.items()
    }
    evals: dict[str, EvalDrafter] = {n: NeuralDrafter(m) for n, m in models.items()}
    bs = max([m.config.block_size for m in models.values()] or [7])
    if ngram:
        evals["ngram"] = NgramEvalDrafter(bs)
    return models, evals


def _run_job(
    target, drafter: EvalDrafter, job: EvalJob, part: Path, max_prompts: int, max_new_tokens: int, seed: int
) -> RunStats:
    """A job's statistics: read back from `part` when a previous run finished it, else
    generated (prompt i seeded seed + i) and saved there."""
    from dspark_serve.training.data import encode_chat, read_prompts

    if part.exists():
        return _stats_from_json(json.loads(part.read_text()))
    prompts = read_prompts(job.dataset)
    if max_prompts:
        prompts = prompts[:max_prompts]
    tok = target.tokenizer
    eos = int(tok.eos_token_id)
    stats = RunStats()
    for i, text in enumerate(prompts):
        stats.merge(
            speculative_generate(
                target.model,
                drafter,
                encode_chat(tok, text),
                max_new_tokens,
                job.temperature,
                eos,
                seed=seed + i,
            )
        )
    part.write_text(json.dumps(asdict(stats)))
    return stats


def _job_row(stats: RunStats, block_size: int) -> dict:
    return {
        "acceptance_length": stats.acceptance_length,
        "conditional_acceptance": stats.conditional_acceptance(block_size),
        "rounds": len(stats.accepted),
        "new_tokens": stats.new_tokens,
        "seconds": round(stats.seconds, 1),
    }


def _macro(table: dict[str, dict], temperatures: Sequence[float], names: Sequence[str]) -> dict:
    """Per temperature, each drafter's acceptance length averaged over the dev sets (and
    DSpark's over DFlash's where both ran)."""
    macro: dict = {}
    for temp in temperatures:
        key = f"T{temp:g}"
        macro[key] = {
            n: float(np.mean([table[d][key][n]["acceptance_length"] for d in table])) for n in names
        }
        if "dspark" in macro[key] and "dflash" in macro[key]:
            macro[key]["dspark_over_dflash"] = macro[key]["dspark"] / macro[key]["dflash"]
    return macro


def _confidence_summary(
    pooled: dict[tuple[str, float], RunStats], models: dict[str, DSparkModel], results: Path
) -> dict:
    """Per (drafter with a confidence head, temperature): the calibration of its cumulative
    survival on the rounds verified, before and after its temperatures; reliability diagrams."""
    from dspark_serve.training.calibrate import (
        cumulative_survival,
        plot_reliability,
        pooled_ece,
        position_metrics,
    )

    out = {}
    for (name, temp), stats in pooled.items():
        model = models.get(name)
        if model is None or not stats.conf_logits:
            continue
        logits, labels, mask = confidence_arrays(stats, model.config.block_size)
        before = position_metrics(cumulative_survival(logits), labels, mask)
        temps = model.calibration.temperatures if model.calibration else (1.0,) * model.config.block_size
        after = position_metrics(
            cumulative_survival(logits, torch.tensor(temps[: logits.shape[1]])), labels, mask
        )
        out[f"{name}_T{temp:g}"] = {
            "ece_before": pooled_ece(before),
            "ece_after": pooled_ece(after),
            "temperatures": list(temps),
            "per_position_before": summarize_positions(before),
            "per_position_after": summarize_positions(after),
        }
        plot_reliability(
            before,
            after,
            f"{name}, T={temp:g}: cumulative survival on dev rounds",
            str(results / f"reliability_{name}_T{temp:g}.png"),
        )
    return out


def run_evaluation(
    target,
    drafters: dict[str, str],
    datasets: Sequence[str] | None,
    results_dir: str,
    max_prompts: int = 8,
    max_new_tokens: int = 128,
    temperatures: Sequence[float] = (0.0, 1.0),
    ngram: bool = True,
    seed: int = 0,
    progress_out: str | None = None,
) -> dict:
    """Evaluate every drafter on every dev set at every temperature; writes
    `<results_dir>/summary.json` and reliability diagrams. Finished (dataset, temperature,
    drafter) runs are kept under `<results_dir>/runs/` and skipped when resuming."""
    from dspark_serve.training.progress import Progress

    results = Path(results_dir)
    (results / "runs").mkdir(parents=True, exist_ok=True)
    files = _dev_files(datasets)
    models, evals = _load_eval_drafters(target, drafters, ngram)
    jobs = [EvalJob(f, t, n) for f in files for t in temperatures for n in evals]
    bar = None if progress_out is None else Progress(progress_out, "evaluate", len(jobs), "run")
    table: dict[str, dict] = {}
    pooled: dict[tuple[str, float], RunStats] = {}
    for j, job in enumerate(jobs):
        part = results / "runs" / f"{job.name}_T{job.temperature:g}_{job.drafter}.json"
        stats = _run_job(target, evals[job.drafter], job, part, max_prompts, max_new_tokens, seed)
        pooled.setdefault((job.drafter, job.temperature), RunStats()).merge(stats)
        row = _job_row(stats, evals[job.drafter].block_size)
        table.setdefault(job.name, {}).setdefault(f"T{job.temperature:g}", {})[job.drafter] = row
        if bar:
            bar.update(
                j + 1,
                len(jobs),
                dataset=job.name,
                T=job.temperature,
                drafter=job.drafter,
                tau=stats.acceptance_length,
            )
    if bar:
        bar.close()
    summary: dict = {
        "datasets": table,
        "max_prompts_per_dataset": max_prompts,
        "max_new_tokens": max_new_tokens,
        "drafters": dict(drafters),
        "macro": _macro(table, temperatures, list(evals)),
        "confidence": _confidence_summary(pooled, models, results),
    }
    write_json(results / "summary.json", summary)
    return summary
