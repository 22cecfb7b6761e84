"""Should this step draft at all? The prefix scheduler prices verification with the target's
cost curve, but drafting itself costs time too, and on small machines (a CPU, a tiny target) a
weak drafter can cost more than it saves. The gate learns, per load level, the decode tokens per
second of steps that drafted and of steps that did not, and picks the better one, trying the
other now and then. It looks only at past steps, never at the drafts of this one, so it cannot
bias the output.

Three parts: `LevelEstimate` keeps what was measured and the verdict drawn from it (or, for a
level not yet measured, the prior it starts from); `ExplorationLoss` books what exploring the
mode not in favour cost; `DraftGate` decides each step from both."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

Price = Callable[[float, int], float]
"""Seconds one target forward takes for `tokens` tokens from `requests` decoding requests (the
profiled cost table): what verification costs at a load."""


def load_level(num_decodes: int) -> int:
    """Load level: 1, 2-3, 4-7, 8-15, ... decoding requests."""
    return int(math.log2(max(num_decodes, 1)))


class Verdict(NamedTuple):
    """Which mode is faster at a level, and by how much."""

    drafting: bool
    """Drafting is the faster mode (or within `GateConfig.margin` of plain)."""
    ratio: float
    """The faster mode's rate over the slower's (>= 1; inf when the slower made nothing)."""


@dataclass(frozen=True)
class GateConfig:
    """The draft gate's knobs."""

    warmup: int = 6
    """Steps of each mode measured at a level before its own verdict is used."""
    burst: int = 3
    """Consecutive steps a mode runs when explored (or alternated); the first is not measured."""
    explore_every: int = 16
    """Shortest interval (in steps at a level) between two steps of the mode not in favour."""
    max_explore_every: int = 512
    """Longest interval between exploration steps, however large the measured gap."""
    probe_every: int = 64
    """Longest interval before a level runs its first burst of each mode when only a prior
    (prediction or neighbour) speaks for it: a prior that overstates the gap must not keep
    the level from measuring it."""
    regret: float = 0.01
    """Share of a level's throughput exploration may cost; sets the interval from the gap."""
    alpha: float = 0.03
    """Decay of both modes' sums per measured step at the level (~1/alpha steps remembered)."""
    margin: float = 0.02
    """Drafting stays on unless plain steps measure this much faster: near break-even the
    verdict would otherwise flip on noise, and each flip strands the other mode's estimate
    until the next exploration."""
    carry: float = 1.5
    """A win of drafting at a lower load by less than this ratio is not carried up: the busier
    level starts plain (and explores) rather than alternating. Each step up in load makes a
    verified block dearer while acceptance stays what it was, and the cost curve prices the
    extra rows as one request's where attention and the drafter grow with every request, so a
    small win carried up tends to be a loss (bench/step_costs.py measures drafting against
    plain steps by load)."""
    climb: float = 0.05
    """Where drafting alone was measured (`LevelEstimate.predicted`), a win carried up d levels
    must clear 1 + climb * d to start the busier level drafting: carried up, a prediction runs
    optimistic (fewer drafts verified at higher load, the drafter's catch-up), the more so the
    farther."""
    price: Price | None = None
    """The target's forward time per (tokens, requests) (the cost table), for `predicted`;
    None: an unmeasured level borrows a neighbour's verdict (`borrowed`)."""
    z: float = 1.0
    """Standard errors by which a level's own verdict must clear its prior to overrule it when
    the two disagree (`favoured`); 0: the own verdict always rules once measured."""

    def __post_init__(self) -> None:
        if self.warmup < 1:
            raise ValueError(f"warmup must be >= 1, got {self.warmup!r}")
        if not (1 <= self.explore_every <= self.max_explore_every):
            raise ValueError(
                f"need 1 <= explore_every <= max_explore_every, got {self.explore_every!r} "
                f"and {self.max_explore_every!r}"
            )
        if not (self.explore_every <= self.probe_every <= self.max_explore_every):
            raise ValueError(
                f"need explore_every <= probe_every <= max_explore_every, got {self.probe_every!r}"
            )
        if not (2 <= self.burst <= self.explore_every):
            raise ValueError(f"burst must be in [2, explore_every], got {self.burst!r}")
        self._check_shares()

    def _check_shares(self) -> None:
        if not (0.0 < self.regret < 1.0):
            raise ValueError(f"regret must be in (0, 1), got {self.regret!r}")
        if not (0.0 < self.alpha <= 1.0):
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha!r}")
        if not (0.0 <= self.margin < 1.0):
            raise ValueError(f"margin must be in [0, 1), got {self.margin!r}")
        if self.carry < 1.0:
            raise ValueError(f"carry must be >= 1, got {self.carry!r}")
        if not (0.0 <= self.climb < 1.0):
            raise ValueError(f"climb must be in [0, 1), got {self.climb!r}")
        if not (0.0 <= self.z < math.inf):
            raise ValueError(f"z must be a finite number >= 0, got {self.z!r}")


