"""The DSpark drafter network (DeepSpec's `Qwen3DSparkModel`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from dspark_serve.drafter.dspark_model.config import Calibration, DSparkConfig
from dspark_serve.drafter.dspark_model.modules import ConfidenceHead, DecoderLayer, MarkovHead, RMSNorm
from dspark_serve.drafter.dspark_model.ops import rope_cos_sin, rope_inv_freq
from dspark_serve.drafter.dspark_model.sampling import CursorRows, GreedyWalk, SampledBlock, sample_block
from dspark_serve.ops.cpu_kernels import argmax_rows
from dspark_serve.ops.processors import (
    GuardedConstraint,
    TokenConstraint,
    TokenContext,
    next_best_allowed,
    process_next,
)
from dspark_serve.ops.sampling_params import SamplingParams


class DSparkModel(nn.Module):
    """The drafter network. embed_tokens / lm_head normally come from the target (frozen)."""

    d2t: torch.Tensor | None  # a buffer when the draft vocabulary is truncated
    inv_freq: torch.Tensor  # a buffer

    def __init__(
        self, config: DSparkConfig, embed_tokens: nn.Embedding | None = None, lm_head: nn.Linear | None = None
    ):
        super().__init__()
        cfg = config
        self.config = cfg
        d = cfg.hidden_size
        self.embed_tokens = embed_tokens if embed_tokens is not None else nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.num_taps * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = lm_head if lm_head is not None else nn.Linear(d, cfg.output_size, bias=False)
        if cfg.truncated:
            # d2t[i] = target id of draft id i (saved with the weights)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None
        self.markov_head = MarkovHead(cfg) if cfg.has_markov else None
        self.confidence_head = (
            ConfidenceHead(d + (cfg.markov_rank if cfg.confidence_uses_markov else 0))
            if cfg.enable_confidence_head
            else None
        )
        self.register_buffer(
            "inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), persistent=False
        )
        # Per-position confidence temperatures (Sequential Temperature Scaling), or None.
        self.calibration: Calibration | None = None
        self._d2t_list: tuple[tuple[int, int], list[int]] | None = None  # d2t's (address, version), list
        self._check_shared()

    # -- shared modules -----------------------------------------------------------------

    def _check_shared(self) -> None:
        v, d, o = self.config.vocab_size, self.config.hidden_size, self.config.output_size
        if tuple(self.embed_tokens.weight.shape) != (v, d):
            raise ValueError(f"embed_tokens must be [{v}, {d}], got {tuple(self.embed_tokens.weight.shape)}")
        if tuple(self.lm_head.weight.shape) != (o, d):
            raise ValueError(f"lm_head must be [{o}, {d}], got {tuple(self.lm_head.weight.shape)}")

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (identity without a truncated vocabulary)."""
        return draft_ids if self.d2t is None else self.d2t[draft_ids]

    def to_target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., output_size] draft distribution -> [..., vocab_size] (zero off the kept ids)."""
        if self.d2t is None:
            return probs
        return probs.new_zeros(*probs.shape[:-1], self.config.vocab_size).index_copy_(-1, self.d2t, probs)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    # -- backbone -----------------------------------------------------------------------

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """target_hidden: [..., m*d] (taps concatenated) -> context features [..., d]."""
        return self.hidden_norm(self.fc(target_hidden.to(self.dtype)))

    def context_kv(
        self, layer_idx: int, feats: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """feats: [..., n, d] projected context; positions: [..., n]
        -> k, v: [..., n, Hkv, D] (k = rope(k_norm(k_proj(feats))), v = v_proj(feats))."""
        cos, sin = rope_cos_sin(positions, self.inv_freq, feats.dtype)
        layer = cast(DecoderLayer, self.layers[layer_idx])
        return layer.self_attn.kv(feats, cos, sin)

    def block_input_ids(self, anchors: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
        """anchors: [...] -> [..., bs] = [anchor, mask, ..., mask]."""
        bs = block_size or self.config.block_size
        ids = torch.full(
            (*anchors.shape, bs), self.config.mask_token_id, dtype=torch.long, device=anchors.device
        )
        ids[..., 0] = anchors
        return ids

    def forward_block(
        self,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        ctx_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Serving forward over blocks with cached context.

        block_ids: [B, L]; block_positions: [B, L]; ctx_kv: per layer (k, v) [B, Lc, Hkv, D];
        ctx_mask: [B, Lc] bool (valid context slots) -> hidden [B, L, d] (final norm applied).
        Each block attends to its valid context and bidirectionally to itself."""
        b, length = block_ids.shape
        mask = torch.cat(
            [
                ctx_mask.unsqueeze(1).expand(b, length, -1),
                torch.ones(b, length, length, dtype=torch.bool, device=block_ids.device),
            ],
            dim=-1,
        )
        x = self.embed_tokens(block_ids).to(self.dtype)
        cos, sin = rope_cos_sin(block_positions, self.inv_freq, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    def forward_train(
        self,
        context_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        anchor_positions: torch.Tensor,
        anchor_valid: torch.Tensor,
    ) -> torch.Tensor:
        """Training forward (DeepSpec semantics).

        context_hidden: [B, S, m*d] target taps for every position; input_ids: [B, S];
        anchor_positions: [B, N] int; anchor_valid: [B, N] bool -> hidden [B, N, bs, d].
        Block n = [x_anchor, mask...] at positions anchor..anchor+bs-1 attends to context
        positions < anchor and bidirectionally to itself. Invalid blocks see only their own
        block (all-mask input) and must be masked out of the loss."""
        cfg = self.config
        bsz, seq = input_ids.shape
        n, bs = anchor_positions.shape[1], cfg.block_size
        dev = input_ids.device
        anchor_positions = anchor_positions.long()
        anchors = torch.gather(input_ids, 1, anchor_positions)
        anchors = torch.where(anchor_valid, anchors, torch.full_like(anchors, cfg.mask_token_id))
        block_ids = self.block_input_ids(anchors, bs).reshape(bsz, n * bs)
        offsets = torch.arange(bs, device=dev)
        block_pos = (anchor_positions.unsqueeze(-1) + offsets).reshape(bsz, n * bs)
        # mask [B, N*bs, S + N*bs]
        q_anchor = anchor_positions.repeat_interleave(bs, dim=1)  # [B, N*bs]
        q_valid = anchor_valid.repeat_interleave(bs, dim=1)
        ctx_ok = (torch.arange(seq, device=dev).view(1, 1, -1) < q_anchor.unsqueeze(-1)) & q_valid.unsqueeze(
            -1
        )
        blk = torch.arange(n, device=dev).repeat_interleave(bs)
        own = (blk.view(-1, 1) == blk.view(1, -1)).unsqueeze(0).expand(bsz, -1, -1)
        mask = torch.cat([ctx_ok, own], dim=-1)

        feats = self.project_context(context_hidden)
        ctx_pos = torch.arange(seq, device=dev).unsqueeze(0).expand(bsz, -1)
        ctx_cos, ctx_sin = rope_cos_sin(ctx_pos, self.inv_freq, feats.dtype)
        x = self.embed_tokens(block_ids).to(self.dtype)
        cos, sin = rope_cos_sin(block_pos, self.inv_freq, x.dtype)
        for layer in cast(Sequence[DecoderLayer], self.layers):
            k, v = layer.self_attn.kv(feats, ctx_cos, ctx_sin)
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x).reshape(bsz, n, bs, -1)

    # -- heads --------------------------------------------------------------------------

    def block_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits. hidden: [..., bs, d]; prev_tokens: [..., bs] (x_{k-1},
        anchor first) -> [..., bs, V] float32 = lm_head(h) + Markov bias."""
        logits = self.lm_head(hidden).float()
        if self.markov_head is not None:
            logits = logits + self.markov_head.block_bias(prev_tokens, hidden).float()
        return logits

    def confidence_logits(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor | None:
        """hidden: [..., bs, d]; prev_tokens: [..., bs] -> raw logits [..., bs] f32 or None."""
        if self.confidence_head is None:
            return None
        feats = hidden
        if self.config.confidence_uses_markov:
            assert self.markov_head is not None  # the config guarantees it
            e = self.markov_head.prev_embed(prev_tokens).to(hidden.dtype)
            feats = torch.cat([hidden, e], dim=-1)
        return self.confidence_head(feats).float()

    def confidence_probs(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor | None:
        """Calibrated c_k = sigmoid(logit_k / T_k). hidden: [..., K, d]; prev: [..., K] -> [..., K]."""
        logits = self.confidence_logits(hidden, prev_tokens)
        return None if logits is None else self.calibrated(logits)

    def calibrated(self, logits: torch.Tensor) -> torch.Tensor:
        """Raw confidence logits [..., K] -> c_k = sigmoid(logit_k / T_k) (the offline fit's
        temperatures; none stored: T = 1)."""
        if self.calibration is not None:
            k = logits.shape[-1]
            temps = self.calibration.temperatures
            if len(temps) < k:
                raise ValueError(f"calibration has {len(temps)} temperatures, block needs {k}")
            logits = logits / torch.tensor(temps[:k], dtype=logits.dtype, device=logits.device)
        return torch.sigmoid(logits)

    def sample_block(
        self,
        base_logits: torch.Tensor,
        anchor: torch.Tensor,
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        hidden: torch.Tensor | None = None,
        contexts: Sequence[TokenContext | None] | None = None,
        greedy: GreedyWalk | None = None,
    ) -> SampledBlock:
        """Left-to-right sampling with this drafter's Markov head (`sampling.sample_block`);
        rows with penalties, a logit bias or a grammar (`contexts`) are processed in the
        target's vocabulary, exactly as the verifier processes p; a greedy, unpenalized row whose
        grammar offers a cursor follows it along the draft instead (`CursorRows`). greedy: an
        all-greedy block's walk in one call (`sampling.sample_block`)."""
        shape = None
        cursors = None
        if contexts is not None:
            cursors = self._cursor_rows(sampling, contexts)

            def shape(i: int, row: torch.Tensor, drafted: list[int]) -> torch.Tensor:
                ctx = contexts[i]
                assert ctx is not None
                sp = sampling[i]
                if sp.greedy and not sp.penalized and ctx.constraint is not None:
                    return self._greedy_under(ctx.constraint, row, drafted)
                full = row if self.d2t is None else self.to_target_logits(row)
                out = process_next(full.unsqueeze(0), sampling[i], ctx, drafted)[0]
                if self.d2t is not None:
                    out = out[self.d2t]
                # Nothing left in the draft vocabulary (a grammar allowing only dropped ids):
                # keep the unprocessed q, a proper distribution; the verifier rejects its draft.
                return out if bool(torch.isfinite(out).any()) else row

        return sample_block(
            base_logits,
            anchor,
            sampling,
            generators,
            self.markov_head,
            self.to_target_ids,
            hidden,
            contexts,
            shape,
            greedy,
            cursors,
        )

    def _cursor_rows(
        self, sampling: Sequence[SamplingParams], contexts: Sequence[TokenContext | None]
    ) -> CursorRows | None:
        """The greedy, unpenalized rows whose guarded constraint offers a cursor, or None."""
        found = {}
        for i, (sp, ctx) in enumerate(zip(sampling, contexts)):
            c = ctx.constraint if ctx is not None else None
            if sp.greedy and not sp.penalized and isinstance(c, GuardedConstraint):
                cursor = c.draft_cursor(self.config.vocab_size)
                if cursor is not None:
                    found[i] = cursor
        if not found:
            return None
        return CursorRows(found, self.d2t, self._targets())

    def _targets(self) -> list[int] | None:
        """d2t as a list (read per drafted token by the cursor rows), made once."""
        if self.d2t is None:
            return None
        key = (self.d2t.data_ptr(), self.d2t._version)  # loading weights writes d2t in place
        if self._d2t_list is None or self._d2t_list[0] != key:
            self._d2t_list = (key, self.d2t.tolist())
        return self._d2t_list[1]

    def _greedy_under(
        self, constraint: TokenConstraint, row: torch.Tensor, drafted: list[int]
    ) -> torch.Tensor:
        """A greedy, unpenalized row under a grammar (`sample_block`'s shape). It reads only its
        argmax, so the row is returned unchanged where the grammar allows that token; else the
        next few best tokens are tried in order (`next_best_allowed`) and the ones before the
        first allowed are dropped; else it is masked in the draft
        vocabulary by the grammar's mask read through d2t (what `process_next` computes over the
        target's vocabulary, without widening the row to it). Nothing left in the draft
        vocabulary: the row as it was (the verifier rejects its draft)."""
        n = len(drafted) + 1
        top = int(argmax_rows(row.unsqueeze(0))[0])
        if constraint.valid_prefix([*drafted, self._target_id(top)]) == n:
            return row
        found = next_best_allowed(row, lambda i: constraint.valid_prefix([*drafted, self._target_id(i)]) == n)
        if found is not None:
            out = row.clone()
            out[found[1]] = float("-inf")  # the forbidden ones ranked above it
            return out
        allowed = constraint.allowed_after(drafted, self.config.vocab_size).to(row.device)
        keep = allowed if self.d2t is None else allowed[self.d2t]
        return row.masked_fill(~keep, float("-inf")) if bool(keep.any()) else row

    def _target_id(self, draft_id: int) -> int:
        return draft_id if self.d2t is None else int(self.d2t[draft_id])

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[output_size] draft logits -> [vocab_size] (-inf off the kept ids)."""
        if self.d2t is None:
            return logits
        return logits.new_full((self.config.vocab_size,), float("-inf")).index_copy_(0, self.d2t, logits)
