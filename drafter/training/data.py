"""Stage 1: the target writes its own responses to the training prompts.

Responses are stored as token ids in numbered shards (`data/shard_00000.pt`, one per
generation batch) so an interrupted run resumes at the first missing shard. The HF backend
can also store the target's tap hidden states in the same pass (the cache of stage 1b), which
saves a second forward over every sequence.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

SHARD_PATTERN = "shard_{:05d}.pt"


@dataclass(frozen=True)
class GenDataConfig:
    """How the training responses are produced.

    prompts: JSONL file of {"turns": [...]} objects (first turn = the user message).
    out_dir: folder for `data/` shards (and `cache/` shards with `with_cache`).
    max_prompt_tokens: prompts longer than this (after the chat template) are skipped.
    max_new_tokens: cap on each response.
    max_prompts: use at most this many prompts (after the seeded shuffle); 0 = all.
    batch_size: prompts generated together.
    temperature: 0 = greedy.
    seed: shuffle + sampling seed.
    holdout_every: every n-th shard is held out for calibration (0 = none).
    worker / num_workers: this process generates the batches i with i % num_workers == worker
        (several processes can share one plan; each shard is written by exactly one).
    """

    prompts: str
    out_dir: str
    max_prompt_tokens: int = 256
    max_new_tokens: int = 192
    max_prompts: int = 0
    batch_size: int = 48
    temperature: float = 0.0
    seed: int = 0
    holdout_every: int = 10
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.worker < self.num_workers):
            raise ValueError(f"need 0 <= worker < num_workers, got {self.worker!r}, {self.num_workers!r}")
        for name in ("max_prompt_tokens", "max_new_tokens", "batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_prompts < 0:
            raise ValueError(f"max_prompts must be >= 0, got {self.max_prompts!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.holdout_every < 0:
            raise ValueError(f"holdout_every must be >= 0, got {self.holdout_every!r}")


@dataclass
class Sample:
    """One training sequence: prompt + the target's response (token ids)."""

    prompt_ids: list[int]
    response_ids: list[int]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def read_prompts(path: str | os.PathLike) -> list[str]:
    """First user turn of every line of a {"turns": [...]} JSONL file."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line)["turns"][0])
    return out


def encode_chat(tokenizer, user_message: str) -> list[int]:
    """Token ids of a one-turn chat ending with the assistant header."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": user_message}],
                                        add_generation_prompt=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def plan_batches(prompt_ids: list[list[int]], cfg: GenDataConfig) -> list[list[int]]:
    """Indices of prompts per generation batch: seeded shuffle, length cap, then batches of
    similar length (less padding) in a shuffled order so any prefix of shards is a mix."""
    rng = random.Random(cfg.seed)
    order = [i for i in range(len(prompt_ids)) if len(prompt_ids[i]) <= cfg.max_prompt_tokens]
    rng.shuffle(order)
    if cfg.max_prompts:
        order = order[:cfg.max_prompts]
    order.sort(key=lambda i: len(prompt_ids[i]))
    batches = [order[i:i + cfg.batch_size] for i in range(0, len(order), cfg.batch_size)]
    rng.shuffle(batches)
    return batches


def is_holdout(shard_index: int, holdout_every: int) -> bool:
    """Every `holdout_every`-th shard (the last of each group) is kept out of training."""
    return holdout_every > 0 and shard_index % holdout_every == holdout_every - 1


def shard_paths(folder: str | os.PathLike) -> list[Path]:
    return sorted(Path(folder).glob("shard_*.pt"))


def shard_index(path: Path) -> int:
    return int(path.stem.split("_")[1])


