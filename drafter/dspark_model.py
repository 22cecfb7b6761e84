"""The DSpark drafter network, checkpoint-compatible with DeepSpec's `Qwen3DSparkModel`.

A few Qwen3-style layers draft a whole block at once: the input is the anchor token followed
by `block_size - 1` mask tokens, queries attend bidirectionally inside the block and to the
target's projected hidden states of every earlier position (KV injection). A Markov head adds
a low-rank bias that depends on the previous draft token; a confidence head estimates the
per-position acceptance probability. Parameter names match DeepSpec exactly so its
checkpoints load as is.
"""
from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from verifier.sampling import SamplingTensors, probs_from_logits, sample
from verifier.sampling_params import SamplingParams

ARCHITECTURE = "Qwen3DSparkModel"
CALIBRATION_FILE = "calibration.json"
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
_SUPPORTED_ROPE = ("default", "linear", "llama3")
# Keys a training framework may put in front of the parameter names.
_KEY_PREFIXES = ("_orig_mod.", "module.", "model.", "draft_model.")


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DSparkConfig:
    """Architecture of a DSpark drafter (the fields of DeepSpec's config.json).

    hidden_size: width d of the drafter (= the target's hidden size).
    num_hidden_layers: number of draft transformer layers.
    num_attention_heads / num_key_value_heads / head_dim: attention shape (GQA allowed).
    intermediate_size: SwiGLU MLP width.
    vocab_size: vocabulary of the shared embedding / LM head.
    block_size: tokens per drafted block (anchor + block_size - 1 masks; predicts block_size).
    target_layer_ids: target layers tapped for KV injection (-1 = embeddings), increasing.
    mask_token_id: token id filling the non-anchor block slots.
    num_target_layers: decoder layers of the target (bounds target_layer_ids).
    rms_norm_eps: RMSNorm epsilon.
    rope_theta: rotary base.
    rope_scaling: rotary scaling dict (HF style, with "rope_type"/"type") or None.
    max_position_embeddings: longest position the rotary tables are meant for.
    attention_bias: whether q/k/v/o projections have biases.
    hidden_act: MLP activation ("silu" for Qwen/Llama).
    markov_rank: rank r of the sequential head; 0 = no head (DFlash).
    markov_head_type: "vanilla", "gated" or "rnn".
    enable_confidence_head: whether a confidence head exists.
    confidence_head_with_markov: confidence input is [h ; W1[x_prev]] instead of h.
    num_anchors: anchors sampled per sequence in training (unused when serving).
    draft_vocab_size: size of a truncated draft vocabulary (0 = the full vocabulary). The
        draft LM head and the Markov head's output then cover only the kept target ids,
        listed in the checkpoint's `d2t` tensor (d2t[i] = target id of draft id i), so q is
        a proper distribution over them (zero elsewhere) and verification stays lossless.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    num_anchors: int = 512
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                     "block_size", "num_target_layers", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads!r}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads!r})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim!r}")
        if not self.target_layer_ids:
            raise ValueError(f"target_layer_ids must not be empty, got {self.target_layer_ids!r}")
        prev = None
        for lid in self.target_layer_ids:
            if not (lid == -1 or 0 <= lid < self.num_target_layers):
                raise ValueError(
                    f"target_layer_ids entry {lid!r} outside {{-1}} U "
                    f"[0, {self.num_target_layers - 1}]")
            if prev is not None and lid <= prev:
                raise ValueError(
                    f"target_layer_ids must be strictly increasing, got {self.target_layer_ids!r}")
            prev = lid
        if not (0 <= self.mask_token_id < self.vocab_size):
            raise ValueError(
                f"mask_token_id must be in [0, vocab_size={self.vocab_size}), "
                f"got {self.mask_token_id!r}")
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank!r}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, "
                f"got {self.markov_head_type!r}")
        if self.confidence_head_with_markov and self.enable_confidence_head and self.markov_rank == 0:
            raise ValueError("confidence_head_with_markov=True needs markov_rank > 0, got 0")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(_ACTIVATIONS)}, got {self.hidden_act!r}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not (0 <= self.draft_vocab_size <= self.vocab_size):
            raise ValueError(f"draft_vocab_size must be in [0, vocab_size={self.vocab_size}], "
                             f"got {self.draft_vocab_size!r}")
        rope_type = _rope_type(self.rope_scaling)
        if rope_type not in _SUPPORTED_ROPE:
            raise ValueError(f"rope_scaling type must be one of {_SUPPORTED_ROPE}, got {rope_type!r}")
        if self.num_anchors <= 0:
            raise ValueError(f"num_anchors must be > 0, got {self.num_anchors!r}")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def has_markov(self) -> bool:
        return self.markov_rank > 0

    @property
    def truncated(self) -> bool:
        return 0 < self.draft_vocab_size < self.vocab_size

    @property
    def output_size(self) -> int:
        """Rows of the draft LM head: the kept ids of a truncated vocabulary, else all."""
        return self.draft_vocab_size if self.truncated else self.vocab_size

    @property
    def confidence_uses_markov(self) -> bool:
        return self.enable_confidence_head and self.confidence_head_with_markov

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> "DSparkConfig":
        """Build from a DeepSpec / HF config.json dict (extra keys are ignored)."""
        archs = d.get("architectures")
        if archs and ARCHITECTURE not in archs:
            raise ValueError(f"expected architectures to contain {ARCHITECTURE!r}, got {archs!r}")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size", "vocab_size", "block_size",
                               "target_layer_ids", "mask_token_id") if k not in d]
        if missing:
            raise ValueError(f"config is missing DSpark fields {missing!r}")
        theta, scaling = _rope_from_hf(d)
        num_heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // num_heads
        enable_conf = bool(d.get("enable_confidence_head", False))
        target_ids = [int(i) for i in d["target_layer_ids"]]
        return cls(
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]),
            block_size=int(d["block_size"]),
            target_layer_ids=tuple(target_ids),
            mask_token_id=int(d["mask_token_id"]),
            # Older configs may lack it; the largest tap bounds it from below.
            num_target_layers=int(d.get("num_target_layers") or max(target_ids) + 1),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
            attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=str(d.get("hidden_act", "silu")),
            markov_rank=int(d.get("markov_rank", 0)),
            markov_head_type=str(d.get("markov_head_type") or "vanilla").lower(),
            enable_confidence_head=enable_conf,
            confidence_head_with_markov=bool(d.get("confidence_head_with_markov", False)) and enable_conf,
            num_anchors=int(d.get("num_anchors", 512)),
            draft_vocab_size=int(d.get("draft_vocab_size") or 0),
        )

    def to_json_dict(self) -> dict[str, Any]:
        """A config.json that DeepSpec's `Qwen3DSparkModel.from_pretrained` accepts."""
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "hidden_act": self.hidden_act,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "block_size": self.block_size,
            "target_layer_ids": list(self.target_layer_ids),
            "num_target_layers": self.num_target_layers,
            "mask_token_id": self.mask_token_id,
            "num_anchors": self.num_anchors,
            "markov_rank": self.markov_rank,
            "enable_confidence_head": self.enable_confidence_head,
        }
        if self.markov_rank > 0:
            d["markov_head_type"] = self.markov_head_type
        if self.enable_confidence_head:
            d["confidence_head_with_markov"] = self.confidence_head_with_markov
        if self.truncated:
            d["draft_vocab_size"] = self.draft_vocab_size
        return d

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        *,
        num_draft_layers: int,
        block_size: int,
        target_layer_ids: Sequence[int],
        mask_token_id: int,
        markov_rank: int = 0,
        markov_head_type: str = "vanilla",
        enable_confidence_head: bool = False,
        confidence_head_with_markov: bool = False,
        num_anchors: int = 512,
        intermediate_size: int | None = None,
    ) -> "DSparkConfig":
        """A drafter shaped like `target_config` (an HF Llama/Qwen2/Qwen3 config or its dict)."""
        d = target_config if isinstance(target_config, dict) else target_config.to_dict()
        # Multimodal wrappers keep the language model under text_config.
        if "hidden_size" not in d and isinstance(d.get("text_config"), dict):
            d = d["text_config"]
        theta, scaling = _rope_from_hf(d)
        num_heads = int(d["num_attention_heads"])
        return cls(
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=int(num_draft_layers),
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // num_heads),
            intermediate_size=int(intermediate_size or d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]),
            block_size=int(block_size),
            target_layer_ids=tuple(int(i) for i in target_layer_ids),
            mask_token_id=int(mask_token_id),
            num_target_layers=int(d["num_hidden_layers"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
            attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=str(d.get("hidden_act", "silu")),
            markov_rank=int(markov_rank),
            markov_head_type=str(markov_head_type).lower(),
            enable_confidence_head=bool(enable_confidence_head),
            confidence_head_with_markov=bool(confidence_head_with_markov) and bool(enable_confidence_head),
            num_anchors=int(num_anchors),
        )

    def replace(self, **changes: Any) -> "DSparkConfig":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return DSparkConfig(**values)


def _rope_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a legacy (rope_theta/rope_scaling) or new
    (rope_parameters) HF config dict."""
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = d.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and _rope_type(scaling) == "default":
        scaling = None
    return float(theta), (dict(scaling) if scaling else None)


@dataclass(frozen=True)
class Calibration:
    """Sequential Temperature Scaling: c_k = sigmoid(logit_k / temperatures[k]).

    temperatures: one positive temperature per block position (index 0 = first draft).
    """

    temperatures: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))
        if not self.temperatures:
            raise ValueError(f"calibration needs at least one temperature, got {self.temperatures!r}")
        for t in self.temperatures:
            if not (t > 0 and math.isfinite(t)):
                raise ValueError(f"calibration temperatures must be finite and > 0, got {t!r}")

    @classmethod
    def from_json_dict(cls, d: dict[str, Any]) -> "Calibration":
        if "temperatures" not in d:
            raise ValueError(f"calibration.json needs a 'temperatures' list, got keys {sorted(d)!r}")
        return cls(temperatures=tuple(d["temperatures"]))

    def to_json_dict(self) -> dict[str, Any]:
        return {"method": "sequential_temperature_scaling", "temperatures": list(self.temperatures)}


# --------------------------------------------------------------------------------------
# Pure math
# --------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., n], weight: [n]. Normalizes in float32 like Qwen3RMSNorm."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies (default / linear / llama3 scaling)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = _rope_type(scaling)
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv = torch.where(is_mid, mid, scaled)
    return inv


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [...] int; inv_freq: [D/2] -> cos, sin: [..., D] in `dtype`."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., L, H, D]; cos/sin: [..., L, D] (broadcast over heads)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q: [B, Lq, H, D]; k, v: [B, Lk, Hkv, D]; mask: [B, Lq, Lk] bool (True = attend).

    Returns [B, Lq, H * D]. Every query row must allow at least one key."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
    return out.transpose(1, 2).flatten(2)


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


# --------------------------------------------------------------------------------------
# Modules (names match DeepSpec's state dict)
# --------------------------------------------------------------------------------------


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
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
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
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

    def step(self, state: torch.Tensor | None, prev_tokens: torch.Tensor,
             hidden: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """prev_tokens: [...]; hidden: [..., d]; state: [..., r] or None
        -> (new state, bias [..., V])."""
        e = self.prev_embed(prev_tokens)
        if self.kind == "vanilla":
            return state, self.markov_w2(e)
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(e.dtype), e], dim=-1)))
            return state, self.markov_w2(gate * e)
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


class DSparkModel(nn.Module):
    """The drafter network. embed_tokens / lm_head normally come from the target (frozen)."""

    def __init__(self, config: DSparkConfig, embed_tokens: nn.Embedding | None = None,
                 lm_head: nn.Linear | None = None):
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
            if cfg.enable_confidence_head else None)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                             persistent=False)
        # Per-position confidence temperatures (Sequential Temperature Scaling), or None.
        self.calibration: Calibration | None = None
        self._check_shared()

    # -- shared modules -----------------------------------------------------------------

    def _check_shared(self) -> None:
        v, d, o = self.config.vocab_size, self.config.hidden_size, self.config.output_size
        if tuple(self.embed_tokens.weight.shape) != (v, d):
            raise ValueError(f"embed_tokens must be [{v}, {d}], got {tuple(self.embed_tokens.weight.shape)}")
        if tuple(self.lm_head.weight.shape) != (o, d):
            raise ValueError(f"lm_head must be [{o}, {d}], got {tuple(self.lm_head.weight.shape)}")

    def attach_shared(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        """Use the target's embedding and LM head (by reference; caller decides freezing).
        With a truncated vocabulary (d2t set), a full-vocabulary head is cut to the kept rows."""
        if self.config.truncated and lm_head.weight.shape[0] == self.config.vocab_size:
            lm_head = draft_head(lm_head, self.d2t)
        self.embed_tokens, self.lm_head = embed_tokens, lm_head
        self._check_shared()

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

    def context_kv(self, layer_idx: int, feats: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """feats: [..., n, d] projected context; positions: [..., n]
        -> k, v: [..., n, Hkv, D] (k = rope(k_norm(k_proj(feats))), v = v_proj(feats))."""
        cos, sin = rope_cos_sin(positions, self.inv_freq, feats.dtype)
        return self.layers[layer_idx].self_attn.kv(feats, cos, sin)

    def block_input_ids(self, anchors: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
        """anchors: [...] -> [..., bs] = [anchor, mask, ..., mask]."""
        bs = block_size or self.config.block_size
        ids = torch.full((*anchors.shape, bs), self.config.mask_token_id,
                         dtype=torch.long, device=anchors.device)
        ids[..., 0] = anchors
        return ids

    def forward_block(self, block_ids: torch.Tensor, block_positions: torch.Tensor,
                      ctx_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      ctx_mask: torch.Tensor) -> torch.Tensor:
        """Serving forward over blocks with cached context.

        block_ids: [B, L]; block_positions: [B, L]; ctx_kv: per layer (k, v) [B, Lc, Hkv, D];
        ctx_mask: [B, Lc] bool (valid context slots) -> hidden [B, L, d] (final norm applied).
        Each block attends to its valid context and bidirectionally to itself."""
        b, length = block_ids.shape
        mask = torch.cat([ctx_mask.unsqueeze(1).expand(b, length, -1),
                          torch.ones(b, length, length, dtype=torch.bool, device=block_ids.device)], dim=-1)
        x = self.embed_tokens(block_ids).to(self.dtype)
        cos, sin = rope_cos_sin(block_positions, self.inv_freq, x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    def forward_train(self, context_hidden: torch.Tensor, input_ids: torch.Tensor,
                      anchor_positions: torch.Tensor, anchor_valid: torch.Tensor) -> torch.Tensor:
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
        ctx_ok = (torch.arange(seq, device=dev).view(1, 1, -1) < q_anchor.unsqueeze(-1)) & q_valid.unsqueeze(-1)
        blk = torch.arange(n, device=dev).repeat_interleave(bs)
        own = (blk.view(-1, 1) == blk.view(1, -1)).unsqueeze(0).expand(bsz, -1, -1)
        mask = torch.cat([ctx_ok, own], dim=-1)

        feats = self.project_context(context_hidden)
        ctx_pos = torch.arange(seq, device=dev).unsqueeze(0).expand(bsz, -1)
        ctx_cos, ctx_sin = rope_cos_sin(ctx_pos, self.inv_freq, feats.dtype)
        x = self.embed_tokens(block_ids).to(self.dtype)
        cos, sin = rope_cos_sin(block_pos, self.inv_freq, x.dtype)
        for layer in self.layers:
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
            e = self.markov_head.prev_embed(prev_tokens).to(hidden.dtype)
            feats = torch.cat([hidden, e], dim=-1)
        return self.confidence_head(feats).float()

    def confidence_probs(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor | None:
        """Calibrated c_k = sigmoid(logit_k / T_k). hidden: [..., K, d]; prev: [..., K] -> [..., K]."""
        logits = self.confidence_logits(hidden, prev_tokens)
        if logits is None:
            return None
        if self.calibration is not None:
            k = logits.shape[-1]
            temps = self.calibration.temperatures
            if len(temps) < k:
                raise ValueError(f"calibration has {len(temps)} temperatures, block needs {k}")
            logits = logits / torch.tensor(temps[:k], dtype=logits.dtype, device=logits.device)
        return torch.sigmoid(logits)

    @torch.no_grad()
    def sample_block(self, base_logits: torch.Tensor, anchor: torch.Tensor,
                     sampling: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                     hidden: torch.Tensor | None = None) -> SampledBlock:
        """Left-to-right sampling with the Markov head.

        base_logits: [B, K, V] (lm_head output); anchor: [B]; sampling/generators: one per
        row; hidden: [B, K, d] (needed by gated / rnn heads) -> SampledBlock.
        q_k = probs_from_logits(corrected logits_k) with the row's temperature/top-p/top-k,
        the same function the verifier shapes p with. Greedy rows take the argmax (q one-hot)
        and skip the vocabulary-wide work."""
        b, steps, vocab = base_logits.shape  # vocab: the draft vocabulary (output_size)
        dev = base_logits.device
        head = self.markov_head
        if head is not None and head.kind != "vanilla" and hidden is None:
            raise ValueError(f"markov_head_type {head.kind!r} needs the block hidden states")
        rows = [i for i, s in enumerate(sampling) if not s.greedy]
        if rows:
            row_idx = torch.tensor(rows, dtype=torch.long, device=dev)
            st = SamplingTensors.from_params([sampling[i] for i in rows], dev)
            row_gens = [generators[i] for i in rows]
        state = head.init_state((b,), head.markov_w1.weight) if head is not None else None
        prev = anchor.long().to(dev)
        tokens, probs, prevs = [], [], []
        for k in range(steps):
            logits = base_logits[:, k].float()
            if head is not None:
                state, bias = head.step(state, prev, hidden[:, k] if hidden is not None else None)
                logits = logits + bias.float()
            tok = logits.argmax(-1)
            if rows:
                q = probs_from_logits(logits[row_idx], st.temperature, st.top_p, st.top_k)
                tok[row_idx] = sample(q, row_gens)
                full = torch.zeros(b, vocab, dtype=torch.float32, device=dev)
                full.scatter_(1, tok.unsqueeze(1), 1.0)
                full[row_idx] = q
                probs.append(full)
            prevs.append(prev)
            tok = self.to_target_ids(tok)
            tokens.append(tok)
            prev = tok
        if steps == 0:
            empty = torch.empty(b, 0, dtype=torch.long, device=dev)
            return SampledBlock(empty, None, empty)
        return SampledBlock(torch.stack(tokens, 1), torch.stack(probs, 1) if rows else None,
                            torch.stack(prevs, 1))


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------

_SHARED_PREFIXES = ("embed_tokens.", "lm_head.")


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, name) for name in names]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path!r}")
    return files


def _normalize_key(key: str, expected: set[str]) -> str:
    """Strip training-framework prefixes ("model.", "_orig_mod.", ...) from unknown keys."""
    k = key
    while k not in expected and k.startswith(_KEY_PREFIXES):
        k = k.split(".", 1)[1]
    return k if k in expected else key


def _read_state_dict(path: str, expected: set[str], skip: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under normalized names; keys starting with `skip` are never read
    (real checkpoints carry vocab-sized copies of the target's embedding and LM head)."""
    state: dict[str, torch.Tensor] = {}
    for name in _weight_files(path):
        with safe_open(name, framework="pt", device="cpu") as f:
            for key in f.keys():
                k = _normalize_key(key, expected)
                if not (skip and k.startswith(skip)):
                    state[k] = f.get_tensor(key)
    return state


def read_config(path: str) -> DSparkConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"no config.json in drafter checkpoint {path!r}")
    with open(cfg_path) as f:
        return DSparkConfig.from_json_dict(json.load(f))


