"""Verification-length policies: how many drafted tokens each request sends to the target.

Every policy is a pure function of (PolicyInput, CostTable, LoadState) -> PolicyDecision,
picked by name (`parse_policy("static:3")`). `dspark` is the hardware-aware prefix
scheduler (Algorithm 1 of the DSpark paper): it trades expected accepted tokens against the
target's step rate at the resulting batch size, and stops at the first admission that does
not improve throughput, which keeps verification lossless.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch-free at run time: the configuration (and server/) reads the registry
    import torch

    Confidences = torch.Tensor | Sequence[float] | None

from dspark_serve.scheduler.load import LoadState  # the one load type (scheduler/load.py)


def _check_points(bs: tuple[int, ...], sps: tuple[float, ...], what: str) -> None:
    if not bs:
        raise ValueError(f"a cost table needs at least one point, got {what} batch sizes ()")
    if len(bs) != len(sps):
        raise ValueError(f"{what} batch sizes {bs!r} and steps per second {sps!r} differ in length")
    if bs[0] < 1 or any(b2 <= b1 for b1, b2 in zip(bs, bs[1:])):
        raise ValueError(f"{what} batch sizes must be strictly increasing and >= 1, got {bs!r}")
    if any(not (math.isfinite(s) and s > 0) for s in sps):
        raise ValueError(f"{what} steps per second must be finite and > 0, got {sps!r}")


def _interp(bs: tuple[int, ...], sps: tuple[float, ...], b: float) -> float:
    """Linear between profiled points, flat below the first; beyond the last the time per
    step grows linearly along the last segment's slope (never shrinks)."""
    if b <= bs[0]:
        return sps[0]
    if b >= bs[-1]:
        if len(bs) == 1 or b == bs[-1]:
            return sps[-1]
        slope = (1.0 / sps[-1] - 1.0 / sps[-2]) / (bs[-1] - bs[-2])
        return 1.0 / (1.0 / sps[-1] + max(slope, 0.0) * (b - bs[-1]))
    i = bisect.bisect_right(bs, b)  # bs[i-1] <= b < bs[i]
    w = (b - bs[i - 1]) / (bs[i] - bs[i - 1])
    return sps[i - 1] + w * (sps[i] - sps[i - 1])


