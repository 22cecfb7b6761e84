"""The training pipeline on tiny random models: loss, batches, a train step, export, eval loop."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dspark_serve.drafter.dspark_model import Calibration, DSparkConfig, load_dspark
from dspark_serve.training.cache import (
    CachedSequence,
    anchored_batch,
    block_targets,
    follow_anchors,
    make_batch,
    pad_sequences,
    sample_anchors,
    target_states,
)
from dspark_serve.training.evaluate import NeuralDrafter, NgramEvalDrafter, speculative_generate
from dspark_serve.training.export import export_drafter
from dspark_serve.training.loss import LossConfig, dspark_loss, position_weights
from dspark_serve.training.train import (
    TrainConfig,
    build_draft_model,
    evaluate_held_out,
    forward_loss,
    greedy_hits,
    run_train,
    trainable_parameters,
    trainable_state,
    training_batch,
)

NEG_INF = float("-inf")


def _log(ps):
    return [math.log(p) if p > 0 else NEG_INF for p in ps]


def test_loss_hand_computed():
    # One block, bs = 2, V = 3.
    # k=1: q = (.5, .25, .25), p = (.25, .5, .25), label 1, confidence logit 0.
    # k=2: q = uniform, p = (.5, .5, 0), label 0, confidence logit log 2 (sigmoid = 2/3).
    draft = torch.tensor([[[_log([0.5, 0.25, 0.25]), [0.0, 0.0, 0.0]]]])
    target = torch.tensor([[[_log([0.25, 0.5, 0.25]), _log([0.5, 0.5, 0.0])]]])
    labels = torch.tensor([[[1, 0]]])
    mask = torch.ones(1, 1, 2, dtype=torch.bool)
    conf = torch.tensor([[[0.0, math.log(2.0)]]])
    out = dspark_loss(draft, target, labels, mask, conf, LossConfig())  # gamma = bs = 2

    w1, w2 = 1.0, math.exp(-1 / 2)
    ce = (w1 * -math.log(0.25) + w2 * math.log(3)) / (w1 + w2)
    l1_1 = 0.25 + 0.25 + 0
    l1_2 = (0.5 - 1 / 3) * 2 + 1 / 3
    l1 = (w1 * l1_1 + w2 * l1_2) / (w1 + w2)
    c1, c2 = 1 - l1_1 / 2, 1 - l1_2 / 2  # 0.75, 2/3

    def bce(prob, y):
        return -(y * math.log(prob) + (1 - y) * math.log(1 - prob))

    conf_loss = (w1 * bce(0.5, c1) + w2 * bce(2 / 3, c2)) / (w1 + w2)
    assert float(out.ce) == pytest.approx(ce, rel=1e-5)
    assert float(out.l1) == pytest.approx(l1, rel=1e-5)
    assert float(out.confidence) == pytest.approx(conf_loss, rel=1e-5)
    assert float(out.loss) == pytest.approx(0.1 * ce + 0.9 * l1 + 1.0 * conf_loss, rel=1e-5)
    assert out.accept_rate.tolist() == pytest.approx([c1, c2], rel=1e-5)
    assert float(out.tau) == pytest.approx(1 + c1 + c1 * c2, rel=1e-5)
    # greedy: position 1's argmax (0) misses the target's (1): nothing after it counts
    assert float(out.greedy_tau) == 1.0
    hit = dspark_loss(target, target, labels, mask, conf, LossConfig())  # q = p: both match
    assert float(hit.greedy_tau) == 3.0


def test_argmax_labels_train_the_cross_entropy_on_the_targets_most_likely_token():
    """ce_labels="argmax": the CE term reads the target's argmax at every slot, not the token
    the data holds (a sample, in a sampled pass); the other terms stay as they were."""
    draft = torch.tensor([[[_log([0.5, 0.3, 0.2]), [0.0, 0.0, 0.0]]]])
    target = torch.tensor([[[_log([0.25, 0.5, 0.25]), _log([0.6, 0.4, 0.0])]]])  # argmax 1, 0
    sampled = torch.tensor([[[2, 1]]])  # what a sampled pass might have written instead
    mask = torch.ones(1, 1, 2, dtype=torch.bool)
    greedy_labels = dspark_loss(draft, target, torch.tensor([[[1, 0]]]), mask, None, LossConfig())
    data = dspark_loss(draft, target, sampled, mask, None, LossConfig())
    argmax = dspark_loss(draft, target, sampled, mask, None, LossConfig(ce_labels="argmax"))
    assert float(argmax.ce) == pytest.approx(float(greedy_labels.ce), rel=1e-6)
    assert float(data.ce) != pytest.approx(float(argmax.ce), rel=1e-3)
    assert float(argmax.l1) == pytest.approx(float(data.l1), rel=1e-6)
    with pytest.raises(ValueError, match="'mode'"):
        LossConfig(ce_labels="mode")


def test_greedy_acceptance_counts_leading_argmax_matches_through_the_draft_vocabulary():
    # 2 blocks of 3 over a target vocabulary of 5, a draft vocabulary of 3 (target ids 4, 0, 2)
    d2t = torch.tensor([4, 0, 2])
    target = torch.full((1, 2, 3, 5), -5.0)
    draft = torch.full((1, 2, 3, 3), -5.0)
    for k, t in enumerate([4, 0, 3]):  # block 0: the target's argmaxes
        target[0, 0, k, t] = 5.0
    for k, d in enumerate([0, 1, 2]):  # draft ids -> target 4, 0, 2: two leading matches
        draft[0, 0, k, d] = 5.0
    target[0, 1, :, 2] = 5.0  # block 1: target 2 everywhere, draft id 2 = target 2 everywhere
    draft[0, 1, :, 2] = 5.0
    labels = torch.zeros(1, 2, 3, dtype=torch.long)
    mask = torch.ones(1, 2, 3, dtype=torch.bool)
    mask[0, 1, 2] = False  # block 1's last slot is past the sequence: not counted
    out = dspark_loss(draft, target, labels, mask, None, LossConfig(), d2t=d2t)
    assert float(out.greedy_tau) == pytest.approx(((1 + 2) + (1 + 2)) / 2)


def test_loss_ignores_masked_slots_and_decay_is_configurable():
    g = torch.Generator().manual_seed(0)
    draft = torch.randn(2, 3, 4, 11, generator=g)
    target = torch.randn(2, 3, 4, 11, generator=g)
    labels = torch.randint(0, 11, (2, 3, 4), generator=g)
    mask = torch.ones(2, 3, 4, dtype=torch.bool)
    mask[1, 2] = False
    mask[0, 0, 2:] = False
    base = dspark_loss(draft, target, labels, mask, None, LossConfig(decay_gamma=0))
    draft2 = draft.clone()
    draft2[1, 2] = 100.0 * torch.randn(4, 11, generator=g)  # junk in masked slots
    draft2[0, 0, 2:] = -7.0
    again = dspark_loss(draft2, target, labels, mask, None, LossConfig(decay_gamma=0))
    assert float(again.loss) == pytest.approx(float(base.loss), rel=1e-6)
    assert position_weights(mask[0, 1], 0.0).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert position_weights(mask[0, 1], 4.0).tolist() == pytest.approx([math.exp(-k / 4) for k in range(4)])
    with pytest.raises(ValueError, match="decay_gamma"):
        LossConfig(decay_gamma=-1.0)
    with pytest.raises(ValueError, match="l1_alpha"):
        LossConfig(l1_alpha=float("nan"))


def test_anchors_and_block_targets():
    loss_mask = torch.zeros(2, 12, dtype=torch.bool)
    loss_mask[0, 5:12] = True
    loss_mask[1, 9:11] = True  # only one candidate anchor (9): 10 is the last supervised
    ids = torch.arange(100, 124).view(2, 12)
    anchors, valid = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(0))
    assert valid[0].all() and valid[1].tolist() == [True, False, False, False]
    assert anchors[1, 0] == 9
    a0 = anchors[0][valid[0]]
    assert (a0 >= 5).all() and (a0 <= 10).all() and (a0.diff() > 0).all()
    labels, mask, _ = block_targets(ids, loss_mask, anchors, valid, 3)
    assert labels[1, 0].tolist()[:1] == [ids[1, 10].item()] and mask[1, 0].tolist() == [True, False, False]
    assert not mask[1, 1:].any()
    for n in range(4):
        a = int(anchors[0, n])
        assert labels[0, n].tolist() == [int(ids[0, min(a + k, 11)]) for k in (1, 2, 3)]
        assert mask[0, n].tolist() == [a + k <= 11 for k in (1, 2, 3)]


def _tiny_target(vocab: int = 96, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.requires_grad_(False)
    return model


def _tiny_drafter_config(target, markov_rank: int = 8) -> DSparkConfig:
    return DSparkConfig.for_target(
        target.config,
        num_draft_layers=1,
        block_size=4,
        target_layer_ids=(0, 2),
        mask_token_id=1,
        markov_rank=markov_rank,
        enable_confidence_head=True,
        confidence_head_with_markov=markov_rank > 0,
        num_anchors=6,
    )


def _cached_sequences(target, n: int, length: int, prompt: int) -> list[CachedSequence]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        # A repetitive pattern the drafter can learn quickly.
        period = int(torch.randint(2, 5, (1,), generator=g))
        base = torch.randint(3, 96, (period,), generator=g)
        ids = base.repeat(length // period + 1)[:length].tolist()
        taps, last = target_states(target, ids, (0, 2))
        out.append(CachedSequence(torch.tensor(ids), prompt, taps, last))
    return out


def test_batch_aligns_target_hidden_with_labels():
    target = _tiny_target()
    seqs = _cached_sequences(target, 2, 20, 6)
    batch = make_batch(seqs, 5, 4, torch.Generator().manual_seed(3))
    for b in range(2):
        for n in range(5):
            if not batch.anchor_valid[b, n]:
                continue
            a = int(batch.anchors[b, n])
            assert batch.prev_tokens[b, n, 0] == seqs[b].input_ids[a]
            for k in range(4):
                if batch.mask[b, n, k]:
                    # label a+k+1 is predicted by the target hidden at a+k
                    assert batch.labels[b, n, k] == seqs[b].input_ids[a + k + 1]
                    assert torch.equal(batch.target_hidden[b, n, k], seqs[b].last[a + k])
    # The cached final hidden really gives the target's logits.
    ids = seqs[0].input_ids.tolist()
    logits = target(torch.tensor([ids])).logits[0, :-1]
    assert torch.allclose(target.lm_head(seqs[0].last.float()), logits, atol=2e-2)


def test_tiny_train_reduces_loss(tmp_path):
    torch.manual_seed(0)
    target = _tiny_target()
    seqs = _cached_sequences(target, 8, 24, 4)
    cfg = _tiny_drafter_config(target)
    model = build_draft_model(cfg, target, init_from_target=True)
    tcfg = TrainConfig(steps=40, batch_seqs=4, num_anchors=6, lr=3e-3, checkpoint_every=20, bf16=False)
    fixed = make_batch(seqs[:4], 6, 4, torch.Generator().manual_seed(9))
    with torch.no_grad():
        before = float(forward_loss(model, fixed, LossConfig(), False).loss)
    history = run_train(model, seqs, tcfg, LossConfig(), tmp_path / "run")
    with torch.no_grad():
        after = float(forward_loss(model, fixed, LossConfig(), False).loss)
    assert len(history) == 40 and after < 0.7 * before
    # Shared modules stay the target's, untouched.
    assert model.lm_head is target.lm_head and not model.lm_head.weight.requires_grad
    # Resuming a finished run does nothing and keeps the weights.
    state = {k: v.clone() for k, v in trainable_state(model).items()}
    assert run_train(model, seqs, tcfg, LossConfig(), tmp_path / "run") == []
    assert all(torch.equal(state[k], v) for k, v in trainable_state(model).items())


def test_held_out_acceptance_is_logged_at_every_checkpoint(tmp_path):
    """Training on some sequences raises their teacher-forced acceptance; the held-out lines
    record the same metric on sequences the run never sees, at each checkpoint."""
    import json

    torch.manual_seed(0)
    target = _tiny_target()
    seqs = _cached_sequences(target, 10, 24, 4)
    train, held = seqs[:8], seqs[8:]
    model = build_draft_model(_tiny_drafter_config(target), target, init_from_target=True)
    before = evaluate_held_out(model, train, 6, LossConfig(), False, 0)
    tcfg = TrainConfig(steps=40, batch_seqs=4, num_anchors=6, lr=3e-3, checkpoint_every=20, bf16=False)
    run_train(model, train, tcfg, LossConfig(), tmp_path / "run", held_out=held)
    lines = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    ho = [x["held_out"] for x in lines if "held_out" in x]
    assert [h["step"] for h in ho] == [20, 40]
    assert all(h["blocks"] > 0 and len(h["accept_rate"]) == 4 and 1.0 <= h["tau"] <= 5.0 for h in ho)
    # the same function on the training sequences sees the fit (so it measures something)
    after = evaluate_held_out(model, train, 6, LossConfig(), False, 40)
    assert after.tau > before.tau
    assert all(1.0 <= h["greedy_tau"] <= 5.0 for h in ho)
    # scoring is deterministic and leaves the model's mode alone
    model.train()
    again = evaluate_held_out(model, held, 6, LossConfig(), False, 40)
    assert model.training and again.tau == pytest.approx(ho[-1]["tau"])


def test_training_starts_from_an_exported_drafter(tmp_path):
    """`--init-from`: an exported drafter (truncated vocabulary, calibration) comes back as a
    trainable float32 model with its own config and d2t map, the same logits as the one
    exported, the target's embedding shared and frozen; training it goes on lowering the loss.
    An export whose weights do not fit its config is refused."""
    from dspark_serve.training.train import draft_model_from_checkpoint

    target = _tiny_target()
    d2t = torch.tensor([0, 1, 2, *range(3, 96, 2)])
    cfg = _tiny_drafter_config(target).replace(draft_vocab_size=int(d2t.numel()))
    model = build_draft_model(cfg, target, init_from_target=True, d2t=d2t)
    seqs = _cached_sequences(target, 8, 24, 4)
    tcfg = TrainConfig(steps=20, batch_seqs=4, num_anchors=6, lr=3e-3, checkpoint_every=20, bf16=False)
    head = target.get_output_embeddings()
    run_train(model, seqs, tcfg, LossConfig(), tmp_path / "first", target_head=head)
    model.calibration = Calibration((1.5, 2.0, 0.7, 3.0))
    export_drafter(model, tmp_path / "ckpt", dtype="float32")
    again = draft_model_from_checkpoint(tmp_path / "ckpt", target)
    assert again.config == model.config and torch.equal(again.d2t, d2t)
    assert again.calibration.temperatures == (1.5, 2.0, 0.7, 3.0)
    assert again.embed_tokens is target.get_input_embeddings() and not again.embed_tokens.weight.requires_grad
    assert all(p.requires_grad and p.dtype == torch.float32 for p in trainable_parameters(again))
    fixed = make_batch(seqs[:4], 6, 4, torch.Generator().manual_seed(9))
    model.eval()
    again.eval()
    with torch.no_grad():
        h = [
            m.forward_train(fixed.context_hidden, fixed.input_ids, fixed.anchors, fixed.anchor_valid)
            for m in (model, again)
        ]
        assert torch.equal(
            model.block_logits(h[0], fixed.prev_tokens), again.block_logits(h[1], fixed.prev_tokens)
        )
        before = float(forward_loss(again, fixed, LossConfig(), False, head).loss)
    run_train(again, seqs, tcfg, LossConfig(), tmp_path / "second", target_head=head)
    with torch.no_grad():
        assert float(forward_loss(again, fixed, LossConfig(), False, head).loss) < before
    (tmp_path / "ckpt" / "config.json").write_text(
        (tmp_path / "ckpt" / "config.json")
        .read_text()
        .replace('"num_hidden_layers": 1', '"num_hidden_layers": 2')
    )
    with pytest.raises(ValueError):
        draft_model_from_checkpoint(tmp_path / "ckpt", target)


def _trained_tiny_drafter(tmp_path):
    """A tiny target, its cached sequences and LM head, a drafter trained 20 steps on them,
    the training config, and a fixed batch: what growing or converting starts from."""
    target = _tiny_target()
    seqs = _cached_sequences(target, 8, 24, 4)
    head = target.get_output_embeddings()
    model = build_draft_model(_tiny_drafter_config(target), target, init_from_target=True)
    tcfg = TrainConfig(steps=20, batch_seqs=4, num_anchors=6, lr=3e-3, checkpoint_every=20, bf16=False)
    run_train(model, seqs, tcfg, LossConfig(), tmp_path / "start", target_head=head)
    model.eval()
    return target, seqs, head, model, tcfg, make_batch(seqs[:4], 6, 4, torch.Generator().manual_seed(9))


def _block_outputs(m, fixed):
    """(block logits, confidence logits) of drafter m on the batch."""
    h = m.forward_train(fixed.context_hidden, fixed.input_ids, fixed.anchors, fixed.anchor_valid)
    return m.block_logits(h, fixed.prev_tokens), m.confidence_logits(h, fixed.prev_tokens)


def test_a_grown_drafter_computes_what_it_grew_from_and_its_new_capacity_learns(tmp_path):
    """`--grow-layers` / `--grow-markov-rank`: the bigger drafter (a layer stacked on top, a
    wider Markov head) gives the same logits and confidences as the trained one it grew from,
    training reaches its new weights (the new layer's output projections leave zero, the new
    Markov columns' W2 too) and lowers the loss; shrinking is refused."""
    from dspark_serve.training.train import grow_draft_model, grown_config

    target, seqs, head, model, tcfg, fixed = _trained_tiny_drafter(tmp_path)
    model.calibration = Calibration((1.5, 2.0, 0.7, 3.0))
    big = grow_draft_model(model, target, layers=2, markov_rank=16)
    assert (big.config.num_hidden_layers, big.config.markov_rank) == (2, 16)
    assert big.calibration is model.calibration
    big.eval()
    with torch.no_grad():
        for a, b in zip(_block_outputs(model, fixed), _block_outputs(big, fixed)):
            assert torch.allclose(a, b, atol=1e-5)
        before = float(forward_loss(big, fixed, LossConfig(), False, head).loss)
    new = big.layers[1]
    assert float(new.self_attn.o_proj.weight.detach().abs().sum()) == 0.0
    run_train(big, seqs, tcfg, LossConfig(), tmp_path / "big", target_head=head)
    with torch.no_grad():
        assert float(forward_loss(big, fixed, LossConfig(), False, head).loss) < before
    assert float(new.self_attn.o_proj.weight.detach().abs().sum()) > 0.0
    assert float(new.mlp.down_proj.weight.detach().abs().sum()) > 0.0
    assert float(big.markov_head.markov_w2.weight[:, 8:].detach().abs().sum()) > 0.0
    with pytest.raises(ValueError, match="already has 2"):
        grown_config(big.config, layers=1)
    with pytest.raises(ValueError, match="rank to 4"):
        grown_config(big.config, markov_rank=4)


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_a_converted_markov_head_keeps_the_bias_and_its_new_inputs_learn(tmp_path, kind):
    """`--convert-markov-head`: a trained vanilla head turned gated (exact) or recurrent (to
    within the conversion's small tanh error) gives the logits and confidences it gave, and
    training reaches the weights that read the backbone's hidden state and the recurrent
    state (zero at conversion), lowering the loss; only a vanilla head converts."""
    from dspark_serve.training.train import grow_draft_model, grown_config

    target, seqs, head, model, tcfg, fixed = _trained_tiny_drafter(tmp_path)
    conv = grow_draft_model(model, target, markov_head_type=kind)
    assert conv.config.markov_head_type == kind and conv.config.markov_rank == model.config.markov_rank
    conv.eval()
    with torch.no_grad():
        (la, ca), (lb, cb) = _block_outputs(model, fixed), _block_outputs(conv, fixed)
        spread = float((la - la.mean(-1, keepdim=True)).abs().mean())
        assert torch.allclose(ca, cb, atol=1e-5)
        assert float((la - lb).abs().max()) < (1e-5 if kind == "gated" else 0.02 * spread)
        before = float(forward_loss(conv, fixed, LossConfig(), False, head).loss)
    mh = conv.markov_head
    r = conv.config.markov_rank
    # The weights fed by what the vanilla head never saw: the backbone's h (and the state).
    fresh = mh.gate_proj.weight[:, :-r] if kind == "gated" else mh.joint_proj.weight[2 * r :, :r]
    assert float(fresh.detach().abs().sum()) == 0.0
    run_train(conv, seqs, tcfg, LossConfig(), tmp_path / kind, target_head=head)
    with torch.no_grad():
        assert float(forward_loss(conv, fixed, LossConfig(), False, head).loss) < before
    assert float(fresh.detach().abs().sum()) > 0.0
    with pytest.raises(ValueError, match="only a vanilla head converts"):
        grown_config(conv.config, markov_head_type="gated" if kind == "rnn" else "rnn")


def test_export_then_load_gives_identical_logits(tmp_path):
    target = _tiny_target()
    cfg = _tiny_drafter_config(target)
    model = build_draft_model(cfg, target, init_from_target=False)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    model.calibration = Calibration((1.5, 2.0, 0.7, 3.0))
    export_drafter(model, tmp_path / "ckpt", dtype="float32")
    names = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"config.json", "model.safetensors", "calibration.json"} <= names
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "ckpt" / "model.safetensors")))
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in keys)
    loaded = load_dspark(
        str(tmp_path / "ckpt"),
        target_embed=target.get_input_embeddings(),
        target_lm_head=target.get_output_embeddings(),
    )
    seqs = _cached_sequences(target, 2, 16, 4)
    batch = make_batch(seqs, 3, 4, torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        outs = []
        for m in (model, loaded):
            h = m.forward_train(batch.context_hidden, batch.input_ids, batch.anchors, batch.anchor_valid)
            outs.append((m.block_logits(h, batch.prev_tokens), m.confidence_probs(h, batch.prev_tokens)))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    assert loaded.calibration.temperatures == (1.5, 2.0, 0.7, 3.0)
    # bf16 export is half the size and still loads.
    export_drafter(model, tmp_path / "bf16", dtype="bfloat16")
    assert (tmp_path / "bf16" / "model.safetensors").stat().st_size < 0.6 * (
        tmp_path / "ckpt" / "model.safetensors"
    ).stat().st_size
    load_dspark(
        str(tmp_path / "bf16"),
        target_embed=target.get_input_embeddings(),
        target_lm_head=target.get_output_embeddings(),
    )


@pytest.mark.parametrize("kind", ["dspark", "ngram"])
def test_eval_loop_is_lossless_greedy(kind):
    target = _tiny_target()
    prompt = [5, 9, 5, 9, 5, 9, 7, 3]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=20,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )[0, len(prompt) :].tolist()
    if kind == "dspark":
        drafter = NeuralDrafter(build_draft_model(_tiny_drafter_config(target), target, True).eval())
    else:
        drafter = NgramEvalDrafter(4)
    stats = speculative_generate(target, drafter, prompt, 20, 0.0, eos_id=-1, seed=0)
    assert stats.new_tokens == 20
    assert 0 < len(stats.accepted) <= 19
    assert stats.generated == ref


