"""Training data through the serving engine: the same tokens as plain greedy decoding, and the
tap states captured in the same pass equal a full forward of the target."""

from __future__ import annotations

import json

import pytest
import torch

from dspark_serve.scheduler.llm import LLM
from dspark_serve.training.cache import load_cache, target_states
from dspark_serve.training.data import GenDataConfig, TapCapture, load_samples, run_gen_data

TAPS = (1, 7, 14)
PROMPTS = [
    "What is 7 times 8?",
    "Name a prime number.",
    "Write a haiku about rain.",
    "Explain a KV cache briefly.",
    "def fib(n):",
]


@pytest.fixture(scope="module")
def llm():
    # float32: greedy equality is exact only there (bf16 is not batch-invariant).
    return LLM(
        dtype="float32",
        max_num_seqs=3,
        max_model_len=256,
        kv_cache_tokens=4096,
        capture=lambda layers: TapCapture(TAPS, layers),
    )


@pytest.mark.slow  # the embedded model: -m "not slow" skips it
def test_gen_data_matches_plain_greedy_and_full_forward(llm, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [p]}) for p in PROMPTS))
    # 3 shards of <= 2 prompts on 3 sequence slots: shards overlap in the running batch.
    cfg = GenDataConfig(
        prompts=str(prompts), out_dir=str(tmp_path / "out"), max_new_tokens=12, batch_size=2, holdout_every=0
    )
    assert run_gen_data(cfg, llm.engine, llm.tokenizer, TAPS) == 3
    samples = load_samples(tmp_path / "out" / "data")
    assert len(samples) == len(PROMPTS)
    hf = llm.engine.runner.model
    eos = llm.tokenizer.eos_token_id
    for s in samples:
        ref = hf.generate(
            torch.tensor([s.prompt_ids]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )[0, len(s.prompt_ids) :].tolist()
        assert s.response_ids == ref[: len(s.response_ids)] and len(s.response_ids) == len(ref)
    cached = load_cache(tmp_path / "out" / "cache", None, 0)
    assert len(cached) == len(PROMPTS)
    for c in cached:
        taps, last = target_states(hf, c.input_ids.tolist(), TAPS)
        assert c.taps.shape == taps.shape and c.last.shape == last.shape
        torch.testing.assert_close(c.taps.float(), taps.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(c.last.float(), last.float(), atol=2e-2, rtol=2e-2)
    # resuming skips finished shards: nothing is regenerated
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out" / "data").glob("shard_*.pt")}
    run_gen_data(cfg, llm.engine, llm.tokenizer, TAPS)
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out" / "data").glob("shard_*.pt")}
    assert before == after


def test_plan_batches_keeps_the_length_window_and_rejects_an_empty_one():
    from dspark_serve.training.data import plan_batches

    lengths = [5, 10, 11, 20, 21, 30]
    prompt_ids = [[0] * n for n in lengths]
    cfg = GenDataConfig(prompts="p", out_dir="o", min_prompt_tokens=10, max_prompt_tokens=20, batch_size=2)
    planned = sorted(i for b in plan_batches(prompt_ids, cfg) for i in b)
    # (10, 20]: the prompts an earlier pass capped at 10 tokens left out, up to the new cap
    assert planned == [2, 3]
    everything = GenDataConfig(prompts="p", out_dir="o", max_prompt_tokens=30, batch_size=2)
    assert sorted(i for b in plan_batches(prompt_ids, everything) for i in b) == list(range(6))
    with pytest.raises(ValueError, match="20"):
        GenDataConfig(prompts="p", out_dir="o", min_prompt_tokens=20, max_prompt_tokens=20)


def test_token_shards_are_compact_read_back_exactly_and_old_shards_still_load(tmp_path):
    import random

    from dspark_serve.training.data import (
        Sample,
        compact_shards,
        read_token_shard,
        save_atomic,
        token_shard,
    )

    rng = random.Random(0)
    # text-like ids: phrases recur (what lzma finds in a target's responses)
    phrases = [[rng.randrange(49152) for _ in range(rng.randrange(3, 12))] for _ in range(40)]

    def ids(n):
        out: list[int] = []
        while len(out) < n:
            out += rng.choice(phrases) if rng.random() < 0.8 else [rng.randrange(49152)]
        return out[:n]

    samples = [Sample(ids(rng.randrange(1, 60)), ids(n)) for n in (0, 1, 2000, 370)]
    new, old = tmp_path / "shard_00000.pt", tmp_path / "shard_00001.pt"
    save_atomic(token_shard(samples, holdout=True), new)
    save_atomic(
        {
            "prompt_ids": [s.prompt_ids for s in samples],
            "response_ids": [s.response_ids for s in samples],
            "holdout": False,
        },
        old,
    )
    assert read_token_shard(new) == (samples, True)
    assert read_token_shard(old) == (samples, False)
    assert new.stat().st_size < old.stat().st_size / 2
    assert load_samples(tmp_path) == samples + samples
    assert load_samples(tmp_path, holdout=False) == samples
    # compaction rewrites the list layout only, and keeps samples and holdout flag
    before = new.read_bytes()
    assert compact_shards(tmp_path) == 1 and new.read_bytes() == before
    assert read_token_shard(old) == (samples, False) and "format" in torch.load(old)
    # ids past uint16 are kept whole
    wide = [Sample([70000, 1], [2**31 - 1])]
    save_atomic(token_shard(wide, holdout=False), new)
    assert read_token_shard(new) == (wide, False)
