"""Commit: a verified step's tokens become output. Stop conditions cut exactly (EOS, stop
strings and max_tokens, even inside an accepted block), the incremental detokenizer turns
tokens into text, and each token gets a `TokenRecord` with its provenance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dspark_serve.scheduler.client import TokenLogprob, TokenRecord, TopLogprob
from dspark_serve.scheduler.metrics_sink import EngineMetricsSink
from dspark_serve.scheduler.request import Request, RequestOutput


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every EOS id the target's generation config, model config or tokenizer declares."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        e = getattr(src, "eos_token_id", None)
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    return frozenset(ids)


@dataclass
class Appended:
    """What appending one step's tokens to a request kept.

    token_ids: the tokens appended (nothing after the stop point).
    pieces: the text each appended token added (held-back text shows up in a later piece).
    finish_reason: "stop" or "length" when the request ended here, else None.
    """

    token_ids: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None


def append_tokens(r: Request, toks: list[int], eos_ids: frozenset[int]) -> Appended:
    """Append a round's tokens to `r` one by one, honouring EOS (not appended), stop strings
    and max_tokens exactly: nothing after the stop point is kept or returned. The caller
    finishes the request when `finish_reason` is set. Under a grammar, EOS is allowed only
    where the output is complete, so it ends the request even with ignore_eos."""
    out = Appended()
    for t in toks:
        if t in eos_ids and (not r.ignore_eos or r.constraint is not None):
            out.finish_reason = "stop"
            break
        r.output_ids.append(t)
        out.token_ids.append(t)
        detok = r.detok
        assert detok is not None  # set when the request is admitted
        before = len(detok.text)
        stopped = detok.add(t)
        out.pieces.append(detok.text[before:])
        if stopped:
            out.finish_reason = "stop"
            break
        if len(r.output_ids) >= r.max_tokens:
            out.finish_reason = "length"
            break
    return out


def token_records(
    appended: Appended,
    provenance: list[tuple[str, int | None]],
    logprobs: list[TokenLogprob] | None = None,
) -> list[TokenRecord]:
    """One TokenRecord per appended token: id, text, where it came from (and its logprob)."""
    lps: list[TokenLogprob | None] = list(logprobs) if logprobs is not None else [None] * len(provenance)
    return [
        TokenRecord(t, text, kind, pos, lp)
        for t, text, (kind, pos), lp in zip(appended.token_ids, appended.pieces, provenance, lps)
    ]


def request_output(
    r: Request, appended: list[int], final: bool, with_spec: bool, tokens: list[TokenRecord] | None = None
) -> RequestOutput:
    """The delta for `r`: its new tokens and the text the detokenizer releases now (all of
    it when final)."""
    text = r.detok.flush(final) if r.detok is not None else ""
    return RequestOutput(
        request_id=r.request_id,
        text=text,
        token_ids=appended,
        finished=final,
        finish_reason=r.finish_reason,
        prompt_tokens=len(r.prompt_ids),
        completion_tokens=len(r.output_ids),
        spec=r.spec if with_spec else None,
        tokens=tokens or [],
    )


def record_tokens(metrics: EngineMetricsSink, r: Request, n: int, kept: int | None, now: float) -> None:
    """The step's token metrics for r: n tokens appended (of `kept` the round kept, for a
    decode; None for a completed prompt's first token), its first-token or inter-token time."""
    metrics.record_tokens(n)
    if kept is not None:
        metrics.record_realized(kept)
    if r.first_token_time is None or r.last_token_time is None:
        r.first_token_time = now
        metrics.record_first_token(now - r.arrival_time, len(r.prompt_ids))
    else:
        metrics.record_inter_token(now - r.last_token_time, n)
    r.last_token_time = now


def target_logprobs(
    r: Request, logits: torch.Tensor, start: int, tokens: list[int], tokenizer: Any
) -> list[TokenLogprob] | None:
    """The target's raw log-probabilities of `tokens`, sampled at flat logits rows start.. of
    the step: the same rows whether a token was an accepted draft, a correction or a bonus, so
    the values are those plain decoding gives. None when r asked for none."""
    if r.logprobs is None:
        return None
    lp = torch.log_softmax(logits[start : start + len(tokens)].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    k = min(r.logprobs, lp.shape[1])
    top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())

    def text(token_id: int) -> str:
        return str(tokenizer.decode([token_id], skip_special_tokens=False))

    return [
        TokenLogprob(
            text(t), float(c), tuple(TopLogprob(int(i), text(int(i)), float(x)) for i, x in zip(ti, tv))
        )
        for t, c, ti, tv in zip(tokens, chosen, top_i.tolist(), top_v.tolist())
    ]
