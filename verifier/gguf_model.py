"""A transformers model built straight from a .gguf file read in place: no converted copy.

The config comes from the file's metadata under the names transformers' own GGUF loader gives
them (its `GGUF_CONFIG_MAPPING`), the weights are the file's tensors dequantized (gguf's
dequantizers: the values llama.cpp computes) into a model allocated without initialisation, and
llama's q/k rows are put back from llama.cpp's rotary permutation. Tested equal to transformers'
own conversion of the same file (config and every weight).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from dspark_serve.ops.cpu_kernels import loaded_kernels
from dspark_serve.ops.quant_kernels import BLOCK_TYPES, QuantMatrix
from dspark_serve.verifier.gguf_blocks import PERMUTED_ARCHITECTURES, rotary_row_order
from dspark_serve.verifier.gguf_reader import GgufReader, GgufTensor

# GGUF tensor name -> HF parameter name ("{i}": the layer)
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def gguf_config_dict(reader: GgufReader) -> dict[str, Any]:
    """The config transformers would build from this file's metadata."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    meta = reader.metadata
    arch = str(meta.get("general.architecture", ""))
    if arch not in GGUF_CONFIG_MAPPING:
        raise ValueError(f"{reader.path.name}: architecture {arch or '(none)'!r} has no config mapping")
    mapping: dict[str, Any] = GGUF_CONFIG_MAPPING
    names: dict[str, dict[str, Any]] = {p: mapping[p] for p in ("general", "tokenizer", arch)}
    cfg: dict[str, Any] = {"tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors)}
    cfg.update(GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}))
    for key, value in meta.items():
        prefix, _, rest = key.partition(".")
        name = names.get(prefix, {}).get(rest)
        if name is not None and name != -1:
            cfg[name] = value.item() if isinstance(value, np.generic) else value
    return cfg


def gguf_weights(reader: GgufReader, config: Any) -> dict[str, torch.Tensor]:
    """The model's parameters (float32) from the file's tensors, by their HF names."""
    permuted = config.model_type in PERMUTED_ARCHITECTURES
    heads = {"attn_q.weight": config.num_attention_heads, "attn_k.weight": config.num_key_value_heads}
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if rest not in LAYER_TENSOR_NAMES:
                raise ValueError(f"{reader.path.name}: tensor {t.name} has no place in the model")
            name = f"model.layers.{layer}.{LAYER_TENSOR_NAMES[rest]}"
        elif t.name in TENSOR_NAMES:
            name, rest = TENSOR_NAMES[t.name], t.name
        else:
            raise ValueError(f"{reader.path.name}: tensor {t.name} has no place in the model")
        w = _dequantized(t).reshape(tuple(reversed(t.shape)))
        if permuted and rest in heads:
            w = w[rotary_row_order(w.shape[0], heads[rest])]
        out[name] = w
    return out


def _dequantized(t: GgufTensor) -> torch.Tensor:
    """A tensor's float32 values: by the C kernels' row decoder where they are loaded already (a
    start with the kernels built before) and the type has one, else gguf's numpy dequantizers;
    the same values either way (`tests/ops/test_quant_kernels.py`)."""
    from gguf import dequantize

    if loaded_kernels() is not None and t.tensor_type.name in BLOCK_TYPES and t.data.ndim == 2:
        with warnings.catch_warnings():  # the map is read-only, and only ever read
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(t.data)
        return QuantMatrix(blocks, t.tensor_type.name, int(t.shape[0])).dequantize()
    return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))  # a copy


def model_from_gguf(reader: GgufReader) -> torch.nn.Module:
    """The model (float32, eval mode) with the file's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    cfg = gguf_config_dict(reader)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    weights = gguf_weights(reader, config)
    with no_init_weights():
        model: torch.nn.Module = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=torch.float32
        )
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    lacking = sorted(set(missing) - tied)
    if lacking or unexpected:
        raise ValueError(f"{reader.path.name}: weights missing {lacking[:3]}, unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        model.tie_weights()  # type: ignore[operator]
    model.eval()
    return model
