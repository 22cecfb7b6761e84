import dataclasses
import itertools
import math
import random

import pytest
import torch

from dspark_serve.scheduler.policy import (
    ConvexPrice,
    CostTable,
    DSparkPolicy,
    LoadState,
    PolicyInput,
    StaticPolicy,
    ThresholdPolicy,
    parse_policy,
    policy_names,
)

CONF = [0.95, 0.9, 0.9, 0.85, 0.85, 0.8, 0.8]  # a typical well-aligned block of 7
POINTS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]


def linear_time_table(alpha, beta, points=POINTS):
    """Step time alpha + beta * B: beta small = memory-bound (light), large = compute-bound."""
    return CostTable(tuple(points), tuple(1.0 / (alpha + beta * b) for b in points))


LIGHT = CostTable((1, 64, 256, 1024), (100.0, 97.0, 80.0, 30.0))
HEAVY = linear_time_table(0.01, 0.0004)


def theta(curves, lengths, table, prefill=0):
    tau = sum(1 + sum(c[:n]) for c, n in zip(curves, lengths))
    return tau * table.sps(len(lengths) + sum(lengths) + prefill)


def load(r, prefill=0):
    return LoadState(num_running=r, num_waiting=0, prefill_tokens=prefill, kv_usage=0.1)


# ---- cost table -------------------------------------------------------------------


def test_cost_table_interpolates_and_extrapolates():
    t = CostTable((1, 3, 5), (10.0, 6.0, 5.0))
    assert t.sps(0) == 10.0 and t.sps(1) == 10.0
    assert math.isclose(t.sps(2), 8.0)
    assert math.isclose(t.sps(4), 5.5)
    assert t.sps(5) == 5.0
    # time per step 1/6 -> 1/5 over the last segment: +1/60 per token beyond B = 5
    assert math.isclose(t.sps(11), 1.0 / (0.2 + 6 / 60))
    assert t.sps(100) < t.sps(11)
    assert CostTable((4,), (2.0,)).sps(1000) == 2.0


def test_cost_table_never_speeds_up_past_the_last_point():
    t = CostTable((1, 2), (1.0, 2.0))  # noisy profile: faster at the larger size
    assert t.sps(50) == 2.0


def test_cost_table_round_trip_and_validation():
    t = CostTable((1, 8), (3.0, 2.5))
    assert CostTable.from_dict(t.to_dict()) == t
    assert isinstance(CostTable([1, 2], [2, 1]).batch_sizes, tuple)
    with pytest.raises(ValueError, match=r"\(4, 2\)"):
        CostTable((4, 2), (1.0, 1.0))
    with pytest.raises(ValueError, match="-1.0"):
        CostTable((1, 2), (1.0, -1.0))
    with pytest.raises(ValueError, match="differ"):
        CostTable((1, 2), (1.0,))
    with pytest.raises(ValueError, match="at least one"):
        CostTable((), ())
    with pytest.raises(ValueError, match="steps_per_second"):
        CostTable.from_dict({"batch_sizes": [1]})


def test_state_and_input_validation():
    with pytest.raises(ValueError, match="1.5"):
        LoadState(kv_usage=1.5)
    with pytest.raises(ValueError, match="-3"):
        LoadState(prefill_tokens=-3)
    with pytest.raises(ValueError, match="max_lengths"):
        PolicyInput([None], [1, 2])
    with pytest.raises(ValueError, match="1.2"):
        PolicyInput([[0.5, 1.2]], [2]).survival_curves()
    with pytest.raises(ValueError, match="nan"):
        PolicyInput([[float("nan")]], [1]).survival_curves()
    with pytest.raises(ValueError, match="max_length 3"):
        PolicyInput([[0.5, 0.5]], [3]).survival_curves()


def test_survival_curves_accept_tensors_lists_and_none():
    inp = PolicyInput([torch.tensor([0.5, 0.5, 0.5]), [1.0, 0.2], None], [2, 2, 3], fallback_confidence=0.5)
    curves = inp.survival_curves()
    assert curves[0] == [0.5, 0.25]
    assert [round(x, 6) for x in curves[1]] == [1.0, 0.2]
    assert curves[2] == [0.5, 0.25, 0.125]


