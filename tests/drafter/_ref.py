"""A DeepSpec-format checkpoint writer and an independent re-implementation of the DSpark
block forward (explicit matmuls, one request at a time) that the drafter is checked against."""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import save_file

TINY = dict(
    hidden=32,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=8,
    inter=48,
    vocab=97,
    block=5,
    taps=[0, 2],
    target_layers=4,
    mask=96,
    rank=6,
    theta=10000.0,
    eps=1e-6,
)


def deepspec_config(t=TINY, head_type="vanilla", confidence=True, with_markov=True, rank=None) -> dict:
    """What DeepSpec's build_draft_config + save_pretrained put in config.json (Qwen3 base)."""
    rank = t["rank"] if rank is None else rank
    cfg = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "transformers_version": "4.57.1",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "head_dim": t["head_dim"],
        "hidden_act": "silu",
        "hidden_size": t["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": t["inter"],
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "num_attention_heads": t["heads"],
        "num_hidden_layers": t["layers"],
        "num_key_value_heads": t["kv_heads"],
        "rms_norm_eps": t["eps"],
        "rope_scaling": None,
        "rope_theta": t["theta"],
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": t["vocab"],
        "layer_types": ["full_attention"] * t["layers"],
        "block_size": t["block"],
        "mask_token_id": t["mask"],
        "target_layer_ids": t["taps"],
        "num_target_layers": t["target_layers"],
        "num_anchors": 64,
        "enable_confidence_head": confidence,
        "markov_rank": rank,
    }
    if rank > 0:
        cfg["markov_head_type"] = head_type
    if confidence:
        cfg["confidence_head_with_markov"] = with_markov and rank > 0
    return cfg


