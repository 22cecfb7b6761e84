"""The one interface every drafter implements (the registry that picks one by name is
drafter/registry.py).

A drafter sees the running requests through `DraftRequest` (a read-only view the engine
builds each step) and answers with one `DraftProposal` per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from dspark_serve.ops.processors import TokenConstraint, TokenContext
from dspark_serve.ops.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dspark_serve.drafter.online_calibration import BucketedCalibrator


@dataclass
class DraftRequest:
    """What a drafter may know about one running request at draft time.

    request_id: stable id (keys the drafter's per-request cache).
    token_ids: prompt + generated tokens so far; token_ids[-1] is the anchor (the last
        token the target produced; its own KV is not yet in the target cache).
    num_prompt_tokens: how many of token_ids are prompt.
    sampling: the request's sampling params (the draft distribution q is shaped like p).
    generator: the request's torch.Generator (seeded requests are reproducible) or None.
    max_draft: the most draft tokens that can be useful (remaining max_tokens, room left in
        the context); a drafter may propose fewer, never more.
    constraint: the request's grammar, or None. A drafter that samples masks q with it; a
        deterministic one (prompt lookup) cuts its block at the first token it forbids.
    branch: the engine can verify a branch for this request beside the first (a
        greedy request at a load where the extra rows are nearly free): a drafter with two
        sources of drafts may put the other one's block in `DraftProposal.branch`.
    verified_with: the request's own sampling params where `sampling` differs from them (a
        sampled request drafting its most likely tokens, `SchedulerConfig.draft_rule`): what
        the target verifies with, and so what a draft's survival depends on.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    generator: torch.Generator | None
    max_draft: int
    constraint: TokenConstraint | None = None
    branch: bool = False
    verified_with: SamplingParams | None = None

    @property
    def target_sampling(self) -> SamplingParams:
        """The sampling params the target verifies this request's drafts with."""
        return self.verified_with or self.sampling

    def context(self) -> TokenContext:
        """What penalties and the grammar read at the first draft position."""
        n = self.num_prompt_tokens
        return TokenContext(self.token_ids[:n], self.token_ids[n:], self.constraint)


@dataclass
class DraftProposal:
    """A block of draft tokens for one request.

    tokens:      [K] int64, K <= block size (K may be 0).
    probs:       [K, V] float32, the draft distribution q_k each token was sampled from
                 (after temperature/top-p/top-k), or None when drafts are deterministic
                 (then q_k is one-hot on tokens[k], as for n-gram lookup or greedy).
    confidences: [K] float32 in [0, 1], c_k = P(token k survives | tokens < k survived), or
                 None when the drafter has no estimate.
    branch:   [M] int64, a second greedy block (only where the request allowed one): the
                 target verifies both from the same anchor and the longer accepted run is
                 kept. Greedy verification keeps exactly the target's argmax chain whichever
                 block it checks, so the choice cannot change the output.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    confidences: torch.Tensor | None = None
    branch: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.numel())


class TapRows(Protocol):
    """Where the engine keeps the tap states of every kept token for as long as its request
    holds its KV (the prefix cache's rows, scheduler/prefix.py)."""

    def rows_of(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """[end - start, m * d]: the tap states of the request's positions start .. end - 1."""
        ...


@dataclass
class AcceptedContext:
    """What the target verified for one request this step, for the drafter to absorb.

    request_id: the request.
    token_ids: the tokens whose target KV was kept this step, in order (prompt chunk
        tokens during prefill; anchor + accepted drafts during decode).
    start_pos: position of token_ids[0] in the sequence.
    hidden: [len(token_ids), m * d] target hidden states at the drafter's tap layers
        (concatenated in target_layer_ids order) for exactly those tokens, or None when the
        drafter asked for no taps or when only `stored` holds them (a cached prefix's).
    stored: where the same rows stay readable while the request runs (`TapRows`), or None: a
        drafter that absorbs its context lazily may keep the positions instead of a copy.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    hidden: torch.Tensor | None
    stored: TapRows | None = None


class Drafter(Protocol):
    """A drafter: proposes, absorbs what was accepted, forgets finished requests."""

    name: str
    block_size: int
    # Target layers whose hidden states the drafter needs (DeepSpec semantics: layer i is
    # the output of decoder layer i, -1 the embeddings). Empty: no taps needed.
    tap_layers: tuple[int, ...]
    # True when confidences are learned online from verification outcomes (n-gram); the
    # engine then keeps verifying a little so they can recover.
    online_confidence: bool
    # The online recalibration of a confidence head (drafter/online_calibration.py), or None;
    # /metrics exports its live ECE and per-position temperatures.
    calibrator: BucketedCalibrator | None

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        """One batched call for all running requests."""
        ...

    def observe(self, contexts: list[AcceptedContext]) -> None:
        """Extend each request's drafter context with the tokens the target kept."""
        ...

    def observe_acceptance(self, request_id: str, proposed: int, accepted: int) -> None:
        """Feedback after verification (online confidence estimates use it)."""
        ...

    def catch_up_seconds(self, request_ids: list[str]) -> float | None:
        """Seconds the next proposal for these requests would spend first absorbing the
        context they kept since they last drafted (0: nothing waits; None: not known yet).
        The draft gate weighs it before exploring drafting at a load where plain steps win."""
        ...

    def free(self, request_id: str) -> None:
        """Drop all state for a finished or aborted request."""
        ...
