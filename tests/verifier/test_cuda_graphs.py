"""CUDA-graph replay of decode and verify steps, proven on the CPU: `EagerReplay` runs the same
step function over the same static, padded buffers a captured graph would read (Triton's kernel
under its interpreter), so padding, bucketing and the static inputs are checked by greedy
equality with transformers."""

from __future__ import annotations

import logging

import pytest

from dspark_serve.drafter.dspark import DraftContexts
from dspark_serve.drafter.dspark_model.fast import FastDraftBackbone
from dspark_serve.drafter.dspark_model.graphs import GraphedBlock
from dspark_serve.drafter.ngram import NgramConfig, NgramDrafter
from dspark_serve.drafter.registry import build_drafter
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.request import Request
from dspark_serve.verifier.config import ModelConfig
from dspark_serve.verifier.cuda_graphs import BucketKey, EagerReplay, GraphedForward, bucket_of
from dspark_serve.verifier.model_runner import ModelRunner
from tests.helpers import ByteTokenizer, hf_greedy, tiny_model
from tests.scheduler.test_speculative import random_dspark
from tests.triton_interpreter import needs_triton

GREEDY = SamplingParams(temperature=0.0)


def run(model, drafter=None, policy="none", budget=60.0, **runner_kw):
    runner = ModelRunner(
        model, 96, 4, attention="triton", linear="torch", cuda_graphs=True, max_model_len=128
    )
    graphed = runner.forward_impl
    assert isinstance(graphed, GraphedForward)
    graphed.budget.budget_s = budget
    engine = Engine(
        runner,
        ByteTokenizer(),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, verify_policy=policy),
        max_model_len=128,
        drafter=drafter,
    )
    prompts = [[9, 8, 7, 9, 8, 7, 9, 8][: 2 + 2 * i] + list(range(60, 60 + 7 * i)) for i in range(3)]
    reqs = [Request(f"r{i}", p, GREEDY, max_tokens=9, ignore_eos=True) for i, p in enumerate(prompts)]
    engine.add_request(reqs[0])
    steps = 0
    while engine.has_work() or steps < 3:
        if steps == 2:  # later arrivals: prefills beside running decodes, then more requests
            for r in reqs[1:]:
                engine.add_request(r)
        engine.step()
        steps += 1
    for r, p in zip(reqs, prompts):
        assert r.output_ids == hf_greedy(model, p, 9), r.request_id
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return graphed


@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_graphed_decode_is_greedy_equal_across_buckets(kind):
    needs_triton()
    graphed = run(tiny_model(kind))
    used = [k for k, g in graphed.graphs.items() if g is not None]
    assert graphed.replays >= 6
    assert {k.segments for k in used} >= {1, 4}  # one request alone, then three padded to four
    assert all(not k.tall for k in used)


def test_graphed_verify_blocks_are_greedy_equal():
    """n-gram drafts: verify segments of several tokens (the tall tile), padded tokens and
    padded segments in the same bucket."""
    needs_triton()
    graphed = run(tiny_model("qwen3"), NgramDrafter(NgramConfig()), "static:3")
    assert any(k.tall or k.tokens > k.segments for k in graphed.graphs)
    assert graphed.replays >= 5


def test_graphed_drafter_and_verify_steps_are_greedy_equal(tmp_path):
    """The DSpark drafter's block pass graphed too (its Triton backbone over static buffers, the
    padding in its cache's scratch slot) beside the target's graphed steps: greedy output equals
    transformers', and the drafter's graphs served its proposals."""
    needs_triton()
    model = tiny_model("qwen3")
    dr = build_drafter("dspark", path=str(random_dspark(model, tmp_path)), target_model=model)
    dr.backbone = FastDraftBackbone(dr.model, kernels="triton")
    dr.graphs = GraphedBlock(dr.backbone, EagerReplay())
    dr.contexts = DraftContexts(dr.model, dr.name, 16, scratch=True)
    dr.cache = dr.contexts.cache
    run(model, dr, "static:3")
    assert dr.graphs.replays >= 5 and dr.graphs.captures >= 2  # one request, then three padded to four
    assert {b.requests for b in dr.graphs.graphs} >= {1, 4}


@pytest.mark.slow  # interpreted engine runs; the full suite
def test_capture_budget_and_failures_fall_back_to_eager(caplog):
    needs_triton()
    graphed = run(tiny_model("llama"), budget=0.0)
    assert graphed.replays == 0 and all(g is None for g in graphed.graphs.values())

    def broken(step):
        raise RuntimeError("capture refused")

    model = tiny_model("llama")
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(
            model, 96, 4, attention="triton", linear="torch", cuda_graphs=True, max_model_len=128
        )
        assert isinstance(runner.forward_impl, GraphedForward)
        runner.forward_impl.capture = broken
        graphed = runner.forward_impl
        engine = Engine(runner, ByteTokenizer(), SchedulerConfig(max_num_seqs=2), max_model_len=128)
        r = Request("a", [3, 4, 5], GREEDY, max_tokens=5, ignore_eos=True)
        engine.add_request(r)
        while engine.has_work():
            engine.step()
    assert r.output_ids == hf_greedy(model, [3, 4, 5], 5)
    assert graphed.replays == 0 and "capture refused" in caplog.text and "runs eagerly" in caplog.text


def test_buckets_and_refusals():
    assert [bucket_of(n) for n in (1, 3, 4, 5, 300, 512)] == [1, 4, 4, 8, 512, 512]
    assert bucket_of(513) is None
    assert BucketKey(8, 4, False, ()) != BucketKey(8, 4, True, ())
    assert ModelConfig(cuda_graphs=True).attention == "auto"  # which then means triton
    with pytest.raises(ValueError, match=r"cuda_graphs needs attention 'triton' \(or auto\), got 'sdpa'"):
        ModelConfig(cuda_graphs=True, attention="sdpa")
    with pytest.raises(ValueError, match="cuda_graphs needs impl='fast'"):
        ModelRunner(tiny_model("llama"), 16, 4, impl="reference", cuda_graphs=True)
    needs_triton()
    with pytest.raises(ValueError, match="CUDA graphs need attention 'triton', got 'sdpa'"):
        ModelRunner(tiny_model("llama"), 16, 4, attention="sdpa", cuda_graphs=True)
    runner = ModelRunner(tiny_model("llama"), 16, 4, cuda_graphs=True)  # auto attention: triton
    assert runner.kv.scratch_slot == 16 * 4 and runner.kv.k.shape[2] == 17 * 4
    assert "CUDA graphs" in runner.describe()
