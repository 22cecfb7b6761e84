"""Stage 1: the target writes its own responses to the training prompts.

Responses are stored as token ids in numbered shards (`data/shard_00000.pt`, one per
generation batch) so an interrupted run resumes at the first missing shard. A shard holds its
ids as lzma-compressed uint16 (`token_shard`: much smaller than pickled lists, so many
passes of data fit in the repository); shards written as lists still load. The serving engine
can also store the target's tap hidden states in the same pass (the cache of stage 1b), which
saves a second forward over every sequence.
"""

from __future__ import annotations

import json
import lzma
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

SHARD_PATTERN = "shard_{:05d}.pt"


@dataclass(frozen=True)
class GenDataConfig:
    """How the training responses are produced.

    prompts: JSONL file of {"turns": [...]} objects (first turn = the user message).
    out_dir: folder for `data/` shards (and `cache/` shards with `with_cache`).
    max_prompt_tokens: prompts longer than this (after the chat template) are skipped.
    min_prompt_tokens: prompts this long or shorter are skipped (0 = none): a later pass can
        cover only the prompts an earlier pass's cap left out.
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
    min_prompt_tokens: int = 0
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
        if not (0 <= self.min_prompt_tokens < self.max_prompt_tokens):
            raise ValueError(
                f"need 0 <= min_prompt_tokens < max_prompt_tokens, got {self.min_prompt_tokens!r}, "
                f"{self.max_prompt_tokens!r}"
            )
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


# The prompt sets vendored with the repository (gzipped JSONL; sources and licences in
# data/README.md): train.jsonl.gz for drafter data, dev-*.jsonl.gz for benchmarks.
PROMPTS_DIR = Path(__file__).resolve().parents[1] / "data" / "prompts"
TRAIN_PROMPTS = PROMPTS_DIR / "train.jsonl.gz"


def dev_sets(folder: str | os.PathLike = PROMPTS_DIR) -> dict[str, Path]:
    """{domain: file} of the dev prompt sets in `folder` (dev-NAME.jsonl or .jsonl.gz)."""
    out = {}
    for f in sorted(Path(folder).glob("dev-*.jsonl*")):
        out[f.name.removeprefix("dev-").split(".jsonl")[0]] = f
    return out


def read_prompts(path: str | os.PathLike) -> list[str]:
    """First user turn of every line of a {"turns": [...]} JSONL file (gzipped or not)."""
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line)["turns"][0])
    return out


def encode_chat(tokenizer, user_message: str) -> list[int]:
    """Token ids of a one-turn chat ending with the assistant header."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_message}], add_generation_prompt=True, return_dict=False
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def plan_batches(prompt_ids: list[list[int]], cfg: GenDataConfig) -> list[list[int]]:
    """Indices of prompts per generation batch: seeded shuffle, length window, then batches of
    similar length (less padding) in a shuffled order so any prefix of shards is a mix."""
    rng = random.Random(cfg.seed)
    lo, hi = cfg.min_prompt_tokens, cfg.max_prompt_tokens
    order = [i for i in range(len(prompt_ids)) if lo < len(prompt_ids[i]) <= hi]
    rng.shuffle(order)
    if cfg.max_prompts:
        order = order[: cfg.max_prompts]
    order.sort(key=lambda i: len(prompt_ids[i]))
    batches = [order[i : i + cfg.batch_size] for i in range(0, len(order), cfg.batch_size)]
    rng.shuffle(batches)
    return batches


def is_holdout(shard_index: int, holdout_every: int) -> bool:
    """Every `holdout_every`-th shard (the last of each group) is kept out of training."""
    return holdout_every > 0 and shard_index % holdout_every == holdout_every - 1


def shard_paths(folder: str | os.PathLike) -> list[Path]:
    return sorted(Path(folder).glob("shard_*.pt"))


def shard_index(path: Path) -> int:
    return int(path.stem.split("_")[1])


def token_shard(samples: Sequence[Sample], holdout: bool) -> dict:
    """A data shard's contents: every prompt's and response's ids, concatenated, as one
    lzma-compressed array each (uint16 while the ids fit, else int32), and their lengths."""
    prompts = [i for s in samples for i in s.prompt_ids]
    responses = [i for s in samples for i in s.response_ids]
    every = prompts + responses
    dtype = "int32" if max(every, default=0) > 0xFFFF or min(every, default=0) < 0 else "uint16"

    def pack(ids: list[int]) -> torch.Tensor:
        # a uint8 tensor, not bytes: torch.save pickles bytes as latin-1 text, which is larger
        data = lzma.compress(np.asarray(ids, dtype=dtype).tobytes(), preset=9)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    return {
        "format": f"{dtype}-lzma",
        "prompt_lengths": [len(s.prompt_ids) for s in samples],
        "response_lengths": [len(s.response_ids) for s in samples],
        "prompt_tokens": pack(prompts),
        "response_tokens": pack(responses),
        "holdout": holdout,
    }