@dataclass(frozen=True)
class CostTable:
    """Profiled speed of one target forward as a function of its batch size in tokens.

    batch_sizes: strictly increasing token counts B (>= 1) at which the target was timed,
        decode-shaped (B requests of one token each, up to the profile's request count).
    steps_per_second: measured forward steps per second SPS(B) at each (> 0, finite).
    block_sizes / block_steps_per_second: optional, the same for ONE request carrying B
        tokens (anchor + drafts): what verifying a block costs beyond the decode itself.
        A step of R requests and B tokens then costs the decode of R requests plus the
        in-request price of the B - R extra tokens; without them, B alone prices the step.
    overhead_seconds: what an engine step spends besides the target forward (drafting,
        verification's sampling, bookkeeping), >= 0: paid once a step whatever the batch,
        so it makes a verified draft relatively cheaper (`step_rate`). Measured while
        serving (scheduler/overhead.py), never profiled or saved with the table.
    grid_requests / grid_tokens / grid_steps_per_second: optional, the forward of R requests
        carrying t tokens each (anchor + drafts), R and t strictly increasing from 1, one row
        of SPS per R. Where it is given, a forward whose request count is known is priced
        from it, by its tokens per request: the block sizes price extra tokens as one
        request's, while at load every request's extra rows also cost attention over its own
        context, so the block shape underprices a verify step at load (bench/step_costs.py
        times verify steps by load).
    """

    batch_sizes: tuple[int, ...]
    steps_per_second: tuple[float, ...]
    block_sizes: tuple[int, ...] | None = None
    block_steps_per_second: tuple[float, ...] | None = None
    overhead_seconds: float = 0.0
    grid_requests: tuple[int, ...] | None = None
    grid_tokens: tuple[int, ...] | None = None
    grid_steps_per_second: tuple[tuple[float, ...], ...] | None = None
    # measured over profiled forward time where a forward falls (`scheduler/correction.py`):
    # the table as the engine sees it now; never saved with it
    correction: Callable[[float, int | None], float] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.overhead_seconds) and self.overhead_seconds >= 0):
            raise ValueError(f"overhead_seconds must be finite and >= 0, got {self.overhead_seconds!r}")
        object.__setattr__(self, "batch_sizes", tuple(int(b) for b in self.batch_sizes))
        object.__setattr__(self, "steps_per_second", tuple(float(s) for s in self.steps_per_second))
        _check_points(self.batch_sizes, self.steps_per_second, "decode")
        if (self.block_sizes is None) != (self.block_steps_per_second is None):
            raise ValueError("block_sizes and block_steps_per_second come together, got one of them")
        if self.block_sizes is not None and self.block_steps_per_second is not None:
            object.__setattr__(self, "block_sizes", tuple(int(b) for b in self.block_sizes))
            object.__setattr__(
                self, "block_steps_per_second", tuple(float(s) for s in self.block_steps_per_second)
            )
            _check_points(self.block_sizes, self.block_steps_per_second, "block")
        grid = (self.grid_requests, self.grid_tokens, self.grid_steps_per_second)
        if any(g is None for g in grid) and any(g is not None for g in grid):
            raise ValueError("grid_requests, grid_tokens and grid_steps_per_second come together")
        if self.grid_requests is not None and self.grid_tokens is not None:
            reqs, toks = tuple(int(r) for r in self.grid_requests), tuple(int(t) for t in self.grid_tokens)
            rows = tuple(tuple(float(x) for x in row) for row in self.grid_steps_per_second or ())
            object.__setattr__(self, "grid_requests", reqs)
            object.__setattr__(self, "grid_tokens", toks)
            object.__setattr__(self, "grid_steps_per_second", rows)
            _check_points(reqs, tuple(1.0 for _ in reqs), "grid request")
            if toks[:1] != (1,):
                raise ValueError(f"grid tokens per request must start at 1, got {toks!r}")
            if len(rows) != len(reqs):
                raise ValueError(f"{len(rows)} grid rows for grid requests {reqs!r}")
            for row in rows:
                _check_points(toks, row, "grid token")

    def _grid_seconds(self, b: float, requests: int) -> float:
        """Seconds of a forward of `requests` requests carrying b tokens in all, from the grid:
        linear in tokens per request along each profiled request count (the time growing along
        the last segment beyond it), linear in requests between them, and past the last one
        its time scaled by the requests (each brings its own rows and context)."""
        assert self.grid_requests is not None and self.grid_tokens is not None
        assert self.grid_steps_per_second is not None
        reqs, toks, rows = self.grid_requests, self.grid_tokens, self.grid_steps_per_second
        t = max(1.0, b / requests)

        def at(i: int) -> float:
            return 1.0 / _interp(toks, rows[i], t)

        if requests <= reqs[0]:
            return at(0)
        if requests >= reqs[-1]:
            return at(len(reqs) - 1) * requests / reqs[-1]
        i = bisect.bisect_right(reqs, requests)  # reqs[i-1] <= requests < reqs[i]
        w = (requests - reqs[i - 1]) / (reqs[i] - reqs[i - 1])
        return (1.0 - w) * at(i - 1) + w * at(i)

    def sps(self, b: float, requests: int | None = None) -> float:
        """Steps per second of a forward of b tokens (from `requests` requests, when known), as
        profiled, and corrected by what the engine measures where it has a correction."""
        profiled = self.profiled_sps(b, requests)
        return profiled if self.correction is None else profiled / self.correction(b, requests)

    def profiled_sps(self, b: float, requests: int | None = None) -> float:
        """`sps` as the profile measured it (no online correction)."""
        if requests is not None and requests >= 1 and self.grid_requests is not None:
            return 1.0 / self._grid_seconds(b, requests)
        decode = _interp(
            self.batch_sizes,
            self.steps_per_second,
            b if requests is None or self.block_sizes is None else requests,
        )
        if (
            requests is None
            or self.block_sizes is None
            or self.block_steps_per_second is None
            or b <= requests
        ):
            return decode
        bb, bs = self.block_sizes, self.block_steps_per_second
        extra = 1.0 / _interp(bb, bs, 1 + b - requests) - 1.0 / _interp(bb, bs, 1)
        return 1.0 / (1.0 / decode + max(extra, 0.0))

    def measured_batches(self, requests: int) -> tuple[int, ...]:
        """The batch sizes (tokens) at which a forward of `requests` requests is priced from a
        measurement rather than between two: the grid's token counts per request, else one
        request's blocks on top of the others' decode, else the decode-shaped batch sizes."""
        r = max(1, requests)
        if self.grid_tokens is not None:
            return tuple(r * t for t in self.grid_tokens)
        if self.block_sizes is not None:
            return tuple(r - 1 + b for b in self.block_sizes)
        return self.batch_sizes

    def step_rate(self, b: float, requests: int | None = None) -> float:
        """Engine steps per second whose forward carries b tokens: the forward (`sps`) plus
        the step's overhead."""
        return 1.0 / (1.0 / self.sps(b, requests) + self.overhead_seconds)

    def to_dict(self) -> dict[str, list[Any]]:
        d: dict[str, list[Any]] = {
            "batch_sizes": list(self.batch_sizes),
            "steps_per_second": list(self.steps_per_second),
        }
        if self.block_sizes is not None:
            d["block_sizes"] = list(self.block_sizes)
            d["block_steps_per_second"] = list(self.block_steps_per_second or ())
        if self.grid_requests is not None:
            d["grid_requests"] = list(self.grid_requests)
            d["grid_tokens"] = list(self.grid_tokens or ())
            d["grid_steps_per_second"] = [list(row) for row in self.grid_steps_per_second or ()]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CostTable:
        missing = [k for k in ("batch_sizes", "steps_per_second") if k not in d]
        if missing:
            raise ValueError(f"cost table dict lacks {missing}, got keys {sorted(d)!r}")
        block = d.get("block_sizes"), d.get("block_steps_per_second")
        grid = d.get("grid_requests"), d.get("grid_tokens"), d.get("grid_steps_per_second")
        return cls(
            batch_sizes=tuple(d["batch_sizes"]),
            steps_per_second=tuple(d["steps_per_second"]),
            block_sizes=None if block[0] is None else tuple(block[0]),
            block_steps_per_second=None if block[1] is None else tuple(block[1]),
            grid_requests=None if grid[0] is None else tuple(grid[0]),
            grid_tokens=None if grid[1] is None else tuple(grid[1]),
            grid_steps_per_second=None if grid[2] is None else tuple(tuple(r) for r in grid[2]),
        )


