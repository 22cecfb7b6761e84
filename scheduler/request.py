"""A request's state as it moves through the engine, and what the engine reports back for it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from dspark_serve.ops.processors import TokenConstraint
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.client import TokenRecord
from dspark_serve.scheduler.detokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"  # queued, no KV yet
    PREFILL = "prefill"  # admitted, prompt partly in the KV cache
    DECODE = "decode"  # prompt done; last token sampled, its KV pending
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculative decoding statistics of one request."""

    rounds: int = 0  # decode steps that verified at least one draft
    drafted: int = 0  # draft tokens the target verified
    accepted: int = 0  # of those, accepted
    steps: int = 0  # all decode steps (the budget per step is drafted / steps)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification round, the target's own token included (tau)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


@dataclass
class Request:
    """One generation request. The engine thread is its only writer."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    queued_at: float = field(default_factory=time.monotonic)  # since when it waits (arrival or preemption)
    logprobs: int | None = None  # None: none; k: each token's logprob and its top k alternatives
    constraint: TokenConstraint | None = None  # grammar state; advanced as tokens are committed
    priority: int = 0  # lower is served first (scheduling_policy "priority"; ignored by fcfs)
    owner: str = ""  # whom its slot counts against (fair slots); empty: itself
    tenant: str = ""  # whose share the owner's slots count against (fair slots); empty: none
    key_name: str = ""  # the API key it came with, by name (per-key metrics); empty: none

    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    num_preemptions: int = 0  # times its KV was freed to make room (it recomputes)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    generator: torch.Generator | None = None
    detok: IncrementalDetokenizer | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    last_budget: int | None = None  # drafts the policy let it verify last step
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        if self.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)

    @property
    def slot_owner(self) -> str:
        """Whom its slot counts against (fair slots): its owner, or itself."""
        return self.owner or self.request_id

    @property
    def slot_tenant(self) -> str:
        """Whose share its owner's slots count against (fair slots): its tenant, or its owner."""
        return self.tenant or self.slot_owner

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens to prefill before it decodes: its prompt, or after a preemption everything
        but its last generated token (the next anchor, whose KV a decode step writes)."""
        return len(self.prompt_ids) + max(len(self.output_ids) - 1, 0)

    @property
    def prefill_ids(self) -> list[int]:
        return self.prompt_ids if not self.output_ids else self.token_ids[:-1]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    """What one engine step produced for one request (a delta, for streaming)."""

    request_id: str
    text: str  # new text since the last output
    token_ids: list[int]  # new tokens since the last output
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    spec: SpecStats | None = None
    error: str | None = None  # set when the engine failed this request (finish_reason "error")
    error_status: int = 500  # 400 when the request's own input failed it (its grammar, its processing)
    tokens: list[TokenRecord] = field(default_factory=list)  # one per token_ids entry
