"""Tiny random targets and a byte-level tokenizer, built inside tests (nothing downloaded)."""
from __future__ import annotations

import torch

from verifier.model_runner import ModelRunner


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is EOS. Multi-byte UTF-8 characters span several tokens,
    which is exactly what incremental detokenization must get right."""

    eos_token_id = 256
    vocab_size = 257

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def tiny_model(kind: str = "llama", vocab: int = 257, seed: int = 0, layers: int = 2,
               dtype=torch.float32):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, eos_token_id=256 if vocab > 256 else None,
                  bos_token_id=None, pad_token_id=None)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen2":  # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        raise ValueError(kind)
    # Sharper logits than the default init make greedy decoding far from ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.to(dtype).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def runner_for(model, num_blocks: int = 256, block_size: int = 4) -> ModelRunner:
    return ModelRunner(model, num_blocks=num_blocks, block_size=block_size)