# ---- simple policies -------------------------------------------------------------


def test_parse_policy_names_and_errors():
    assert parse_policy("none").name == "none"
    assert parse_policy("static:3").name == "static:3"
    assert parse_policy(" threshold:0.4 ").name == "threshold:0.4"
    assert parse_policy("dspark").name == "dspark"
    assert parse_policy("dspark_global").name == "dspark_global"
    assert set(policy_names()) >= {"none", "static", "threshold", "dspark", "dspark_global"}
    for bad in ["greedy", "static", "static:x", "static:-1", "threshold:1.5", "dspark:2", ""]:
        with pytest.raises(ValueError) as e:
            parse_policy(bad)
        assert repr(bad) in str(e.value)


def test_none_static_threshold():
    inp = PolicyInput([[0.9, 0.9, 0.9, 0.5, 0.9], [0.5, 0.5], None], [5, 2, 0])
    ls = load(3)
    none = parse_policy("none")(inp, HEAVY, ls)
    assert none.lengths == [0, 0, 0] and none.expected_tokens == 3.0
    static = parse_policy("static:3")(inp, HEAVY, ls)
    assert static.lengths == [3, 2, 0]
    assert math.isclose(static.expected_tokens, 3 + (0.9 + 0.81 + 0.729) + (0.5 + 0.25))
    # a = 0.9, 0.81, 0.729, 0.3645, ...: three stay >= 0.7
    assert parse_policy("threshold:0.7")(inp, HEAVY, ls).lengths == [3, 0, 0]
    assert parse_policy("threshold:0")(inp, HEAVY, ls).lengths == [5, 2, 0]


# ---- DSpark prefix scheduler -----------------------------------------------------


def test_light_load_verifies_long_blocks_heavy_load_short():
    dspark = parse_policy("dspark")
    light = dspark(PolicyInput([CONF] * 4, [7] * 4), LIGHT, load(4))
    assert light.lengths == [7] * 4
    heavy = dspark(PolicyInput([CONF] * 32, [7] * 32), HEAVY, load(32))
    mean = sum(heavy.lengths) / 32
    assert 0 < mean <= 3, heavy.lengths
    # the same table under light concurrency still gives long blocks
    few = dspark(PolicyInput([CONF] * 2, [7] * 2), HEAVY, load(2))
    assert min(few.lengths) >= 5


def test_confident_requests_get_longer_budgets():
    inp = PolicyInput([CONF] * 8 + [[0.6] * 7] * 8, [7] * 16)
    d = parse_policy("dspark")(inp, HEAVY, load(16))
    assert min(d.lengths[:8]) > max(d.lengths[8:])


def test_max_lengths_respected():
    inp = PolicyInput([CONF, CONF, CONF, None], [0, 2, 7, 4], fallback_confidence=0.9)
    d = parse_policy("dspark")(inp, LIGHT, load(4))
    assert d.lengths == [0, 2, 7, 4]
    for name in ["static:5", "threshold:0.1", "dspark_global"]:
        lengths = parse_policy(name)(inp, LIGHT, load(4)).lengths
        assert all(n <= m for n, m in zip(lengths, [0, 2, 7, 4])), name


def knee_table(knee=64, t0=0.01, per_token=0.01 / 16):
    """Flat (memory-bound) up to the knee, then every extra token costs per_token seconds."""
    points = (1, knee, knee + 8, knee + 16, knee + 32, 2 * knee, 4 * knee)
    return CostTable(points, tuple(1.0 / (t0 + per_token * max(0, b - knee)) for b in points))


