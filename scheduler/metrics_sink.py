"""What the engine reports to its metrics: one typed call per event, and the snapshot the
gauges read. `scheduler/metrics.py` exports the reports to Prometheus; `NullMetrics` drops them
when metrics are off. No prometheus import here: the engine runs without the server stack."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from dspark_serve.scheduler.load import LoadState

if TYPE_CHECKING:
    from dspark_serve.drafter.online_calibration import BucketedCalibrator
    from dspark_serve.scheduler.block_manager import PrefixCacheStats
    from dspark_serve.scheduler.policy import CostTable, PolicyDecision


@dataclass(frozen=True)
class SlotShares:
    """Who holds the running slots (fair slots, `scheduler.py`).

    fair_preemptions: slots given back to a waiting owner or tenant so far (cumulative).
    largest_share: the running slots the largest owner holds, over max_num_seqs, 0..1.
    by_key: running slots by API key name ("" for requests without a key), over max_num_seqs.
    """

    fair_preemptions: int = 0
    largest_share: float = 0.0
    by_key: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class QueueWait:
    """A request admitted after `seconds` in the waiting queue (since it arrived, or since it
    was preempted), with its API key's name ("" without one)."""

    key_name: str
    seconds: float


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine carries after a step (or an admission / abort), for the gauges.

    num_running: admitted requests (prefilling or decoding).
    num_waiting: requests queued for admission.
    kv_usage: fraction of KV cache blocks held by requests, 0..1.
    calibrator: the drafter's online confidence calibration, or None.
    kv_cached_free: fraction of KV cache blocks holding cached prefixes nobody holds (they
        count as free, so they are not in kv_usage), 0..1.
    prefix_cache: cumulative prefix-cache counters and occupancy, or None.
    preemptions: requests preempted so far (cumulative).
    slots: fair slots' state (`SlotShares`).
    """

    num_running: int
    num_waiting: int
    kv_usage: float
    calibrator: BucketedCalibrator | None = None
    kv_cached_free: float = 0.0
    prefix_cache: PrefixCacheStats | None = None
    preemptions: int = 0
    slots: SlotShares = field(default_factory=lambda: SlotShares())


class EngineMetricsSink(Protocol):
    """What the engine reports, one call per event. `EngineMetrics` exports it to Prometheus;
    `NullMetrics` (metrics disabled) drops it."""

    def record_forward(self, tokens: int, seconds: float) -> None: ...
    def record_policy(
        self, decision: PolicyDecision, load: LoadState | None = None, overhead: float | None = None
    ) -> None: ...
    # the profiled and the measured time of the last decode step's forward, and the correction
    # the policy applies there (scheduler/correction.py)
    def record_cost(self, predicted: float, measured: float, correction: float) -> None: ...
    def record_round(self, drafted: int, accepted: int) -> None: ...
    # a branch (a second draft block from the same anchor) was verified; kept: its run was the
    # longer one and replaced the first block's
    def record_branch(self, kept: bool) -> None: ...
    def record_first_token(self, seconds: float, prompt_tokens: int) -> None: ...
    def record_inter_token(self, seconds: float, n: int) -> None: ...
    def record_tokens(self, n: int) -> None: ...
    def record_realized(self, n: int) -> None: ...
    def record_finished(self, reason: str | None, seconds: float) -> None: ...
    def record_step(self, snap: EngineSnapshot) -> None: ...
    def record_queue_waits(self, waits: Sequence[QueueWait]) -> None: ...
    def set_cost_table(self, table: CostTable, source: str) -> None: ...


class NullMetrics:
    """Metrics disabled: every report is dropped."""

    def set_cost_table(self, table: CostTable, source: str) -> None:
        pass

    def record_forward(self, tokens: int, seconds: float) -> None:
        pass

    def record_policy(
        self, decision: PolicyDecision, load: LoadState | None = None, overhead: float | None = None
    ) -> None:
        pass

    def record_cost(self, predicted: float, measured: float, correction: float) -> None:
        pass

    def record_round(self, drafted: int, accepted: int) -> None:
        pass

    def record_branch(self, kept: bool) -> None:
        pass

    def record_first_token(self, seconds: float, prompt_tokens: int) -> None:
        pass

    def record_inter_token(self, seconds: float, n: int) -> None:
        pass

    def record_tokens(self, n: int) -> None:
        pass

    def record_realized(self, n: int) -> None:
        pass

    def record_finished(self, reason: str | None, seconds: float) -> None:
        pass

    def record_step(self, snap: EngineSnapshot) -> None:
        pass

    def record_queue_waits(self, waits: Sequence[QueueWait]) -> None:
        pass