def test_training_data_joins_work_directories_and_keeps_held_out_shards_apart(tmp_path):
    """`dspark-train train --extra-data`: every folder's training shards join, held-out shards
    (every n-th) stay out, and the memory-mapped load gives back exactly what was saved."""
    from dspark_serve.training.cli import build_parser
    from dspark_serve.training.data import SHARD_PATTERN, save_atomic
    from dspark_serve.training.train import load_train_data

    def shard(first_id: int) -> dict:
        ids = [torch.arange(first_id, first_id + 6), torch.arange(first_id, first_id + 5)]
        return {
            "tap_ids": [0],
            "input_ids": ids,
            "num_prompt": [2, 2],
            "taps": [torch.randn(len(x), 8, dtype=torch.float16) for x in ids],
            "last": [torch.randn(len(x), 4, dtype=torch.float16) for x in ids],
        }

    saved = {}
    for folder in ("a", "b"):
        (tmp_path / folder / "cache").mkdir(parents=True)
        for i in range(3):  # holdout_every=3: shard 2 is held out
            saved[folder, i] = shard(100 * i + (0 if folder == "a" else 1000))
            save_atomic(saved[folder, i], tmp_path / folder / "cache" / SHARD_PATTERN.format(i))
    data = []
    for folder in ("a", "b"):
        data += load_train_data(tmp_path / folder, holdout_every=3)
    firsts = sorted(int(s.input_ids[0]) for s in data)
    assert firsts == [0, 0, 100, 100, 1000, 1000, 1100, 1100]
    got = next(s for s in data if int(s.input_ids[0]) == 1100 and len(s.input_ids) == 5)
    assert torch.equal(got.taps, saved["b", 1]["taps"][1]) and got.num_prompt == 2
    args = build_parser().parse_args(["train", "--out", "a", "--extra-data", "b", "--extra-data", "c"])
    assert args.extra_data == ["b", "c"]