def test_prefill_tokens_reduce_budgets():
    # 8 requests x (1 + 7) tokens fill the batch exactly up to the knee: verifying is free.
    # Prefill chunks in the same step push the batch past it, so drafts start to cost.
    inp = PolicyInput([CONF] * 8, [7] * 8)
    dspark = parse_policy("dspark")
    alone = dspark(inp, knee_table(), load(8))
    assert alone.lengths == [7] * 8
    some = dspark(inp, knee_table(), load(8, prefill=16))
    more = dspark(inp, knee_table(), load(8, prefill=64))
    assert sum(more.lengths) < sum(some.lengths) < sum(alone.lengths)
    assert max(more.lengths) <= 3


def test_expected_tokens_is_tau_and_zero_survival_never_admitted():
    inp = PolicyInput([[0.8, 0.0, 1.0], [1.0, 1.0, 1.0]], [3, 3])
    d = parse_policy("dspark")(inp, LIGHT, load(2))
    assert d.lengths == [1, 3]
    assert math.isclose(d.expected_tokens, 2 + 0.8 + 3.0)
    assert parse_policy("dspark")(PolicyInput([], []), LIGHT, load(0)).lengths == []


def test_early_stop_differs_from_global_search():
    # A profile that dips then recovers: the first admission loses, later ones win.
    table = CostTable((2, 3, 4, 8), (1.0, 0.6, 0.55, 0.5))
    inp = PolicyInput([[1.0] * 3, [1.0] * 3], [3, 3])
    stop = DSparkPolicy(convex=False)(inp, table, load(2))  # the table alone (the paper's SPS)
    full = parse_policy("dspark_global")(inp, table, load(2))
    assert stop.lengths == [0, 0]
    assert full.lengths == [3, 3]
    assert theta([[1.0] * 3] * 2, full.lengths, table) > theta([[1.0] * 3] * 2, stop.lengths, table)
    # the served policy: the first admission does not pay on the table, so it admits again on
    # the envelope, where the dip is spread over the blocks that pay for it
    assert parse_policy("dspark")(inp, table, load(2)).lengths == [3, 3]


def step_table(jump: float = 1.0) -> CostTable:
    """A decode step of one token a request at 100 steps/s; any block of two or more tokens
    `jump` times dearer, and then flat (a verify forward on another path than the decode)."""
    slow = 100.0 / (1.0 + jump)
    return CostTable(
        (1, 2048), (100.0, 100.0), block_sizes=(1, 2, 8, 32), block_steps_per_second=(100.0, slow, slow, slow)
    )


@pytest.mark.parametrize("requests", [1, 8, 32])
def test_a_fixed_cost_of_verifying_at_all_does_not_stop_every_draft(requests):
    """Every first draft pays the whole jump on the table and is refused; the served policy
    prices the step on the envelope then and verifies the blocks, which make more tokens a
    second under the table itself than plain decoding."""
    table = step_table()
    inp = PolicyInput([CONF] * requests, [7] * requests)
    curves = inp.survival_curves()
    alone = DSparkPolicy(convex=False)(inp, table, load(requests))
    served = DSparkPolicy()(inp, table, load(requests))
    assert sum(alone.lengths) == 0
    assert min(served.lengths) >= 5, served.lengths

    def rate(lengths):
        return sum(1 + sum(c[:n]) for c, n in zip(curves, lengths)) * table.step_rate(
            requests + sum(lengths), requests
        )

    assert rate(served.lengths) > 1.5 * rate(alone.lengths)
    # a step whose first draft pays is priced as the table says: unchanged by the envelope
    light = DSparkPolicy(convex=False)(inp, LIGHT, load(requests))
    assert DSparkPolicy()(inp, LIGHT, load(requests)).lengths == light.lengths


