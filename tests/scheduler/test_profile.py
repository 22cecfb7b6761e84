"""The SPS cost profile: measured on any device, cached per model/device/dtype, reused, redone
on demand, and fed to the load-aware policy."""

import json
import math

import torch

from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler import profile
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.policy import CostTable
from dspark_serve.scheduler.request import Request
from tests.helpers import ByteTokenizer, FakeDrafterBase, runner_for, tiny_model


def test_profile_is_measured_cached_and_reprofiled(tmp_path, monkeypatch):
    runner = runner_for(tiny_model("llama"), num_blocks=1024, block_size=16)
    monkeypatch.setattr(profile, "BATCH_SIZES", (1, 4, 16, 64))
    calls = []
    real = profile.measure

    def counting(r, *a, **k):
        calls.append(1)
        return real(r, batch_sizes=(1, 4, 16, 64), context_lens=(16, 64), repeats=1)

    monkeypatch.setattr(profile, "measure", counting)
    table, raw, source = profile.load_or_profile(runner, "tiny", tmp_path)
    assert isinstance(table, CostTable) and source.startswith("measured") and len(calls) == 1
    assert table.batch_sizes == (1, 4, 16, 64)
    sps = table.steps_per_second
    assert all(b <= a for a, b in zip(sps, sps[1:]))  # never faster at a bigger batch
    assert set(raw["by_context"]) == {"16", "64"}
    # the grid (R requests x t tokens each) is measured with it and priced from: never faster
    # with more tokens or more requests
    assert table.grid_requests == profile.GRID_REQUESTS and table.grid_tokens == profile.GRID_TOKENS
    grid = table.grid_steps_per_second or ()
    assert all(b <= a for row in grid for a, b in zip(row, row[1:]))
    assert all(b <= a for r1, r2 in zip(grid, grid[1:]) for a, b in zip(r1, r2))
    assert math.isclose(table.sps(8, requests=2), grid[1][2])  # 2 requests x 4 tokens: a grid point
    cached = list((tmp_path / "cost-tables").glob("tiny-cpu-*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["profile"]["steps_per_second"] == list(sps)
    table2, _, source2 = profile.load_or_profile(runner, "tiny", tmp_path)
    assert source2.startswith("cached") and table2 == table and len(calls) == 1
    _, _, source3 = profile.load_or_profile(runner, "tiny", tmp_path, reprofile=True)
    assert source3.startswith("measured") and len(calls) == 2
    assert "steps/s" in profile.format_table(raw)
    if runner.forward_impl.uses_c_kernels():  # the C kernels run here: a new build of them is
        import dspark_serve.verifier.model_runner as mr  # new costs, measured again

        monkeypatch.setattr(mr, "kernels_key", lambda: "another-build")
        _, _, source4 = profile.load_or_profile(runner, "tiny", tmp_path)
        assert source4.startswith("measured") and len(calls) == 3


class ConstantConfidenceDrafter(FakeDrafterBase):
    """Drafts token 0 with confidence 0.9 at every position."""

    name, tap_layers, block_size, calibrator = "const", (), 6, None
    online_confidence = False

    def propose(self, requests):
        import torch

        from dspark_serve.drafter.base import DraftProposal

        return [
            DraftProposal(
                torch.zeros(min(6, r.max_draft), dtype=torch.long),
                None,
                torch.full((min(6, r.max_draft),), 0.9),
            )
            for r in requests
        ]


def mean_budget(concurrency: int) -> float:
    # A compute-bound cost curve: a step costs ~ B tokens beyond 8.
    table = CostTable((1, 8, 16, 32, 64, 128), (100.0, 100.0, 50.0, 25.0, 12.5, 6.25))
    engine = Engine(
        runner_for(tiny_model("llama"), num_blocks=2048),
        ByteTokenizer(),
        SchedulerConfig(
            verify_policy="dspark", max_num_seqs=64, max_num_batched_tokens=1024, draft_gate=False
        ),
        max_model_len=256,
        drafter=ConstantConfidenceDrafter(),
        cost_table=table,
    )
    reqs = [
        Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0), 12, ignore_eos=True)
        for i in range(concurrency)
    ]
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    return sum(r.spec.drafted for r in reqs) / sum(r.spec.steps for r in reqs)


