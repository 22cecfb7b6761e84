"""The reasoning split on a real engine under speculation, the end tag at every offset of a
verified block: a tiny "bigram" target whose next token depends only on the current one writes a
fixed script (`<think>`, a few reasoning tokens, `</think>`, an answer), and an oracle drafter
proposes that script, its first block of 0-7 tokens and then blocks of 7, so the committed blocks
cross the end tag at each offset; the end tag one token (greedy) or several (seeded sampling);
whole and streamed through the official client."""

from __future__ import annotations

import copy

import pytest
import torch

from dspark_serve.drafter.base import DraftProposal

pytestmark = pytest.mark.slow

REASONING = " alpha beta gamma delta epsilon zeta"
ANSWER = " The answer is seven."


def bigram_model(vocab: int, chain: list[int]):
    """A tiny Llama whose layers add nothing (o_proj and down_proj zero): the logits read the
    current token's embedding only. chain[i] -> chain[i + 1] gets a logit far above the rest."""
    from tests.helpers import tiny_model

    model = tiny_model("llama", vocab=vocab)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        assert len(set(chain[:-1])) == len(chain) - 1 <= emb.shape[1]
        for i, (t, nxt) in enumerate(zip(chain, chain[1:])):
            emb[t] = 0.0
            emb[t, i] = 1.0
            head[nxt] = 0.0
            head[nxt, i] = 30.0
    return model


class OracleDrafter:
    """Proposes the script's next tokens: `first` of them at a request's first drafting step,
    then 7 (the first block length is read from the prompt's last user message, "first N")."""

    name = "oracle"
    block_size = 7
    tap_layers: tuple[int, ...] = ()
    online_confidence = False
    calibrator = None

    def __init__(self, script: list[int], tokenizer) -> None:
        self.script, self.tok, self.seen = script, tokenizer, set()

    def propose(self, requests):
        out = []
        for r in requests:
            done = len(r.token_ids) - r.num_prompt_tokens
            k = 7
            if r.request_id not in self.seen:
                self.seen.add(r.request_id)
                prompt = self.tok.decode(r.token_ids[: r.num_prompt_tokens])
                k = int(prompt.rsplit("first ", 1)[1].split()[0])
            k = min(k, r.max_draft)
            out.append(DraftProposal(torch.tensor(self.script[done : done + k], dtype=torch.long)))
        return out

    def observe(self, contexts):
        pass

    def observe_acceptance(self, request_id, proposed, accepted):
        pass

    def catch_up_seconds(self, request_ids):
        return 0.0

    def free(self, request_id):
        self.seen.discard(request_id)


@pytest.fixture(scope="module", params=["one token", "several tokens"])
def server(request):
    """The end tag `</think>` as one added token (greedy requests), or left to the vocabulary:
    several tokens, which the detokenizer releases in pieces (seeded sampled requests)."""
    from dspark_serve.verifier.loader import load_target
    from tests.server.test_e2e import tiny_server

    tok = copy.deepcopy(load_target(None).tokenizer)
    tok.add_tokens(["<think>", "</think>"] if request.param == "one token" else ["<think>"])
    think = tok.convert_tokens_to_ids("<think>")
    end = tok.encode("</think>", add_special_tokens=False)
    words, answer = (
        tok.encode(REASONING, add_special_tokens=False),
        tok.encode(ANSWER, add_special_tokens=False),
    )
    assert 4 <= len(words) <= 7  # so first blocks of 0-7 drafts put the end tag at every offset
    assert (len(end) == 1) == (request.param == "one token")
    script = [think, *words, *end, *answer, tok.eos_token_id]
    anchor = tok.encode("\n", add_special_tokens=False)[-1]  # the generation prompt's last token
    model = bigram_model(len(tok), [anchor, *script])

    s = tiny_server(tok, model, OracleDrafter(script, tok), "qwen3", policy="static:7", draft_gate=False)
    sampling = {"temperature": 0} if request.param == "one token" else {"temperature": 0.8, "seed": 11}
    yield s, sampling
    s.close()


def test_the_end_tag_at_every_offset_of_a_drafted_block(server):
    from tests.server.test_e2e import MODEL

    live, sampling = server
    c = live.client()
    for first in range(8):  # the end tag lands at each offset of the first or second verified block
        kw = dict(
            model=MODEL,
            messages=[{"role": "user", "content": f"first {first} please"}],
            max_tokens=40,
            **sampling,
        )
        whole = c.chat.completions.create(**kw)
        msg = whole.choices[0].message
        assert msg.model_extra["reasoning_content"] == REASONING, first
        assert msg.content == ANSWER.lstrip(), first
        spec = whole.usage.model_extra["spec_decode"]
        assert spec["accepted_tokens"] == spec["draft_tokens"] > 0  # the oracle's blocks were all kept
        chunks = list(c.chat.completions.create(**kw, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == REASONING
        assert "".join(d.content or "" for d in deltas) == ANSWER.lstrip()