def save_atomic(obj, path: Path) -> None:
    """Write then rename, so a killed run never leaves a truncated shard behind."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def cut_response(ids: Sequence[int], eos_ids: set[int]) -> list[int]:
    """Response tokens up to and including the first end-of-turn token."""
    out = []
    for t in ids:
        out.append(int(t))
        if int(t) in eos_ids:
            break
    return out


@torch.no_grad()
def hf_generate_batch(model, prompts: list[list[int]], cfg: GenDataConfig, eos_ids: set[int],
                      pad_id: int, tap_ids: Sequence[int] | None,
                      generator_seed: int) -> tuple[list[Sample], list[dict] | None]:
    """Generate one left-padded batch with a plain KV-cache loop on an HF causal LM.

    With tap_ids, also returns per sample the cache record {taps [L-1, m*d] fp16,
    last [L-1, d] fp16}: the target's states at every position but the last (whose hidden
    is never needed: it would predict past the end). Only those layers are kept per step,
    which is what makes this loop much lighter than `generate(output_hidden_states=True)`."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    bsz, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((bsz, width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        attn[b, width - len(p):] = 1
    ids, attn = ids.to(dev), attn.to(dev)
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    gen = torch.Generator(device=dev).manual_seed(generator_seed)
    keep = None if tap_ids is None else [0 if i == -1 else i + 1 for i in tap_ids]
    steps_taps: list[torch.Tensor] = []  # per forward: [B, n, m*d]
    steps_last: list[torch.Tensor] = []
    cache = DynamicCache()
    out_tokens = torch.empty(bsz, 0, dtype=torch.long, device=dev)
    done = torch.zeros(bsz, dtype=torch.bool, device=dev)
    cur, cur_pos = ids, pos
    for _ in range(cfg.max_new_tokens):
        out = model(input_ids=cur, attention_mask=attn, position_ids=cur_pos, past_key_values=cache,
                    use_cache=True, output_hidden_states=keep is not None, logits_to_keep=1)
        if keep is not None:
            hs = out.hidden_states
            steps_taps.append(torch.cat([hs[i] for i in keep], -1).to(torch.float16))
            steps_last.append(hs[-1].to(torch.float16))
        logits = out.logits[:, -1].float()
        if cfg.temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / cfg.temperature, -1), 1, generator=gen)[:, 0]
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        out_tokens = torch.cat([out_tokens, nxt[:, None]], 1)
        done = done | torch.isin(nxt, torch.tensor(sorted(eos_ids), device=dev))
        if bool(done.all()):
            break
        cur, cur_pos = nxt[:, None], cur_pos[:, -1:] + 1
        attn = torch.cat([attn, torch.ones(bsz, 1, dtype=attn.dtype, device=dev)], 1)
    samples = [Sample(list(p), cut_response(out_tokens[b].tolist(), eos_ids)) for b, p in enumerate(prompts)]
    if keep is None:
        return samples, None
    taps_all = torch.cat(steps_taps, 1).cpu()  # [B, width + steps, m*d]
    last_all = torch.cat(steps_last, 1).cpu()
    records = []
    for b, s in enumerate(samples):
        start = width - len(s.prompt_ids)
        stop = width + len(s.response_ids) - 1  # inputs: prompt + all responses but the last
        records.append({"taps": taps_all[b, start:stop].clone(), "last": last_all[b, start:stop].clone()})
    return samples, records


def run_gen_data(cfg: GenDataConfig, model, tokenizer, tap_ids: Sequence[int] | None,
                 progress: Callable[[int, int, int], None] | None = None) -> int:
    """Generate every planned batch whose shard is missing; returns the number of shards."""
    data_dir = Path(cfg.out_dir) / "data"
    cache_dir = Path(cfg.out_dir) / "cache"
    data_dir.mkdir(parents=True, exist_ok=True)
    if tap_ids is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    prompts = [encode_chat(tokenizer, p) for p in read_prompts(cfg.prompts)]
    batches = plan_batches(prompts, cfg)
    eos_ids = {int(tokenizer.eos_token_id)}
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    with open(data_dir / "plan.json", "w") as f:
        json.dump({"config": cfg.__dict__, "num_batches": len(batches),
                   "num_prompts": sum(map(len, batches))}, f, indent=1)
    tokens_done = 0
    for i, batch in enumerate(batches):
        if i % cfg.num_workers != cfg.worker:
            continue
        path = data_dir / SHARD_PATTERN.format(i)
        cpath = cache_dir / SHARD_PATTERN.format(i)
        if path.exists() and (tap_ids is None or cpath.exists()):
            if progress:
                progress(i + 1, len(batches), tokens_done)
            continue
        samples, records = hf_generate_batch(model, [prompts[j] for j in batch], cfg, eos_ids,
                                             pad_id, tap_ids, cfg.seed * 100003 + i)
        if records is not None:
            save_atomic(cache_record_shard(samples, records, tap_ids), cpath)
        save_atomic({"prompt_ids": [s.prompt_ids for s in samples],
                     "response_ids": [s.response_ids for s in samples],
                     "holdout": is_holdout(i, cfg.holdout_every)}, path)
        tokens_done += sum(len(s.response_ids) for s in samples)
        if progress:
            progress(i + 1, len(batches), tokens_done)
    return len(batches)


def cache_record_shard(samples: list[Sample], records: list[dict], tap_ids: Sequence[int]) -> dict:
    """The on-disk cache shard: token ids, prompt lengths and fp16 target states."""
    return {
        "tap_ids": list(tap_ids),
        "input_ids": [torch.tensor(s.token_ids, dtype=torch.long) for s in samples],
        "num_prompt": [len(s.prompt_ids) for s in samples],
        "taps": [r["taps"] for r in records],
        "last": [r["last"] for r in records],
    }


def load_samples(data_dir: str | os.PathLike, holdout: bool | None = None) -> list[Sample]:
    """Samples of every shard (holdout None = all, True/False = only that split)."""
    out = []
    for path in shard_paths(data_dir):
        shard = torch.load(path)
        if holdout is not None and bool(shard.get("holdout", False)) != holdout:
            continue
        out += [Sample(p, r) for p, r in zip(shard["prompt_ids"], shard["response_ids"])]
    return out
