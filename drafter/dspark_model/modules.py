"""The layers of the DSpark drafter (parameter names match DeepSpec's state dict)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dspark_serve.drafter.dspark_model.config import DSparkConfig
from dspark_serve.drafter.dspark_model.ops import ACTIVATIONS, apply_rope, attend, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        h, hkv, dh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, dh
        self.q_proj = nn.Linear(d, h * dh, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, hkv * dh, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, hkv * dh, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * dh, d, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(dh, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(dh, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [..., L, d]; cos/sin: [..., L, D] -> k, v: [..., L, Hkv, D] (k normed + roped)."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """x: [B, L, d] block inputs; cos/sin: [B, L, D]; ctx_k/ctx_v: [B, Lc, Hkv, D]
        (context, already normed + roped); mask: [B, L, Lc + L] bool -> [B, L, d]."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))
        q = apply_rope(q, cos, sin)
        k, v = self.kv(x, cos, sin)
        k = torch.cat([ctx_k.to(k.dtype), k], dim=1)
        v = torch.cat([ctx_v.to(v.dtype), v], dim=1)
        return self.o_proj(attend(q, k, v, mask))


class MLP(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MarkovHead(nn.Module):
    """Sequential head: logits_k = U_k + bias(x_{k-1}, h_k[, state]).

    vanilla: W2(W1[x]); gated: W2(sigmoid(G[h ; W1[x]]) * W1[x]);
    rnn: GRU-like state s over the block, bias = W2(tanh(o)).
    """

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        r, d, vocab = cfg.markov_rank, cfg.hidden_size, cfg.vocab_size
        self.kind = cfg.markov_head_type
        self.rank = r
        # W1 reads the previous token, a target id (the anchor may lie outside a truncated
        # draft vocabulary); W2 writes draft-vocabulary logits.
        self.markov_w1 = nn.Embedding(vocab, r)
        self.markov_w2 = nn.Linear(r, cfg.output_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(d + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + d, 3 * r)

    def prev_embed(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """prev_tokens: [...] -> W1[prev]: [..., r]."""
        return self.markov_w1(prev_tokens.long())

    def init_state(self, lead_shape: Sequence[int], like: torch.Tensor) -> torch.Tensor | None:
        if self.kind != "rnn":
            return None
        return torch.zeros(*lead_shape, self.rank, device=like.device, dtype=like.dtype)

    def step(
        self, state: torch.Tensor | None, prev_tokens: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """prev_tokens: [...]; hidden: [..., d]; state: [..., r] or None
        -> (new state, bias [..., V])."""
        e = self.prev_embed(prev_tokens)
        if self.kind == "vanilla":
            return state, self.markov_w2(e)
        if hidden is None:
            raise ValueError(f"a {self.kind!r} Markov head needs the block's hidden states")
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(e.dtype), e], dim=-1)))
            return state, self.markov_w2(gate * e)
        if state is None:
            raise ValueError("an 'rnn' Markov head needs its state (init_state)")
        z = torch.cat([state, e, hidden.to(e.dtype)], dim=-1)
        g, c, o = self.joint_proj(z).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        new_state = g * state + (1.0 - g) * torch.tanh(c)
        return new_state, self.markov_w2(torch.tanh(o))

    def block_bias(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced bias. prev_tokens: [..., bs]; hidden: [..., bs, d] -> [..., bs, V]."""
        if self.kind != "rnn":
            return self.step(None, prev_tokens, hidden)[1]
        state = self.init_state(prev_tokens.shape[:-1], self.markov_w1.weight)
        out = []
        for k in range(prev_tokens.shape[-1]):
            state, bias = self.step(state, prev_tokens[..., k], hidden[..., k, :])
            out.append(bias)
        return torch.stack(out, dim=-2)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)
