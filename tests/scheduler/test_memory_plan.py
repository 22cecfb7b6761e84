"""The start-up memory plan at real shapes: Qwen3-8B and Qwen3-14B targets with DeepSpec's block-7
DSpark drafters, built on the meta device (no memory, no weights), planned on an 80 GB and a
141 GB card; and its refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dspark_serve.drafter.dspark_model import DSparkConfig
from dspark_serve.drafter.dspark_model.model import DSparkModel
from dspark_serve.scheduler.builder import device_memory_plan
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.memory_plan import GiB, TargetGeometry, parameter_bytes, plan_memory
from dspark_serve.verifier.config import ModelConfig

# (hidden, layers, heads, intermediate, the drafter's target taps) of Qwen3's config.json and
# DeepSpec's config/dspark files (block 7, 5 draft layers, Markov rank 256, mask token 151669)
SHAPES = {
    "qwen3-8b": (4096, 36, 32, 12288, (1, 9, 17, 25, 33)),
    "qwen3-14b": (5120, 40, 40, 17408, (1, 10, 19, 28, 37)),
}
CARDS = {"80GB": 80 * 10**9, "141GB": 141 * 10**9}


class Target:
    """What the builder reads of a loaded target: its model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model


class Drafter:
    """What the builder reads of a DSpark drafter: its model, taps and block."""

    def __init__(self, model: DSparkModel) -> None:
        self.model, self.block_size = model, model.config.block_size
        self.tap_layers = model.config.target_layer_ids


def build(name: str) -> tuple[Target, Drafter]:
    hidden, layers, heads, inter, taps = SHAPES[name]
    cfg = Qwen3Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=inter,
        vocab_size=151936,
        tie_word_embeddings=False,
    )
    dcfg = DSparkConfig(
        hidden_size=hidden,
        num_hidden_layers=5,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=inter,
        vocab_size=151936,
        block_size=7,
        target_layer_ids=taps,
        mask_token_id=151669,
        num_target_layers=layers,
        markov_rank=256,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
    )
    with torch.device("meta"):
        target = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        drafter = DSparkModel(dcfg, target.model.embed_tokens, target.lm_head).to(torch.bfloat16)
    return Target(target), Drafter(drafter)


@pytest.mark.parametrize("card", sorted(CARDS))
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_published_shapes_fit_the_cards(name, card):
    target, drafter = build(name)
    sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    model_cfg = ModelConfig(max_model_len=4096, cuda_graphs=True, attention="triton")
    plan = device_memory_plan(model_cfg, sched, target, drafter, torch.bfloat16, CARDS[card], 4096)
    geo = TargetGeometry.of(target.model.config)
    # the parts are what the shapes say: bf16 weights of target and drafter (the shared
    # embedding and LM head once), K/V of 8 heads of 128 in every layer, five taps per slot
    target_params = sum(p.numel() for p in target.model.parameters())
    drafter_own = sum(
        p.numel() for n, p in drafter.model.named_parameters() if not n.startswith(("embed", "lm_head"))
    )
    assert 0 <= plan.weights - 2 * (target_params + drafter_own) < 2**20  # + rotary buffers
    assert plan.kv_per_token == 2 * geo.num_layers * 8 * 128 * 2
    assert plan.tap_rows_per_token == 5 * geo.hidden_size * 2
    assert plan.drafter_contexts == (256 + 1) * 4096 * (2 * 5 * 8 * 128 * 2)  # and the scratch slot
    assert plan.total <= plan.budget < plan.total + plan.per_token  # all of the budget, no more
    assert plan.kv_tokens >= 4096
    assert "KV cache" in plan.table() and "budget (0.9 of" in plan.table()


def test_the_8b_shape_holds_256_requests_of_2k_tokens_on_141_gb():
    """Without the prefix cache's tap rows (its largest per-token part after K/V), and with
    prefill chunks of 4096 tokens; with them the same card holds fewer (the table says how many)."""
    target, drafter = build("qwen3-8b")
    sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096, enable_prefix_caching=False)
    model_cfg = ModelConfig(max_model_len=2048, cuda_graphs=True, attention="triton")
    plan = device_memory_plan(model_cfg, sched, target, drafter, torch.bfloat16, CARDS["141GB"], 2048)
    assert plan.tap_rows_per_token == 0 and plan.kv_tokens >= 256 * 2048, plan.table()
    with_taps = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=4096)
    plan = device_memory_plan(model_cfg, with_taps, target, drafter, torch.bfloat16, CARDS["141GB"], 2048)
    assert 0 < plan.kv_tokens < 256 * 2048


def test_a_model_that_cannot_fit_is_refused_with_the_table():
    target, drafter = build("qwen3-14b")
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048)
    with pytest.raises(
        ValueError, match=r"does not fit: 0 KV tokens remain(.|\n)*weights \(target \+ drafter\)"
    ):
        device_memory_plan(ModelConfig(), sched, target, drafter, torch.bfloat16, 24 * 10**9, 2048)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        ModelConfig(gpu_memory_utilization=1.5)


def test_every_part_is_counted_against_the_budget():
    geo = TargetGeometry(64, 128, 2, 4, 2, 16, 100)
    base = dict(device_bytes=GiB, utilization=0.5, weights=10**6, target=geo, elt=2, max_model_len=64,
                max_num_seqs=4, max_num_batched_tokens=256, max_logit_rows=32)  # fmt: skip
    plain = plan_memory(**base)  # type: ignore[arg-type]
    more = plan_memory(**base, tap_width=5 * 64, drafter_context_per_token=1024, graph_tokens=512)  # type: ignore[arg-type]
    assert more.graph_pool > 0 and more.drafter_contexts == (4 + 1) * 64 * 1024
    assert more.kv_tokens < plain.kv_tokens and more.total <= more.budget
    assert plain.budget == GiB // 2 and plain.kv_tokens == (plain.budget - plain.fixed) // plain.per_token


def test_shared_tensors_are_counted_once():
    a = torch.nn.Linear(4, 8, bias=False)
    b = torch.nn.Sequential(torch.nn.Linear(8, 2), a)  # a's weight inside b too
    assert parameter_bytes([a, b]) == 4 * (32 + 16 + 2)