@dataclass
class ModeRate:
    """Decode tokens per second of one mode's recent steps: exponentially decayed sums of tokens
    and of seconds, and their ratio. A ratio of sums, not an average of per-step rates: how many
    drafts a step keeps varies a lot from step to step, and an average of ratios would swing
    with every lucky or unlucky step."""

    tokens: float = 0.0
    seconds: float = 0.0  # times the plain pace at each step's request count (`update`)
    samples: int = 0
    step_seconds: float = 0.0  # moving average of one step's duration (plain seconds)
    # decayed like tokens and seconds: steps, decoding requests, and rows verified (each
    # request's anchor plus its verified drafts), for the cost-curve prior (`predicted`)
    steps: float = 0.0
    requests: float = 0.0
    rows: float = 0.0
    # decayed like the sums, per step: squared weights (`steps` is the weights' sum) and the
    # log rate's first two moments, for how far the ratio of sums can be trusted (`spread`)
    w2: float = 0.0
    lx: float = 0.0
    lxx: float = 0.0

    @property
    def value(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def update(
        self, tokens: float, seconds: float, alpha: float, requests: int, rows: int, pace: float = 1.0
    ) -> None:
        """One step: `tokens` made in `seconds` by `requests` requests verifying `rows` rows.
        pace: the tokens per second a plain step makes at this step's request count (the cost
        curve's; 1: none known): seconds are booked times it, so `value` is tokens over what
        plain decoding would have made meanwhile, and steps at different request counts within
        one level compare fairly (a level spans a factor of two in requests, and a mode measured
        mostly where more requests ran would otherwise look faster for that alone)."""
        keep = 1.0 - alpha if self.samples else 0.0
        self.age(keep)
        self.tokens += tokens
        self.seconds += seconds * pace
        self.steps += 1.0
        self.requests += requests
        self.rows += rows
        self.step_seconds = keep * self.step_seconds + (1.0 - keep) * seconds
        self.samples += 1
        x = math.log(max(tokens, 0.5) / (seconds * pace))  # a step that kept nothing still counts
        self.w2 += 1.0
        self.lx += x
        self.lxx += x * x

    def age(self, keep: float) -> None:
        self.tokens *= keep
        self.seconds *= keep
        self.steps *= keep
        self.requests *= keep
        self.rows *= keep
        self.w2 *= keep * keep
        self.lx *= keep
        self.lxx *= keep

    def spread(self) -> float:
        """Squared standard error of the mean per-step log rate (decayed weights): how far this
        mode's rate may be off by the luck of the steps it remembers; inf with one step."""
        w = self.steps
        n = w * w / self.w2 if self.w2 > 0 else 0.0  # effective number of steps
        if n <= 1.0 + 1e-9:
            return math.inf
        mean = self.lx / w
        var = max(0.0, self.lxx / w - mean * mean) * n / (n - 1.0)
        return var / n


class LevelEstimate:
    """Per load level, each mode's measured rate (`ModeRate`) and the verdict drawn from them.

    A level not yet measured starts from a prior (`prior`). With the target's cost curve
    (`GateConfig.price`), drafting's gain here is predicted from the nearest measured level:
    the tokens a drafting step made per request there stay, what verifying its rows costs moves
    along the curve (`predicted`), so a win at light load can become a predicted loss where the
    forward is compute-bound, and stays a win where more rows cost the same. Without a cost
    curve it borrows a neighbour's verdict (`borrowed`). The level's own measurements take over
    where they agree with that prior or clear it by `z` standard errors (`favoured`); a verdict
    that contradicts it by less keeps the prior in force while exploration settles it.
    """

    def __init__(self, config: GateConfig) -> None:
        self.config = config
        self.rates: dict[tuple[int, bool], ModeRate] = {}

    def rate(self, level: int, drafting: bool) -> ModeRate:
        return self.rates.get((level, drafting), ModeRate())

    def learn(
        self, level: int, drafting: bool, tokens: int, seconds: float, requests: int, rows: int
    ) -> None:
        """One measured step of a mode. Both modes' memories age with the level's steps, not
        only with their own: the mode not in favour is measured a few steps per interval, and
        what it measured long ago (another request, another text) must give way to its latest
        bursts."""
        other = self.rates.get((level, not drafting))
        if other is not None:
            other.age(1.0 - self.config.alpha)
        rate = self.rates.setdefault((level, drafting), ModeRate())
        rate.update(tokens, seconds, self.config.alpha, requests, rows, self.pace(requests))

    def pace(self, requests: int) -> float:
        """Plain decoding's tokens per second at `requests` requests on the cost curve (1.0
        without one): the unit a mode's rate is measured in (`ModeRate.update`)."""
        price = self.config.price
        return requests / price(requests, requests) if price is not None and requests > 0 else 1.0

    def verdict(self, level: int, samples: int | None = None) -> Verdict | None:
        """The verdict at a level with `samples` (default `warmup`) measured steps of each
        mode, else None."""
        on, off = self.rate(level, True), self.rate(level, False)
        need = self.config.warmup if samples is None else samples
        if on.samples < need or off.samples < need:
            return None
        best = on.value >= off.value * (1.0 - self.config.margin)
        lo = min(on.value, off.value)
        return Verdict(best, max(on.value, off.value) / lo if lo > 0 else math.inf)

    def early(self, level: int) -> Verdict | None:
        """The level's verdict from as few as two measured steps of each mode."""
        return self.verdict(level, min(2, self.config.warmup))

    def borrowed(self, level: int) -> Verdict | None:
        """A neighbour's verdict that carries over: drafting lost at a lower level (so it loses
        here too), or won there by less than `carry` (so it likely loses here: plain, with the
        gap taken as that margin), or won at a higher one (so it wins here too); the nearest
        such level."""
        measured = sorted({lvl for lvl, _ in self.rates}, key=lambda lvl: abs(lvl - level))
        for lvl in measured:
            v = self.verdict(lvl)
            if v is None:
                continue
            if (lvl < level and not v.drafting) or (lvl > level and v.drafting):
                return v
            if lvl < level and v.ratio < self.config.carry:
                return Verdict(False, v.ratio)
        return None

    def predicted(self, num_decodes: int) -> Verdict | None:
        """Drafting's gain at `num_decodes` requests, carried along the cost curve from the
        nearest measured level; None without a cost curve or a measured level.

        There, a drafting step made `a` tokens per request verifying `rows` rows per request
        and took a / gain times a plain step; the curve accounts for price(B rows, B) /
        price(B, B) of that, and the rest (the drafter, bookkeeping) is taken to grow with the
        batch as a plain step does. Here, with B' requests: gain' = a / (price(B' rows, B') /
        price(B', B') + rest). Carried up to a busier level the prediction runs optimistic
        (the policy verifies fewer drafts there, so fewer tokens; the drafter's own cost grows
        faster than a memory-bound plain step's), so, as with `carry` for a borrowed verdict, a
        predicted win there by less than `carry` starts the level plain, its gap unknown (ratio
        1: exploration at the shortest interval). Exploration corrects either way. Where no
        level has both modes measured, a level where drafting was measured speaks
        (`_from_drafting_alone`)."""
        if self.config.price is None:
            return None
        level = load_level(num_decodes)
        measured = sorted({lvl for lvl, _ in self.rates if lvl != level}, key=lambda lvl: abs(lvl - level))
        both = self._from_both_modes(level, num_decodes, measured)
        return both if both is not None else self._from_drafting_alone(level, num_decodes, measured)

    def _from_both_modes(self, level: int, num_decodes: int, measured: list[int]) -> Verdict | None:
        """The prediction from the nearest level where both modes were measured."""
        for lvl in measured:
            if self.verdict(lvl) is None:
                continue
            on, off = self.rates[(lvl, True)], self.rates[(lvl, False)]
            if min(on.requests, on.steps, on.value, off.value) <= 0:
                continue
            gain = self._carried(on, off.value, num_decodes)
            return self._from_gain(gain, lvl < level, self.config.carry)
        return None

    def _from_drafting_alone(self, level: int, num_decodes: int, measured: list[int]) -> Verdict | None:
        """The prediction from the nearest level where drafting alone was measured. Where the
        drafter decides per request, one request drafts at every step, so a server that has
        only seen light traffic knows drafting's rate alone. Plain's is then the curve's forward
        time, which leaves out a plain step's sampling and bookkeeping: plain looks faster than
        it is and the drafter's share dearer, an error towards plain that `carry` would
        compound; a win carried up must instead clear `climb` per level."""
        assert self.config.price is not None
        for lvl in measured:
            drafted = self.rates.get((lvl, True))
            if (
                drafted is None
                or drafted.samples < self.config.warmup
                or min(drafted.requests, drafted.steps, drafted.value) <= 0
            ):
                continue
            # plain's rate there, in the unit rates are measured in (plain's pace on the curve)
            n = drafted.requests / drafted.steps
            plain = n / self.config.price(n, max(1, round(n))) / self.pace(max(1, round(n)))
            gain = self._carried(drafted, plain, num_decodes)
            return self._from_gain(gain, lvl < level, 1.0 + self.config.climb * (level - lvl))
        return None

    def _from_gain(self, gain: float, carried_up: bool, bar: float) -> Verdict:
        """The verdict a predicted gain gives: a win carried up from a lower level by less than
        `bar` starts plain, its gap unknown (ratio 1)."""
        margin = self.config.margin
        if carried_up and 1.0 - margin <= gain < bar:
            return Verdict(False, 1.0)
        return Verdict(gain >= 1.0 - margin, max(gain, 1.0 / gain))

    def _carried(self, on: ModeRate, plain: float, num_decodes: int) -> float:
        """Drafting's gain at `num_decodes` requests from its rate `on` at another level where
        plain decoding runs at `plain` tokens per second (`predicted`)."""
        a, rows = on.tokens / on.requests, max(1.0, on.rows / on.requests)
        rest = max(0.0, a / (on.value / plain) - self._verify_cost(on.requests / on.steps, rows))
        return a / (self._verify_cost(num_decodes, rows) + rest)

    def _verify_cost(self, requests: float, rows: float) -> float:
        """A drafting step's target forward over a plain one's, `rows` rows per request."""
        price = self.config.price
        assert price is not None
        n = max(1, round(requests))
        return price(n * rows, n) / price(n, n)

    def prior(self, num_decodes: int) -> Verdict | None:
        """What an unmeasured level starts from: the cost-curve prediction, else a borrowed
        verdict."""
        if self.config.price is not None:
            return self.predicted(num_decodes)
        return self.borrowed(load_level(num_decodes))

    def favoured(self, num_decodes: int) -> Verdict | None:
        """The mode a level runs: its own verdict where it agrees with the prior (the cost-curve
        prediction or a neighbour's verdict) or clears it by `z` standard errors, else the
        prior; the prior alone while the level is unmeasured. A verdict rests on the few steps
        a mode was explored in, on a host whose speed drifts: one burst in a slow spell can
        make a mode look much faster than it is, so a verdict against the prior must clear
        that noise."""
        lvl = load_level(num_decodes)
        own, prior = self.early(lvl), self.prior(num_decodes)
        if own is None:
            return prior
        if prior is None:  # nothing to agree with: it takes `warmup` steps of each mode
            return own if self.verdict(lvl) is not None else None
        # one measured burst that agrees with the prior is enough to size the gap (and so the
        # exploration interval) by; few steps make a wide error, so the test needs no warm-up
        return own if own.drafting == prior.drafting or self.clears(lvl) else prior

    def contested(self, num_decodes: int) -> bool:
        """The level's own measurements disagree with what it runs (its prior, which they have
        not cleared): exploration then runs at the shortest interval, to settle which is
        right."""
        own = self.early(load_level(num_decodes))
        return own is not None and self.favoured(num_decodes) != own

    def clears(self, level: int) -> bool:
        """The measured gap between the modes (log of the rates' ratio) exceeds `z` standard
        errors of the two means of per-step log rates."""
        on, off = self.rates[(level, True)], self.rates[(level, False)]
        if on.value <= 0 or off.value <= 0:
            return True
        se = math.sqrt(on.spread() + off.spread())
        return abs(math.log(on.value / off.value)) > self.config.z * se


@dataclass
class ExplorationLoss:
    """Per level, what exploring cost: the seconds lost so far by the exploration under way,
    and a moving average of what a whole exploration lost (its burst and both switches)."""

    open: dict[int, float] = field(default_factory=dict)
    per_burst: dict[int, float] = field(default_factory=dict)

    def add(self, level: int, seconds: float) -> None:
        self.open[level] = self.open.get(level, 0.0) + seconds

    def close(self, level: int) -> None:
        """The exploration under way at `level`, if any, is over: average in what it lost."""
        if level not in self.open:
            return
        loss = max(0.0, self.open.pop(level))
        old = self.per_burst.get(level)
        self.per_burst[level] = loss if old is None else 0.5 * old + 0.5 * loss


class DraftGate:
    """Per load level, the faster of drafting and plain steps (`LevelEstimate.favoured`), with
    exploration whose cost is bounded.

    Exploring (running the mode not in favour) keeps both estimates current, but a step of the
    slower mode costs throughput: when it yields `ratio` times fewer tokens per second, one
    such step every n steps loses about (ratio - 1) / n of the level's throughput. So the
    interval grows with the measured gap, to keep that loss under `regret` (`interval`). What
    an exploration really costs is measured too (`ExplorationLoss`: the burst, and the
    switches both ways), and the interval also keeps that within `regret`, so a burst whose
    switch is dear runs rarely enough.

    A mode runs in bursts of `burst` steps, and the first step after a switch is not measured:
    it pays for the switch, not for the mode. Drafting after plain steps first projects the
    context those steps kept, and a request's first drafting step after plain ones may draft
    only a short block: measured, such a step makes drafting look slower than it is, and a
    gate that explores one step at a time can then stay closed for good. With nothing known
    of a level, it alternates the two modes in bursts.
    """

    def __init__(self, config: GateConfig | None = None) -> None:
        self.config = config if config is not None else GateConfig()
        self.estimate = LevelEstimate(self.config)
        self.loss = ExplorationLoss()
        self._steps: dict[int, int] = {}  # steps decided per level
        self._last: dict[int, bool] = {}  # mode of the last recorded step per level
        self._since: dict[int, int] = {}  # steps since an exploration began

    def rate(self, num_decodes: int, drafting: bool) -> float:
        """A mode's measured decode tokens per second at this load's level, at `num_decodes`
        requests."""
        return self.estimate.rate(load_level(num_decodes), drafting).value * self.estimate.pace(num_decodes)

    def favoured(self, num_decodes: int) -> Verdict | None:
        """The mode this load's level runs (`LevelEstimate.favoured`)."""
        return self.estimate.favoured(num_decodes)

    def interval(self, ratio: float, level: int | None = None, favoured: bool | None = None) -> int:
        """Steps between the starts of two explorations (a burst each) when the mode not in
        favour is `ratio` times slower; at a `level` whose explorations were measured, also
        long enough that their measured loss (switches included) stays within `regret`.
        favoured: the mode the level runs (None: its own verdict's)."""
        cfg = self.config
        if not math.isfinite(ratio):
            return cfg.max_explore_every
        n = math.ceil(cfg.burst * (ratio - 1.0) / cfg.regret)
        v = self.estimate.early(level) if level is not None and level in self.loss.per_burst else None
        if level is not None and v is not None:
            mode = v.drafting if favoured is None else favoured
            step = self.estimate.rates[(level, mode)].step_seconds  # a step of the favoured mode
            if step > 0:
                n = max(n, math.ceil(self.loss.per_burst[level] / (cfg.regret * step)))
        return min(cfg.max_explore_every, max(cfg.explore_every, n))

    def catch_up_interval(self, level: int, seconds: float) -> int:
        """Steps at `level` between explorations of drafting that keep a catch-up of `seconds`
        within `regret` of the plain steps' time (at most `max_explore_every`; 0 while no plain
        step is measured there)."""
        plain = self.estimate.rates.get((level, False))
        if plain is None or plain.step_seconds <= 0:
            return 0
        cfg = self.config
        return min(cfg.max_explore_every, math.ceil(seconds / (cfg.regret * plain.step_seconds)))

    def should_draft(self, num_decodes: int, explore: bool = True, catch_up: float | None = None) -> bool:
        """Draft this step? catch_up: seconds the drafter would first spend absorbing the
        context kept since these requests last drafted (None: unknown). Where plain steps are
        favoured, an exploration of drafting pays it on top of its burst: it waits until it has
        as many steps behind it as keep that within `regret` (`catch_up_interval`), whatever
        the prior or a contest asks.
        explore=False (a step that also carries a prefill chunk: it is not measured, and
        drafting in it first projects the context the plain steps kept) follows the level's
        favoured mode (its verdict or prior), runs plain while nothing is known of the level,
        and neither starts nor counts toward an exploration. Plain, because such a step's
        drafting teaches nothing and costs most where it is least likely to pay: the drafter
        absorbs every new prompt's context, often at a load where drafting loses."""
        lvl = load_level(num_decodes)
        if not explore:
            v = self.favoured(num_decodes)
            return v.drafting if v is not None else False
        n = self._steps.get(lvl, 0)
        self._steps[lvl] = n + 1
        v = self.favoured(num_decodes)
        if v is None:  # alternate, in bursts, until both modes are measured here
            return (n // self.config.burst) % 2 == 0
        every = self._explore_every(num_decodes, v, catch_up)
        # steps since the last exploration burst began; a burst is never cut short, even when
        # the interval (which follows the measured gap) shrinks or grows meanwhile
        k = self._since.get(lvl, self.config.burst)
        if k >= every:
            k = 0
        self._since[lvl] = k + 1
        return (not v.drafting) if k < self.config.burst else v.drafting

    def _explore_every(self, num_decodes: int, favoured: Verdict, catch_up: float | None) -> int:
        """The exploration interval at this load's level, running `favoured`: the shortest while
        the level's measurements contest its prior, within `probe_every` while only a prior
        speaks for it, else what the gap and the measured loss allow (`interval`); for
        drafting where plain steps run, long enough to pay the drafter's catch-up."""
        lvl = load_level(num_decodes)
        best, ratio = favoured
        if self.estimate.contested(num_decodes):
            every = self.config.explore_every
        elif self.estimate.early(lvl) is None:  # a prior alone: measure the level soon all the same
            every = min(self.interval(ratio, lvl, best), self.config.probe_every)
        else:
            every = self.interval(ratio, lvl, best)
        if not best and catch_up:
            every = max(every, self.catch_up_interval(lvl, catch_up))
        return every

    def record(
        self, num_decodes: int, drafting: bool, decode_tokens: int, seconds: float, rows: int | None = None
    ) -> None:
        """One pure decode step: its requests, mode, tokens made and duration; rows: tokens the
        target verified for them (anchors + drafts; None: one per request)."""
        if num_decodes <= 0 or seconds <= 0:
            return
        lvl = load_level(num_decodes)
        switched = self._last.get(lvl, drafting) != drafting
        self._last[lvl] = drafting
        self._account(num_decodes, drafting, switched, decode_tokens, seconds)
        if switched:  # the switch's own cost, not the mode's
            return
        used = num_decodes if rows is None else rows
        self.estimate.learn(lvl, drafting, decode_tokens, seconds, num_decodes, used)

    def _account(self, num_decodes: int, drafting: bool, switched: bool, tokens: int, seconds: float) -> None:
        """Book what exploring costs at a level with its own verdict: a step of the mode not
        in favour, or a switch either way, loses the time the favoured mode would not have
        needed for the same tokens. The first plain step of the favoured mode closes the
        exploration's account."""
        lvl = load_level(num_decodes)
        v = self.favoured(num_decodes) if self.estimate.early(lvl) is not None else None
        if v is None:
            return
        # the favoured mode's rate in tokens per second at this step's request count
        best = self.estimate.rates[(lvl, v.drafting)].value * self.estimate.pace(num_decodes)
        if drafting != v.drafting or switched:
            self.loss.add(lvl, seconds - (tokens / best if best > 0 else 0.0))
        else:
            self.loss.close(lvl)
