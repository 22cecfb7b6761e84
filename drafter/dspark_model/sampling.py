"""Drawing a draft block left to right from the drafter's logits and its Markov head."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dspark_serve.drafter.dspark_model.modules import MarkovHead
from dspark_serve.ops.cpu_kernels import argmax_rows
from dspark_serve.ops.processors import DraftCursor, TokenContext, needs_processing
from dspark_serve.ops.sampling import SamplingTensors, probs_from_logits, sample
from dspark_serve.ops.sampling_params import SamplingParams

# (base_logits [B, K, V'], anchor [B]) -> (tokens, prev_tokens) [B, K], or None: not applicable
GreedyWalk = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]


@dataclass
class SampledBlock:
    """Draft tokens of a batch of blocks.

    tokens: [B, K] int64 target ids, sampled left to right from the Markov-corrected distribution.
    probs:  [B, K, V'] float32, the distribution q_k each token was drawn from (one-hot for
            greedy rows), or None when every row is greedy. V' is the draft vocabulary
            (`to_target_probs` spreads it over the target's).
    prev_tokens: [B, K] int64, the token preceding each draft (anchor, tokens[:, :-1]).
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    prev_tokens: torch.Tensor


@dataclass(frozen=True)
class _SampledRows:
    """The rows of a block that sample (not greedy): their indices, sampling tensors and
    generators."""

    index: torch.Tensor
    tensors: SamplingTensors
    generators: list[torch.Generator | None]

    @classmethod
    def of(
        cls,
        rows: list[int],
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        dev: torch.device,
    ) -> _SampledRows:
        return cls(
            torch.tensor(rows, dtype=torch.long, device=dev),
            SamplingTensors.from_params([sampling[i] for i in rows], dev),
            [generators[i] for i in rows],
        )

    def draw(self, logits: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """Overwrite these rows of tok [B] (the argmax) with draws from q; returns the block
        step's distributions [B, V'] (one-hot on greedy rows)."""
        st = self.tensors
        q = probs_from_logits(logits[self.index], st.temperature, st.top_p, st.top_k, st.min_p)
        tok[self.index] = sample(q, self.generators)
        full = torch.zeros(logits.shape[0], logits.shape[1], dtype=torch.float32, device=logits.device)
        full.scatter_(1, tok.unsqueeze(1), 1.0)
        full[self.index] = q
        return full


@dataclass(frozen=True)
class CursorRows:
    """The greedy, unpenalized rows of a block whose constraint follows the draft as it is
    written (`DraftCursor`): row index -> its cursor; d2t / targets: the target token of each
    draft-vocabulary entry, as a tensor and as a list (None: the same ids)."""

    cursors: dict[int, DraftCursor]
    d2t: torch.Tensor | None
    targets: list[int] | None

    def pick(self, logits: torch.Tensor, tok: torch.Tensor) -> None:
        """logits: [B, V'] one position's; tok: [B] their argmax, the rows' picks written in."""
        ids = tok.tolist()
        for i, cursor in self.cursors.items():
            found = cursor.pick(logits[i], ids[i], self.d2t, self.targets)
            if found != ids[i]:
                tok[i] = found

    def close(self) -> None:
        for cursor in self.cursors.values():
            cursor.close()


def _shaped_logits(
    logits: torch.Tensor,
    shaped: list[int],
    shape: Callable[[int, torch.Tensor, list[int]], torch.Tensor],
    tokens: list[torch.Tensor],
) -> torch.Tensor:
    """The step's logits with the processed rows passed through shape (a copy)."""
    logits = logits.clone()
    drafted = torch.stack(tokens, 1).tolist() if tokens else [[] for _ in range(logits.shape[0])]
    for i in shaped:
        logits[i] = shape(i, logits[i], drafted[i])
    return logits


@torch.no_grad()
def sample_block(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    sampling: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    head: MarkovHead | None,
    to_target_ids: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor | None = None,
    contexts: Sequence[TokenContext | None] | None = None,
    shape: Callable[[int, torch.Tensor, list[int]], torch.Tensor] | None = None,
    greedy: GreedyWalk | None = None,
    cursors: CursorRows | None = None,
) -> SampledBlock:
    """Left-to-right sampling with the Markov head.

    base_logits: [B, K, V] (lm_head output); anchor: [B]; sampling/generators: one per
    row; head: the Markov head (None: no correction); to_target_ids: draft ids -> target ids;
    hidden: [B, K, d] (needed by gated / rnn heads) -> SampledBlock.
    q_k = probs_from_logits(corrected logits_k) with the row's temperature/top-p/top-k,
    the same function the verifier shapes p with. Greedy rows take the argmax (q one-hot)
    and skip the vocabulary-wide work.
    contexts / shape: rows whose request has penalties, a logit bias or a grammar
    (`needs_processing`) get their step-k logits passed through shape(row, logits [V'],
    tokens drafted so far) before anything else, so q (and a greedy argmax) is the processed
    distribution the verifier's p is compared with (ops/processors.py).
    greedy: (base_logits, anchor) -> (tokens, prev_tokens) target ids for a block whose rows
    are all greedy and unprocessed, the same argmax walk in one call (a C loop on CPUs,
    `fast.GreedyMarkov`), or None where it does not apply.
    cursors: greedy, unpenalized rows under a constraint that follows the draft (`CursorRows`):
    their argmax is checked and, where refused, replaced at each position, instead of shape
    (the same tokens); closed on return."""
    b, steps, _ = base_logits.shape
    dev = base_logits.device
    if head is not None and head.kind != "vanilla" and hidden is None:
        raise ValueError(f"markov_head_type {head.kind!r} needs the block hidden states")
    rows = [i for i, s in enumerate(sampling) if not s.greedy]
    picked = cursors.cursors if cursors is not None else {}
    shaped: list[int] = []
    if contexts is not None and shape is not None:
        shaped = [i for i, s in enumerate(sampling) if needs_processing(s, contexts[i]) and i not in picked]
    try:
        if greedy is not None and not rows and not shaped and not picked and steps > 0:
            walked = greedy(base_logits, anchor)
            if walked is not None:
                return SampledBlock(walked[0].to(dev), None, walked[1].to(dev))
        sampler = _SampledRows.of(rows, sampling, generators, dev) if rows else None
        return _left_to_right(
            base_logits,
            anchor,
            head,
            hidden,
            sampler,
            shaped,
            shape,
            to_target_ids,
            cursors if picked else None,
        )
    finally:
        if cursors is not None:
            cursors.close()


def _left_to_right(
    base_logits: torch.Tensor,
    anchor: torch.Tensor,
    head: MarkovHead | None,
    hidden: torch.Tensor | None,
    sampler: _SampledRows | None,
    shaped: list[int],
    shape: Callable[[int, torch.Tensor, list[int]], torch.Tensor] | None,
    to_target_ids: Callable[[torch.Tensor], torch.Tensor],
    cursors: CursorRows | None = None,
) -> SampledBlock:
    """The block one step at a time: Markov bias from the previous token, processing of the
    shaped rows, argmax, the cursor rows' picks, then the sampled rows' draws (see
    `sample_block`)."""
    b, steps, _ = base_logits.shape
    dev = base_logits.device
    state = head.init_state((b,), head.markov_w1.weight) if head is not None else None
    prev = anchor.long().to(dev)
    tokens: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    prevs: list[torch.Tensor] = []
    for k in range(steps):
        logits = base_logits[:, k].float()
        if head is not None:
            state, bias = head.step(state, prev, hidden[:, k] if hidden is not None else None)
            logits = logits + bias.float()
        if shaped and shape is not None:
            logits = _shaped_logits(logits, shaped, shape, tokens)
        tok = argmax_rows(logits)
        if cursors is not None:
            cursors.pick(logits, tok)
        if sampler is not None:
            probs.append(sampler.draw(logits, tok))
        prevs.append(prev)
        prev = to_target_ids(tok)
        tokens.append(prev)
    if steps == 0:
        empty = torch.empty(b, 0, dtype=torch.long, device=dev)
        return SampledBlock(empty, None, empty)
    return SampledBlock(
        torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None, torch.stack(prevs, 1)
    )