@dataclass(frozen=True)
class PolicyInput:
    """What the drafter said about each running request this step.

    confidences: per request, c_k = P(draft k survives | drafts < k survived) for k = 1..,
        as a 1-D tensor or list with at least max_lengths[r] entries, or None when the
        drafter has no estimate.
    max_lengths: per request, the most drafts worth verifying (proposal length, already
        capped by remaining max_tokens and context room).
    fallback_confidence: c_k assumed for requests without confidences (e.g. the drafter's
        running acceptance rate); it must not depend on this step's drafts.
    weights: per request, how much one of its expected accepted tokens counts in the budget
        choice (scheduling by priority: the best priority in the step 1, each level worse half);
        None = all 1. Fixed before drafting, so the lengths stay causal.
    """

    confidences: Sequence[Confidences]
    max_lengths: Sequence[int]
    fallback_confidence: float = 0.5
    weights: Sequence[float] | None = None

    def __post_init__(self) -> None:
        if len(self.confidences) != len(self.max_lengths):
            raise ValueError(
                f"{len(self.confidences)} confidence rows but {len(self.max_lengths)} max_lengths"
            )
        bad = [m for m in self.max_lengths if m < 0]
        if bad:
            raise ValueError(f"max_lengths must be >= 0, got {bad!r}")
        if not (0.0 <= self.fallback_confidence <= 1.0):
            raise ValueError(f"fallback_confidence must be in [0, 1], got {self.fallback_confidence!r}")
        if self.weights is not None and (
            len(self.weights) != len(self.max_lengths) or any(not w > 0 for w in self.weights)
        ):
            raise ValueError(f"weights must be one positive number per request, got {self.weights!r}")

    def survival_curves(self) -> list[list[float]]:
        """a_{r,j} = prod_{i<=j} c_{r,i} for j = 1..max_lengths[r], per request."""
        curves = []
        for r, (conf, m) in enumerate(zip(self.confidences, self.max_lengths)):
            if conf is None:
                c = [self.fallback_confidence] * m
            else:
                c = conf.detach().float().cpu().tolist() if hasattr(conf, "detach") else list(conf)
                if len(c) < m:
                    raise ValueError(f"request {r}: {len(c)} confidences for max_length {m}")
                c = [float(x) for x in c[:m]]
                if any(not (0.0 <= x <= 1.0) for x in c):  # also catches NaN
                    raise ValueError(f"request {r}: confidences must be in [0, 1], got {c!r}")
            a, curve = 1.0, []
            for x in c:
                a *= x  # x <= 1, so the curve never increases, even in floating point
                curve.append(a)
            curves.append(curve)
        return curves