def read_token_shard(path: Path) -> tuple[list[Sample], bool]:
    """A data shard's samples and whether it is held out (either layout: `token_shard`'s or
    the lists of ids earlier runs wrote)."""
    return _decode_token_shard(torch.load(path), path)


def _decode_token_shard(shard: dict, path: Path) -> tuple[list[Sample], bool]:
    holdout = bool(shard.get("holdout", False))
    if "format" not in shard:
        return [Sample(list(p), list(r)) for p, r in zip(shard["prompt_ids"], shard["response_ids"])], holdout
    dtype = shard["format"].split("-")[0]
    if shard["format"] != f"{dtype}-lzma" or dtype not in ("uint16", "int32"):
        raise ValueError(f"{path}: unknown token shard format {shard['format']!r}")

    def unpack(data: torch.Tensor, lengths: list[int]) -> list[list[int]]:
        flat = np.frombuffer(lzma.decompress(data.numpy().tobytes()), dtype=dtype).tolist()
        if len(flat) != sum(lengths):
            raise ValueError(f"{path}: {len(flat)} token ids for lengths summing to {sum(lengths)}")
        cuts = np.cumsum([0, *lengths]).tolist()
        return [flat[a:b] for a, b in zip(cuts[:-1], cuts[1:])]

    prompts = unpack(shard["prompt_tokens"], shard["prompt_lengths"])
    responses = unpack(shard["response_tokens"], shard["response_lengths"])
    return [Sample(p, r) for p, r in zip(prompts, responses)], holdout


def compact_shards(folder: str | os.PathLike) -> int:
    """Rewrite a folder's list-layout data shards in `token_shard`'s layout (same samples, same
    holdout flag; each read back and compared before it replaces the old one). -> how many."""
    n = 0
    for path in shard_paths(folder):
        shard = torch.load(path)
        if "format" in shard:
            continue  # already compact
        samples, holdout = _decode_token_shard(shard, path)
        tmp = path.with_suffix(".compact")
        torch.save(token_shard(samples, holdout), tmp)
        if read_token_shard(tmp) != (samples, holdout):
            tmp.unlink()
            raise RuntimeError(f"{path}: the compact shard does not read back the same")
        os.replace(tmp, path)
        n += 1
    return n


def save_atomic(obj, path: Path) -> None:
    """Write then rename, so a killed run never leaves a truncated shard behind."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class TapCapture:
    """The engine's `HiddenCapture` for data generation: per request, the target's tap states
    and final-norm hidden of every token it fed, in position order (fp16 on the CPU).

    layers: the drafter's taps followed by the last layer (whose tap is the final-norm hidden
    that the frozen LM head turns into the target's logits)."""

    def __init__(self, tap_ids: Sequence[int], num_layers: int) -> None:
        self.tap_ids = tuple(tap_ids)
        self.layers = self.tap_ids + (num_layers - 1,)
        self._rows: dict[str, list[torch.Tensor]] = {}
        self._count: dict[str, int] = {}

    def observe(self, contexts) -> None:
        for c in contexts:
            have = self._count.get(c.request_id, 0)
            if c.start_pos != have or c.hidden is None:
                raise RuntimeError(f"capture of {c.request_id!r}: rows from {c.start_pos}, have {have}")
            self._rows.setdefault(c.request_id, []).append(c.hidden.to("cpu", torch.float16))
            self._count[c.request_id] = have + c.hidden.shape[0]

    def pop(self, request_id: str) -> dict:
        """{taps [n, m*d], last [n, d]} for the n fed positions of a finished request."""
        self._count.pop(request_id, None)
        h = torch.cat(self._rows.pop(request_id), 0)
        d = h.shape[1] // len(self.layers)
        return {"taps": h[:, :-d].clone(), "last": h[:, -d:].clone()}


@dataclass
class _Shard:
    """A shard being generated: its prompts, and per prompt slot the response and (with taps)
    the captured states of the requests finished so far."""

    index: int
    prompt_ids: list[list[int]]
    responses: dict[int, list[int]]
    records: dict[int, dict]

    @property
    def complete(self) -> bool:
        return len(self.responses) == len(self.prompt_ids)


@dataclass(frozen=True)
class _Pending:
    """A request in the engine: the shard and prompt slot its response goes to."""

    shard: _Shard
    slot: int
    request: Any


@dataclass(frozen=True)
class _GenDataPaths:
    """Where a generation writes: token shards under data/, cache shards (taps) under cache/."""

    data_dir: Path
    cache_dir: Path
    tap_ids: Sequence[int] | None

    def done(self, i: int) -> bool:
        return (self.data_dir / SHARD_PATTERN.format(i)).exists() and (
            self.tap_ids is None or (self.cache_dir / SHARD_PATTERN.format(i)).exists()
        )

    def save(self, shard: _Shard, holdout_every: int) -> list[Sample]:
        """Both shards of a complete shard, cache first; returns its samples."""
        samples = [Sample(list(p), shard.responses[j]) for j, p in enumerate(shard.prompt_ids)]
        if self.tap_ids is not None:
            records = [shard.records[j] for j in range(len(samples))]
            save_atomic(
                cache_record_shard(samples, records, self.tap_ids),
                self.cache_dir / SHARD_PATTERN.format(shard.index),
            )
        save_atomic(
            token_shard(samples, is_holdout(shard.index, holdout_every)),
            self.data_dir / SHARD_PATTERN.format(shard.index),
        )
        return samples