def test_the_envelope_is_convex_below_the_table_and_equal_where_it_is_convex():
    table = step_table()
    for requests, extra in ((1, 7), (8, 56), (32, 224)):
        price = ConvexPrice.of(table, requests, requests, requests + extra)
        xs, ys = price.batches, price.seconds_at
        slopes = [(ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1)]
        assert all(b >= a - 1e-12 for a, b in zip(slopes, slopes[1:]))  # convex
        for b in range(requests, requests + extra + 1):
            assert price.seconds(b) <= 1.0 / table.step_rate(b, requests) + 1e-12
        assert price.seconds(requests) == pytest.approx(0.01)  # ends on the table
        assert price.seconds(requests + extra) == pytest.approx(
            1.0 / table.step_rate(requests + extra, requests)
        )
    # a convex curve (linear time) is its own envelope
    lin = linear_time_table(0.01, 0.001)
    price = ConvexPrice.of(lin, 4, 4, 32)
    for b in lin.measured_batches(4):
        if 4 <= b <= 32:
            assert price.seconds(b) == pytest.approx(1.0 / lin.step_rate(b, 4))


def test_on_the_envelope_the_early_stop_is_the_global_optimum():
    """tau is concave along the admission order and the envelope's time convex, so Theta is
    unimodal: stopping at the first admission that does not pay loses nothing there."""
    rng = random.Random(7)
    for _ in range(40):
        points = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
        times = [0.01]
        for _ in points[1:]:  # an arbitrary increasing, non-convex step time
            times.append(times[-1] + rng.choice([0.0, 0.0005, 0.004, 0.01]))
        table = CostTable(points, tuple(1.0 / t for t in times))
        r = rng.randint(1, 4)
        conf = [[rng.uniform(0.2, 1.0) for _ in range(4)] for _ in range(r)]
        inp = PolicyInput(conf, [4] * r)
        curves = inp.survival_curves()
        price = ConvexPrice.of(table, r, r, r + 4 * r)
        order = sorted((-a, j, i) for i, c in enumerate(curves) for j, a in enumerate(c, start=1))
        tau, best, at = float(r), r / price.seconds(r), 0
        for n, (neg_a, _, _) in enumerate(order, start=1):
            tau -= neg_a
            theta_n = tau / price.seconds(r + n)
            if theta_n > best:
                best, at = theta_n, n
        stopped = DSparkPolicy()._admit(order, float(r), r, lambda b: 1.0 / price.seconds(b))
        assert stopped == at


@pytest.mark.parametrize("alpha,beta", [(1.0, 0.01), (1.0, 0.2), (0.2, 0.3)])
def test_dspark_finds_the_optimum_when_throughput_is_unimodal(alpha, beta):
    """With step time linear in B, Theta along the sorted path is unimodal, so the early
    stop loses nothing: compare against brute force over all length vectors."""
    rng = random.Random(int(alpha * 100 + beta * 1000))
    r, gamma = 3, 3
    table = linear_time_table(alpha, beta, list(range(1, r * (gamma + 1) + 1)))
    for _ in range(20):
        conf = [[rng.uniform(0.3, 1.0) for _ in range(gamma)] for _ in range(r)]
        inp = PolicyInput(conf, [gamma] * r)
        curves = inp.survival_curves()
        best = max(theta(curves, list(ls), table) for ls in itertools.product(range(gamma + 1), repeat=r))
        got = DSparkPolicy()(inp, table, load(r))
        assert math.isclose(theta(curves, got.lengths, table), best, rel_tol=1e-9)


def test_policy_objects_are_frozen_and_validated():
    with pytest.raises(ValueError, match="-2"):
        StaticPolicy(k=-2)
    with pytest.raises(ValueError, match="nan"):
        ThresholdPolicy(threshold=float("nan"))
    p = DSparkPolicy()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.early_stop = False  # type: ignore[misc]


# ---- block-shaped pricing: requests and tokens -------------------------------------------

# A step of R decode requests is dear (each request adds its own attention and bookkeeping),
# while extra tokens inside one request are nearly free (a CPU or GPU with flat small-batch matmuls).
STEEP_DECODE = (1, 2, 4, 8, 16, 32), (35.0, 31.0, 26.0, 16.0, 10.0, 4.7)
FLAT_BLOCK = (1, 2, 4, 8, 16, 32), (35.0, 34.0, 32.0, 26.0, 18.0, 10.0)