def test_follow_anchors_start_after_the_leading_hits():
    """A block from anchor a with m leading hits stops at a + 1 + m; the anchor there is valid
    only when it and the next position are supervised, and invalid blocks stay invalid."""
    loss_mask = torch.zeros(1, 14, dtype=torch.bool)
    loss_mask[0, 3:] = True  # prompt 0..2, response 3..13
    anchors = torch.tensor([[3, 5, 6, 9, 2]])
    valid = torch.tensor([[True, True, True, True, False]])
    hits = torch.tensor(
        [
            [
                [True, True, False, True],  # m = 2 (a later hit does not count) -> 6
                [True, True, True, True],  # a full block -> 5 + 1 + 4 = 10
                [False, True, True, True],  # m = 0 -> 7
                [True, True, True, False],  # -> 13, the last position: nothing after it to predict
                [True, True, True, True],  # an invalid block stays invalid
            ]
        ]
    )
    nxt, ok = follow_anchors(anchors, valid, hits, loss_mask)
    assert ok.tolist() == [[True, True, True, False, False]]
    assert nxt[ok].tolist() == [6, 10, 7]


def test_follow_anchors_are_the_anchors_a_greedy_speculative_loop_drafts_from(tmp_path):
    """Chaining follow anchors over a greedy speculative generation, teacher-forced, visits the
    same anchors as the loop itself (the same drafter, verified by the target), round by round."""
    torch.manual_seed(0)
    target = _tiny_target()
    model = build_draft_model(_tiny_drafter_config(target), target, init_from_target=True)
    # Briefly trained on the target's own greedy text, so blocks stop at varied lengths.
    prompts = [
        [5, 9, 5, 9, 5, 9, 7, 3],
        [11, 12, 13, 11, 12, 13, 40, 2],
        [8, 8, 30, 8, 8, 30, 8, 8],
        [17, 3, 64, 22, 9, 41, 5, 70],
    ]
    seqs = []
    for pr in prompts:
        ids = pr + speculative_generate(target, NgramEvalDrafter(4), pr, 40, 0.0, eos_id=-1).generated
        taps, last = target_states(target, ids, (0, 2))
        seqs.append(CachedSequence(torch.tensor(ids), len(pr), taps, last))
    tcfg = TrainConfig(steps=15, batch_seqs=3, num_anchors=12, lr=3e-3, checkpoint_every=15, bf16=False)
    run_train(model, seqs, tcfg, LossConfig(), tmp_path / "run")
    model.eval()
    rounds = []
    for pr in prompts:
        stats = speculative_generate(target, NeuralDrafter(model), pr, 40, 0.0, eos_id=-1)
        ids = pr + stats.generated
        taps, last = target_states(target, ids, (0, 2))
        padded = pad_sequences([CachedSequence(torch.tensor(ids), len(pr), taps, last)])
        anchor = len(pr)  # the first generated token: the loop drafts its first block from it
        for proposed, accepted in zip(stats.proposed, stats.accepted):
            if proposed < model.config.block_size:
                break  # the loop's last, shortened rounds
            a = torch.tensor([[anchor]])
            batch = anchored_batch(padded, a, torch.ones_like(a, dtype=torch.bool), model.config.block_size)
            nxt, ok = follow_anchors(
                a, batch.anchor_valid, greedy_hits(model, batch, False), padded.loss_mask
            )
            assert bool(ok) and int(nxt) == anchor + 1 + accepted
            rounds.append(accepted)
            anchor = int(nxt)
    assert len(rounds) >= 20 and {0, 4} <= set(rounds)  # blocks stopped at once and ran full


