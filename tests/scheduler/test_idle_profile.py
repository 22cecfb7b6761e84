"""The full cost table measured in the engine's idle gaps: requests are served while it is
measured, it takes over when done (cached, on /metrics), and it never changes an output."""

import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler import profile
from dspark_serve.scheduler.async_engine import AsyncEngine, idle_work
from dspark_serve.scheduler.builder import EngineBundle, TableChoice, cost_table_for, measure_when_idle
from dspark_serve.scheduler.client import GenerationParams
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.idle_profile import IdleProfile
from dspark_serve.scheduler.metrics import EngineMetrics
from dspark_serve.scheduler.policy import CostTable
from dspark_serve.scheduler.request import Request
from tests.helpers import ByteTokenizer, FakeDrafterBase, runner_for, tiny_model

SMALL = {
    "batch_sizes": (1, 4),
    "context_lens": (16,),
    "repeats": 1,
    "block_sizes": (1, 4),
    "grid_requests": (1, 2),
}
PROVISIONAL = CostTable((1, 8, 64), (100.0, 80.0, 10.0))


class OnesDrafter(FakeDrafterBase):
    """Drafts token 1 at every position, confidence 0.9 (mostly rejected: the output must
    still be the target's greedy text)."""

    name, tap_layers, block_size, calibrator = "ones", (), 4, None
    online_confidence = False

    def propose(self, requests):
        import torch

        from dspark_serve.drafter.base import DraftProposal

        return [
            DraftProposal(
                torch.ones(min(4, r.max_draft), dtype=torch.long),
                None,
                torch.full((min(4, r.max_draft),), 0.9),
            )
            for r in requests
        ]


def _engine(metrics=None) -> Engine:
    return Engine(
        runner_for(tiny_model("llama"), num_blocks=512, block_size=16),
        ByteTokenizer(),
        SchedulerConfig(verify_policy="dspark", draft_gate=False),
        max_model_len=256,
        drafter=OnesDrafter(),
        cost_table=PROVISIONAL,
        metrics=metrics,
    )


def _generate(engine: Engine, rid: str) -> list[int]:
    req = Request(rid, [3, 1, 4, 1, 5, 9, 2, 6] * 3, SamplingParams(temperature=0), 24, ignore_eos=True)
    engine.add_request(req)
    while engine.has_work():
        engine.step()
    return list(req.output_ids)


def _idle(engine: Engine, tmp_path: Path, quiet: float = 0.0) -> IdleProfile:
    measurement = profile.TableMeasurement(engine.runner, engine.blocks, **SMALL)
    path = tmp_path / "cost-tables" / "tiny.json"
    measure_when_idle(engine, TableChoice(PROVISIONAL, "provisional", path), engine.metrics)  # type: ignore[arg-type]
    idle = engine.idle_profile
    assert idle is not None
    idle.measurement, idle.quiet_seconds = measurement, quiet
    return idle


def test_requests_are_served_mid_measurement_and_the_measured_table_takes_over(tmp_path):
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "tiny")
    engine = _engine(metrics)
    metrics.set_cost_table(PROVISIONAL, "provisional")
    idle = _idle(engine, tmp_path)
    free = engine.blocks.num_free_blocks
    for _ in range(3):
        idle_work(engine)
    assert 0 < idle.progress < 1 and engine.blocks.num_free_blocks < free  # scratch contexts laid out
    before = _generate(engine, "a")  # served now, not after the measurement
    assert not idle.measurement.done and engine.idle_profile is idle
    assert engine.speculation.cost_table == PROVISIONAL
    assert engine.blocks.num_free_blocks == free  # the step took the scratch slots back
    engine.speculation.correction.record(8, 1, 0.01, 0.02)  # learned against the provisional table
    while engine.idle_profile is not None:
        idle_work(engine)
    cached = json.loads((tmp_path / "cost-tables" / "tiny.json").read_text())["profile"]
    assert engine.speculation.cost_table == CostTable.from_dict(cached) != PROVISIONAL
    assert engine.speculation.correction.factor(8, 1) == 1.0  # starts afresh on the new table
    assert (
        registry.get_sample_value("dspark:cost_table_in_force", {"model_name": "tiny", "source": "measured"})
        == 1
    )
    assert (
        registry.get_sample_value(
            "dspark:cost_table_in_force", {"model_name": "tiny", "source": "provisional"}
        )
        == 0
    )
    # the measurement's forwards wrote KV into slots the prefix cache and the next request use:
    # the same prompt gives the same greedy text under the new table
    assert _generate(engine, "b") == before
    assert engine.blocks.num_free_blocks == free


def test_idle_work_waits_for_a_quiet_engine(tmp_path):
    engine = _engine()
    idle = _idle(engine, tmp_path, quiet=30.0)
    _generate(engine, "a")  # the engine was just busy
    assert 29 < idle.wait() <= 30
    idle_work(engine)
    assert idle.measurement.timed == 0