@dataclass(frozen=True)
class PolicyDecision:
    """lengths: drafts to verify per request; expected_tokens: tau, the expected tokens this
    step yields (sum over requests of 1 + sum_{j <= l_r} a_{r,j})."""

    lengths: list[int]
    expected_tokens: float


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    # The most drafts it verifies for one request in any step, or None (what the drafter
    # proposes): drafting past it is wasted work, so the drafter is not asked for more.
    @property
    def max_length(self) -> int | None: ...

    def __call__(self, inp: PolicyInput, table: CostTable, load: LoadState) -> PolicyDecision: ...


def _decision(curves: list[list[float]], lengths: list[int]) -> PolicyDecision:
    tau = sum(1.0 + sum(curve[:n]) for curve, n in zip(curves, lengths))
    return PolicyDecision(lengths=lengths, expected_tokens=tau)


@dataclass(frozen=True)
class NoSpeculation:
    """Plain decoding: verify nothing, every request gets only the target's own token."""

    name: str = field(default="none", init=False)
    max_length: int | None = field(default=0, init=False)

    def __call__(self, inp: PolicyInput, table: CostTable, load: LoadState) -> PolicyDecision:
        return _decision(inp.survival_curves(), [0] * len(inp.max_lengths))


@dataclass(frozen=True)
class StaticPolicy:
    """Verify a fixed k drafts per request (capped by max_lengths), whatever the load.

    k: drafts per request, >= 0.
    """

    k: int

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"static length must be >= 0, got {self.k!r}")

    @property
    def name(self) -> str:
        return f"static:{self.k}"

    @property
    def max_length(self) -> int | None:
        return self.k

    def __call__(self, inp: PolicyInput, table: CostTable, load: LoadState) -> PolicyDecision:
        return _decision(inp.survival_curves(), [min(self.k, m) for m in inp.max_lengths])


@dataclass(frozen=True)
class ThresholdPolicy:
    """Verify the longest prefix whose survival a_j = prod c_i stays >= threshold (load-blind).

    threshold: in [0, 1]; 0 verifies everything proposed.
    """

    threshold: float
    max_length: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if not (0.0 <= self.threshold <= 1.0):
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold!r}")

    @property
    def name(self) -> str:
        return f"threshold:{self.threshold:g}"

    def __call__(self, inp: PolicyInput, table: CostTable, load: LoadState) -> PolicyDecision:
        curves = inp.survival_curves()
        lengths = [sum(1 for a in curve if a >= self.threshold) for curve in curves]
        return _decision(curves, lengths)