def test_training_with_follow_anchors_moves_only_the_chosen_share_and_still_learns(tmp_path):
    """follow_fraction 0 builds exactly the uniform batch (old runs resume alike); 0.5 moves
    half the anchors of each sequence to their follow anchors and leaves the rest; such runs
    lower the loss, and held-out scoring reports the greedy tau at follow anchors too."""
    torch.manual_seed(0)
    target = _tiny_target()
    seqs = _cached_sequences(target, 8, 24, 4)
    model = build_draft_model(_tiny_drafter_config(target), target, init_from_target=True)
    base = TrainConfig(steps=40, batch_seqs=4, num_anchors=6, lr=3e-3, checkpoint_every=20, bf16=False)
    uniform = training_batch(model, seqs[:4], base, torch.Generator().manual_seed(9))
    same = make_batch(seqs[:4], 6, 4, torch.Generator().manual_seed(9))
    assert torch.equal(uniform.anchors, same.anchors) and torch.equal(uniform.labels, same.labels)

    half = dataclasses.replace(base, follow_fraction=0.5)
    moved = training_batch(model, seqs[:4], half, torch.Generator().manual_seed(9))
    slots = torch.randperm(6, generator=_after_anchors(seqs[:4], 9))[:3]
    hits = greedy_hits(model, make_batch(seqs[:4], 6, 4, torch.Generator().manual_seed(9)), False)
    nxt, ok = follow_anchors(same.anchors, same.anchor_valid, hits, pad_sequences(seqs[:4]).loss_mask)
    want = same.anchors.clone()
    want[:, slots] = torch.where(ok[:, slots], nxt[:, slots], same.anchors[:, slots])
    assert torch.equal(moved.anchors, want) and not torch.equal(moved.anchors, same.anchors)
    assert torch.equal(moved.anchor_valid, same.anchor_valid)

    fixed = make_batch(seqs[:4], 6, 4, torch.Generator().manual_seed(9))
    with torch.no_grad():
        before = float(forward_loss(model, fixed, LossConfig(), False).loss)
    run_train(model, seqs, half, LossConfig(), tmp_path / "run", held_out=seqs[6:])
    with torch.no_grad():
        assert float(forward_loss(model, fixed, LossConfig(), False).loss) < 0.7 * before
    ho = evaluate_held_out(model, seqs[6:], 6, LossConfig(), False, 40)
    assert 1.0 <= ho.follow_greedy_tau <= 5.0
    with pytest.raises(ValueError, match="1.5"):
        TrainConfig(follow_fraction=1.5)


