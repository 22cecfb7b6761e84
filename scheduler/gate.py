"""Should this step draft at all? The prefix scheduler prices verification with the target's
cost curve, but drafting itself costs time too, and on small machines (a CPU, a tiny target) a
weak drafter can cost more than it saves. The gate learns, per load level, the decode tokens per
second of steps that drafted and of steps that did not, and picks the better one, trying the
other now and then. It looks only at past steps, never at the drafts of this one, so it cannot
bias the output."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

Price = Callable[[float, int], float]
"""Seconds one target forward takes for `tokens` tokens from `requests` decoding requests (the
profiled cost table): what verification costs at a load."""


@dataclass
class _Rate:
    """Decode tokens per second of one mode's recent steps: exponentially decayed sums of tokens
    and of seconds, and their ratio. A ratio of sums, not an average of per-step rates: how many
    drafts a step keeps varies a lot (1 to 8 tokens), and an average of ratios would swing with
    every lucky or unlucky step."""

    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0
    step_seconds: float = 0.0  # moving average of one step's duration
    # decayed like tokens and seconds: steps, decoding requests, and rows verified (each
    # request's anchor plus its verified drafts), for the cost-curve prior (`DraftGate.predicted`)
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

    def update(self, tokens: float, seconds: float, alpha: float, requests: int, rows: int) -> None:
        keep = 1.0 - alpha if self.samples else 0.0
        self.age(keep)
        self.tokens += tokens
        self.seconds += seconds
        self.steps += 1.0
        self.requests += requests
        self.rows += rows
        self.step_seconds = keep * self.step_seconds + (1.0 - keep) * seconds
        self.samples += 1
        x = math.log(max(tokens, 0.5) / seconds)  # a step that kept nothing still counts
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


@dataclass
class DraftGate:
    """Per load level, the faster of drafting and plain steps, with exploration whose cost is
    bounded.

    Exploring (running the mode not in favour) keeps both estimates current, but a step of the
    slower mode costs throughput: when it yields `ratio` times fewer tokens per second, one such
    step every n steps loses about (ratio - 1) / n of the level's throughput. So the interval
    grows with the measured gap, to keep that loss under `regret` (1%: a 1.5x slower mode runs
    once every 50 steps).

    What an exploration really costs is measured too: every step of a burst and the first
    step back in the favoured mode (the switches both ways included), against what the
    favoured mode would have made in the same time. The interval is the larger of the two
    bounds, so a burst whose switch is dear (a drafter projecting the context that many plain
    steps kept, at high load) runs rarely enough that it too stays within `regret`.

    A mode runs in bursts of `burst` steps, and the first step after a switch is not measured:
    it pays for the switch, not for the mode. Drafting after plain steps first projects the
    context those steps kept (the DSpark drafter absorbs it lazily), and a request's first
    drafting step after plain ones may draft only a short block: measured, such a step makes
    drafting look slower than it is in steady state, and a gate that explores one step at a
    time can then stay closed for good.

    A level not yet measured starts from a neighbour's measurements. With the target's cost
    curve (`price`), it predicts drafting's gain here from the nearest measured level: the
    tokens a drafting step made per request there stay, what verifying its rows costs moves
    along the curve (`predicted`), so on a machine whose forward is compute-bound at this load
    a win at one request becomes a predicted loss at sixteen, and on one whose forward costs
    the same for 1 and 64 tokens it stays a win. Without a cost curve it borrows the
    neighbour's verdict: if drafting lost at a lower load (or won there by less than `carry`)
    it starts off here, and if it won at a higher load it starts on. Either way the level's
    own measurements (taken as exploration, at the interval the predicted gap sets) take over
    where they agree with that prior (from one measured burst: the gap they measure sets the
    interval) or clear it by `z` standard errors; a verdict that contradicts it by less keeps
    the prior in force and explores at the shortest interval until the level's own steps
    settle it (`favoured`). A level that only has a prior explores within `probe_every`
    steps whatever gap the prior claims.
    With nothing to go on, it alternates the two modes in bursts.
    """

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
    the level from measuring it (a predicted 1.15x drafting win at sixteen requests was a
    1.2x loss, and its 45-step interval left the level unmeasured through short runs)."""
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
    level starts plain (and explores) rather than alternating, since each step up in load makes
    a verified block dearer while acceptance stays what it was. On a 2-core CPU with AMX tiles a
    1.29x win predicted at sixteen requests from four was a 1.18x loss (the curve prices the
    extra rows as one request's, where attention and the drafter grow with every request), and
    the level, starting on, measured too few plain steps in a short run to overrule it."""
    climb: float = 0.05
    """Where drafting alone was measured (`predicted`), a win carried up d levels must clear
    1 + climb * d to start the busier level drafting: carried up, a prediction runs optimistic
    (fewer drafts verified at higher load, the drafter's catch-up), the more so the farther."""
    price: Price | None = None
    """The target's forward time per (tokens, requests) (the cost table), for `predicted`;
    None: an unmeasured level borrows a neighbour's verdict (`borrowed`)."""
    z: float = 1.0
    """Standard errors by which a level's own verdict must clear its prior to overrule it when
    the two disagree (`favoured`); 0: the own verdict always rules once measured."""
    _rates: dict[tuple[int, bool], _Rate] = field(default_factory=dict)
    _steps: dict[int, int] = field(default_factory=dict)
    _last: dict[int, bool] = field(default_factory=dict)  # mode of the last recorded step per level
    _since: dict[int, int] = field(default_factory=dict)  # steps since an exploration began
    # per level: seconds lost so far by the exploration under way, and a moving average of
    # what a whole exploration lost (the burst and both switches)
    _open_loss: dict[int, float] = field(default_factory=dict)
    _burst_loss: dict[int, float] = field(default_factory=dict)

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

    @staticmethod
    def level(num_decodes: int) -> int:
        """Load level: 1, 2-3, 4-7, 8-15, ... decoding requests."""
        return int(math.log2(max(num_decodes, 1)))

    def rate(self, num_decodes: int, drafting: bool) -> float:
        return self._rates.get((self.level(num_decodes), drafting), _Rate()).value

    def verdict(self, level: int, samples: int | None = None) -> tuple[bool, float] | None:
        """(drafting is faster, the rate ratio faster / slower) at a level with `samples`
        (default `warmup`) measured steps of each mode, else None."""
        on = self._rates.get((level, True), _Rate())
        off = self._rates.get((level, False), _Rate())
        need = self.warmup if samples is None else samples
        if on.samples < need or off.samples < need:
            return None
        best = on.value >= off.value * (1.0 - self.margin)
        lo = min(on.value, off.value)
        return best, (max(on.value, off.value) / lo if lo > 0 else math.inf)

    def borrowed(self, level: int) -> tuple[bool, float] | None:
        """A neighbour's verdict that carries over: drafting lost at a lower level (so it loses
        here too), or won there by less than `carry` (so it likely loses here: plain, with the
        gap taken as that margin), or won at a higher one (so it wins here too); the nearest
        such level."""
        measured = sorted({lvl for lvl, _ in self._rates}, key=lambda lvl: abs(lvl - level))
        for lvl in measured:
            v = self.verdict(lvl)
            if v is None:
                continue
            if (lvl < level and not v[0]) or (lvl > level and v[0]):
                return v
            if lvl < level and v[1] < self.carry:
                return False, v[1]
        return None

    def predicted(self, num_decodes: int) -> tuple[bool, float] | None:
        """Drafting's gain at `num_decodes` requests, carried along the cost curve from the
        nearest measured level, as (drafting is faster, the rate ratio faster / slower); None
        without a cost curve or a measured level.

        There, a drafting step made `a` tokens per request verifying `rows` rows per request
        and took a / gain times a plain step; the curve accounts for price(B rows, B) /
        price(B, B) of that, and the rest (the drafter, bookkeeping) is taken to grow with the
        batch as a plain step does. Here, with B' requests: gain' = a / (price(B' rows, B') /
        price(B', B') + rest). Carried up to a busier level the prediction runs optimistic
        (the policy verifies fewer drafts there, so fewer tokens; the drafter's own cost grows
        faster than a memory-bound plain step's), so, as with `carry` for a borrowed verdict, a
        predicted win there by less than `carry` starts the level plain, its gap unknown (ratio
        1: exploration at the shortest interval). On a 2-core CPU a 1.15x win predicted at
        sixteen requests from four was a 1.2x loss. Exploration corrects either way. Where no
        level has both modes measured, a level where drafting was measured speaks, plain's
        rate there taken from the curve (below)."""
        if self.price is None:
            return None
        level = self.level(num_decodes)
        measured = sorted({lvl for lvl, _ in self._rates if lvl != level}, key=lambda lvl: abs(lvl - level))
        for lvl in measured:
            if self.verdict(lvl) is None:
                continue
            on, off = self._rates[(lvl, True)], self._rates[(lvl, False)]
            if min(on.requests, on.steps, on.value, off.value) <= 0:
                continue
            g = self._carried(on, off.value, num_decodes)
            if lvl < level and 1.0 - self.margin <= g < self.carry:
                return False, 1.0
            return g >= 1.0 - self.margin, max(g, 1.0 / g)
        # No level has both modes measured: one request drafts at every step where the drafter
        # decides per request, so a server that has only seen light traffic knows drafting's
        # rate alone. Plain's is then the curve's forward time, which leaves out a plain step's
        # sampling and bookkeeping: plain looks faster than it is and the drafter's share
        # (`rest`) dearer, an error towards plain that `carry` would compound; a win carried up
        # must instead clear `climb` per level. Measured at one request on a 2-core CPU with AMX
        # tiles: 1.16-1.2x predicted at 2-8 requests (1.3-1.5x real), 1.04-1.14x at 16 (~1.0x),
        # 0.96-1.04x at 32 (~0.87x), where alternating blindly made a first wave of 32 requests
        # draft half its steps at a 10-15% loss.
        for lvl in measured:
            drafted = self._rates.get((lvl, True))
            if (
                drafted is None
                or drafted.samples < self.warmup
                or min(drafted.requests, drafted.steps, drafted.value) <= 0
            ):
                continue
            n = drafted.requests / drafted.steps
            g = self._carried(drafted, n / self.price(n, max(1, round(n))), num_decodes)
            if lvl < level and 1.0 - self.margin <= g < 1.0 + self.climb * (level - lvl):
                return False, 1.0
            return g >= 1.0 - self.margin, max(g, 1.0 / g)
        return None

    def _carried(self, on: _Rate, plain: float, num_decodes: int) -> float:
        """Drafting's gain at `num_decodes` requests from its rate `on` at another level where
        plain decoding runs at `plain` tokens per second (`predicted`)."""
        a, rows = on.tokens / on.requests, max(1.0, on.rows / on.requests)
        rest = max(0.0, a / (on.value / plain) - self._verify_cost(on.requests / on.steps, rows))
        return a / (self._verify_cost(num_decodes, rows) + rest)

    def _verify_cost(self, requests: float, rows: float) -> float:
        """A drafting step's target forward over a plain one's, `rows` rows per request."""
        assert self.price is not None
        n = max(1, round(requests))
        return self.price(n * rows, n) / self.price(n, n)

    def prior(self, num_decodes: int) -> tuple[bool, float] | None:
        """What an unmeasured level starts from: the cost-curve prediction, else a borrowed
        verdict."""
        if self.price is not None:
            return self.predicted(num_decodes)
        return self.borrowed(self.level(num_decodes))

    def favoured(self, num_decodes: int) -> tuple[bool, float] | None:
        """The mode a level runs, as (drafting, the rate ratio faster / slower): its own verdict
        where it agrees with the prior (the cost-curve prediction or a neighbour's verdict) or
        clears it by `z` standard errors, else the prior; the prior alone while the level is
        unmeasured. A verdict rests on the few steps a mode was explored in, against a host
        whose speed drifts by tens of percent: in a logged run on a 2-core CPU, one burst of
        plain steps at four requests, in a slow spell, made drafting look 1.3-1.8x faster
        there, and sixteen requests drafted through three runs at a ~1.2x loss."""
        lvl = self.level(num_decodes)
        own, prior = self._early(lvl), self.prior(num_decodes)
        if own is None:
            return prior
        if prior is None:  # nothing to agree with: it takes `warmup` steps of each mode
            return own if self.verdict(lvl) is not None else None
        # one measured burst that agrees with the prior is enough to size the gap (and so the
        # exploration interval) by; few steps make a wide error, so the test needs no warm-up
        return own if own[0] == prior[0] or self._clears(lvl) else prior

    def _early(self, level: int) -> tuple[bool, float] | None:
        """The level's verdict from as few as two measured steps of each mode."""
        return self.verdict(level, min(2, self.warmup))

    def contested(self, num_decodes: int) -> bool:
        """The level's own measurements disagree with what it runs (its prior, which they have
        not cleared): exploration then runs at the shortest interval, to settle which is
        right."""
        own = self._early(self.level(num_decodes))
        return own is not None and self.favoured(num_decodes) != own

    def _clears(self, level: int) -> bool:
        """The measured gap between the modes (log of the rates' ratio) exceeds `z` standard
        errors of the two means of per-step log rates."""
        on, off = self._rates[(level, True)], self._rates[(level, False)]
        if on.value <= 0 or off.value <= 0:
            return True
        se = math.sqrt(on.spread() + off.spread())
        return abs(math.log(on.value / off.value)) > self.z * se

    def interval(self, ratio: float, level: int | None = None, favoured: bool | None = None) -> int:
        """Steps between the starts of two explorations (a burst each) when the mode not in
        favour is `ratio` times slower; at a `level` whose explorations were measured, also
        long enough that their measured loss (switches included) stays within `regret`.
        favoured: the mode the level runs (None: its own verdict's)."""
        if not math.isfinite(ratio):
            return self.max_explore_every
        n = math.ceil(self.burst * (ratio - 1.0) / self.regret)
        v = self._early(level) if level is not None and level in self._burst_loss else None
        if level is not None and v is not None:
            mode = v[0] if favoured is None else favoured
            step = self._rates[(level, mode)].step_seconds  # a step of the favoured mode
            if step > 0:
                n = max(n, math.ceil(self._burst_loss[level] / (self.regret * step)))
        return min(self.max_explore_every, max(self.explore_every, n))

    def catch_up_interval(self, level: int, seconds: float) -> int:
        """Steps at `level` between explorations of drafting that keep a catch-up of `seconds`
        within `regret` of the plain steps' time (at most `max_explore_every`; 0 while no plain
        step is measured there)."""
        plain = self._rates.get((level, False))
        if plain is None or plain.step_seconds <= 0:
            return 0
        return min(self.max_explore_every, math.ceil(seconds / (self.regret * plain.step_seconds)))

    def should_draft(self, num_decodes: int, explore: bool = True, catch_up: float | None = None) -> bool:
        """Draft this step? catch_up: seconds the drafter would first spend absorbing the
        context kept since these requests last drafted (None: unknown). Where plain steps are
        favoured, an exploration of drafting pays it on top of its burst: it waits until it has
        as many steps behind it as keep that within `regret` (`catch_up_interval`), whatever
        the prior or a contest asks. At sixteen requests on a 2-core CPU, a first exploration
        absorbed every prompt, ~4,000 positions, in a step 3-5x a plain one's length: two such
        cost a 64-token run 5-10% of its throughput.
        explore=False (a step that also carries a prefill chunk: it is not
        measured, and drafting in it first projects the context the plain steps kept) follows
        the level's favoured mode (its verdict or prior), runs plain while nothing is known of
        the level, and neither starts nor counts toward an exploration. Plain, because such a
        step's drafting teaches nothing and costs most where it is least likely to pay: a
        fresh server hit by 32 requests at once spent ~3.5 s of a 21 s run drafting in its
        prefill steps, the drafter absorbing every prompt's context, at a load where drafting
        loses."""
        lvl = self.level(num_decodes)
        if not explore:
            v = self.favoured(num_decodes)
            return v[0] if v is not None else False
        n = self._steps.get(lvl, 0)
        self._steps[lvl] = n + 1
        v = self.favoured(num_decodes)
        if v is None:  # alternate, in bursts, until both modes are measured here
            return (n // self.burst) % 2 == 0
        best, ratio = v
        if self.contested(num_decodes):
            every = self.explore_every
        elif self._early(lvl) is None:  # a prior alone: measure the level soon all the same
            every = min(self.interval(ratio, lvl, best), self.probe_every)
        else:
            every = self.interval(ratio, lvl, best)
        if not best and catch_up:
            every = max(every, self.catch_up_interval(lvl, catch_up))
        # steps since the last exploration burst began; a burst is never cut short, even when
        # the interval (which follows the measured gap) shrinks or grows meanwhile
        k = self._since.get(lvl, self.burst)
        if k >= every:
            k = 0
        self._since[lvl] = k + 1
        return (not best) if k < self.burst else best

    def record(
        self, num_decodes: int, drafting: bool, decode_tokens: int, seconds: float, rows: int | None = None
    ) -> None:
        """One pure decode step: its requests, mode, tokens made and duration; rows: tokens the
        target verified for them (anchors + drafts; None: one per request)."""
        if num_decodes <= 0 or seconds <= 0:
            return
        lvl = self.level(num_decodes)
        switched = self._last.get(lvl, drafting) != drafting
        self._last[lvl] = drafting
        self._account(num_decodes, drafting, switched, decode_tokens, seconds)
        if switched:  # the switch's own cost, not the mode's
            return
        # Both modes' memories age with the level's steps, not only with their own: the mode not
        # in favour is measured a few steps per interval, and what it measured long ago (another
        # request, another text) must give way to its latest bursts.
        other = self._rates.get((lvl, not drafting))
        if other is not None:
            other.age(1.0 - self.alpha)
        rate = self._rates.setdefault((lvl, drafting), _Rate())
        rate.update(decode_tokens, seconds, self.alpha, num_decodes, num_decodes if rows is None else rows)

    def _account(self, num_decodes: int, drafting: bool, switched: bool, tokens: int, seconds: float) -> None:
        """Book what exploring costs at a level with its own verdict: a step of the mode not
        in favour, or a switch either way, loses the time the favoured mode would not have
        needed for the same tokens. The first plain step of the favoured mode closes the
        exploration's account."""
        lvl = self.level(num_decodes)
        v = self.favoured(num_decodes) if self._early(lvl) is not None else None
        if v is None:
            return
        best = self._rates[(lvl, v[0])].value
        if drafting != v[0] or switched:
            lost = seconds - (tokens / best if best > 0 else 0.0)
            self._open_loss[lvl] = self._open_loss.get(lvl, 0.0) + lost
        elif lvl in self._open_loss:
            loss = max(0.0, self._open_loss.pop(lvl))
            old = self._burst_loss.get(lvl)
            self._burst_loss[lvl] = loss if old is None else 0.5 * old + 0.5 * loss