def test_cost_table_prices_extra_tokens_inside_requests():
    t = CostTable(*STEEP_DECODE, *FLAT_BLOCK)
    assert t.sps(8) == 16.0  # without the request count: decode-shaped
    assert t.sps(8, requests=8) == 16.0  # 8 requests x 1 token
    # 1 request x 8 tokens: the decode of one request plus 7 extra tokens priced in-request
    assert math.isclose(t.sps(8, requests=1), 1.0 / (1 / 35.0 + (1 / 26.0 - 1 / 35.0)))
    assert math.isclose(t.sps(8, requests=1), 26.0)
    # 4 requests x 2 tokens: decode of 4 plus 4 extra tokens (in-request block of 1 + 4 = 5,
    # between the measured 4 and 8: 32 - 6/4)
    assert math.isclose(t.sps(8, requests=4), 1.0 / (1 / 26.0 + 1 / 30.5 - 1 / 35.0))
    again = CostTable.from_dict(t.to_dict())
    assert again == t and CostTable.from_dict(CostTable(*STEEP_DECODE).to_dict()).block_sizes is None
    with pytest.raises(ValueError, match="come together"):
        CostTable(*STEEP_DECODE, block_sizes=(1, 2))
    with pytest.raises(ValueError, match="block"):
        CostTable(*STEEP_DECODE, (1, 1), (2.0, 1.0))


def test_dspark_policy_verifies_blocks_where_they_are_cheap_in_request():
    curves = [[0.7, 0.6, 0.6, 0.5, 0.5, 0.4, 0.4]]
    inp = PolicyInput(confidences=[torch.tensor(curves[0])], max_lengths=[7])
    steep_only = DSparkPolicy()(inp, CostTable(*STEEP_DECODE), load(1))
    shaped = DSparkPolicy()(inp, CostTable(*STEEP_DECODE, *FLAT_BLOCK), load(1))
    # priced as 1 + k decode requests, drafts look dear; priced in-request they pay
    assert shaped.lengths[0] > steep_only.lengths[0]
    assert shaped.lengths[0] >= 4


def test_a_steps_overhead_makes_longer_verification_pay():
    """A compute-bound forward (time grows with every token) and a fixed cost every step
    besides it: priced, the overhead is spread over more tokens, so the policy verifies more,
    and the lengths it picks maximise tau over the whole step's time, not the forward's."""
    table = linear_time_table(0.002, 0.001)
    inp = PolicyInput([CONF] * 4, [7] * 4)
    dspark = parse_policy("dspark")
    bare = dspark(inp, table, load(4))
    priced_table = dataclasses.replace(table, overhead_seconds=0.02)
    priced = dspark(inp, priced_table, load(4))
    assert sum(priced.lengths) > sum(bare.lengths), (bare.lengths, priced.lengths)
    curves = inp.survival_curves()

    def whole_step(lengths):
        tau = sum(1 + sum(c[:n]) for c, n in zip(curves, lengths))
        return tau * priced_table.step_rate(4 + sum(lengths), 4)

    assert whole_step(priced.lengths) > whole_step(bare.lengths)
    assert priced_table.step_rate(8, 4) == pytest.approx(1.0 / (1.0 / table.sps(8, 4) + 0.02))
    assert table.step_rate(8, 4) == table.sps(8, 4)  # no overhead: the forward alone
    for bad in (-0.001, math.inf, math.nan):
        with pytest.raises(ValueError, match="overhead_seconds"):
            dataclasses.replace(table, overhead_seconds=bad)


def grid_time(r: int, t: int, per_row_s: float) -> float:
    """STEEP_DECODE's decode of r requests, and every extra token costing `per_row_s`."""
    return 1.0 / dict(zip(*STEEP_DECODE))[r] + r * (t - 1) * per_row_s


def grid_table(per_row_s: float) -> CostTable:
    """Decode and block shapes of STEEP_DECODE / FLAT_BLOCK, and a grid of `grid_time`."""
    reqs, toks = (1, 2, 4, 8, 16), (1, 2, 4, 8)
    rows = tuple(tuple(1.0 / grid_time(r, t, per_row_s) for t in toks) for r in reqs)
    grid = dict(grid_requests=reqs, grid_tokens=toks, grid_steps_per_second=rows)
    return CostTable(*STEEP_DECODE, *FLAT_BLOCK, **grid)


