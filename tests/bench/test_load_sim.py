"""The load-aware loop on a virtual clock (bench/load_sim.py): with the table the H200 profiled
(a block of two or more tokens a request priced far above a decode step) on a machine where
verifying is nearly free, the default policy drafts and reaches the best static length; where
verifying really costs what a compute-bound table says, it stays near plain decoding."""

from __future__ import annotations

import pytest

from bench.load_sim import Machine, graphed_forward, h200_table, simulate, table_forward
from tests.scheduler.test_policy import linear_time_table

POLICIES = ("none", "static:1", "static:3", "static:5", "static:7")


def best_fixed(table, machine, requests, steps):
    return max(
        simulate(p, table, machine, requests, steps, clock_from=steps // 4).tokens_per_second
        for p in POLICIES
    )


@pytest.mark.parametrize(
    "shape,requests", [("qwen3-0.6b-like", 8), ("qwen3-0.6b-like", 32), ("qwen3-4b-like", 1)]
)
def test_a_table_that_prices_verification_dear_does_not_keep_the_loop_from_drafting(shape, requests):
    table, steps = h200_table(shape), 400
    machine = Machine(graphed_forward(), draft_seconds=0.001)
    res = simulate("dspark", table, machine, requests, steps, clock_from=steps // 4)
    best = best_fixed(table, machine, requests, steps)
    assert res.late_budget() >= 5.0, res.late_budget()
    assert res.tokens_per_second >= 0.95 * best, (res.tokens_per_second, best)


@pytest.mark.parametrize("requests", [8, 32])
def test_where_verifying_is_dear_the_loop_stays_near_plain_decoding(requests):
    table, steps = linear_time_table(0.002, 0.004), 400  # compute-bound: every row costs twice the base
    machine = Machine(table_forward(table), draft_seconds=0.001)
    res = simulate("dspark", table, machine, requests, steps, clock_from=steps // 4)
    plain = simulate("none", table, machine, requests, steps, clock_from=steps // 4)
    best = best_fixed(table, machine, requests, steps)
    assert best == pytest.approx(plain.tokens_per_second)  # no static length pays here
    assert res.tokens_per_second >= 0.97 * best, (res.tokens_per_second, best)
