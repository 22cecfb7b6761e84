"""The memory plan of an accelerator at start-up: what is fixed, and how many KV tokens remain.

Everything the engine will hold is counted against `gpu_memory_utilization` of the device's
memory (vLLM's name and default): the weights of the target and the drafter (shared tensors once),
the activation peak of the largest step, the CUDA graphs' pool, the drafter's context pools at
their largest, and per KV token its keys and values in every layer plus the tap rows the
prefix cache keeps beside them. The KV cache gets what remains, so a request the scheduler
admits (its tokens fit the KV blocks) never runs the device out of memory mid-step; a
configuration whose remainder cannot hold one request of `max_model_len` is refused at start-up,
with the table.

Pure arithmetic on counts (the model's parameters may live on the meta device), so the plan of
a Qwen3-14B on a 141 GB card is checked on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

GiB = 2**30


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class TargetGeometry:
    """The target's shape, as its HF config gives it."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def of(cls, hf_config: object) -> TargetGeometry:
        c = hf_config
        heads = int(c.num_attention_heads)  # type: ignore[attr-defined]
        hidden = int(c.hidden_size)  # type: ignore[attr-defined]
        return cls(
            hidden_size=hidden,
            intermediate_size=int(c.intermediate_size),  # type: ignore[attr-defined]
            num_layers=int(c.num_hidden_layers),  # type: ignore[attr-defined]
            num_heads=heads,
            num_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or hidden // heads),
            vocab_size=int(c.vocab_size),  # type: ignore[attr-defined]
        )

    def kv_bytes_per_token(self, elt: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elt

    def activation_bytes(self, tokens: int, logit_rows: int, elt: int) -> int:
        """The live tensors of one step of `tokens` rows at its widest point (a layer's
        residual stream, its norm, q/k/v, attention output and SwiGLU's gate|up, product and
        down projection), and the logits of `logit_rows` rows in the model's dtype plus the
        float32 copies sampling makes (probabilities, the sort of top-p, the CDF)."""
        d, i = self.hidden_size, self.intermediate_size
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_row = 4 * d + qkv + self.num_heads * self.head_dim + 3 * i
        return tokens * per_row * elt + logit_rows * self.vocab_size * (elt + 3 * 4)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of each part against the budget, and the KV tokens that fit.

    fixed parts: weights, activation_peak, graph_pool, drafter_contexts; per token: kv_per_token
    (K and V of every layer) and tap_rows_per_token (the prefix cache's hidden rows per slot)."""

    device_bytes: int
    utilization: float
    weights: int
    activation_peak: int
    graph_pool: int
    drafter_contexts: int
    kv_per_token: int
    tap_rows_per_token: int
    kv_tokens: int

    @property
    def budget(self) -> int:
        return int(self.device_bytes * self.utilization)

    @property
    def fixed(self) -> int:
        return self.weights + self.activation_peak + self.graph_pool + self.drafter_contexts

    @property
    def per_token(self) -> int:
        return self.kv_per_token + self.tap_rows_per_token

    @property
    def total(self) -> int:
        return self.fixed + self.kv_tokens * self.per_token

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("weights (target + drafter)", self.weights),
            ("activation peak (largest step)", self.activation_peak),
            ("CUDA graph pool", self.graph_pool),
            ("drafter context pools (at most)", self.drafter_contexts),
            (f"KV cache ({self.kv_tokens} tokens)", self.kv_tokens * self.kv_per_token),
            (f"tap rows ({self.kv_tokens} tokens)", self.kv_tokens * self.tap_rows_per_token),
            ("planned", self.total),
            (f"budget ({self.utilization:g} of {self.device_bytes / GiB:.1f} GiB)", self.budget),
        ]

    def table(self) -> str:
        width = max(len(name) for name, _ in self.rows())
        return "\n".join(f"  {name:<{width}}  {n / GiB:9.2f} GiB" for name, n in self.rows())


def parameter_bytes(modules: Iterable[torch.nn.Module]) -> int:
    """Bytes of every parameter and buffer of the modules, a tensor shared between them (the
    drafter's view of the target's embedding and LM head) counted once."""
    seen: set[int] = set()
    total = 0
    for m in modules:
        for t in (*m.parameters(), *m.buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def plan_memory(
    device_bytes: int,
    utilization: float,
    weights: int,
    target: TargetGeometry,
    elt: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_logit_rows: int,
    tap_width: int = 0,
    drafter_context_per_token: int = 0,
    graph_tokens: int = 0,
) -> MemoryPlan:
    """The plan (see the module's docstring). tap_width: hidden values the prefix cache keeps per
    KV slot (taps x hidden, 0 without a drafter that taps); drafter_context_per_token: bytes of
    the drafter's context K/V per position (its pools double, to the next power of two of
    max_num_seqs request slots and a scratch slot, of the next power of two of max_model_len
    positions at their largest); graph_tokens: the largest
    CUDA graph bucket (its pool holds one such step's activations; 0 without graphs).
    -> MemoryPlan, or ValueError with the table when one request of max_model_len cannot fit."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    activation = target.activation_bytes(
        max_num_batched_tokens, min(max_logit_rows, max_num_batched_tokens), elt
    )
    graph = target.activation_bytes(graph_tokens, graph_tokens, elt) if graph_tokens else 0
    contexts = (_next_pow2(max_num_seqs) + 1) * _next_pow2(max_model_len) * drafter_context_per_token
    kv, taps = target.kv_bytes_per_token(elt), tap_width * elt
    plan = MemoryPlan(device_bytes, utilization, weights, activation, graph, contexts, kv, taps, 0)
    tokens = max(0, (plan.budget - plan.fixed) // plan.per_token)
    plan = MemoryPlan(device_bytes, utilization, weights, activation, graph, contexts, kv, taps, tokens)
    if tokens < max_model_len:
        raise ValueError(
            f"the model does not fit: {tokens} KV tokens remain, one request of max_model_len "
            f"{max_model_len} needs {max_model_len}; lower --max-model-len, --max-num-seqs or "
            f"--max-num-batched-tokens, or raise --gpu-memory-utilization\n{plan.table()}"
        )
    return plan
