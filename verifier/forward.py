"""What one target forward takes and returns, and the interface every forward implements.

The forward runs the new tokens of every scheduled request as one flat batch (no padding of the
token batch) over the paged KV cache. Which cache blocks a request holds is the scheduler's
business (`scheduler/block_manager.py`): each segment carries its block table, the forward only
reads it, writes the new tokens' K/V at their slots and attends to the blocks before them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

# Segments this short (decode/verify rounds) are attended together, one call per layer; longer
# ones (prefill chunks) get a call each, so one long prompt never pads the whole batch.
SMALL_SEGMENT = 32


@dataclass
class Segment:
    """The new tokens of one request in this forward.

    token_ids: tokens fed this step (prefill chunk, or anchor + drafts).
    start_pos: sequence position of token_ids[0]; the KV of positions < start_pos is cached.
    logits_from: logits are returned for segment rows [logits_from, len(token_ids)).
    blocks: the request's block table: the cache block of positions [i * block_size, (i + 1) *
        block_size) is blocks[i]; it covers every position up to start_pos + len(token_ids).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    logits_from: int
    blocks: Sequence[int]

    @property
    def num_logits(self) -> int:
        return len(self.token_ids) - self.logits_from

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)

    def slots(self, block_size: int, start: int, end: int) -> list[int]:
        """Cache slots of positions [start, end)."""
        return [self.blocks[p // block_size] * block_size + p % block_size for p in range(start, end)]


@dataclass
class ForwardOutput:
    """logits: [sum num_logits, V], segments in order: float32, or the model's dtype from the
    fast CPU forward (consumers that need float32, sampling and logprobs, widen the rows they
    read; a greedy verdict is the argmax, the same in either). hidden: [sum len(token_ids), m*d]
    (tap layers concatenated) or None. *_offsets[i]: first row of segment i. slots: [sum
    len(token_ids)] the KV cache slot of every row (where its K/V was written), or None."""

    logits: torch.Tensor
    logits_offsets: list[int]
    hidden: torch.Tensor | None
    token_offsets: list[int]
    slots: torch.Tensor | None = None


@dataclass(frozen=True)
class RowLayout:
    """Where each segment's rows lie in the flat batch: token_offsets[i] its first token row,
    logits_offsets[i] its first logits row, logit_rows the token rows logits are taken from."""

    token_offsets: list[int]
    logits_offsets: list[int]
    logit_rows: list[int]

    @classmethod
    def of(cls, segments: Sequence[Segment]) -> RowLayout:
        token_offsets: list[int] = []
        logits_offsets: list[int] = []
        logit_rows: list[int] = []
        r = 0
        for s in segments:
            token_offsets.append(r)
            logits_offsets.append(len(logit_rows))
            logit_rows.extend(range(r + s.logits_from, r + len(s.token_ids)))
            r += len(s.token_ids)
        return cls(token_offsets, logits_offsets, logit_rows)


@dataclass(frozen=True)
class ModelParts:
    """The pieces of a HF causal LM (Llama/Qwen2/Qwen3: pre-norm attention + SwiGLU MLP, Qwen3
    with q/k head norms, Qwen2 with q/k/v biases) a forward runs, and its geometry."""

    model: torch.nn.Module
    config: Any
    embed: torch.nn.Module
    layers: list[Any]  # the HF decoder layers
    norm: torch.nn.Module
    rotary: torch.nn.Module
    lm_head: torch.nn.Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelParts:
        cfg: Any = model.config
        inner: Any = model.model
        p = next(model.parameters())
        return cls(
            model=model,
            config=cfg,
            embed=inner.embed_tokens,
            layers=list(inner.layers),
            norm=inner.norm,
            rotary=inner.rotary_emb,
            lm_head=model.lm_head,  # type: ignore[arg-type]
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            device=p.device,
            dtype=p.dtype,
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def has_qk_norm(self) -> bool:
        return hasattr(self.layers[0].self_attn, "q_norm")

    @property
    def scaling(self) -> float:
        return float(self.head_dim**-0.5)


class Forward(Protocol):
    """One way to run the target (the reference forward, the fast one)."""

    def __call__(self, segments: Sequence[Segment], tap_layers: tuple[int, ...]) -> ForwardOutput: ...

    def describe(self) -> str: ...

    def uses_c_kernels(self) -> bool: ...