def test_engine_budget_shrinks_with_load():
    light, heavy = mean_budget(1), mean_budget(48)
    assert light >= 3.0 and heavy <= 1.0, (light, heavy)


class PessimisticOnlineDrafter(ConstantConfidenceDrafter):
    """Claims confidence 0 everywhere, learned online: the policy alone would never verify."""

    online_confidence = True

    def propose(self, requests):
        props = super().propose(requests)
        for p in props:
            p.confidences = p.confidences * 0
        return props


def test_online_confidence_drafters_still_explore():
    engine = Engine(
        runner_for(tiny_model("llama")),
        ByteTokenizer(),
        SchedulerConfig(verify_policy="dspark", explore_every=4, draft_gate=False),
        max_model_len=256,
        drafter=PessimisticOnlineDrafter(),
    )
    r = Request("x", [1, 2, 3], SamplingParams(temperature=0), 30, ignore_eos=True)
    engine.add_request(r)
    while engine.has_work():
        engine.step()
    assert r.spec.rounds >= 5 and r.spec.drafted == r.spec.rounds  # length 1 every 4th step


def _quick_measure(monkeypatch):
    monkeypatch.setattr(profile, "BATCH_SIZES", (1, 4))
    calls = []
    real = profile.measure

    def counting(r, *a, **k):
        calls.append(1)
        return real(r, batch_sizes=(1, 4), context_lens=(16,), repeats=1)

    monkeypatch.setattr(profile, "measure", counting)
    return calls


