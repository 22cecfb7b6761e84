"""The runner on CUDA gives the CPU runner's greedy tokens (skips cleanly without CUDA)."""

import pytest
import torch

from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.request import Request
from tests.helpers import ByteTokenizer, runner_for, tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def greedy(model, prompt, n):
    engine = Engine(runner_for(model), ByteTokenizer(), SchedulerConfig(), max_model_len=256)
    r = Request("c", prompt, SamplingParams(temperature=0), n, ignore_eos=True)
    engine.add_request(r)
    while engine.has_work():
        engine.step()
    return r.output_ids


@cuda
def test_cuda_runner_matches_cpu():
    model = tiny_model("qwen3")
    cpu = greedy(model, list(range(50, 80)), 24)
    gpu = greedy(model.to("cuda"), list(range(50, 80)), 24)
    assert gpu == cpu