def test_the_async_loop_serves_a_request_while_measuring_and_switches_when_idle(tmp_path):
    """The engine thread measures between requests: a request sent mid-measurement is answered
    long before the measurement ends (each forward slowed here to make it long), and the table
    switches once the engine is idle again."""
    engine = _engine()
    idle = _idle(engine, tmp_path)
    real = idle.measurement.advance

    def slow() -> None:
        time.sleep(0.02)
        real()

    idle.measurement.advance = slow  # type: ignore[method-assign]
    bundle = EngineBundle(engine, ByteTokenizer(), SimpleNamespace(name="float32", reason=""))  # type: ignore[arg-type]
    eng = AsyncEngine(lambda: bundle, "tiny", 256)
    eng.start()
    try:
        assert eng.wait_ready(30)
        deadline = time.monotonic() + 30
        while idle.measurement.timed < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert idle.measurement.timed >= 3

        import asyncio

        async def ask() -> list[int]:
            ids: list[int] = []
            async for d in eng.generate(
                "r", [3, 1, 4, 1, 5], GenerationParams(max_tokens=8, temperature=0.0)
            ):
                ids += d.token_ids
            return ids

        got = asyncio.run(ask())
        assert len(got) == 8 and not idle.measurement.done  # answered mid-measurement
        while engine.idle_profile is not None and time.monotonic() < deadline + 60:
            time.sleep(0.05)
        assert engine.idle_profile is None and engine.speculation.cost_table != PROVISIONAL
    finally:
        eng.stop()


def _choice(tmp_path, reprofile=False, background=True) -> TableChoice:
    runner = runner_for(tiny_model("llama"), num_blocks=1024, block_size=16)
    cfg = SchedulerConfig(reprofile=reprofile, cost_table_in_background=background)
    return cost_table_for(runner, SimpleNamespace(name="tiny"), tmp_path, cfg, True, None, lambda s: None)


def test_a_first_start_serves_on_a_probe_and_a_damaged_cache_is_measured_afresh(
    tmp_path, caplog, monkeypatch
):
    first = _choice(tmp_path)
    assert first.source == "provisional" and first.measure_to is not None and first.table is not None
    assert not first.measure_to.exists()  # a provisional table is never cached
    table = first.table
    assert table.grid_requests == (1, 4, 16) and table.batch_sizes == (1, 4, 16, 64)
    profile.write_cached(
        first.measure_to, profile.measure(runner_for(tiny_model("llama"), 1024, 16), **SMALL)
    )
    again = _choice(tmp_path)
    assert again.source == "cached" and again.measure_to is None
    first.measure_to.write_text(first.measure_to.read_text().replace("1", "2", 3))  # damaged
    with caplog.at_level(logging.WARNING):
        damaged = _choice(tmp_path)
    assert damaged.source == "provisional"
    assert any("is damaged" in r.getMessage() and "measuring again" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(profile, "load_or_profile", lambda *a, **k: pytest.fail("measured before serving"))
    assert _choice(tmp_path, reprofile=True).source == "provisional"


def test_offline_use_measures_before_the_first_step(tmp_path, monkeypatch):
    calls = []
    real = profile.measure

    def quick(runner, *a, **k):
        calls.append(1)
        return real(runner, **SMALL)

    monkeypatch.setattr(profile, "measure", quick)
    choice = _choice(tmp_path, background=False)
    assert choice.source == "measured" and calls == [1]
    assert _choice(tmp_path, background=False).source == "cached"


def test_a_measurement_released_mid_group_lays_its_contexts_out_again():
    runner = runner_for(tiny_model("llama"), num_blocks=256, block_size=16)
    from dspark_serve.scheduler.block_manager import BlockManager

    blocks = BlockManager(256, 16)
    m = profile.TableMeasurement(runner, blocks, **SMALL)
    whole = profile.measure(runner, **SMALL)
    while not m.done:
        m.advance()
        m.release()
        assert blocks.num_free_blocks == 256
    raw = m.result()
    for key in ("batch_sizes", "block_sizes", "grid_requests", "grid_tokens"):
        assert raw[key] == whole[key]
    assert m.timed == m.forwards == 2 * (2 + 2 * 4) + 2 * 2


def test_a_failing_measurement_leaves_the_engine_on_its_table(tmp_path, caplog):
    engine = _engine()
    idle = _idle(engine, tmp_path)
    idle_work(engine)  # one forward: scratch contexts laid out
    free = engine.blocks.num_free_blocks

    def broken() -> None:
        raise RuntimeError("a forward failed")

    idle.measurement.advance = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR):
        idle_work(engine)
    assert engine.idle_profile is None and engine.speculation.cost_table == PROVISIONAL
    assert engine.blocks.num_free_blocks > free  # the scratch slots went back
    assert any("measuring the cost table failed" in r.getMessage() for r in caplog.records)
    assert len(_generate(engine, "a")) == 24  # and it serves on
