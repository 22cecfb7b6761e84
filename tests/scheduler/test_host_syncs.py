"""One host synchronisation per step on the CUDA path: the read of the verdict.

The CUDA path's step (the fast forward with Triton attention and torch's matmuls, verification,
rejection sampling) runs here on the CPU, Triton's kernels under its interpreter, inside
`tests/host_syncs.py`'s catcher: every read of device data outside the verdict read
(`verifier.rejection.read_to_host`) fails the test. The catcher is first shown to catch each
kind of read."""

from __future__ import annotations

import pytest
import torch

from dspark_serve.drafter.ngram import NgramConfig, NgramDrafter
from dspark_serve.ops import triton_attention
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.request import Request
from dspark_serve.verifier import attention, rejection
from dspark_serve.verifier.model_runner import ModelRunner
from tests.helpers import ByteTokenizer, hf_greedy, tiny_model
from tests.host_syncs import SyncCatcher
from tests.triton_interpreter import needs_triton


def _reads(catcher: SyncCatcher, fn) -> list[str]:
    before = len(catcher.reads)
    with catcher.watching():
        fn()
    return [r.what for r in catcher.reads[before:]]


def test_the_catcher_catches_each_read_of_device_data():
    c = SyncCatcher()
    dev = torch.arange(6.0)
    mask = dev > 2
    c.taint([dev, mask])
    host = torch.arange(6.0)
    cases = {
        "tolist": lambda: dev.tolist(),
        "item": lambda: dev[0].item(),
        "int": lambda: int(dev[1]),
        "bool": lambda: bool(dev.any()),
        "numpy": lambda: dev.numpy(),
        "nonzero": lambda: dev.nonzero(),
        "boolean index": lambda: host[mask],
        "boolean index_put_": lambda: host.index_put_((mask,), torch.tensor(0.0)),
        "derived": lambda: (dev * 2 + 1).sum().tolist(),  # computed from device data
    }
    for name, fn in cases.items():
        assert _reads(c, fn), f"{name} was not caught"
    # host data, and device data written from the host, are no reads
    host = torch.arange(6.0)
    assert _reads(c, lambda: (host.tolist(), int(host[2]), host[host > 1], dev.copy_(host))) == []
    with c.allow():
        assert _reads(c, lambda: dev.tolist()) == []


CASES = {  # drafter, policy, sampling, CUDA graphs
    "plain greedy": (None, "none", SamplingParams(temperature=0.0), False),
    "n-gram greedy": ("ngram", "static:3", SamplingParams(temperature=0.0), False),
    "n-gram sampled": ("ngram", "auto", SamplingParams(temperature=0.8, top_p=0.9, seed=5), False),
    "plain sampled": (None, "none", SamplingParams(temperature=1.0, top_k=20), False),
    "n-gram greedy, graphs": ("ngram", "static:3", SamplingParams(temperature=0.0), True),
}


QUICK = ("n-gram sampled", "n-gram greedy, graphs")  # the others run in the full suite


@pytest.mark.parametrize(
    "case", [c if c in QUICK else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES)]
)
def test_a_cuda_path_step_reads_the_device_once(case, monkeypatch):
    needs_triton()
    drafter_name, policy, sampling, graphs = CASES[case]
    model = tiny_model("qwen3")
    runner = ModelRunner(
        model, 128, 4, attention="triton", linear="torch", cuda_graphs=graphs, max_model_len=256
    )
    drafter = NgramDrafter(NgramConfig()) if drafter_name else None
    engine = Engine(
        runner,
        ByteTokenizer(),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, verify_policy=policy),
        max_model_len=256,
        drafter=drafter,
    )
    c = SyncCatcher()
    c.taint(model.parameters())
    c.taint(model.buffers())
    c.taint([runner.kv.k, runner.kv.v])
    fast = runner.forward_impl.fast if graphs else runner.forward_impl  # type: ignore[attr-defined]
    rope = fast.rope
    c.taint([t for t in (rope.cos, rope.sin) if t is not None])
    verdicts = 0
    read = rejection.read_to_host
    kernel = triton_attention.paged_attention

    def verdict(*tensors):
        nonlocal verdicts
        verdicts += 1
        with c.allow():
            return read(*tensors)

    def launch(*args, **kwargs):  # a kernel launch: the interpreter runs the device's work here
        with c.allow():
            return kernel(*args, **kwargs)

    monkeypatch.setattr(rejection, "read_to_host", verdict)
    monkeypatch.setattr(attention.triton_attention, "paged_attention", launch)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5][: 3 + 2 * i] + list(range(40, 40 + 9 * i)) for i in range(3)]
    reqs = [Request(f"r{i}", p, sampling, max_tokens=10, ignore_eos=True) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    steps = 0
    while engine.has_work():
        before = verdicts
        with c.watching():
            engine.step()
        assert verdicts - before <= 1, f"step {steps} read the verdict {verdicts - before} times"
        steps += 1
    assert c.reads == [], "reads of device data outside the verdict:\n" + "\n".join(
        f"{r.what} at {r.where}" for r in c.reads
    )
    assert verdicts >= 10  # every decode step read its verdict, once
    if graphs:
        assert runner.forward_impl.replays > 0  # type: ignore[attr-defined]
    if sampling.greedy:  # and the step computed the right thing
        for r, p in zip(reqs, prompts):
            assert r.output_ids == hf_greedy(model, p, 10)
