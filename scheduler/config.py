"""Configuration of the engine loop (admission, batching, verification policy)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dspark_serve.scheduler.policy import policy_names, policy_usages

AUTO_POLICY = "auto"


def policy_choices() -> list[str]:
    """Every valid `verify_policy` spec: auto and each registered policy (with its argument)."""
    return [AUTO_POLICY, *policy_usages()]


SCHEDULING_POLICIES = ("fcfs", "priority")
DRAFT_RULES = ("argmax", "sampled")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching and verification-length knobs."""

    max_num_seqs: int = 32
    """Most requests decoding at once."""
    max_num_batched_tokens: int = 512
    """Token budget of one target forward (decodes + drafts + prefill chunks)."""
    max_waiting: int = 256
    """Waiting-queue capacity; a request beyond it is answered 429."""
    verify_policy: str = AUTO_POLICY
    """auto (dspark when a drafter is on, else none) or a registered policy (scheduler/policy.py)."""
    reprofile: bool = False
    """Re-measure the target cost table even when a cached one exists."""
    cost_table_in_background: bool = True
    """Where no cached cost table fits (a first start on this machine, or --reprofile): serve at
    once on a provisional table from a short probe and measure the full table in the engine's
    idle gaps (it takes over when done, and is cached); false: measure it before serving."""
    draft_gate: bool = True
    """With the dspark policy: skip drafting at load levels where steps that draft have
    produced fewer tokens per second than steps that do not (the drafter's own cost)."""
    draft_rule: str = "argmax"
    """How an unseeded sampled request's drafts are drawn: argmax (the drafter's most likely
    tokens, q one-hot on them: each kept with probability p(draft)) or sampled (from the
    drafter's q at the request's temperature, each kept with probability min(1, p/q)). Both are
    exactly lossless; which pays more depends on the drafter and the temperature (argmax also
    drafts on the greedy path, without a softmax per position; docs/benchmarks.md, "Draft rules
    at temperature 0.7 and 1"). Greedy and seeded requests always draft the most likely tokens."""
    draft_headroom: int = 2
    """With the dspark policy: a request drafts at most this many positions past the budget
    the policy gave it last step (0 = always a full block). Positions the policy cannot
    admit are not worth drafting; the cap follows load within a few steps."""
    price_overhead: bool = True
    """With the dspark policy: price what a drafting step spends besides the target forward
    (drafting, sampling, bookkeeping; measured per load level from past steps) into the
    choice of verification lengths, as time every step pays whatever its size, so a longer
    verification spreads it over more tokens. False prices the target forward alone (the
    cost table, the paper's SPS)."""
    branch_rows: int = 0
    """Verified rows within which a greedy request also verifies a branch: a second draft block
    from the same anchor (with the combined drafters: prompt lookup's match beside a DSpark-led
    block), keeping the longer accepted run; never in a step that prefills. 0 = never (the
    default): a branch raises the tokens per round, but where the extra rows cost compute (a
    CPU) the longer forward takes that gain back and per-user speed does not move
    (bench/branches.py measures both). Worth it where a forward's time does not grow
    with these few extra rows (an accelerator)."""
    enable_prefix_caching: bool = True
    """Share the KV of full blocks of committed tokens across requests by a hash of their
    content and position (automatic prefix caching): a prompt whose leading blocks are cached
    skips their prefill, and the drafter's context for them is restored from the target's
    tap hidden states cached beside the blocks."""
    explore_every: int = 8
    """For drafters whose confidences are learned online (n-gram): every n-th decode step of a
    request verifies at least one draft, so a pessimistic estimate can recover."""
    scheduling_policy: str = "fcfs"
    """fcfs: requests are admitted in arrival order and the newest is preempted first; priority
    (vLLM's name and meaning): by the request's `priority`, lower first, ties in arrival order,
    the lowest preempted first, and a request's expected accepted tokens weigh more in the
    verification budget the better its priority is than its peers'."""
    priority_aging_s: float = 10.0
    """With the priority policy: a waiting request's priority improves by one for every this many
    seconds it waits, so no request starves."""
    fair_slots: bool = True
    """With the fcfs policy, while requests wait for a slot (`max_num_seqs`): the waiting request
    whose owner (an HTTP request with its n choices) holds the fewest slots is admitted first,
    and an owner holding more slots than a waiting one's plus one gives its newest back
    (preempted: it resumes by recomputing), so no request's n choices starve the others;
    off: first come, first served."""

    def policy_spec(self, drafting: bool) -> str:
        """The policy verify_policy names: auto is dspark when a drafter is on, else none."""
        if self.verify_policy == AUTO_POLICY:
            return "dspark" if drafting else "none"
        return self.verify_policy

    def __post_init__(self) -> None:
        if not (1 <= self.max_num_seqs <= 4096):
            raise ValueError(f"max_num_seqs must be in [1, 4096], got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens < 16:
            raise ValueError(f"max_num_batched_tokens must be >= 16, got {self.max_num_batched_tokens!r}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting!r}")
        if self.draft_headroom < 0:
            raise ValueError(f"draft_headroom must be >= 0, got {self.draft_headroom!r}")
        if self.branch_rows < 0:
            raise ValueError(f"branch_rows must be >= 0, got {self.branch_rows!r}")
        if self.explore_every < 1:
            raise ValueError(f"explore_every must be >= 1, got {self.explore_every!r}")
        if self.draft_rule not in DRAFT_RULES:
            raise ValueError(f"draft_rule must be one of {DRAFT_RULES}, got {self.draft_rule!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if not (self.priority_aging_s > 0 and math.isfinite(self.priority_aging_s)):
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s!r}")
        for flag in ("enable_prefix_caching", "price_overhead", "cost_table_in_background"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be true or false, got {getattr(self, flag)!r}")
        name = self.verify_policy.split(":", 1)[0]
        if name != AUTO_POLICY and name not in policy_names():
            raise ValueError(
                f"unknown verify_policy {self.verify_policy!r}; choose one of {policy_choices()}"
            )