def _write_plan(data_dir: Path, cfg: GenDataConfig, batches: list[list[int]]) -> None:
    with open(data_dir / "plan.json", "w") as f:
        # file names only: the plan is committed with the data and must not name this machine
        json.dump(
            {
                "config": {**cfg.__dict__, "prompts": Path(cfg.prompts).name, "out_dir": "."},
                "num_batches": len(batches),
                "num_prompts": sum(map(len, batches)),
            },
            f,
            indent=1,
        )


def _prepare_dirs(cfg: GenDataConfig, engine, tap_ids: Sequence[int] | None) -> _GenDataPaths:
    paths = _GenDataPaths(Path(cfg.out_dir) / "data", Path(cfg.out_dir) / "cache", tap_ids)
    paths.data_dir.mkdir(parents=True, exist_ok=True)
    if tap_ids is not None:
        paths.cache_dir.mkdir(parents=True, exist_ok=True)
        if engine.capture is None or tuple(engine.capture.tap_ids) != tuple(tap_ids):
            raise ValueError("the engine must capture the requested taps")
    return paths


def _add_shard_requests(engine, shard: _Shard, cfg: GenDataConfig, owner: dict[str, _Pending]) -> None:
    """One request per prompt of the shard, seeded by shard and slot when sampling."""
    from dspark_serve.ops.sampling_params import SamplingParams
    from dspark_serve.scheduler.request import Request

    for j, ids in enumerate(shard.prompt_ids):
        seed = cfg.seed * 100003 + shard.index * 1009 + j
        sp = SamplingParams(temperature=cfg.temperature, seed=seed if cfg.temperature > 0 else None)
        rid = f"gen-{shard.index}-{j}"
        req = Request(rid, list(ids), sp, cfg.max_new_tokens)
        engine.add_request(req)
        owner[rid] = _Pending(shard, j, req)


def _collect_finished(engine, owner: dict[str, _Pending], eos: int) -> None:
    """One engine step; every request it finishes hands its response (and states) to its shard."""
    for out in engine.step():
        if not out.finished:
            continue
        pending = owner.pop(out.request_id)
        req_tokens = list(pending.request.output_ids)
        if out.finish_reason == "stop":
            req_tokens.append(eos)  # the end-of-turn token is a label too
        pending.shard.responses[pending.slot] = req_tokens
        if engine.capture is not None:
            pending.shard.records[pending.slot] = engine.capture.pop(out.request_id)


def run_gen_data(
    cfg: GenDataConfig,
    engine,
    tokenizer,
    tap_ids: Sequence[int] | None,
    progress: Callable[[int, int, int], None] | None = None,
) -> int:
    """Generate every planned shard that is missing, through the serving engine at its full
    concurrency (`engine` built with a `TapCapture` when `tap_ids` is given, plain decoding).

    Shards are fed back to back: the next shard's prompts join as soon as the engine has free
    sequence slots, so the batch never drains between shards. Returns the number of shards."""
    paths = _prepare_dirs(cfg, engine, tap_ids)
    prompts = [encode_chat(tokenizer, p) for p in read_prompts(cfg.prompts)]
    batches = plan_batches(prompts, cfg)
    eos = int(tokenizer.eos_token_id)
    _write_plan(paths.data_dir, cfg, batches)
    mine = [i for i in range(len(batches)) if i % cfg.num_workers == cfg.worker]
    todo = [i for i in mine if not paths.done(i)]
    finished_shards = len(mine) - len(todo)
    owner: dict[str, _Pending] = {}
    open_shards: list[_Shard] = []
    tokens_done = 0
    while todo or open_shards:
        # Join the next shard once the running ones leave free sequence slots.
        while todo and len(owner) < engine.cfg.max_num_seqs:
            i = todo.pop(0)
            open_shards.append(_Shard(i, [prompts[j] for j in batches[i]], {}, {}))
            _add_shard_requests(engine, open_shards[-1], cfg, owner)
        _collect_finished(engine, owner, eos)
        for sh in [s for s in open_shards if s.complete]:
            open_shards.remove(sh)
            samples = paths.save(sh, cfg.holdout_every)
            tokens_done += sum(len(s.response_ids) for s in samples)
            finished_shards += 1
            if progress:
                progress(finished_shards, len(batches) // cfg.num_workers, tokens_done)
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
        samples, held = read_token_shard(path)
        if holdout is None or held == holdout:
            out += samples
    return out