def read_calibration(path: str) -> Calibration | None:
    cal_path = os.path.join(path, CALIBRATION_FILE)
    if not os.path.exists(cal_path):
        return None
    with open(cal_path) as f:
        return Calibration.from_json_dict(json.load(f))


def resolve_device(device: torch.device | str) -> torch.device:
    """"cuda" -> "cuda:<current>", so device identity checks are exact."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def load_dspark(
    path: str,
    target_embed: nn.Embedding | None = None,
    target_lm_head: nn.Linear | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    drop_markov_head: bool = False,
) -> DSparkModel:
    """Load a DeepSpec-format drafter (config.json + *.safetensors [+ calibration.json]).

    The target's embedding / LM head are shared by reference when given (the drafter's
    copies are frozen target weights anyway, and not even read); otherwise the checkpoint
    must contain them. drop_markov_head: load as DFlash (no Markov correction); a
    confidence head that reads W1[x_prev] is dropped with it, since its input is gone."""
    cfg = read_config(path)
    if drop_markov_head and cfg.has_markov:
        conf = cfg.enable_confidence_head and not cfg.confidence_uses_markov
        cfg = cfg.replace(markov_rank=0, enable_confidence_head=conf,
                          confidence_head_with_markov=False)
    if (target_embed is None) != (target_lm_head is None):
        raise ValueError("pass both target_embed and target_lm_head, or neither")
    dev = resolve_device(device)
    shared = target_embed is not None
    embed = _as_shared(target_embed, dev, dtype) if shared else None
    # A truncated vocabulary's head is cut from the target's once d2t is read (below).
    head = _as_shared(target_lm_head, dev, dtype) if shared and not cfg.truncated else None
    with torch.device("meta"):  # no throwaway random init of ~0.5B parameters
        model = DSparkModel(cfg, embed, head)
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    skip = _SHARED_PREFIXES if shared else ()
    state = _read_state_dict(path, set(own), skip)
    if drop_markov_head:
        state = {k: v for k, v in state.items()
                 if k in own or not k.startswith(("markov_head.", "confidence_head."))}
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise ValueError(f"unexpected weights in {path!r}: {unexpected[:8]}")
    if cfg.truncated and "d2t" not in state:
        raise ValueError(f"{path!r}: draft_vocab_size is {cfg.draft_vocab_size} but there is no d2t map")
    missing = sorted(k for k in set(own) - set(state) if not (shared and k.startswith(skip)))
    if missing:
        hint = (" (embed_tokens / lm_head are not in the checkpoint: pass the target's)"
                if any(k.startswith(_SHARED_PREFIXES) for k in missing) else "")
        raise ValueError(f"missing weights in {path!r}: {missing[:8]}{hint}")
    for key, value in state.items():
        if tuple(value.shape) != own[key]:
            raise ValueError(f"weight {key!r} has shape {tuple(value.shape)}, config implies {own[key]}")
    model.load_state_dict({k: v.to(device=dev) if k == "d2t" else v.to(device=dev, dtype=dtype)
                           for k, v in state.items()}, strict=False, assign=True)
    if cfg.truncated:
        d2t = model.d2t
        if d2t.min() < 0 or d2t.max() >= cfg.vocab_size or d2t.unique().numel() != d2t.numel():
            raise ValueError(f"{path!r}: d2t must list distinct target ids in [0, {cfg.vocab_size})")
        if shared:
            model.lm_head = draft_head(target_lm_head, d2t, dev, dtype)
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(dev)
    model.calibration = read_calibration(path)
    return model.eval()


def draft_head(lm_head: nn.Module, d2t: torch.Tensor, device: torch.device | None = None,
               dtype: torch.dtype | None = None) -> nn.Linear:
    """The rows of a target LM head that a truncated draft vocabulary keeps (frozen copy)."""
    w = lm_head.weight
    dev, dt = device or w.device, dtype or w.dtype
    head = nn.Linear(w.shape[1], d2t.numel(), bias=False, device=dev, dtype=dt)
    with torch.no_grad():
        head.weight.copy_(w.detach()[d2t.to(w.device)].to(device=dev, dtype=dt))
    return head.requires_grad_(False)


def _as_shared(mod: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The target module itself when it already lives on device/dtype, else a frozen copy."""
    w = mod.weight
    if w.device == device and w.dtype == dtype:
        return mod
    if isinstance(mod, nn.Embedding):
        new = nn.Embedding(w.shape[0], w.shape[1], device=device, dtype=dtype)
    else:
        new = nn.Linear(w.shape[1], w.shape[0], bias=getattr(mod, "bias", None) is not None,
                        device=device, dtype=dtype)
    with torch.no_grad():
        new.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in mod.state_dict().items()})
    return new.requires_grad_(False)


def save_dspark(model: DSparkModel, path: str, include_shared: bool = False) -> None:
    """Write config.json + model.safetensors (+ calibration.json) in DeepSpec's format."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_json_dict(), f, indent=2)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()
             if include_shared or not k.startswith(_SHARED_PREFIXES)}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if model.calibration is not None:
        save_calibration(model.calibration, path)


def save_calibration(calibration: Calibration, path: str) -> None:
    with open(os.path.join(path, CALIBRATION_FILE), "w") as f:
        json.dump(calibration.to_json_dict(), f, indent=2)
