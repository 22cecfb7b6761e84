"""Lossless speculative verification: accept / reject draft tokens against the target.

One pure, batched function over a flat layout: rows are verified tokens, request after
request (each request's draft positions then its bonus position), located by per-request
offsets as in the target's varlen forward; nothing is padded to the longest draft block.
The output of every request is distributed exactly as tokens sampled one by one from the
target (Leviathan et al. 2023, Chen et al. 2023), provided the number of drafts a request
verifies was decided without looking at those drafts' own values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dspark_serve.ops.cpu_kernels import FinalDraws, sample_final_rows
from dspark_serve.ops.sampling import sample_from_uniforms

# Below this residual mass p and q are equal up to rounding; sample from p instead.
RESIDUAL_EPS = 1e-6


def verify_offsets(num_draft: torch.Tensor) -> torch.Tensor:  # [B+1] int64
    """cu_seqlens of the flat verify rows: request b owns rows [out[b], out[b+1]), which are
    its num_draft[b] draft positions and then its bonus position (num_draft[b] + 1 rows)."""
    n = num_draft.to(dtype=torch.long)
    return torch.cat([n.new_zeros(1), (n + 1).cumsum(0)])


@dataclass
class RejectionResult:
    """What verification produced for each request, in the flat verify layout.

    offsets:       [B+1] int64, request b's rows are [offsets[b], offsets[b+1]) (num_draft[b] + 1).
    output_tokens: [T] int64, T = offsets[B]; request b's rows hold its new tokens first
        (the num_accepted[b] accepted drafts, then one recovered or bonus token), -1 after.
    num_accepted:  [B] int64, accepted draft tokens (0..num_draft).
    num_output:    [B] int64, = num_accepted + 1 (every round yields at least one token).
    faults:        request index -> why its rows could not be processed (set by
        `verifier.verify.verify`); such a request's verdict is void.
    """

    output_tokens: torch.Tensor
    num_accepted: torch.Tensor
    num_output: torch.Tensor
    offsets: torch.Tensor
    faults: dict[int, str] = field(default_factory=dict, compare=False)
    # the same as host lists, made on first read (the engine reads request by request)
    _lists: tuple[list[int], list[int], list[int], list[int]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def _host(self) -> tuple[list[int], list[int], list[int], list[int]]:
        if self._lists is None:
            out, acc, num, off = read_to_host(
                self.output_tokens, self.num_accepted, self.num_output, self.offsets
            )
            self._lists = (out, acc, num, off)
        return self._lists

    def tokens(self, b: int) -> list[int]:
        """Request b's new tokens (accepted drafts, then the recovered or bonus token)."""
        out, _, num_output, offsets = self._host()
        return out[offsets[b] : offsets[b] + num_output[b]]

    def accepted(self, b: int) -> int:
        """Request b's accepted drafts."""
        return self._host()[1][b]

    def cpu(self) -> RejectionResult:
        """The verdict on the host, read from the device in one copy."""
        if self.output_tokens.device.type == "cpu":
            return self
        host = RejectionResult.of_lists(*self._host())
        host.faults = self.faults
        return host

    @classmethod
    def of_lists(
        cls, output: list[int], accepted: list[int], num_output: list[int], offsets: list[int]
    ) -> RejectionResult:
        """A verdict already on the host (its lists kept: the engine reads those)."""
        t = [torch.tensor(x, dtype=torch.long) for x in (output, accepted, num_output, offsets)]
        result = cls(t[0], t[1], t[2], t[3])
        result._lists = (output, accepted, num_output, offsets)
        return result


def read_to_host(*tensors: torch.Tensor) -> list[list[int]]:
    """1-D integer tensors as host lists, in one device-to-host copy: the read that waits for
    the device. A step makes it once, for its verdict (accepted lengths and tokens)."""
    if len(tensors) == 1:
        return [tensors[0].tolist()]
    flat = torch.cat([t.reshape(-1).to(torch.long) for t in tensors]).tolist()
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()])
        at += t.numel()
    return out