@dataclass(frozen=True)
class ConvexPrice:
    """Seconds of an engine step on the lower convex envelope of the table's step times
    (`CostTable.step_rate`) at a fixed request count, through the batch sizes the table
    measured there (`CostTable.measured_batches`) from the first batch (the decodes and any
    prefill) to the largest (every draft the step may verify), linear in time between them.

    A curve whose time jumps with the first extra token a request and then stays flat (a
    verify forward on another path than the decode step, a first tile of rows) is concave
    there: the first draft admitted pays the whole jump, the rest ride free. An admission
    that stops at the first draft that does not pay then never verifies anything, although
    whole blocks would (what the H200's profiled table did to the policy; bench/load_sim.py
    replays it). On the envelope each admission pays its share of the jump. The envelope is
    a function of the table and the step's shape only (request count, prefill tokens, the
    most drafts each request may verify), never of the drafts, so the choice stays causal.
    Theta = tau / seconds is then a concave tau over a convex time along the admission
    order: unimodal, so the early stop finds the envelope's best admission count."""

    batches: tuple[int, ...]  # strictly increasing
    seconds_at: tuple[float, ...]  # the envelope's vertices

    @classmethod
    def of(cls, table: CostTable, requests: int, first: int, last: int) -> ConvexPrice:
        knots = sorted({first, last, *(b for b in table.measured_batches(requests) if first < b < last)})
        hull: list[tuple[int, float]] = []
        for b in knots:  # the lower hull of points sorted by batch (monotone chain)
            p = (b, 1.0 / table.step_rate(b, requests))
            while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0.0:
                hull.pop()
            hull.append(p)
        return cls(tuple(b for b, _ in hull), tuple(t for _, t in hull))

    def seconds(self, b: float) -> float:
        """The envelope at batch b (linear between its vertices, flat outside them)."""
        xs, ys = self.batches, self.seconds_at
        if b <= xs[0]:
            return ys[0]
        if b >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, b)  # xs[i-1] <= b < xs[i]
        w = (b - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + w * (ys[i] - ys[i - 1])


def _cross(o: tuple[int, float], a: tuple[int, float], b: tuple[int, float]) -> float:
    """> 0 where o -> a -> b turns left (a lies below the chord o-b: a stays on the lower hull)."""
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


@dataclass(frozen=True)
class DSparkPolicy:
    """Hardware-aware prefix scheduler (DSpark Algorithm 1).

    Admit (request, position) pairs in order of survival a_{r,j}, each adding one token to
    the batch B and a_{r,j} to tau, and keep the admission count maximising
    Theta = tau * SPS(B), SPS the engine's whole step (`CostTable.step_rate`: the forward
    and the step's overhead, which a longer verification spreads over more tokens).

    early_stop: stop at the first admission that does not strictly improve Theta. This is
        what makes it lossless: whether x_{r,j} is verified then depends only on survivals
        ranked above it, never on values computed from x_{r,j} itself. Without it
        (`dspark_global`), the best over all prefixes of the order can depend on x_{r,j}
        through a_{r,j+1}, which biases the output (the paper's Appendix A).
    convex: where the first admission does not pay on the table, admit again with SPS from
        the lower convex envelope of the step's time (`ConvexPrice`): a fixed cost of
        verifying at all (a jump from one token a request to two) is then spread over the
        block that pays for it instead of refusing every draft for good. Whether the first
        admission pays depends on the top survival alone, so the switch stays causal; a step
        whose first draft pays is priced as the table says. False: the table alone (the
        paper's SPS).

    Prefill tokens already in the step start B above R: drafts get dearer where they push
    the batch past the knee of SPS, and relatively cheaper when prefill dominates the step.
    """

    early_stop: bool = True
    convex: bool = True
    max_length: int | None = field(default=None, init=False)

    @property
    def name(self) -> str:
        return "dspark" if self.early_stop else "dspark_global"

    def __call__(self, inp: PolicyInput, table: CostTable, load: LoadState) -> PolicyDecision:
        curves = inp.survival_curves()
        r_count = len(curves)
        if r_count == 0:
            return PolicyDecision(lengths=[], expected_tokens=0.0)
        w = list(inp.weights) if inp.weights is not None else [1.0] * r_count
        # Admitted by weighted survival w_r * a_{r,j} (w_r fixed before drafting: still a
        # prefix per request, still causal). Ties: lower position first.
        order = sorted(
            (-w[r] * a, j, r) for r, curve in enumerate(curves) for j, a in enumerate(curve, start=1) if a > 0
        )
        first, tau = r_count + load.prefill_tokens, float(sum(w))
        # R decoding requests; drafts and prefill tokens are priced as extra tokens on top.
        best_n = self._admit(order, tau, first, lambda b: table.step_rate(b, r_count))
        if best_n == 0 and self.convex and order:
            # the first admission does not pay on the table (that depends on the top survival
            # alone, so the switch is causal): priced on the envelope, a block may
            price = ConvexPrice.of(table, r_count, first, first + sum(inp.max_lengths))
            best_n = self._admit(order, tau, first, lambda b: 1.0 / price.seconds(b))
        lengths = [0] * r_count
        for _, j, r in order[:best_n]:
            lengths[r] = j  # admitted in increasing j per request
        return _decision(curves, lengths)

    def _admit(
        self, order: list[tuple[float, int, int]], tau: float, batch: int, rate: Callable[[int], float]
    ) -> int:
        """How many of `order` (negated weighted survivals, best first) to admit, from a step of
        `batch` tokens worth `tau` expected tokens, priced by `rate` (steps per second)."""
        best_theta, best_n = tau * rate(batch), 0
        for n, (neg_a, _, _) in enumerate(order, start=1):
            batch += 1
            tau -= neg_a
            theta = tau * rate(batch)
            if theta > best_theta:
                best_theta, best_n = theta, n
            elif self.early_stop:
                break
        return best_n


PolicyFactory = Callable[[str | None], Policy]
_REGISTRY: dict[str, PolicyFactory] = {}
_USAGE: dict[str, str] = {}


def register_policy(name: str, usage: str | None = None) -> Callable[[PolicyFactory], PolicyFactory]:
    """Register a factory that builds the policy from the text after ':' (None if absent).
    usage: how the name is written with its argument (e.g. "static:K"); default the name."""

    def deco(factory: PolicyFactory) -> PolicyFactory:
        _REGISTRY[name] = factory
        _USAGE[name] = usage or name
        return factory

    return deco


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def policy_usages() -> list[str]:
    """Every policy as written in a spec, e.g. ["dspark", "dspark_global", "none", "static:K", ...]."""
    return [_USAGE[n] for n in policy_names()]


def parse_policy(spec: str) -> Policy:
    """Build a policy from its spec (`policy_usages()`: "none", "static:K", "dspark", ...)."""
    name, sep, arg = spec.strip().partition(":")
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {spec!r}; choose one of {policy_names()}")
    try:
        return _REGISTRY[name](arg if sep else None)
    except ValueError as e:
        raise ValueError(f"bad policy {spec!r}: {e}") from e


def _no_arg(name: str, arg: str | None) -> None:
    if arg is not None:
        raise ValueError(f"policy {name!r} takes no argument, got {arg!r}")


def _required(name: str, arg: str | None) -> str:
    if not arg:
        raise ValueError(f"policy {name!r} needs an argument, e.g. {name}:3")
    return arg


@register_policy("none")
def _make_none(arg: str | None) -> Policy:
    _no_arg("none", arg)
    return NoSpeculation()


@register_policy("static", usage="static:K")
def _make_static(arg: str | None) -> Policy:
    return StaticPolicy(k=int(_required("static", arg)))


@register_policy("threshold", usage="threshold:T")
def _make_threshold(arg: str | None) -> Policy:
    return ThresholdPolicy(threshold=float(_required("threshold", arg)))


@register_policy("dspark")
def _make_dspark(arg: str | None) -> Policy:
    _no_arg("dspark", arg)
    return DSparkPolicy(early_stop=True)


@register_policy("dspark_global")
def _make_dspark_global(arg: str | None) -> Policy:
    _no_arg("dspark_global", arg)
    # the paper's global search over the table as it is: the biased counterexample
    return DSparkPolicy(early_stop=False, convex=False)