def deepspec_weights(cfg: dict, seed: int = 0, meta: bool = False) -> dict[str, torch.Tensor]:
    """Random weights under DeepSpec's state-dict names (no embed_tokens / lm_head); meta: shapes
    only, on the meta device (published sizes at no cost)."""
    g = torch.Generator().manual_seed(seed)
    d, h, hkv, dh = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    inter, vocab, m = cfg["intermediate_size"], cfg["vocab_size"], len(cfg["target_layer_ids"])

    def rnd(*shape, scale=None):
        if meta:
            return torch.empty(*shape, device="meta")
        scale = scale if scale is not None else 1.0 / math.sqrt(shape[-1])
        return torch.randn(*shape, generator=g) * scale

    def norm_w(n):
        return torch.empty(n, device="meta") if meta else 1.0 + 0.1 * torch.randn(n, generator=g)

    w = {"fc.weight": rnd(d, m * d), "hidden_norm.weight": norm_w(d), "norm.weight": norm_w(d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w.update(
            {
                p + "self_attn.q_proj.weight": rnd(h * dh, d),
                p + "self_attn.k_proj.weight": rnd(hkv * dh, d),
                p + "self_attn.v_proj.weight": rnd(hkv * dh, d),
                p + "self_attn.o_proj.weight": rnd(d, h * dh),
                p + "self_attn.q_norm.weight": norm_w(dh),
                p + "self_attn.k_norm.weight": norm_w(dh),
                p + "mlp.gate_proj.weight": rnd(inter, d),
                p + "mlp.up_proj.weight": rnd(inter, d),
                p + "mlp.down_proj.weight": rnd(d, inter),
                p + "input_layernorm.weight": norm_w(d),
                p + "post_attention_layernorm.weight": norm_w(d),
            }
        )
    r = cfg["markov_rank"]
    if r > 0:
        w["markov_head.markov_w1.weight"] = rnd(vocab, r, scale=1.0)
        w["markov_head.markov_w2.weight"] = rnd(vocab, r, scale=2.0 / math.sqrt(r))
        if cfg["markov_head_type"] == "gated":
            w["markov_head.gate_proj.weight"] = rnd(r, d + r)
            w["markov_head.gate_proj.bias"] = rnd(r, scale=0.5)
        if cfg["markov_head_type"] == "rnn":
            w["markov_head.joint_proj.weight"] = rnd(3 * r, 2 * r + d)
            w["markov_head.joint_proj.bias"] = rnd(3 * r, scale=0.5)
    if cfg["enable_confidence_head"]:
        extra = r if cfg.get("confidence_head_with_markov") else 0
        w["confidence_head.proj.weight"] = rnd(1, d + extra)
        w["confidence_head.proj.bias"] = rnd(1, scale=0.5)
    return w


def write_checkpoint(
    path, cfg: dict, weights: dict[str, torch.Tensor], prefix: str = "", shards: int = 1, dtype=torch.float32
) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    items = sorted(weights.items())
    if shards == 1:
        save_file(
            {prefix + k: v.to(dtype).contiguous() for k, v in items}, os.path.join(path, "model.safetensors")
        )
        return
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {prefix + k: v.to(dtype).contiguous() for k, v in items[s::shards]}
        weight_map.update({k: name for k in part})
        save_file(part, os.path.join(path, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


# ---- reference math (float64, one request) -------------------------------------------


def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """x: [L, H, D]; pos: [L]."""
    dh = x.shape[-1]
    half = dh // 2
    inv = theta ** (-(torch.arange(half, dtype=torch.float64) * 2) / dh)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def ref_block_hidden(w, cfg, embed, ctx_hidden, anchor, block_size=None):
    """w: weights (float64); embed: [V, d]; ctx_hidden: [S, m*d] taps of positions 0..S-1;
    the anchor sits at position S -> final hidden [bs, d]."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    h, hkv, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    bs = block_size or cfg["block_size"]
    s = ctx_hidden.shape[0]
    c = _rms(ctx_hidden @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = embed[torch.tensor([anchor] + [cfg["mask_token_id"]] * (bs - 1))]
    pos_c, pos_b = torch.arange(s), torch.arange(s, s + bs)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        a = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _rms(
            (a @ w[p + "self_attn.q_proj.weight"].T).view(bs, h, dh), w[p + "self_attn.q_norm.weight"], eps
        )
        q = _rope(q, pos_b, theta)

        def kv(inp, pos):
            k = (inp @ w[p + "self_attn.k_proj.weight"].T).view(-1, hkv, dh)
            k = _rope(_rms(k, w[p + "self_attn.k_norm.weight"], eps), pos, theta)
            return k, (inp @ w[p + "self_attn.v_proj.weight"].T).view(-1, hkv, dh)

        kc, vc = kv(c, pos_c)
        kb, vb = kv(a, pos_b)
        keys, vals = torch.cat([kc, kb]), torch.cat([vc, vb])
        out = torch.zeros(bs, h, dh, dtype=torch.float64)
        for head in range(h):
            j = head // (h // hkv)
            scores = q[:, head] @ keys[:, j].T / math.sqrt(dh)
            out[:, head] = torch.softmax(scores, dim=-1) @ vals[:, j]
        x = x + out.reshape(bs, h * dh) @ w[p + "self_attn.o_proj.weight"].T
        a = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = a @ w[p + "mlp.gate_proj.weight"].T
        x = (
            x
            + ((gate * torch.sigmoid(gate)) * (a @ w[p + "mlp.up_proj.weight"].T))
            @ w[p + "mlp.down_proj.weight"].T
        )
    return _rms(x, w["norm.weight"], eps)


def ref_markov_bias(w, cfg, prev, h_k, state):
    """One step of the sequential head -> (state, bias [V])."""
    e = w["markov_head.markov_w1.weight"][prev]
    w2 = w["markov_head.markov_w2.weight"]
    kind = cfg["markov_head_type"]
    if kind == "vanilla":
        return state, w2 @ e
    if kind == "gated":
        gate = torch.sigmoid(
            w["markov_head.gate_proj.weight"] @ torch.cat([h_k, e]) + w["markov_head.gate_proj.bias"]
        )
        return state, w2 @ (gate * e)
    r = cfg["markov_rank"]
    z = w["markov_head.joint_proj.weight"] @ torch.cat([state, e, h_k]) + w["markov_head.joint_proj.bias"]
    g, cand, o = torch.sigmoid(z[:r]), torch.tanh(z[r : 2 * r]), z[2 * r :]
    return g * state + (1 - g) * cand, w2 @ torch.tanh(o)


def ref_greedy_draft(w, cfg, lm_head, hidden, anchor, markov=True):
    """Greedy left-to-right drafting -> (tokens [bs], corrected logits [bs, V], conf logits [bs] | None)."""
    bs = hidden.shape[0]
    use_markov = markov and cfg["markov_rank"] > 0
    state = torch.zeros(cfg["markov_rank"], dtype=torch.float64) if use_markov else None
    prev, toks, logits, conf = anchor, [], [], []
    for k in range(bs):
        lk = lm_head @ hidden[k]
        if use_markov:
            state, bias = ref_markov_bias(w, cfg, prev, hidden[k], state)
            lk = lk + bias
        if cfg["enable_confidence_head"] and (markov or not cfg.get("confidence_head_with_markov")):
            feats = hidden[k]
            if cfg.get("confidence_head_with_markov"):
                feats = torch.cat([feats, w["markov_head.markov_w1.weight"][prev]])
            conf.append(w["confidence_head.proj.weight"][0] @ feats + w["confidence_head.proj.bias"][0])
        tok = int(lk.argmax())
        toks.append(tok)
        logits.append(lk)
        prev = tok
    return toks, torch.stack(logits), (torch.stack(conf) if conf else None)
