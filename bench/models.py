"""Random-weight models built from a config, nothing downloaded: the tiny targets the tests and
CPU runs use, and Qwen3-shaped targets (with a DSpark drafter of the matching shape) built
without the slow weight initialisation, for timing on an accelerator.

Only torch and transformers are needed (no server stack), so `bench/gpu_suite.py` can import
this on a bare GPU machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark_serve.verifier.model_runner import ModelRunner


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is EOS. Multi-byte UTF-8 characters span several tokens,
    which is exactly what incremental detokenization must get right."""

    eos_token_id = 256
    vocab_size = 257

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class CharTokenizer:
    """For random vocabularies: token i decodes to one printable character, so incremental
    detokenization advances every token (as with a real tokenizer) instead of re-decoding a
    growing window of ids that decode to nothing. No EOS."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:
        return "".join(chr(0x21 + i % 94) for i in ids)


def tiny_model(
    kind: str = "llama",
    vocab: int = 257,
    seed: int = 0,
    layers: int = 2,
    dtype=torch.float32,
    head_dim: int = 16,
):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=max(64, 2 * head_dim),
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=512,
        eos_token_id=256 if vocab > 256 else None,
        bos_token_id=None,
        pad_token_id=None,
    )
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
    dev = next(model.parameters()).device
    out = model.generate(
        torch.tensor([prompt], device=dev),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def runner_for(model, num_blocks: int = 256, block_size: int = 4) -> ModelRunner:
    return ModelRunner(model, num_blocks=num_blocks, block_size=block_size)


# -- Qwen3-shaped targets -------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetShape:
    """The architecture of a Qwen3 decoder (the fields of its config.json that set the cost).

    name: label used in reports.
    hidden_size / num_hidden_layers / num_attention_heads / num_key_value_heads / head_dim /
    intermediate_size / vocab_size: as in transformers' Qwen3Config.
    tie_word_embeddings: whether the LM head shares the embedding matrix.
    draft_layers: layers of the DSpark drafter of the matching DeepSpec shape.
    draft_taps: target layers the drafter reads (target_layer_ids).
    markov_rank: rank of the drafter's sequential head.
    """

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    draft_layers: int
    draft_taps: tuple[int, ...]
    markov_rank: int

    def __post_init__(self) -> None:
        for f in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "draft_layers",
        ):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be > 0, got {getattr(self, f)!r}")
        if not self.draft_taps or not all(0 <= t < self.num_hidden_layers for t in self.draft_taps):
            raise ValueError(f"draft_taps must be target layers, got {self.draft_taps!r}")

    @property
    def num_params(self) -> int:
        d, L, D = self.hidden_size, self.num_hidden_layers, self.head_dim
        attn = d * D * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * D
        mlp = 3 * d * self.intermediate_size
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return L * (attn + mlp + 2 * d) + d + emb


def _taps(layers: int, n: int = 5) -> tuple[int, ...]:
    """DFlash/DeepSpec-style taps: n layers spread from layer 1 to layer L-3."""
    return tuple(1 + round(i * (layers - 4) / (n - 1)) for i in range(n))


# Public Qwen3 shapes (config.json of Qwen3-0.6B and Qwen3-4B); the drafter follows the DeepSpec
# block-7 recipe: 5 Qwen3 layers, 5 taps, a rank-256 vanilla Markov head, a confidence head.
QWEN3_0_6B = TargetShape("qwen3-0.6b-like", 1024, 28, 16, 8, 128, 3072, 151936, True, 5, _taps(28), 256)
QWEN3_4B = TargetShape("qwen3-4b-like", 2560, 36, 32, 8, 128, 9728, 151936, True, 5, _taps(36), 256)
# Qwen3-8B's config.json: untied embeddings, the shape DeepSpec's published block-7 drafter serves.
QWEN3_8B = TargetShape("qwen3-8b-like", 4096, 36, 32, 8, 128, 12288, 151936, False, 5, _taps(36), 256)
# CPU stand-ins with the same structure, small enough for a test.
TINY_A = TargetShape("tiny-a", 64, 2, 4, 2, 16, 128, 512, True, 1, (0, 1), 8)
TINY_B = TargetShape("tiny-b", 96, 3, 4, 2, 24, 192, 512, False, 1, (0, 2), 8)
SHAPES = {s.name: s for s in (QWEN3_0_6B, QWEN3_4B, QWEN3_8B, TINY_A, TINY_B)}


def random_qwen3(
    shape: TargetShape,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int = 0,
    std: float = 0.02,
    out_std_scale: float = 0.05,
):
    """A Qwen3ForCausalLM of `shape` with random weights, built on the meta device and filled in
    place on `device` (no per-layer init, no float32 detour, no download).

    Linear weights ~ N(0, std), except the two that write into the residual stream (o_proj,
    down_proj): N(0, std * out_std_scale); norms = 1; the embedding / LM head ~ N(0, 4/sqrt(d)).
    Why the small output projections: greedy decoding must not depend on how many tokens share
    a forward, or a speculative run leaves the plain run's continuation that the replay drafter
    replays. With every weight at N(0, std), the layers swamp the embedding, the top two logits
    of the 4B-like shape sit closer together than bf16 kernels of different batch shapes move
    them, so greedy output flips within a few tokens and the replay drafter's realised acceptance
    collapses far below the one asked for (docs/benchmarks.md, the GPU suite). With small output
    projections the embedding stays a large part of the residual, and the tied head's top logit
    (the token itself) leads by a wide margin: no kernel's rounding flips it. Every kernel and
    shape is unchanged, so the cost curve is too. Pass out_std_scale=1 for the plain init."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=40960,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=None,
        pad_token_id=None,
        eos_token_id=None,
    )
    dev = torch.device(device)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device=dev)
    if shape.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device=dev).manual_seed(seed)
    head_std = 4.0 / shape.hidden_size**0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0.0, head_std, generator=gen)
            elif "o_proj" in name or "down_proj" in name:
                p.normal_(0.0, std * out_std_scale, generator=gen)
            else:
                p.normal_(0.0, std, generator=gen)
        # Non-persistent buffers (rotary inverse frequencies) were left empty by to_empty.
        with dev:
            model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    return model.eval().requires_grad_(False)


def random_dspark(target, shape: TargetShape, block_size: int = 7, seed: int = 0, cuda_graphs: bool = False):
    """A randomly initialised DSpark drafter (Markov + confidence heads) of the DeepSpec shape
    matching `shape`, sharing the target's embedding and LM head, on the target's device/dtype,
    served through `DSparkDrafter` (the drafter registered as "dspark"); cuda_graphs: its block
    pass replayed as CUDA graphs where it runs the Triton kernels."""
    from dspark_serve.drafter.dspark import DSparkDrafter, DSparkDrafterConfig
    from dspark_serve.drafter.dspark_model import DSparkConfig, DSparkModel, rope_inv_freq

    p = next(target.parameters())
    cfg = DSparkConfig.for_target(
        target.config,
        num_draft_layers=shape.draft_layers,
        block_size=block_size,
        target_layer_ids=shape.draft_taps,
        mask_token_id=shape.vocab_size - 1,
        markov_rank=shape.markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
    )
    torch.manual_seed(seed)
    with p.device:
        model = DSparkModel(cfg, embed_tokens=target.model.embed_tokens, lm_head=target.lm_head)
    model = model.to(p.dtype)
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(p.device)
    model.requires_grad_(False)
    return DSparkDrafter(model, DSparkDrafterConfig(cuda_graphs=cuda_graphs), "dspark")