def test_a_grid_prices_a_forward_by_its_requests_and_their_tokens_each():
    t = grid_table(0.002)
    # on grid points: R requests x t tokens
    assert math.isclose(t.sps(16, requests=4), 1.0 / grid_time(4, 4, 0.002))
    assert math.isclose(t.sps(4, requests=4), 26.0)  # 4 x 1: the decode of 4
    # between token counts (4 x 3: SPS linear between 4 x 2 and 4 x 4), between request counts
    # (6 x 2: time linear between 4 x 2 and 8 x 2), past the last request count (32 x 2: the
    # time of 16 x 2, twice), past the last token count (2 x 16: time along the last segment)
    s42, s44 = t.sps(8, requests=4), t.sps(16, requests=4)
    assert math.isclose(t.sps(12, requests=4), (s42 + s44) / 2)
    assert math.isclose(1 / t.sps(12, requests=6), (1 / t.sps(8, 4) + 1 / t.sps(16, 8)) / 2)
    assert math.isclose(1 / t.sps(64, requests=32), 2 / t.sps(32, requests=16))
    s24, s28 = t.sps(8, requests=2), t.sps(16, requests=2)
    assert math.isclose(1 / t.sps(32, requests=2), 1 / s28 + (1 / s28 - 1 / s24) * 2)
    # without the request count: the decode-shaped table, as before
    assert t.sps(8) == CostTable(*STEEP_DECODE).sps(8)
    # a grid prices 16 requests' drafts dearer than one request's block of as many tokens
    assert grid_table(0.004).sps(64, requests=16) < CostTable(*STEEP_DECODE, *FLAT_BLOCK).sps(64, requests=16)
    again = CostTable.from_dict(t.to_dict())
    assert again == t and again.grid_steps_per_second == t.grid_steps_per_second


def test_a_grid_is_validated():
    reqs, toks = (1, 4), (1, 2)
    rows = ((30.0, 20.0), (10.0, 5.0))
    with pytest.raises(ValueError, match="come together"):
        CostTable(*STEEP_DECODE, grid_requests=reqs, grid_tokens=toks)
    with pytest.raises(ValueError, match="start at 1"):
        CostTable(*STEEP_DECODE, grid_requests=reqs, grid_tokens=(2, 4), grid_steps_per_second=rows)
    with pytest.raises(ValueError, match="grid rows"):
        CostTable(*STEEP_DECODE, grid_requests=reqs, grid_tokens=toks, grid_steps_per_second=rows[:1])
    with pytest.raises(ValueError, match="grid token"):
        bad = ((30.0, -1.0), rows[1])
        CostTable(*STEEP_DECODE, grid_requests=reqs, grid_tokens=toks, grid_steps_per_second=bad)
    with pytest.raises(ValueError, match="grid request"):
        CostTable(*STEEP_DECODE, grid_requests=(4, 1), grid_tokens=toks, grid_steps_per_second=rows)


def test_the_policy_verifies_fewer_drafts_where_the_grid_says_load_makes_them_dear():
    """At sixteen requests the block shape (one request's extra tokens) prices drafts almost
    free; a grid that measured every request's extra rows costing attention over its own context
    makes the policy verify fewer, and what it picks is the best prefix under the grid's price."""
    inp = PolicyInput([CONF] * 16, [7] * 16)
    dspark = parse_policy("dspark")
    shaped = dspark(inp, CostTable(*STEEP_DECODE, *FLAT_BLOCK), load(16))
    gridded = dspark(inp, grid_table(0.004), load(16))
    assert sum(gridded.lengths) < sum(shaped.lengths), (gridded.lengths, shaped.lengths)
    cheap = dspark(inp, grid_table(0.00001), load(16))
    assert sum(cheap.lengths) > sum(gridded.lengths)
