"""The training prompts made here copy no held-out prompt: the committed set is checked by hash
against every benchmark and dev prompt the repository holds (whole prompts and every run of
words), and the generator is shown to drop a candidate that copies one."""

from __future__ import annotations

import random

from dspark_serve.training.data import PROMPTS_DIR
from dspark_serve.training.prompts import (
    SHINGLE_WORDS,
    HeldOut,
    make_prompts,
    math_prompts,
    read_turns,
    shingle_hashes,
    text_hash,
)

MADE = sorted(PROMPTS_DIR.glob("train-made*.jsonl.gz"))


def held_out_sets() -> list:
    """Every vendored prompt set but the made ones: the benchmark-derived train set and the dev sets."""
    return [f for f in sorted(PROMPTS_DIR.glob("*.jsonl*")) if f not in MADE]


def test_the_made_prompts_copy_no_benchmark_or_dev_prompt_by_hash():
    held = held_out_sets()
    assert {f.name for f in held} >= {"train.jsonl.gz", "dev-gsm8k.jsonl.gz", "dev-humaneval.jsonl.gz"}
    benchmark = [t for f in held for t in read_turns(f)]
    assert len(benchmark) > 3000
    assert [f.name for f in MADE] == ["train-made-json.jsonl.gz", "train-made.jsonl.gz"]
    made = [t for f in MADE for t in read_turns(f)]
    assert len(made) >= 7500 and len({text_hash(t) for t in made}) == len(made)  # distinct
    whole = {text_hash(t) for t in benchmark}
    runs: set[int] = set()
    for t in benchmark:
        runs |= shingle_hashes(t)
    assert not any(text_hash(t) in whole for t in made)
    assert not any(shingle_hashes(t) & runs for t in made)


def test_the_generator_drops_a_candidate_that_copies_a_held_out_prompt():
    free = make_prompts({"math": 40, "chat": 20}, HeldOut([]), seed=3)
    assert make_prompts({"math": 40, "chat": 20}, HeldOut([]), seed=3) == free  # seeded
    assert {r["domain"] for r in free} == {"math", "chat"} and len(free) == 60
    victim = free[0]["turns"][0]
    # held out: the prompt itself, or a passage that quotes a run of its words
    words = victim.split()
    quoting = "Some preamble here. " + " ".join(words[: max(SHINGLE_WORDS, len(words))]) + " And more."
    for held in ([victim], [quoting.upper()]):
        again = make_prompts({"math": 40, "chat": 20}, HeldOut(held), seed=3)
        assert victim not in [r["turns"][0] for r in again]
        assert len(again) == 60  # replaced by another draw


def test_math_exercises_are_varied():
    src = math_prompts(random.Random(0))
    drawn = [next(src) for _ in range(300)]
    assert len(set(drawn)) > 280
    assert sum("Solve" in p for p in drawn) > 5 and sum("%" in p for p in drawn) > 5
