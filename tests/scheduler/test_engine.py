"""The engine on tiny random models: continuous batching gives every request exactly the tokens
transformers' `generate` gives it alone; KV blocks all come back; stops are exact."""

import pytest
import torch

from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine, RequestRejected
from dspark_serve.scheduler.request import Request
from tests.helpers import ByteTokenizer, hf_greedy, runner_for, tiny_model
from tests.kv_tables import Tables

GREEDY = SamplingParams(temperature=0.0)


def make_engine(model, drafter=None, policy="auto", max_num_seqs=8, budget=64, num_blocks=256):
    return Engine(
        runner_for(model, num_blocks=num_blocks),
        ByteTokenizer(),
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, verify_policy=policy),
        max_model_len=512,
        drafter=drafter,
    )


def run_all(engine, arrivals: dict[int, list[Request]], cancel: dict[int, str] | None = None):
    """Step the engine; requests in arrivals[k] join before step k; cancel[k] aborts one."""
    step = 0
    while engine.has_work() or any(k >= step for k in arrivals):
        for r in arrivals.get(step, []):
            engine.add_request(r)
        if cancel and step in cancel:
            engine.abort(cancel[step])
        engine.step()
        step += 1
        assert step < 2000


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_mixed_batch_matches_generate(kind):
    model = tiny_model(kind)
    engine = make_engine(model, budget=48)  # small budget: prompts prefill in chunks
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 37, 90, 12, 61)]
    reqs = [
        Request(f"r{i}", p, GREEDY, max_tokens=12 + 3 * i, ignore_eos=True) for i, p in enumerate(prompts)
    ]
    doomed = Request("cancel-me", prompts[2], GREEDY, max_tokens=50, ignore_eos=True)
    arrivals = {0: reqs[:2] + [doomed], 3: reqs[2:4], 7: reqs[4:]}
    run_all(engine, arrivals, cancel={5: "cancel-me"})
    for r in reqs:
        assert r.finish_reason == "length"
        assert r.output_ids == hf_greedy(model, r.prompt_ids, r.max_tokens), r.request_id
    assert doomed.finish_reason == "abort" and len(doomed.output_ids) < 50
    blocks = engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks and engine.scheduler.reserved_blocks == 0


def test_rollback_then_reforward_reproduces_logits():
    model = tiny_model("qwen3")
    runner = runner_for(model)
    ids = list(range(10, 40))
    t = Tables(runner)
    t.append("a", 30)
    first = runner.forward([t.segment("a", ids, 0, 0)]).logits.clone()
    t.append("a", 5)
    runner.forward([t.segment("a", [1, 2, 3, 4, 5], 30, 0)])  # rejected drafts ...
    t.truncate("a", 20)  # ... rolled back further
    t.append("a", 10)
    again = runner.forward([t.segment("a", ids[20:], 20, 0)]).logits
    torch.testing.assert_close(again, first[20:], rtol=1e-5, atol=1e-5)
    full = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(first, full, rtol=1e-4, atol=1e-4)


def test_stop_string_is_cut_exactly_and_usage_counts_returned_tokens():
    model = tiny_model("llama")
    prompt = list(b"hello")
    ref = hf_greedy(model, prompt, 40)
    text = ByteTokenizer().decode(ref)
    # pick a stop string from the middle of the greedy text, spanning two tokens
    cut = next(i for i in range(5, len(ref) - 2) if ref[i] < 128 and ref[i + 1] < 128)
    stop = ByteTokenizer().decode(ref[cut : cut + 2])
    engine = make_engine(model)
    r = Request("s", prompt, GREEDY, max_tokens=40, stop=(stop,), ignore_eos=True)
    engine.add_request(r)
    pieces = []
    while engine.has_work():
        pieces += [o.text for o in engine.step()]
    out = "".join(pieces)
    assert r.finish_reason == "stop"
    assert out == text[: text.find(stop)]
    assert stop not in out
    assert len(r.output_ids) == cut + 2  # through the token completing the stop, nothing after


def test_eos_stops_and_is_not_returned():
    model = tiny_model("llama")
    with torch.no_grad():  # make EOS (256) the argmax after any token
        model.lm_head.weight[256] = model.lm_head.weight[:256].mean(0) * 0 + 5.0
        model.model.norm.weight.fill_(1.0)
    prompt = list(b"abc")
    engine = make_engine(model)
    r = Request("e", prompt, GREEDY, max_tokens=20)
    engine.add_request(r)
    while engine.has_work():
        engine.step()
    ref = hf_greedy(model, prompt, 20)
    n = ref.index(256) if 256 in ref else 20
    assert r.output_ids == ref[:n]
    assert r.finish_reason == ("stop" if n < 20 else "length")


def test_too_long_and_full_queue_are_rejected():
    model = tiny_model("llama")
    engine = Engine(
        runner_for(model), ByteTokenizer(), SchedulerConfig(max_num_seqs=1, max_waiting=1), max_model_len=64
    )
    with pytest.raises(RequestRejected) as e:
        engine.add_request(Request("x", [1] * 60, GREEDY, max_tokens=10))
    assert "64" in str(e.value) and "70" in str(e.value) and e.value.status == 400
    engine.add_request(Request("a", [1, 2], GREEDY, max_tokens=4))
    with pytest.raises(RequestRejected) as e:
        engine.add_request(Request("b", [1, 2], GREEDY, max_tokens=4))
    assert e.value.status == 429


@pytest.mark.parametrize("caching", [False, True])
def test_admission_does_not_reserve_the_worst_case_and_preemption_keeps_outputs(caching):
    model = tiny_model("llama")
    # 16 blocks x 4 tokens = 64 slots; each request grows to 40 tokens: all three are admitted
    # (their prompts fit), and the pool running out preempts the newest, which later resumes
    # by recomputing its prompt and output
    engine = Engine(
        runner_for(model, num_blocks=16),
        ByteTokenizer(),
        SchedulerConfig(max_num_batched_tokens=64, enable_prefix_caching=caching),
        max_model_len=512,
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (20,), generator=g).tolist() for _ in range(3)]
    reqs = [Request(f"r{i}", p, GREEDY, max_tokens=20, ignore_eos=True) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, len(engine.running))
    assert peak == 3
    assert engine.scheduler.num_preemptions > 0 and sum(r.num_preemptions for r in reqs) > 0
    for r in reqs:
        assert r.finish_reason == "length" and r.output_ids == hf_greedy(model, r.prompt_ids, 20)
    assert engine.blocks.num_free_blocks == 16


def test_seeded_sampling_is_reproducible_and_batch_independent():
    model = tiny_model("llama")
    sp = SamplingParams(temperature=1.0, seed=123)

    def gen(extra: int) -> list[int]:
        engine = make_engine(model)
        r = Request("s", list(b"seed"), sp, max_tokens=15, ignore_eos=True)
        engine.add_request(r)
        for i in range(extra):
            engine.add_request(
                Request(
                    f"o{i}", list(b"other"), SamplingParams(temperature=1.0), max_tokens=15, ignore_eos=True
                )
            )
        while engine.has_work():
            engine.step()
        return r.output_ids

    assert gen(0) == gen(3)
