"""Prompt-lookup drafter: propose what followed the most recent earlier occurrence of the
last n tokens. No weights; confidences come from its own running acceptance statistics, kept
apart by the length of the suffix matched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dspark_serve.drafter.base import AcceptedContext, DraftProposal, DraftRequest

if TYPE_CHECKING:
    from dspark_serve.drafter.online_calibration import BucketedCalibrator


@dataclass(frozen=True)
class NgramConfig:
    """Prompt lookup settings.

    block_size: most tokens proposed per step.
    max_ngram / min_ngram: suffix lengths tried, longest first.
    prior_accept / prior_reject: Beta prior on each position's conditional acceptance rate.
    """

    block_size: int = 5
    max_ngram: int = 4
    min_ngram: int = 1
    prior_accept: float = 3.0
    prior_reject: float = 1.0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size!r}")
        if self.min_ngram <= 0:
            raise ValueError(f"min_ngram must be > 0, got {self.min_ngram!r}")
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"max_ngram must be >= min_ngram ({self.min_ngram}), got {self.max_ngram!r}")
        if self.prior_accept <= 0 or self.prior_reject <= 0:
            raise ValueError(
                f"Beta prior must be positive, got ({self.prior_accept!r}, {self.prior_reject!r})"
            )


def lookup_continuation(tokens: np.ndarray, max_ngram: int, min_ngram: int, k: int) -> np.ndarray:
    """tokens: [L] int64 -> up to k tokens that followed the most recent earlier match of the
    longest suffix (length max_ngram down to min_ngram); empty if none matches."""
    return lookup_match(tokens, max_ngram, min_ngram, k)[0]


def lookup_match(tokens: np.ndarray, max_ngram: int, min_ngram: int, k: int) -> tuple[np.ndarray, int]:
    """`lookup_continuation` and the length of the suffix it matched (0 when none did).

    One pass over the context finds where the last token occurred before (every match of any
    suffix ends at such a place); each of those is then extended backwards against the suffix,
    at most max_ngram - 1 steps over those few places only. (A sliding window per suffix length
    compared the whole context up to max_ngram times, a cost every request paid at every step
    that grew with its context.)"""
    n_tok = tokens.shape[0]
    longest = min(max_ngram, n_tok - 1)
    if k <= 0 or longest < min_ngram:
        return tokens[:0], 0
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # a match ends here; a token follows it
    if not ends.size:
        return tokens[:0], 0
    length = np.ones(ends.shape[0], dtype=np.int64)  # matched suffix length, while unbroken
    alive = np.ones(ends.shape[0], dtype=bool)
    for j in range(1, longest):
        back = ends - j
        alive &= back >= 0
        alive[alive] = tokens[back[alive]] == tokens[n_tok - 1 - j]
        length += alive
    best = int(length.max())
    if best < min_ngram:
        return tokens[:0], 0
    start = int(ends[np.flatnonzero(length == best)[-1]]) + 1  # the most recent of the longest
    return tokens[start : start + k], best


class NgramDrafter:
    name = "ngram"
    tap_layers: tuple[int, ...] = ()
    calibrator: BucketedCalibrator | None = None  # its confidences are learned from outcomes instead
    # Confidences are learned from verification outcomes, so the engine keeps verifying a
    # little even when they look poor (otherwise a low estimate could never recover).
    online_confidence = True

    def __init__(self, config: NgramConfig):
        self.config = config
        self.block_size = config.block_size
        # Global per-position counts by the length of the suffix matched (a one-token match
        # is a far weaker sign than a four-token one): trials[n, k] = times position k of a
        # block found by an n-token match was verified with all earlier drafts accepted;
        # accepts[n, k] = times it was then accepted too.
        self.trials = np.zeros((config.max_ngram + 1, config.block_size), dtype=np.float64)
        self.accepts = np.zeros((config.max_ngram + 1, config.block_size), dtype=np.float64)
        self._matched: dict[str, int] = {}  # per request: its last proposal's match length

    def confidences(self, k: int, matched: int | None = None) -> torch.Tensor:
        """[k] float32 posterior-mean conditional acceptance per position of a block found by a
        `matched`-token match (None: the longest)."""
        c = self.config
        n = c.max_ngram if matched is None else matched
        mean = (self.accepts[n, :k] + c.prior_accept) / (self.trials[n, :k] + c.prior_accept + c.prior_reject)
        return torch.from_numpy(mean.astype(np.float32))

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        out = []
        for req in requests:
            k = min(self.block_size, max(req.max_draft, 0))
            cont, matched = lookup_match(
                np.asarray(req.token_ids, dtype=np.int64), self.config.max_ngram, self.config.min_ngram, k
            )
            if req.constraint is not None and len(cont):
                # q is one-hot: cutting the block at the first token the grammar forbids is
                # exact (that token could only be rejected), and saves verifying it.
                cont = cont[: req.constraint.valid_prefix(cont.tolist())]
            self._matched[req.request_id] = matched if len(cont) else 0
            tokens = torch.from_numpy(cont.copy())
            conf = self.confidences(len(cont), matched)
            out.append(DraftProposal(tokens=tokens, probs=None, confidences=conf))
        return out

    def observe(self, contexts: list[AcceptedContext]) -> None:
        """Nothing to absorb: lookups read the request's token ids directly."""

    def catch_up_seconds(self, request_ids: list[str]) -> float | None:
        return 0.0  # nothing to absorb

    def observe_acceptance(self, request_id: str, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        if not (0 <= accepted <= proposed):
            raise ValueError(f"accepted must be in [0, proposed={proposed}], got {accepted!r}")
        n = self._matched.get(request_id, 0)
        if n == 0:  # its last proposal was empty: the verified block was not this drafter's
            return
        proposed = min(proposed, self.block_size)
        accepted = min(accepted, proposed)
        # Positions before the first rejection succeeded; the rejected one failed; later
        # ones were never tested under the "earlier accepted" condition.
        seen = min(accepted + 1, proposed)
        self.trials[n, :seen] += 1
        self.accepts[n, :accepted] += 1

    def free(self, request_id: str) -> None:
        self._matched.pop(request_id, None)


def build_ngram(
    block_size: int | None = None,
    max_ngram: int = 4,
    min_ngram: int = 1,
    prior_accept: float = 3.0,
    prior_reject: float = 1.0,
    path: str | None = None,
    target_model: object = None,
    device: object = None,
    dtype: object = None,
    online_calibration: bool = True,
    cuda_graphs: bool = False,
) -> NgramDrafter:
    """block_size None = NgramConfig's default. target_model / device / dtype /
    online_calibration / cuda_graphs are accepted so one call site serves every drafter;
    prompt lookup needs none of them (its confidences are learned online anyway)."""
    if path is not None:
        raise ValueError(f"the ngram drafter has no weights; got a checkpoint path {path!r}")
    del target_model, device, dtype, online_calibration, cuda_graphs
    size = NgramConfig.block_size if block_size is None else block_size
    return NgramDrafter(NgramConfig(size, max_ngram, min_ngram, prior_accept, prior_reject))
