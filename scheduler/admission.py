"""What a request must bring before the engine queues it: everything a step reads from its
input is checked here, so no step can fail because of it. The server's request models own the
HTTP-level rules; these are the engine's own (the vocabulary, the context and KV limits, the
tokenizer, the tensors sampling builds), which hold for every caller of the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dspark_serve.ops.sampling import SamplingTensors
from dspark_serve.scheduler.client import EngineError
from dspark_serve.scheduler.limits import LimitError, check_context, check_token_ids
from dspark_serve.scheduler.request import Request, Status


class RequestRejected(EngineError):
    """A request the engine cannot take (too long, queue full); carries an HTTP status."""


@dataclass(frozen=True)
class Limits:
    """vocab_size: token ids must be below it. max_model_len: prompt + max_tokens. kv_blocks:
    the blocks the whole cache has; blocks_needed(n): the blocks n tokens take."""

    vocab_size: int
    max_model_len: int
    kv_blocks: int
    block_size: int

    def blocks_needed(self, n: int) -> int:
        return -(-n // self.block_size)


def _check_tokens(req: Request, V: int) -> None:
    if not req.prompt_ids:
        raise RequestRejected("the prompt is empty", 400, "messages")
    check_token_ids(req.prompt_ids, V, "prompt", "prompt")
    if type(req.max_tokens) is not int or req.max_tokens < 1:
        raise RequestRejected(
            f"max_tokens must be a positive integer, got {req.max_tokens!r}", 400, "max_tokens"
        )
    if not all(isinstance(s, str) for s in req.stop):
        raise RequestRejected("stop must be strings", 400, "stop")


def _check_sampling(req: Request, V: int) -> None:
    sp = req.sampling
    if sp.seed is not None and req.generator is None:
        raise RequestRejected("a seeded request needs its generator", 400, "seed")
    try:  # the sampling parameters must fit the tensors the step builds from them
        SamplingTensors.from_params([sp], torch.device("cpu"))
    except (ValueError, TypeError, RuntimeError, OverflowError) as exc:
        raise RequestRejected(f"sampling parameters out of range: {exc}", 400) from exc
    check_token_ids((t for t, _ in sp.logit_bias), V, "logit_bias", "logit_bias")
    if req.logprobs is not None and not (0 <= req.logprobs <= 20):
        raise RequestRejected(f"top_logprobs must be in [0, 20], got {req.logprobs!r}", 400, "top_logprobs")


def _check_length(req: Request, limits: Limits) -> None:
    total = len(req.prompt_ids) + req.max_tokens
    check_context(len(req.prompt_ids), req.max_tokens, limits.max_model_len)
    if limits.blocks_needed(total) > limits.kv_blocks:
        raise RequestRejected("the request needs more KV cache than the server has", 400, "max_tokens")


def check_request(req: Request, limits: Limits, in_use: bool) -> None:
    """Raises RequestRejected (with its HTTP status and parameter) for what the request cannot
    bring; `in_use`: its id is already taken."""
    if in_use:
        raise RequestRejected(f"request id {req.request_id!r} is already in use", 400)
    try:
        _check_tokens(req, limits.vocab_size)
        _check_sampling(req, limits.vocab_size)
        _check_length(req, limits)
    except LimitError as exc:
        raise RequestRejected(str(exc), 400, exc.param, exc.code) from exc


def step_problem(req: Request, vocab_size: int) -> str | None:
    """What is wrong with a scheduled request's input, checked before a step touches any state
    (KV, drafter, generators); None when it is fine."""
    V = vocab_size
    if req.detok is None:
        return "not admitted through add_request"
    if req.status is Status.DECODE:
        t: Any = req.output_ids[-1] if req.output_ids else None
        if type(t) is not int or not (0 <= t < V):
            return f"last token {t!r} out of range"
        return None
    for t in req.prefill_ids[req.num_computed :]:
        if type(t) is not int or not (0 <= t < V):
            return f"prompt token id {t!r} out of range [0, {V})"
    return None