def test_truncated_or_edited_cache_is_detected_and_rebuilt(tmp_path, monkeypatch):
    calls = _quick_measure(monkeypatch)
    runner = runner_for(tiny_model("llama"), num_blocks=512, block_size=16)
    table, _, _ = profile.load_or_profile(runner, "tiny", tmp_path)
    (path,) = (tmp_path / "cost-tables").glob("tiny-*.json")
    text = path.read_text()
    path.write_text(text[: len(text) // 2])  # a kill mid-write, say
    _, _, source = profile.load_or_profile(runner, "tiny", tmp_path)
    assert source.startswith("measured") and len(calls) == 2
    assert profile.read_cached(path) is not None  # rebuilt, whole again
    doc = json.loads(path.read_text())
    doc["profile"]["steps_per_second"][0] *= 10  # a tampered table is not trusted
    path.write_text(json.dumps(doc))
    _, _, source = profile.load_or_profile(runner, "tiny", tmp_path)
    assert source.startswith("measured") and len(calls) == 3
    assert not list((tmp_path / "cost-tables").glob(".*.tmp"))  # no temporary files left


def test_second_start_from_a_saved_copy_uses_the_cached_table(tmp_path, monkeypatch):
    """The key ignores what differs between a freshly made model and a saved copy of it
    reloaded (its path, dtype field, library version)."""
    from transformers import AutoModelForCausalLM

    calls = _quick_measure(monkeypatch)
    first = tiny_model("llama")
    _, _, source = profile.load_or_profile(runner_for(first, num_blocks=512, block_size=16), "tiny", tmp_path)
    assert source.startswith("measured")
    first.save_pretrained(tmp_path / "copy")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "copy", dtype=torch.float32).eval()
    assert again.config.to_dict() != first.config.to_dict()  # the configs do differ
    _, _, source = profile.load_or_profile(runner_for(again, num_blocks=512, block_size=16), "tiny", tmp_path)
    assert source.startswith("cached") and len(calls) == 1


def test_merge_raises_a_slow_small_batch_instead_of_lowering_the_bigger_ones():
    # one slow sample at B=4 (a noisy spell): the bigger batches keep their own speeds
    merged = profile._merge({128: [50.0, 20.0, 45.0, 30.0], 512: [48.0, 22.0, 43.0, 28.0]}, 4)
    assert merged == [49.0, 44.0, 44.0, 29.0]
    assert all(b <= a for a, b in zip(merged, merged[1:]))


def test_grid_is_made_monotone_in_tokens_and_requests():
    # one slow sample (2 requests x 1 token, a noisy spell): raised to the bigger shapes' speed
    g = profile._grid({128: [50.0, 40.0, 20.0, 30.0], 512: [52.0, 42.0, 22.0, 28.0]}, (1, 2), (1, 4))
    assert g["grid_steps_per_second"] == [[51.0, 41.0], [29.0, 29.0]]


def test_profile_times_its_shapes_in_interleaved_rounds(monkeypatch):
    runner = runner_for(tiny_model("llama"), num_blocks=1024, block_size=16)
    sizes = []
    real_forward = runner.forward

    def recording(segs, *a, **k):
        sizes.append(sum(len(s.token_ids) for s in segs))
        return real_forward(segs, *a, **k)

    monkeypatch.setattr(runner, "forward", recording)
    raw = profile.measure(
        runner,
        batch_sizes=(1, 4, 16),
        context_lens=(16,),
        repeats=2,
        block_sizes=(1, 8),
        grid_requests=(1, 2),
        grid_tokens=(1, 3),
    )
    # a warm-up round and two timed ones, each going through every shape in turn: the decode
    # shapes and the grid's (R requests x t tokens) share their rounds, then the block shapes
    assert sizes == [1, 4, 16, 1, 3, 2, 6] * 3 + [1, 8] * 3
    assert len(raw["steps_per_second"]) == 3 and len(raw["block_steps_per_second"]) == 2
    assert raw["grid_requests"] == [1, 2] and raw["grid_tokens"] == [1, 3]
    assert [len(row) for row in raw["grid_steps_per_second"]] == [2, 2]


def test_a_table_measured_with_a_small_kv_pool_is_not_reused_by_a_larger_one(tmp_path, monkeypatch):
    """A small pool shrinks the contexts the table is measured at (to 1 here): a server with
    room for them measures its own instead of reusing it."""
    calls = _quick_measure(monkeypatch)
    model = tiny_model("llama")
    small = runner_for(model, num_blocks=64, block_size=16)
    large = runner_for(model, num_blocks=2048, block_size=16)
    assert profile.measured_contexts(small)[0] == [1, 1]
    assert profile.measured_contexts(large) == ([128, 512], [128, 512])
    assert profile.load_or_profile(small, "tiny", tmp_path)[2].startswith("measured")
    assert profile.load_or_profile(large, "tiny", tmp_path)[2].startswith("measured") and len(calls) == 2
    assert profile.load_or_profile(large, "tiny", tmp_path)[2].startswith("cached") and len(calls) == 2


def test_the_grid_goes_to_the_largest_batch_the_kv_cache_admits_on_an_accelerator():
    """On CUDA the profile measures up to 256 requests where the KV cache holds them (a CPU keeps
    32); measured at 64 requests here (forced), a 64-request step is priced from the grid, not
    scaled up from 32."""
    from types import SimpleNamespace

    def fake(device: str, slots: int):
        return SimpleNamespace(
            device=torch.device(device), kv=SimpleNamespace(num_blocks=slots // 16, block_size=16)
        )

    assert profile.profile_requests(fake("cpu", 10**7)) == 32
    assert profile.profile_requests(fake("cuda", 10**7)) == 256
    assert profile.profile_requests(fake("cuda", 100 * (512 + 9))) == 64  # 128 would not fit
    assert profile.profile_requests(fake("cuda", 1000)) == 32  # never below the CPU's
    runner = runner_for(tiny_model("llama"), num_blocks=1024, block_size=16)
    raw = profile.measure(runner, batch_sizes=(1, 4, 16, 64), context_lens=(16,), repeats=1, nreq=64)
    table = CostTable.from_dict(raw)
    assert table.grid_requests == (1, 2, 4, 8, 16, 32, 64)
    grid = table.grid_steps_per_second or ()
    assert math.isclose(table.sps(64, requests=64), grid[-1][0])  # a grid point
    assert math.isclose(table.sps(128, requests=64), grid[-1][1])  # 64 requests x 2 tokens