def rejection_sample(
    target_probs: torch.Tensor,  # [T, V] float, T = sum(num_draft + 1): processed target p per verify row
    draft_tokens: torch.Tensor,  # [D] int64, D = sum(num_draft): request b's drafts at rows offsets[b] - b ..
    draft_probs: torch.Tensor | None,  # [D, V] float, draft q each token was sampled from; None = one-hot
    num_draft: torch.Tensor,  # [B] int64 >= 0, drafts request b verifies
    generators: Sequence[torch.Generator | None] | None = None,  # B entries
    draft_deterministic: torch.Tensor | None = None,  # [B] bool, requests whose q is one-hot on the draft
) -> RejectionResult:
    """Verify a flat batch of draft blocks.

    Request b owns verify rows offsets[b] .. offsets[b] + num_draft[b] (offsets =
    `verify_offsets(num_draft)`): row offsets[b] + k holds the target p that judges its draft
    k (draft row offsets[b] - b + k), the last row its bonus position. For k < num_draft[b]
    (p = that target row, q = the draft's q):

    - accepted token: draft x_k is kept with probability min(1, p(x_k) / q(x_k)), in order,
      while every earlier draft was kept;
    - recovered token: at the first rejection k, one token is sampled from
      norm(max(0, p - q)) and the request stops (if that residual has ~no mass, p == q up to
      rounding and p is used);
    - bonus token: if all num_draft[b] drafts are accepted, one token is sampled from the
      request's last row (position num_draft[b]).

    q is one-hot on the draft token when draft_probs is None or the request is flagged
    deterministic (n-gram lookup, greedy drafting); then acceptance is with probability
    p(x_k) and the residual is p with x_k removed. With a greedy (one-hot) target this is
    exactly "accept while draft == argmax, then emit the argmax".

    Randomness: request b draws num_draft[b] + 1 uniforms from generators[b] (or the global RNG
    when None), so a seeded request does not depend on what else is in the batch.
    """
    n_list = _checked_counts(
        target_probs, draft_tokens, draft_probs, num_draft, generators, draft_deterministic
    )
    t, vocab = target_probs.shape
    b, d = len(n_list), sum(n_list)
    device = target_probs.device
    nd = num_draft.to(device=device, dtype=torch.long)  # [B]
    offsets = verify_offsets(nd)  # [B+1]
    starts = offsets[:-1]  # [B] first verify row of each request
    u = _uniforms(n_list, generators, device)  # [T]: a request's draft rows, then its final draw
    req = torch.repeat_interleave(torch.arange(b, device=device), nd)  # [D] request of each draft
    vrow = torch.arange(d, device=device) + req  # [D] verify row judging each draft
    pos = vrow - starts[req]  # [D] position of each draft in its block
    tokens = draft_tokens.to(device=device, dtype=torch.long).clamp(0, vocab - 1)  # [D]
    det = None if draft_deterministic is None else draft_deterministic.to(device=device, dtype=torch.bool)
    q = _DraftQ(draft_probs, det, tokens)

    # Acceptance: u < p/q  <=>  u * q < p (no division, q = 0 cannot blow up).
    p_tok = target_probs[vrow, tokens].float()  # [D]
    accept = u[vrow] * q.of_tokens(req, p_tok) < p_tok  # [D]
    # Length of each request's accepted prefix: its first rejected position, or num_draft.
    # (an accepted draft offers num_draft, which changes nothing: no boolean selection, so the
    # host never waits on the device for the count of rejected drafts)
    num_accepted = nd.clone()  # [B]
    if d > 0:
        num_accepted.scatter_reduce_(0, req, torch.where(accept, nd[req], pos), reduce="amin")

    # Recovered and bonus tokens both sit at row starts + num_accepted: sample from the residual
    # where the request was rejected there, from p itself where it ran out of drafts.
    final_rows = starts + num_accepted  # [B]
    final_tokens = q.final_draws(target_probs, final_rows, num_accepted < nd, u[offsets[1:] - 1])  # [B]

    output = torch.full((t,), -1, dtype=torch.long, device=device)
    kept = pos < num_accepted[req]  # [D]
    output.index_copy_(0, vrow, torch.where(kept, tokens, -1))
    output[final_rows] = final_tokens  # after: a final row is a draft row that was not kept
    return RejectionResult(
        output_tokens=output, num_accepted=num_accepted, num_output=num_accepted + 1, offsets=offsets
    )


