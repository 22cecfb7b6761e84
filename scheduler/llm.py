"""Offline batch generation through the engine (data generation, benchmarks, tests)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from drafter.config import DrafterConfig
from scheduler.builder import build_engine
from scheduler.config import SchedulerConfig
from scheduler.engine import HiddenCapture
from scheduler.request import Request, SpecStats
from verifier.config import ModelConfig
from verifier.sampling_params import SamplingParams


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str
    finish_reason: str
    spec: SpecStats | None


class LLM:
    """`LLM(model=None, drafter="none").generate(prompt_token_ids, SamplingParams(...), 128)`."""

    def __init__(self, model: str | None = None, drafter: str = "none", drafter_path: str | None = None,
                 block_size: int | None = None, verify_policy: str = "auto", max_num_seqs: int = 32,
                 max_model_len: int = 2048, device: str = "cpu", dtype: str = "auto",
                 kv_cache_tokens: int = 0, max_num_batched_tokens: int = 512,
                 cache_dir: str | None = None, forward: str = "fast", linear: str = "auto",
                 quantize: str = "none",
                 capture: Callable[[int], HiddenCapture] | None = None) -> None:
        bundle = build_engine(
            ModelConfig(model=model, device=device, dtype=dtype, max_model_len=max_model_len,
                        kv_cache_tokens=kv_cache_tokens, cache_dir=cache_dir, forward=forward,
                        linear=linear, quantize=quantize),
            DrafterConfig(drafter=drafter, drafter_path=drafter_path, block_size=block_size),
            SchedulerConfig(max_num_seqs=max_num_seqs, verify_policy=verify_policy,
                            max_num_batched_tokens=max_num_batched_tokens, max_waiting=1 << 30),
            capture=capture)
        self.engine = bundle.engine
        self.tokenizer = bundle.tokenizer
        self.model_name = bundle.model_name
        self._ids = itertools.count()

    def generate(self, prompt_token_ids: list[list[int]], sampling_params: SamplingParams,
                 max_tokens: int, on_progress=None, ignore_eos: bool = False) -> list[GenerationOutput]:
        reqs = []
        for ids in prompt_token_ids:
            sp = sampling_params
            r = Request(f"offline-{next(self._ids)}", list(ids), sp, max_tokens, ignore_eos=ignore_eos)
            self.engine.add_request(r)
            reqs.append(r)
        texts = {r.request_id: [] for r in reqs}
        done = 0
        while self.engine.has_work():
            for out in self.engine.step():
                if out.request_id in texts:
                    texts[out.request_id].append(out.text)
                if out.finished:
                    done += 1
                    if on_progress is not None:
                        on_progress(done, len(reqs))
        return [GenerationOutput(r.output_ids, "".join(texts[r.request_id]), r.finish_reason or "",
                                 r.spec if self.engine.drafter is not None else None) for r in reqs]
