"""DeepSpec checkpoint compatibility: a checkpoint written with DeepSpec's names and config
fields loads, and the drafter's block forward, Markov sampling and confidence head equal an
independent re-implementation of the DeepSpec semantics (tests/drafter/_ref.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dspark_serve.drafter.base import AcceptedContext, DraftRequest
from dspark_serve.drafter.dspark import DSparkDrafter, DSparkDrafterConfig
from dspark_serve.drafter.dspark_model import (
    Calibration,
    DSparkConfig,
    load_dspark,
    rope_inv_freq,
    save_dspark,
)
from dspark_serve.ops.sampling_params import SamplingParams
from tests.drafter._ref import (
    TINY,
    deepspec_config,
    deepspec_weights,
    ref_block_hidden,
    ref_greedy_draft,
    write_checkpoint,
)

GREEDY = SamplingParams(temperature=0.0)


def tiny_target(seed=1):
    g = torch.Generator().manual_seed(seed)
    embed = nn.Embedding(TINY["vocab"], TINY["hidden"]).double()
    head = nn.Linear(TINY["hidden"], TINY["vocab"], bias=False).double()
    with torch.no_grad():
        embed.weight.copy_(torch.randn(embed.weight.shape, generator=g))
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.5)
    return embed, head


def make_ckpt(tmp_path, name="ckpt", **cfg_kw):
    cfg = deepspec_config(**cfg_kw)
    w = deepspec_weights(cfg)
    path = tmp_path / name
    write_checkpoint(path, cfg, w)
    return str(path), cfg, {k: v.double() for k, v in w.items()}


def ctx_and_tokens(s, seed=2):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(s, len(TINY["taps"]) * TINY["hidden"], generator=g, dtype=torch.float64)
    tokens = torch.randint(0, TINY["vocab"] - 1, (s + 1,), generator=g).tolist()
    return ctx, tokens


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_serving_block_matches_reference(tmp_path, head_type):
    path, cfg, w = make_ckpt(tmp_path, head_type=head_type)
    embed, head = tiny_target()
    model = load_dspark(path, embed, head, dtype=torch.float64)
    drafter = DSparkDrafter(model, DSparkDrafterConfig(), "dspark")
    s = 9
    ctx, tokens = ctx_and_tokens(s)
    drafter.observe([AcceptedContext("a", tokens[:s], 0, ctx)])
    req = DraftRequest("a", tokens, s, GREEDY, None, max_draft=100)

    ref_h = ref_block_hidden(w, cfg, embed.weight.detach(), ctx, tokens[s])
    torch.testing.assert_close(drafter.block_hidden([req])[0], ref_h, rtol=1e-5, atol=1e-5)

    prop = drafter.propose([req])[0]
    toks, ref_logits, ref_conf = ref_greedy_draft(w, cfg, head.weight.detach(), ref_h, tokens[s])
    assert prop.tokens.tolist() == toks
    assert prop.probs is None  # greedy: q is one-hot on the tokens
    torch.testing.assert_close(prop.confidences.double(), torch.sigmoid(ref_conf), rtol=1e-5, atol=1e-6)
    # Teacher-forced training logits agree with the reference corrected logits.
    prev = torch.tensor([tokens[s]] + toks[:-1])
    torch.testing.assert_close(model.block_logits(ref_h, prev).double(), ref_logits, rtol=1e-5, atol=1e-5)
    # The Markov head really moves the logits (the comparison above is not vacuous).
    assert (ref_logits - ref_h @ head.weight.detach().T).abs().max() > 0.1


def test_training_forward_matches_reference(tmp_path):
    path, cfg, w = make_ckpt(tmp_path)
    embed, head = tiny_target()
    model = load_dspark(path, embed, head, dtype=torch.float64)
    s, extra = 7, 4
    ctx, tokens = ctx_and_tokens(s + extra, seed=3)
    input_ids = torch.tensor([tokens[: s + extra]])
    anchors = torch.tensor([[s, 2, 0]])
    valid = torch.tensor([[True, True, False]])
    out = model.forward_train(ctx.unsqueeze(0), input_ids, anchors, valid)
    assert out.shape == (1, 3, TINY["block"], TINY["hidden"])
    for n in range(2):
        a = int(anchors[0, n])
        ref = ref_block_hidden(w, cfg, embed.weight.detach(), ctx[:a], tokens[a])
        torch.testing.assert_close(out[0, n], ref, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out[0, 2]).all()  # invalid block: finite, masked later


def test_dflash_ignores_markov_head(tmp_path):
    path, cfg, w = make_ckpt(tmp_path)
    embed, head = tiny_target()
    model = load_dspark(path, embed, head, dtype=torch.float64, drop_markov_head=True)
    assert model.markov_head is None and model.confidence_head is None  # conf read W1[x_prev]
    drafter = DSparkDrafter(model, DSparkDrafterConfig(), "dflash")
    s = 6
    ctx, tokens = ctx_and_tokens(s, seed=4)
    drafter.observe([AcceptedContext("a", tokens[:s], 0, ctx)])
    prop = drafter.propose([DraftRequest("a", tokens, s, GREEDY, None, max_draft=100)])[0]
    ref_h = ref_block_hidden(w, cfg, embed.weight.detach(), ctx, tokens[s])
    toks, _, conf = ref_greedy_draft(w, cfg, head.weight.detach(), ref_h, tokens[s], markov=False)
    assert prop.tokens.tolist() == toks and conf is None and prop.confidences is None


def test_dflash_checkpoint_confidence_without_markov(tmp_path):
    path, cfg, w = make_ckpt(tmp_path, rank=0, confidence=True, with_markov=False)
    embed, head = tiny_target()
    model = load_dspark(path, embed, head, dtype=torch.float64)
    assert model.markov_head is None
    ref_h = ref_block_hidden(w, cfg, embed.weight.detach(), *ctx_and_tokens(5)[0:1], 3)
    _, _, conf = ref_greedy_draft(w, cfg, head.weight.detach(), ref_h, 3)
    got = model.confidence_logits(ref_h, torch.zeros(TINY["block"], dtype=torch.long))
    torch.testing.assert_close(got.double(), conf, rtol=1e-6, atol=1e-6)


def test_sharded_prefixed_bf16_checkpoint(tmp_path):
    cfg = deepspec_config()
    w = deepspec_weights(cfg, seed=5)
    write_checkpoint(tmp_path / "plain", cfg, {k: v.to(torch.bfloat16).float() for k, v in w.items()})
    write_checkpoint(tmp_path / "sharded", cfg, w, prefix="model.", shards=3, dtype=torch.bfloat16)
    embed, head = tiny_target()
    a = load_dspark(str(tmp_path / "plain"), embed, head, dtype=torch.float64)
    b = load_dspark(str(tmp_path / "sharded"), embed, head, dtype=torch.float64)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)


def test_load_errors(tmp_path):
    path, cfg, w = make_ckpt(tmp_path)
    embed, head = tiny_target()
    with pytest.raises(ValueError, match="embed_tokens"):
        load_dspark(path)  # neither in the checkpoint nor from a target
    bad = dict(w)
    bad["fc.weight"] = torch.zeros(3, 3)
    write_checkpoint(tmp_path / "bad_shape", cfg, bad)
    with pytest.raises(ValueError, match="fc.weight"):
        load_dspark(str(tmp_path / "bad_shape"), embed, head)
    extra = dict(w)
    extra["layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    write_checkpoint(tmp_path / "extra", cfg, extra)
    with pytest.raises(ValueError, match="unexpected"):
        load_dspark(str(tmp_path / "extra"), embed, head)
    missing = {k: v for k, v in w.items() if k != "norm.weight"}
    write_checkpoint(tmp_path / "missing", cfg, missing)
    with pytest.raises(ValueError, match="norm.weight"):
        load_dspark(str(tmp_path / "missing"), embed, head)
    with pytest.raises(ValueError, match="config.json"):
        load_dspark(str(tmp_path / "nowhere"), embed, head)


def test_config_roundtrip_and_validation():
    d = deepspec_config(head_type="gated")
    cfg = DSparkConfig.from_json_dict(d)
    assert cfg.target_layer_ids == (0, 2) and cfg.markov_head_type == "gated" and cfg.confidence_uses_markov
    out = cfg.to_json_dict()
    assert out["architectures"] == ["Qwen3DSparkModel"] and out["model_type"] == "qwen3"
    for key in (
        "block_size",
        "target_layer_ids",
        "mask_token_id",
        "markov_rank",
        "markov_head_type",
        "enable_confidence_head",
        "confidence_head_with_markov",
        "num_target_layers",
        "head_dim",
    ):
        assert out[key] == d[key], key
    assert DSparkConfig.from_json_dict(out) == cfg
    # transformers 5 style: theta inside rope_parameters.
    new_style = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
    new_style["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
    assert DSparkConfig.from_json_dict(new_style).rope_theta == 5e5
    with pytest.raises(ValueError, match="strictly increasing"):
        DSparkConfig.from_json_dict({**d, "target_layer_ids": [2, 0]})
    with pytest.raises(ValueError, match="'lstm'"):
        DSparkConfig.from_json_dict({**d, "markov_head_type": "lstm"})
    with pytest.raises(ValueError, match="Qwen3DSparkModel"):
        DSparkConfig.from_json_dict({**d, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="mask_token_id"):
        DSparkConfig.from_json_dict({**d, "mask_token_id": 10_000})


def test_for_target_llama_and_qwen3():
    from transformers import LlamaConfig, Qwen3Config

    q = Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        rope_theta=1e6,
    )
    cfg = DSparkConfig.for_target(
        q,
        num_draft_layers=2,
        block_size=7,
        target_layer_ids=[1, 3, 4],
        mask_token_id=299,
        markov_rank=8,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
    )
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.num_target_layers) == (64, 16, 2, 6)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None and cfg.num_hidden_layers == 2
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    lc = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        vocab_size=300,
        rope_theta=5e5,
        rope_scaling=scaling,
        max_position_embeddings=512,
    )
    cfg = DSparkConfig.for_target(
        lc, num_draft_layers=1, block_size=4, target_layer_ids=[-1, 2], mask_token_id=0
    )
    assert cfg.head_dim == 16 and cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == "llama3"
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](lc, "cpu")
    scaled = rope_inv_freq(16, 5e5, cfg.rope_scaling)
    torch.testing.assert_close(scaled, hf_inv.float())
    assert not torch.allclose(scaled, rope_inv_freq(16, 5e5, None))


def test_save_load_roundtrip_and_calibration(tmp_path):
    path, cfg, _ = make_ckpt(tmp_path)
    embed, head = tiny_target()
    model = load_dspark(path, embed, head, dtype=torch.float64)
    out = tmp_path / "resaved"
    save_dspark(model, str(out))
    with open(out / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen3DSparkModel"]
    from safetensors.torch import load_file

    assert not {"embed_tokens.weight", "lm_head.weight"} & set(load_file(str(out / "model.safetensors")))
    again = load_dspark(str(out), embed, head, dtype=torch.float64)
    h = torch.randn(2, TINY["block"], TINY["hidden"], dtype=torch.float64)
    prev = torch.randint(0, TINY["vocab"], (2, TINY["block"]))
    torch.testing.assert_close(again.block_logits(h, prev), model.block_logits(h, prev), rtol=0, atol=0)
    save_dspark(model, str(tmp_path / "full"), include_shared=True)
    standalone = load_dspark(str(tmp_path / "full"), dtype=torch.float64)  # no target needed
    torch.testing.assert_close(standalone.block_logits(h, prev), model.block_logits(h, prev), rtol=0, atol=0)

    # Sequential Temperature Scaling: c_k = sigmoid(logit_k / T_k).
    temps = [0.5, 2.0, 1.0, 3.0, 0.25]
    with open(tmp_path / "ckpt" / "calibration.json", "w") as f:
        json.dump(Calibration(tuple(temps)).to_json_dict(), f)
    calibrated = load_dspark(path, embed, head, dtype=torch.float64)
    assert calibrated.calibration is not None
    raw = calibrated.confidence_logits(h, prev)
    expect = torch.sigmoid(raw / torch.tensor(temps, dtype=raw.dtype))
    torch.testing.assert_close(calibrated.confidence_probs(h, prev), expect)
    assert not torch.allclose(expect, torch.sigmoid(raw))
    # Served confidences carry the calibration.
    drafter = DSparkDrafter(calibrated, DSparkDrafterConfig(), "dspark")
    s = 5
    ctx, tokens = ctx_and_tokens(s, seed=7)
    drafter.observe([AcceptedContext("r", tokens[:s], 0, ctx)])
    req = DraftRequest("r", tokens, s, GREEDY, None, max_draft=100)
    prop = drafter.propose([req])[0]
    hid = drafter.block_hidden([req])
    prev = torch.tensor([[tokens[s]] + prop.tokens.tolist()[:-1]])
    raw = calibrated.confidence_logits(hid, prev)[0]
    torch.testing.assert_close(
        prop.confidences.double(),
        torch.sigmoid(raw / torch.tensor(temps, dtype=raw.dtype)).double(),
        rtol=1e-6,
        atol=1e-6,
    )
    with open(tmp_path / "ckpt" / "calibration.json", "w") as f:
        json.dump({"temperatures": [1.0, -1.0]}, f)
    with pytest.raises(ValueError, match="-1.0"):
        load_dspark(path, embed, head)


PUBLISHED = {  # DeepSpec's config/dspark files for Qwen3-8B and Qwen3-14B, and the targets' shapes
    "qwen3-8b": dict(hidden=4096, layers=5, heads=32, kv_heads=8, head_dim=128, inter=12288, vocab=151936,
                     block=7, taps=[1, 9, 17, 25, 33], target_layers=36, mask=151669, rank=256,
                     theta=1000000.0, eps=1e-6),
    "qwen3-14b": dict(hidden=5120, layers=5, heads=40, kv_heads=8, head_dim=128, inter=17408, vocab=151936,
                      block=7, taps=[1, 10, 19, 28, 37], target_layers=40, mask=151669, rank=256,
                      theta=1000000.0, eps=1e-6),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_loader_takes_deepspec_names_at_the_published_shapes(name, tmp_path, monkeypatch):
    """DeepSpec's parameter names (some under a training framework's prefix) at the published
    drafters' sizes, on the meta device: every weight lands, shared embedding and LM head
    included, with the Markov head and the confidence head reading it."""
    import dspark_serve.drafter.dspark_model.checkpoint as ckpt

    t = PUBLISHED[name]
    cfg = deepspec_config(t)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    weights = deepspec_weights(cfg, meta=True)
    stored = {("model." if i % 2 else "") + k: v for i, (k, v) in enumerate(sorted(weights.items()))}

    def read(path, expected, skip):  # the safetensors read: what the files would hold
        return {ckpt._normalize_key(k, expected): v for k, v in stored.items()}

    monkeypatch.setattr(ckpt, "_read_state_dict", read)
    with torch.device("meta"):
        embed = nn.Embedding(t["vocab"], t["hidden"], dtype=torch.bfloat16)
        head = nn.Linear(t["hidden"], t["vocab"], bias=False, dtype=torch.bfloat16)
    model = load_dspark(str(tmp_path), embed, head, device="meta", dtype=torch.bfloat16)
    c = model.config
    assert (c.block_size, c.num_hidden_layers, c.markov_rank, c.mask_token_id) == (7, 5, 256, 151669)
    assert c.target_layer_ids == tuple(t["taps"]) and c.confidence_head_with_markov
    state = model.state_dict()
    for k, v in weights.items():
        assert tuple(state[k].shape) == tuple(v.shape), k
    assert model.embed_tokens is embed and model.lm_head is head
    assert state["fc.weight"].shape == (t["hidden"], 5 * t["hidden"])
    drafter_params = sum(v.numel() for v in weights.values())
    assert drafter_params > 0.9e9  # five target-sized layers: about a billion parameters (8B)
    missing = dict(stored)
    missing.pop(next(k for k in stored if k.endswith("layers.4.mlp.down_proj.weight")))
    monkeypatch.setattr(
        ckpt, "_read_state_dict", lambda *a: {ckpt._normalize_key(k, a[1]): v for k, v in missing.items()}
    )
    with pytest.raises(ValueError, match="missing weights .*layers.4.mlp.down_proj.weight"):
        load_dspark(str(tmp_path), embed, head, device="meta", dtype=torch.bfloat16)
