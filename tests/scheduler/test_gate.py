"""The draft gate: learns per load level whether drafting pays, from past steps only."""

import time

import torch

from dspark_serve.drafter.base import DraftProposal
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.gate import DraftGate
from dspark_serve.scheduler.request import Request
from dspark_serve.verifier.sampling_params import SamplingParams
from tests.helpers import ByteTokenizer, hf_greedy, runner_for, tiny_model


def test_gate_alternates_then_picks_the_faster_mode_and_explores():
    g = DraftGate(warmup=2, explore_every=5)
    seen = []
    for _ in range(4):
        d = g.should_draft(1)
        seen.append(d)
        g.record(1, d, decode_tokens=1 if not d else 3, seconds=0.1 if not d else 0.1)
    assert seen.count(True) == 2 and seen.count(False) == 2  # warm-up measures both
    picks = [g.should_draft(1) for _ in range(10)]
    assert picks.count(True) >= 8 and picks.count(False) >= 1  # drafting is 3x faster here
    # a different load level is learned separately
    assert g.level(1) != g.level(16) and g.rate(16, True) == 0.0


class SlowWrongDrafter:
    """Drafts a constant token (almost always rejected) and takes 30 ms: drafting loses."""

    name, tap_layers, block_size, calibrator = "slow-wrong", (), 4, None
    online_confidence = False

    def propose(self, requests):
        time.sleep(0.03)
        return [
            DraftProposal(
                torch.full((min(4, r.max_draft),), 44, dtype=torch.long),
                None,
                torch.full((min(4, r.max_draft),), 0.95),
            )
            for r in requests
        ]

    def observe(self, contexts):
        pass

    def observe_acceptance(self, *a):
        pass

    def free(self, rid):
        pass


def test_engine_stops_drafting_when_it_does_not_pay_and_stays_lossless():
    model = tiny_model("llama")
    prompt = list(b"gate test")
    engine = Engine(
        runner_for(model),
        ByteTokenizer(),
        SchedulerConfig(verify_policy="dspark"),
        max_model_len=256,
        drafter=SlowWrongDrafter(),
    )
    assert engine.gate is not None
    r = Request("g", prompt, SamplingParams(temperature=0), 80, ignore_eos=True)
    engine.add_request(r)
    while engine.has_work():
        engine.step()
    assert r.output_ids == hf_greedy(model, prompt, 80)
    drafted_steps = r.spec.rounds
    assert drafted_steps < 0.35 * r.spec.steps, (drafted_steps, r.spec.steps)
    assert engine.gate.rate(1, False) > engine.gate.rate(1, True)


def test_seeded_requests_do_not_depend_on_the_gate():
    model = tiny_model("llama")

    def run(seed_gate_state: int) -> list[int]:
        engine = Engine(
            runner_for(model),
            ByteTokenizer(),
            SchedulerConfig(verify_policy="dspark"),
            max_model_len=256,
            drafter=SlowWrongDrafter(),
        )
        for i in range(seed_gate_state):  # teach the gate different things first
            engine.gate.record(1, i % 2 == 0, decode_tokens=1 + (i % 3), seconds=0.01)
        r = Request("s", list(b"seeded"), SamplingParams(temperature=1.0, seed=11), 20, ignore_eos=True)
        engine.add_request(r)
        while engine.has_work():
            engine.step()
        assert r.spec.rounds >= r.spec.steps - 1  # drafts every step (the last has no room)
        return r.output_ids

    assert run(0) == run(7)