def _checked_counts(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_draft: torch.Tensor,
    generators: Sequence[torch.Generator | None] | None,
    draft_deterministic: torch.Tensor | None,
) -> list[int]:
    """`rejection_sample`'s inputs checked against each other -> num_draft as host integers."""
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs must be [T, V], got shape {tuple(target_probs.shape)}")
    if num_draft.dim() != 1:
        raise ValueError(f"num_draft must be [B], got shape {tuple(num_draft.shape)}")
    t, vocab = target_probs.shape
    n_list = [int(n) for n in num_draft.tolist()]
    b, d = len(n_list), sum(n_list)
    bad = [n for n in n_list if n < 0]
    if bad:
        raise ValueError(f"num_draft values must be >= 0, got {bad}")
    if t != d + b:
        raise ValueError(f"target_probs must have sum(num_draft + 1) = [{d + b}] rows, got {t}")
    if tuple(draft_tokens.shape) != (d,):
        raise ValueError(
            f"draft_tokens must be [{d}] (sum of num_draft), got shape {tuple(draft_tokens.shape)}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (d, vocab):
        raise ValueError(f"draft_probs must be [{d}, {vocab}], got shape {tuple(draft_probs.shape)}")
    if generators is not None and len(generators) != b:
        raise ValueError(f"{b} requests but {len(generators)} generators")
    if draft_deterministic is not None and tuple(draft_deterministic.shape) != (b,):
        raise ValueError(f"draft_deterministic must be [{b}], got shape {tuple(draft_deterministic.shape)}")
    return n_list


class _DraftQ:
    """The draft distribution q of each draft row: `probs` [D, V], or one-hot on the draft token
    where there are none or the request is deterministic (`det` [B] bool); tokens [D]."""

    def __init__(self, probs: torch.Tensor | None, det: torch.Tensor | None, tokens: torch.Tensor) -> None:
        self.probs, self.det, self.tokens = probs, det, tokens

    def of_tokens(self, req: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """q(x_k) of every draft [D] (req [D]: each draft's request)."""
        if self.probs is None:
            return torch.ones_like(like)
        q_tok = self.probs[torch.arange(len(self.tokens), device=like.device), self.tokens].float()
        if self.det is not None:
            q_tok = torch.where(self.det[req], torch.ones_like(q_tok), q_tok)
        return q_tok

    def final_draws(
        self, target_probs: torch.Tensor, final_rows: torch.Tensor, rejected: torch.Tensor, u: torch.Tensor
    ) -> torch.Tensor:
        """[B] each request's last token, drawn with its last uniform (u [B]) from
        `final_distribution` (target_probs [T, V]; final_rows, rejected [B]): on a CPU in one C
        pass per row that reads p (and q) where they lie, the residual computed as it is read
        (`sample_final_rows`, the same rule); elsewhere the distributions, then the draw (no
        host copy, so the host never waits on the device here)."""
        if target_probs.device.type == "cpu":
            b, d = len(final_rows), len(self.tokens)
            zeros = torch.zeros(b, dtype=torch.long)
            drow = (final_rows - torch.arange(b)).clamp(0, max(d - 1, 0))  # [B] draft row
            draws = FinalDraws(
                target_probs,
                final_rows,
                self.probs if d else None,
                drow,
                self.det if self.det is not None else zeros.bool(),
                self.tokens[drow] if d else zeros,
                rejected,
                RESIDUAL_EPS,
            )
            drawn = sample_final_rows(draws, u)
            if drawn is not None:
                return drawn
        p_final = target_probs[final_rows].float()
        return sample_from_uniforms(self.final_distribution(p_final, final_rows, rejected), u)

    def final_distribution(
        self, p_final: torch.Tensor, final_rows: torch.Tensor, rejected: torch.Tensor
    ) -> torch.Tensor:
        """[B, V]: norm(max(0, p - q)) at a request's rejected draft (p where that residual has
        ~no mass), p itself where every draft was accepted (p_final [B, V]: the rows at
        final_rows [B]; rejected [B] bool)."""
        d = len(self.tokens)
        if d == 0:
            return p_final
        b = len(final_rows)
        drow = (final_rows - torch.arange(b, device=p_final.device)).clamp(max=d - 1)  # [B] draft row
        onehot = torch.zeros_like(p_final).scatter_(1, self.tokens[drow].unsqueeze(1), 1.0)
        if self.probs is None:
            q_final = onehot
        else:
            q_final = self.probs[drow].float()
            if self.det is not None:
                q_final = torch.where(self.det.unsqueeze(1), onehot, q_final)
        residual = (p_final - q_final).clamp_min(0.0)
        use_residual = rejected & (residual.sum(dim=1) > RESIDUAL_EPS)
        return torch.where(use_residual.unsqueeze(1), residual, p_final)


def greedy_verify(
    target_argmax: torch.Tensor,  # [T] int64, T = sum(num_draft + 1): processed target argmax per row
    draft_tokens: torch.Tensor,  # [D] int64, D = sum(num_draft): request b's drafts, in order
    num_draft: torch.Tensor,  # [B] int64 >= 0, drafts request b verifies
) -> RejectionResult:
    """`rejection_sample` for a batch whose every request is greedy (one-hot target p): draft
    k is accepted while it equals the argmax of its row and every earlier draft was accepted;
    the recovered or bonus token is the argmax at the first row not accepted. Exactly what
    `rejection_sample` returns for one-hot p (whatever q), without a vocabulary-wide
    probability or a random draw. It walks host lists (a few integers per request: a dozen
    tiny tensor ops cost more), so the result is on the host."""
    if target_argmax.dim() != 1 or num_draft.dim() != 1:
        raise ValueError(
            f"target_argmax must be [T] and num_draft [B], got {tuple(target_argmax.shape)} "
            f"and {tuple(num_draft.shape)}"
        )
    (argmax,) = read_to_host(target_argmax)  # the verdict's one read from the device
    drafts, counts = draft_tokens.tolist(), num_draft.tolist()
    b, d = len(counts), sum(counts)
    if len(argmax) != d + b or tuple(draft_tokens.shape) != (d,):
        raise ValueError(
            f"need {d + b} verify rows and {d} drafts, got {tuple(target_argmax.shape)} and "
            f"{tuple(draft_tokens.shape)}"
        )
    output, accepted, offsets = [-1] * (d + b), [], [0]
    row = first = 0  # request's first verify row, its first draft
    for k in counts:
        a = 0
        while a < k and drafts[first + a] == argmax[row + a]:
            a += 1
        output[row : row + a] = drafts[first : first + a]
        output[row + a] = argmax[row + a]  # recovered (first mismatch) or bonus token
        accepted.append(a)
        row, first = row + k + 1, first + k
        offsets.append(row)
    return RejectionResult.of_lists(output, accepted, [a + 1 for a in accepted], offsets)


def _uniforms(
    n_list: list[int],
    generators: Sequence[torch.Generator | None] | None,
    device: torch.device,
) -> torch.Tensor:  # [T]
    """Per request, num_draft acceptance uniforms then the final draw's, in its verify rows."""
    t = sum(n_list) + len(n_list)
    if generators is None or all(g is None for g in generators):
        return torch.rand(t, device=device)
    if any(g is None for g in generators):
        u = torch.rand(t, device=device)  # global RNG for requests without a generator
    else:
        u = torch.zeros(t, device=device)
    start = 0
    for n, g in zip(n_list, generators):
        if g is not None:
            u[start : start + n + 1] = torch.rand(n + 1, generator=g, device=g.device).to(device)
        start += n + 1
    return u
