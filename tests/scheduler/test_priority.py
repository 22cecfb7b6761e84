"""Scheduling by priority (vLLM's `priority`: lower first, ties first come first served):
admission order, aging so nothing starves, the worst preempted first, fcfs ignoring it, and the
verification budget weighted towards the better priority; the HTTP field reaches the engine."""

from __future__ import annotations

import time

import pytest
import torch

from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.block_manager import BlockManager
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.load import LoadState
from dspark_serve.scheduler.policy import CostTable, DSparkPolicy, PolicyInput
from dspark_serve.scheduler.request import Request
from dspark_serve.scheduler.scheduler import Scheduler
from tests.scheduler.test_scheduler import run_batch

GREEDY = SamplingParams(temperature=0.0)


def req(rid: str, priority: int, prompt: int = 8, arrived: float | None = None) -> Request:
    r = Request(rid, list(range(prompt)), GREEDY, 100, priority=priority)
    if arrived is not None:
        r.arrival_time = arrived
    return r


def sched(policy: str, seqs: int = 2, blocks: int = 40, aging: float = 10.0) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=64, scheduling_policy=policy,
                          priority_aging_s=aging)  # fmt: skip
    return Scheduler(cfg, BlockManager(num_blocks=blocks, block_size=4))


def test_admission_by_priority_then_arrival_and_fcfs_ignores_it():
    now = time.monotonic()
    reqs = [
        req("late-low", 5, arrived=now),
        req("a-high", 0, arrived=now + 0.01),
        req("b-high", 0, arrived=now + 0.02),
    ]
    s = sched("priority")
    for r in reqs:
        s.add(r)
    s.schedule()
    assert [r.request_id for r in s.running] == ["a-high", "b-high"]  # ties: arrival order
    f = sched("fcfs")
    for r in [req("late-low", 5, arrived=now), req("a-high", 0, arrived=now + 0.01)]:
        f.add(r)
    f.schedule()
    assert [r.request_id for r in f.running] == ["late-low", "a-high"]


def test_aging_lets_a_long_waiting_request_overtake():
    now = time.monotonic()
    s = sched("priority", seqs=1, aging=1.0)
    old = req("old-low", 3, arrived=now - 5.0)  # waited 5 s: 3 - 5 = -2 beats a fresh 0
    s.add(req("new-high", 0, arrived=now))
    s.add(old)
    s.schedule()
    assert s.running == [old]
    with pytest.raises(ValueError, match="priority_aging_s"):
        SchedulerConfig(priority_aging_s=0)
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")


def test_the_worst_priority_is_preempted_first():
    """KV runs short: by priority the worst running request gives its blocks back, even when
    it was admitted first; fcfs preempts the newest."""
    now = time.monotonic()
    for policy, victim in (("priority", "low"), ("fcfs", "high")):
        s = sched(policy, seqs=2, blocks=5)
        low, high = req("low", 9, prompt=8, arrived=now), req("high", 0, prompt=8, arrived=now + 0.01)
        s.add(low)
        run_batch(s, s.schedule())
        s.add(high)
        run_batch(s, s.schedule())
        assert {r.request_id for r in s.running} == {"low", "high"}
        for _ in range(8):  # both decode until the 5 blocks cannot hold both
            batch = s.schedule()
            if batch.preempted:
                break
            run_batch(s, batch)
        assert [r.request_id for r in batch.preempted] == [victim], policy


def test_the_budget_favours_the_better_priority():
    """Two requests with the same confidences at a load where verifying costs: unweighted they
    get budgets within one of each other; weighted 1 and 1/2 (priority 0 and 1), the better one
    gets more, whichever of the two it is."""
    table = CostTable((1, 2, 4, 8, 16), (100.0, 95.0, 80.0, 55.0, 30.0))
    conf = [torch.full((7,), 0.8)] * 2
    policy = DSparkPolicy()
    even = policy(PolicyInput(conf, [7, 7]), table, LoadState(2))
    assert abs(even.lengths[0] - even.lengths[1]) <= 1  # a tie broken by position
    first = policy(PolicyInput(conf, [7, 7], weights=[1.0, 0.5]), table, LoadState(2))
    second = policy(PolicyInput(conf, [7, 7], weights=[0.5, 1.0]), table, LoadState(2))
    assert first.lengths[0] >= first.lengths[1] + 2 and list(second.lengths) == list(first.lengths)[::-1]
    with pytest.raises(ValueError, match="weights"):
        PolicyInput(conf, [7, 7], weights=[1.0])


def test_the_http_priority_reaches_the_engine():
    from dspark_serve.scheduler.async_engine import _request
    from dspark_serve.server.params import generation_params
    from dspark_serve.server.protocol import CompletionRequest

    body = CompletionRequest.model_validate({"prompt": "hi", "max_tokens": 4, "priority": -3})
    params = generation_params(body, prompt_len=2, max_model_len=64)
    assert params.priority == -3 and _request("x", [1, 2], params).priority == -3
    with pytest.raises(ValueError, match="priority"):
        CompletionRequest.model_validate({"prompt": "hi", "priority": "high"})
