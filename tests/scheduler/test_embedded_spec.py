"""On the embedded SmolLM2-135M-Instruct: greedy speculative output equals plain decoding, for
the n-gram drafter, the shipped DSpark drafter (with online recalibration on, the default), its
DFlash ablation and both drafters combined, under every policy."""

import pytest

from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.llm import LLM
from dspark_serve.scheduler.policy import CostTable

pytestmark = pytest.mark.slow  # a real server, cluster, browser or the embedded model: -m "not slow" skips it

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether?",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
]


@pytest.mark.parametrize(
    "drafter,policies",
    [
        ("ngram", ["static:5", "dspark"]),
        ("dspark", ["static:7", "dspark", "threshold:0.3"]),
        ("dflash", ["static:7"]),
        ("dspark+ngram", ["static:7", "dspark"]),
    ],
)
def test_greedy_speculation_equals_plain_on_embedded_model(drafter, policies):
    # float32: bit-exact greedy equality is the losslessness proof (bf16 is not batch-invariant)
    llm = LLM(drafter=drafter, max_num_seqs=4, max_model_len=1024, kv_cache_tokens=8192, dtype="float32")
    # The load-aware policy must draft here whatever this machine's measured (and load-dependent)
    # cost table says: a table where a few extra tokens are nearly free.
    llm.engine.speculation.cost_table = CostTable((1, 8, 64), (100.0, 100.0, 40.0))
    tok = llm.tokenizer
    ids = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False
        )
        for p in PROMPTS
    ]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
    llm.engine.set_policy("none")
    plain = [o.token_ids for o in llm.generate(ids, SamplingParams(temperature=0), 40)]
    for policy in policies:
        llm.engine.set_policy(policy)
        outs = llm.generate(ids, SamplingParams(temperature=0), 40)
        assert [o.token_ids for o in outs] == plain, policy
        assert sum(o.spec.drafted for o in outs) > 0, policy


def test_fast_forward_equals_reference_and_generate_on_embedded_model():
    """float32 greedy on the real model: the fast forward gives the reference forward's tokens
    and transformers' own `generate` tokens, with three requests decoding together."""
    import torch

    outs = {}
    for forward in ("reference", "fast"):
        llm = LLM(
            drafter="none",
            max_num_seqs=4,
            max_model_len=1024,
            kv_cache_tokens=4096,
            dtype="float32",
            forward=forward,
        )
        tok = llm.tokenizer
        ids = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False
            )
            for p in PROMPTS
        ]
        ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
        outs[forward] = [
            o.token_ids for o in llm.generate(ids, SamplingParams(temperature=0), 24, ignore_eos=True)
        ]
    assert outs["fast"] == outs["reference"]
    model = llm.engine.runner.model
    for p, got in zip(ids, outs["fast"]):
        ref = model.generate(
            torch.tensor([p]),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=None,
        )[0, len(p) :].tolist()
        assert got == ref
