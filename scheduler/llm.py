"""Offline batch generation through the engine (data generation, benchmarks, tests)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from dspark_serve.drafter.config import DrafterConfig
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.builder import build_engine
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import HiddenCapture
from dspark_serve.scheduler.request import Request, SpecStats
from dspark_serve.verifier.config import ModelConfig


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str
    finish_reason: str
    spec: SpecStats | None


# Where the offline defaults differ from the serving ones: the CPU, a waiting queue that
# never refuses (the caller submits its whole batch at once), and a cost table measured before
# the first step (an offline run has no idle gaps to measure it in).
OFFLINE_DEFAULTS = {"device": "cpu", "max_waiting": 1 << 30, "cost_table_in_background": False}
OFFLINE_CONFIGS = (ModelConfig, DrafterConfig, SchedulerConfig)


def offline_configs(**options: Any) -> tuple[ModelConfig, DrafterConfig, SchedulerConfig]:
    """The component configs from keyword arguments named like their fields (any field of
    ModelConfig, DrafterConfig or SchedulerConfig), over OFFLINE_DEFAULTS and then the
    configs' own defaults."""
    known = {f.name for c in OFFLINE_CONFIGS for f in fields(c)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"unexpected keyword arguments {unknown}; LLM takes the fields of "
            f"{', '.join(c.__name__ for c in OFFLINE_CONFIGS)}"
        )
    values = {**OFFLINE_DEFAULTS, **options}

    def pick(c: type) -> dict[str, Any]:
        return {f.name: values[f.name] for f in fields(c) if f.name in values}

    return (
        ModelConfig(**pick(ModelConfig)),
        DrafterConfig(**pick(DrafterConfig)),
        SchedulerConfig(**pick(SchedulerConfig)),
    )


class LLM:
    """`LLM(model=None, drafter="none").generate(prompt_token_ids, SamplingParams(...), 128)`.

    Keyword arguments: any field of ModelConfig, DrafterConfig or SchedulerConfig (see
    `offline_configs`); capture(num_layers) builds a hidden-state capture for training data."""

    def __init__(self, *, capture: Callable[[int], HiddenCapture] | None = None, **options: Any) -> None:
        bundle = build_engine(*offline_configs(**options), capture=capture)
        self.engine = bundle.engine
        self.tokenizer = bundle.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling_params: SamplingParams,
        max_tokens: int,
        on_progress: Callable[[int, int], None] | None = None,
        ignore_eos: bool = False,
    ) -> list[GenerationOutput]:
        reqs = []
        for ids in prompt_token_ids:
            sp = sampling_params
            r = Request(f"offline-{next(self._ids)}", list(ids), sp, max_tokens, ignore_eos=ignore_eos)
            self.engine.add_request(r)
            reqs.append(r)
        texts: dict[str, list[str]] = {r.request_id: [] for r in reqs}
        done = 0
        while self.engine.has_work():
            for out in self.engine.step():
                if out.request_id in texts:
                    texts[out.request_id].append(out.text)
                if out.finished:
                    done += 1
                    if on_progress is not None:
                        on_progress(done, len(reqs))
        return [
            GenerationOutput(
                r.output_ids,
                "".join(texts[r.request_id]),
                r.finish_reason or "",
                r.spec if self.engine.drafter is not None else None,
            )
            for r in reqs
        ]