def _after_anchors(seqs, seed: int) -> torch.Generator:
    """A generator in the state training_batch leaves it after sampling the uniform anchors."""
    gen = torch.Generator().manual_seed(seed)
    sample_anchors(pad_sequences(seqs).loss_mask, 6, gen)
    return gen


def test_dspark_train_trains_scores_finalizes_and_starts_from_an_export(tmp_path, monkeypatch):
    """`dspark-train train` end to end on a tiny target: a run with a truncated draft vocabulary
    saves its final drafter and arguments, scores its checkpoints on the held-out shard,
    finalizes an earlier step, and an export grown by a layer starts a second run."""
    import json
    import types

    from dspark_serve.training import cli
    from dspark_serve.training.data import SHARD_PATTERN, save_atomic
    from dspark_serve.training.train import draft_model_from_checkpoint

    target = _tiny_target()
    seqs = _cached_sequences(target, 9, 24, 4)
    out = tmp_path / "out"
    (out / "cache").mkdir(parents=True)
    for i in range(3):  # holdout_every=3: shard 2 is held out
        part = seqs[3 * i : 3 * i + 3]
        shard = {
            "tap_ids": [0, 2],
            "input_ids": [s.input_ids for s in part],
            "num_prompt": [s.num_prompt for s in part],
            "taps": [s.taps for s in part],
            "last": [s.last for s in part],
        }
        save_atomic(shard, out / "cache" / SHARD_PATTERN.format(i))
    loaded = types.SimpleNamespace(model=target, tokenizer=types.SimpleNamespace(eos_token_id=2))
    monkeypatch.setattr(cli, "_load_target", lambda a: loaded)
    model_args = ["--layers", "1", "--block-size", "4", "--taps", "0,2", "--mask-token-id", "1"]
    model_args += ["--markov-rank", "8", "--num-anchors", "6", "--holdout-every", "3", "--fp32"]
    run = ["train", "--out", str(out), "--name", "r", "--steps", "4", "--checkpoint-every", "2"]
    run += ["--held-out-seqs", "2", "--draft-vocab", "10", *model_args]
    assert cli.main(run) == 0
    work = out / "train" / "r"
    saved = json.loads((work / "final" / "train_args.json").read_text())
    assert saved["sequences"] == 6 and saved["train"]["steps"] == 4
    assert draft_model_from_checkpoint(work / "final", target).config.draft_vocab_size == 10
    assert cli.main([*run, "--score-checkpoints"]) == 0
    scored = json.loads((work / "held_out.json").read_text())
    assert scored["held_out_sequences"] == 2 and [c["step"] for c in scored["checkpoints"]] == [2, 4]
    assert cli.main([*run, "--finalize-at", "2"]) == 0
    assert json.loads((work / "final" / "train_args.json").read_text())["train"]["steps"] == 2
    export_drafter(draft_model_from_checkpoint(work / "final", target), tmp_path / "export", dtype="float32")
    grown = ["train", "--out", str(out), "--name", "g", "--steps", "2", "--checkpoint-every", "2"]
    grown += ["--held-out-seqs", "0", "--init-from", str(tmp_path / "export"), "--grow-layers", "2"]
    assert cli.main([*grown, *model_args]) == 0
    again = draft_model_from_checkpoint(out / "train" / "g" / "final", target)
    assert again.config.num_hidden_layers == 2 and again.config.draft_vocab_size == 10
    with pytest.raises(SystemExit):
        cli.main(["train", "--out", str(out), "--grow-layers", "2"])


