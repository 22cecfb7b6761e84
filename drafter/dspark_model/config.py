"""The DSpark drafter's architecture (DeepSpec's config.json) and its confidence calibration."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from dspark_serve.drafter.dspark_model.ops import ACTIVATIONS, SUPPORTED_ROPE, rope_type

ARCHITECTURE = "Qwen3DSparkModel"
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
# The fields a config.json must have; the others have defaults.
REQUIRED_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
    "block_size",
    "target_layer_ids",
    "mask_token_id",
)


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
        self._check_sizes()
        self._check_taps()
        self._check_heads()
        self._check_numerics()

    def _check_sizes(self) -> None:
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "block_size",
            "num_target_layers",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads!r}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads!r})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim!r}")

    def _check_taps(self) -> None:
        """Taps: target layers (-1: the embeddings), strictly increasing; the mask token."""
        if not self.target_layer_ids:
            raise ValueError(f"target_layer_ids must not be empty, got {self.target_layer_ids!r}")
        prev = None
        for lid in self.target_layer_ids:
            if not (lid == -1 or 0 <= lid < self.num_target_layers):
                raise ValueError(
                    f"target_layer_ids entry {lid!r} outside {{-1}} U [0, {self.num_target_layers - 1}]"
                )
            if prev is not None and lid <= prev:
                raise ValueError(
                    f"target_layer_ids must be strictly increasing, got {self.target_layer_ids!r}"
                )
            prev = lid
        if not (0 <= self.mask_token_id < self.vocab_size):
            raise ValueError(
                f"mask_token_id must be in [0, vocab_size={self.vocab_size}), got {self.mask_token_id!r}"
            )

    def _check_heads(self) -> None:
        """The Markov and confidence heads."""
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0, got {self.markov_rank!r}")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}"
            )
        if self.confidence_head_with_markov and self.enable_confidence_head and self.markov_rank == 0:
            raise ValueError("confidence_head_with_markov=True needs markov_rank > 0, got 0")

    def _check_numerics(self) -> None:
        """Activation, norm, rotary embedding, draft vocabulary, anchors."""
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(ACTIVATIONS)}, got {self.hidden_act!r}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not (0 <= self.draft_vocab_size <= self.vocab_size):
            raise ValueError(
                f"draft_vocab_size must be in [0, vocab_size={self.vocab_size}], "
                f"got {self.draft_vocab_size!r}"
            )
        kind = rope_type(self.rope_scaling)
        if kind not in SUPPORTED_ROPE:
            raise ValueError(f"rope_scaling type must be one of {SUPPORTED_ROPE}, got {kind!r}")
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
    def from_json_dict(cls, d: dict[str, Any]) -> DSparkConfig:
        """Build from a DeepSpec / HF config.json dict (extra keys are ignored)."""
        archs = d.get("architectures")
        if archs and ARCHITECTURE not in archs:
            raise ValueError(f"expected architectures to contain {ARCHITECTURE!r}, got {archs!r}")
        missing = [k for k in REQUIRED_FIELDS if k not in d]
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
    ) -> DSparkConfig:
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

    def replace(self, **changes: Any) -> DSparkConfig:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return DSparkConfig(**values)


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a legacy (rope_theta/rope_scaling) or new
    (rope_parameters) HF config dict."""
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = d.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and rope_type(scaling) == "default":
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
    def from_json_dict(cls, d: dict[str, Any]) -> Calibration:
        if "temperatures" not in d:
            raise ValueError(f"calibration.json needs a 'temperatures' list, got keys {sorted(d)!r}")
        return cls(temperatures=tuple(d["temperatures"]))

    def to_json_dict(self) -> dict[str, Any]:
        return {"method": "sequential_temperature_scaling", "temperatures": list(self.temperatures)}