@pytest.mark.parametrize("with_probs", [False, True])
def test_sampled_verification_emits_the_targets_distribution(with_probs):
    """Rejection sampling is lossless: the first token a round emits (the draft when kept, the
    residual draw when not) follows the target's distribution, whatever the draft's."""
    from dspark_serve.training.evaluate import Proposal, verify_sampled

    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.log(p).repeat(2, 1)  # [K+1, V] at temperature 1
    q = torch.tensor([[0.7, 0.1, 0.1, 0.1]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    n = 20000
    for _ in range(n):
        draft = int(torch.multinomial(q[0], 1, generator=gen)) if with_probs else 0
        prop = Proposal(torch.tensor([draft]), q if with_probs else None, None)
        verdict = verify_sampled([draft], logits, prop, 1.0, gen)
        counts[draft if verdict.accepted else verdict.bonus] += 1
    assert torch.allclose(counts / n, p, atol=0.015)


def test_evaluation_writes_a_summary_and_resumes_from_its_runs(tmp_path):
    """`dspark-train evaluate` on a tiny target: every drafter at every temperature on every
    dev set, the macro average, the confidence head's calibration before and after its
    temperatures with reliability diagrams; a second call reads the finished runs back."""
    import json
    import types

    from dspark_serve.training.evaluate import run_evaluation

    class Tokenizer:
        eos_token_id = 11

        def apply_chat_template(self, messages, add_generation_prompt, return_dict):
            return [3 + ord(c) % 90 for c in messages[0]["content"]][:12]

    target = _tiny_target()
    model = build_draft_model(_tiny_drafter_config(target), target, True).eval()
    model.calibration = Calibration((1.5, 2.0, 0.7, 3.0))
    export_drafter(model, tmp_path / "dspark", dtype="float32")
    dev = tmp_path / "dev-toy.jsonl"
    dev.write_text("\n".join(json.dumps({"turns": [t]}) for t in ["abcabcabc", "hello hello", "unused"]))
    loaded = types.SimpleNamespace(model=target, tokenizer=Tokenizer())
    results = tmp_path / "results"
    kwargs = dict(max_prompts=2, max_new_tokens=16, temperatures=(0.0, 1.0), seed=1)
    summary = run_evaluation(loaded, {"dspark": str(tmp_path / "dspark")}, [str(dev)], str(results), **kwargs)
    rows = summary["datasets"]["toy"]
    assert set(rows) == {"T0", "T1"} and all(set(r) == {"dspark", "ngram"} for r in rows.values())
    assert all(1.0 <= r["acceptance_length"] <= 5.0 for t in rows.values() for r in t.values())
    assert summary["macro"]["T0"]["dspark"] == rows["T0"]["dspark"]["acceptance_length"]
    assert summary["confidence"]["dspark_T0"]["temperatures"] == [1.5, 2.0, 0.7, 3.0]
    assert (results / "reliability_dspark_T1.png").exists() and (results / "summary.json").exists()
    assert len(list((results / "runs").glob("*.json"))) == 4
    written = (results / "summary.json").read_text()
    run_evaluation(loaded, {"dspark": str(tmp_path / "dspark")}, [str(dev)], str(results), **kwargs)
    assert (results / "summary.json").read_text() == written
