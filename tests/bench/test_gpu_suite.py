"""The GPU suite in its tiny CPU mode, run the way the GPU machine runs it: a plain
`python bench/gpu_suite.py` from another folder, with the server stack (fastapi, pydantic,
prometheus_client, uvicorn, httpx) and llguidance made unimportable. Plus its guards, config
and summary."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_suite import JSON_NAME, Suite, SuiteConfig, summarize
from bench.models import SHAPES

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "bench" / "gpu_suite.py"
BLOCKED = ("fastapi", "pydantic", "prometheus_client", "uvicorn", "httpx", "llguidance")

RUNNER = r"""
import importlib.abc, runpy, sys
BLOCKED = {blocked!r}

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed on the GPU machine")
        return None

sys.meta_path.insert(0, Blocker())
sys.argv = [{suite!r}] + {args!r}
try:
    runpy.run_path({suite!r}, run_name="__main__")
except SystemExit as exc:
    if exc.code:
        raise
print("ENGINE_FILE", sys.modules["dspark_serve.scheduler.engine"].__file__)
print("LEAKED", sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
"""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-suite")
    out = tmp / "out"
    code = RUNNER.format(blocked=BLOCKED, suite=str(SUITE), args=["--out", str(out), "--tiny"])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, out, json.loads((out / JSON_NAME).read_text())


@pytest.mark.slow  # the tiny suite run (about 35 s)
def test_runs_from_a_plain_checkout_without_the_server_stack(tiny_run):
    stdout, _, report = tiny_run
    engine_file = next(l.split(" ", 1)[1] for l in stdout.splitlines() if l.startswith("ENGINE_FILE"))
    assert Path(engine_file).resolve().is_relative_to(ROOT)  # the checkout's code, not an install
    assert "LEAKED []" in stdout
    assert report["config"]["cpu_table"] == "bench/results/sweep-dspark-gate.json"  # no host paths
    assert str(ROOT) not in json.dumps(report)


@pytest.mark.slow  # the tiny suite run (about 35 s)
def test_every_stage_ran_and_the_device_checks_passed(tiny_run):
    _, out, report = tiny_run
    stages = report["stages"]
    assert list(stages) == [
        "checks",
        "decode tiny-a",
        "long prompt tiny-a",
        "build",
        "profile",
        "sweep",
        "competing load",
        "timings",
        "plots",
    ]
    assert all(stages[s]["status"] == "ok" for s in stages), {s: stages[s].get("error") for s in stages}
    assert report["commit"] and report["commit"] == report["config"]["commit"]
    checks = stages["checks"]["result"]
    assert {k: v["passed"] for k, v in checks.items() if isinstance(v, dict)} == {
        "forward_modes": True,
        "greedy_equality": True,
        "rejection_statistics": True,
        "paged_kv_rollback": True,
        "batch_invariance": True,
        "drafter_backbone": True,
    }
    assert checks["greedy_equality"]["plain_equals_hf_generate"]
    assert all(checks["batch_invariance"]["invariant"].values())
    assert checks["rejection_statistics"]["tv_broken_sampler"] > checks["rejection_statistics"]["bound"]
    assert report["complete"] and report["summary"]["stage_status"]["sweep"] == "ok"
    assert (out / JSON_NAME).stat().st_size < 200_000
    pngs = sorted(p.name for p in out.glob("*.png"))
    if importlib.util.find_spec("matplotlib") is None:
        assert pngs == [] and "matplotlib" in stages["plots"]["result"]["skipped"]
    else:
        assert pngs == ["cost_table.png", "sweep.png"]
        assert all((out / p).stat().st_size < 500_000 for p in pngs)


@pytest.mark.slow  # the tiny suite run (about 35 s)
def test_the_forward_modes_are_checked_then_measured_interleaved(tiny_run):
    """Every mode that can run here (the Triton ones under the interpreter, where the tests run)
    keeps greedy equality, and the decode stages measure each of them, rounds interleaved."""
    _, _, report = tiny_run
    modes = report["stages"]["checks"]["result"]["forward_modes"]
    triton_modes = ["triton", "triton+graphs", "triton+graphs+invariant"]
    expected = ["sdpa", *triton_modes] if importlib.util.find_spec("triton") else ["sdpa"]
    assert modes["passed_modes"] == expected
    if "triton+graphs" in expected:
        assert modes["modes"]["triton+graphs"]["static:4"]["graph_replays"] > 0
    measured = [m for m in expected if m in ("sdpa", "triton+graphs")]  # tiny mode's decode_modes
    for stage in ("decode tiny-a", "long prompt tiny-a"):
        res = report["stages"][stage]["result"]
        assert list(res["modes"]) == measured and res["rounds"] == 3
        for row in res["modes"].values():
            assert len(row["plain_rounds"]) == 3 and row["plain_tok_s"] > 0
            assert row["static_equals_plain"] and row["plain_agrees_with_first_mode"] == 1.0
            assert abs(row["realised_accept_rate"] - 0.8) < 0.2
            assert row["static_over_plain"] > 0  # measured; its size is the suite's figure, not a test's
    assert report["stages"]["long prompt tiny-a"]["result"]["prompt_len"] == 24
    load = report["stages"]["competing load"]["result"]
    assert [p["steps"] > 0 and p["mean_budget"] > 0 for p in load["phases"]] == [True] * 3


@pytest.mark.slow  # the tiny suite run (about 35 s)
def test_models_and_cost_tables_are_sane(tiny_run):
    _, _, report = tiny_run
    models = report["stages"]["build"]["result"]["models"]
    assert [m["name"] for m in models] == ["tiny-a", "tiny-b"]
    assert all(m["params"] == SHAPES[m["name"]].num_params > m["drafter_params"] > 0 for m in models)
    tables = report["stages"]["profile"]["result"]["tables"]
    for t in tables.values():
        sps = t["steps_per_second"]
        assert len(sps) == len(t["batch_sizes"]) and all(s > 0 for s in sps)
        assert all(b <= a for a, b in zip(sps, sps[1:]))  # made non-increasing


@pytest.mark.slow  # the tiny suite run (about 35 s)
def test_sweep_is_lossless_and_realises_the_configured_acceptance(tiny_run):
    _, _, report = tiny_run
    res = report["stages"]["sweep"]["result"]
    rows = res["rows"]
    assert res["complete"] and not res["cut"]
    assert {(r["shape"], r["concurrency"], r["policy"]) for r in rows} == {
        (s, c, p) for s in ("tiny-a", "tiny-b") for c in (1, 4) for p in ("none", "static:7", "dspark")
    }
    for r in rows:
        assert r["completion_tokens"] == r["requests"] * 24 and r["requests"] == 4
        assert r["per_user_tps"] > 0 and r["aggregate_tps"] > 0 and math.isfinite(r["aggregate_tps"])
        assert r["kv_free_after"]
        if r["policy"] != "none":
            assert r["equal_to_plain"] == 1.0 and r["diverged_requests"] == 0  # greedy: lossless
    static = [r for r in rows if r["policy"] == "static:7"]
    assert all(r["tau"] > 1.5 and r["mean_budget"] > 3 for r in static)
    tried = sum(r["positions_tried"] for r in rows)
    accepted = sum(r["positions_accepted"] for r in rows)
    assert tried > 300 and abs(accepted / tried - 0.8) < 0.08, (accepted, tried)


@pytest.mark.slow  # the tiny suite run (about 35 s)
def test_timings_split_the_step(tiny_run):
    _, _, report = tiny_run
    t = report["stages"]["timings"]["result"]
    assert set(t["drafter"]["by_batch"]) == {"1", "4"}
    assert all(v["propose_ms"] > 0 and v["backbone_ms"] > 0 for v in t["drafter"]["by_batch"].values())
    points = t["engine_split"]["points"]
    assert {(p["concurrency"], p["policy"]) for p in points} == {
        (1, "none"),
        (1, "dspark"),
        (4, "none"),
        (4, "dspark"),
    }
    for p in points:
        assert p["decode_steps"] > 0 and 0 < p["plan_ms"] <= p["forward_ms"] <= p["step_ms"] * 1.05
    hf = t["hf_generate"]
    assert hf["tokens"] == hf["engine_tokens"] == 13 and hf["tokens_per_s"] > 0
    assert hf["same_tokens_share"] == 1.0  # the same model: the same greedy tokens
    assert t["engine_vs_hf_generate_c1"] == hf["engine_vs_hf"] > 0
    assert t["profiler"]["concurrency"] == 4
    for policy in ("none", "static:7"):
        prof = t["profiler"][policy]
        assert prof["step_wall_ms"] > 0 and len(prof["top_ops"]) == 10
        # torch's matmuls, or the C kernel's calls, labelled "small_gemm" while profiled
        assert any("mm" in op["name"] or "linear" in op["name"] for op in prof["top_ops"])


# -- guards, config, summary (no model needed) ------------------------------------------------
# In-process suites keep the test process's torch thread count (threads=0).
def test_a_failing_stage_is_recorded_and_the_next_still_runs(tmp_path):
    suite = Suite(SuiteConfig.tiny(budget_s=60, threads=0), tmp_path)
    suite.stage("boom", lambda res: 1 / 0)
    suite.stage("fine", lambda res: res.update(x=1) or True)
    suite.stage("later", lambda res: True, needs=("boom",))
    report = json.loads((tmp_path / JSON_NAME).read_text())["stages"]
    assert report["boom"]["status"] == "error" and "ZeroDivisionError" in report["boom"]["error"]
    assert report["fine"] == {**report["fine"], "status": "ok", "result": {"x": 1}}
    assert report["later"]["status"] == "skipped" and "boom" in report["later"]["reason"]


def test_the_budget_skips_stages_instead_of_running_over(tmp_path):
    suite = Suite(SuiteConfig.tiny(budget_s=0.001, threads=0), tmp_path)
    ran = []
    suite.stage("slow", lambda res: ran.append(1) or True, min_s=5)
    assert not ran and suite.report["stages"]["slow"]["status"] == "skipped"
    assert "budget" in suite.report["stages"]["slow"]["reason"]


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(dtype="int8"), "int8"),
        (dict(shapes=("nope",)), "nope"),
        (dict(concurrency=(0, 4)), "0"),
        (dict(accept_rate=1.5), "1.5"),
        (dict(max_num_batched_tokens=16), "16"),
        (dict(budget_s=-1.0), "-1.0"),
        (dict(threads=-1), "-1"),
    ],
)
def test_bad_config_values_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        SuiteConfig.tiny(**bad)


def test_summary_computes_the_aims_from_the_rows():
    row = lambda p, c, pu, agg: {
        "shape": "s",
        "policy": p,
        "concurrency": c,
        "per_user_tps": pu,
        "aggregate_tps": agg,
        "realised_accept_rate": None if p == "none" else 0.8,
    }
    rows = [
        row("none", 1, 10, 10),
        row("static:7", 1, 30, 30),
        row("dspark", 1, 30, 30),
        row("none", 256, 5, 1000),
        row("static:7", 256, 2, 500),
        row("dspark", 256, 4, 1200),
    ]
    report = {
        "stages": {
            "sweep": {"status": "ok", "result": {"rows": rows, "policies": ["none", "static:7", "dspark"]}},
            "timings": {"status": "ok", "result": {"engine_vs_hf_generate_c1": 1.2}},
        }
    }
    s = summarize(report)
    assert s["dspark_vs_plain_per_user_low"] == 3.0 and s["dspark_vs_plain_aggregate_high"] == 1.2
    assert s["static_vs_plain_aggregate_high"] == 0.5
    assert s["aims_met"] == {
        "plain_vs_hf_generate_c1": False,
        "dspark_vs_plain_per_user_low": True,
        "dspark_vs_plain_aggregate_high": True,
    }
    assert s["realised_accept_rate"]["dspark@256"] == 0.8


def test_a_failing_sweep_point_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    import bench.gpu_suite as gs

    suite = Suite(SuiteConfig.tiny(shapes=("tiny-a",), max_tokens=6, threads=0), tmp_path)
    suite.stage("build", suite.build)
    suite.stage("profile", suite.profile)
    real = gs.run_engine_closed_loop

    def flaky(engine, prompts, conc, *a, **k):
        if conc == 1 and a[-1] == "static:7":  # label = policy
            engine.add_request(gs.Request("stuck", prompts[0], gs.SamplingParams(temperature=0.0), 4))
            engine.step()
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(engine, prompts, conc, *a, **k)

    monkeypatch.setattr(gs, "run_engine_closed_loop", flaky)
    entry = suite.stage("sweep", suite.sweep)
    res = entry["result"]
    assert entry["status"] == "failed" and not res["complete"]
    assert [(e["concurrency"], e["policy"]) for e in res["errors"]] == [(1, "static:7")]
    assert "out of memory" in res["errors"][0]["error"]
    assert [(r["concurrency"], r["policy"]) for r in res["rows"]] == [
        (1, "none"),
        (1, "dspark"),
        (4, "none"),
        (4, "static:7"),
        (4, "dspark"),
    ]
    assert all(r["kv_free_after"] for r in res["rows"])  # the failed point's KV was released


def test_staged_parts_join_back_and_a_bad_part_is_caught(tmp_path):
    from bench.gpu_stage import join, split

    big = tmp_path / "model.gguf"
    big.write_bytes(bytes(range(256)) * 9000)  # 2.3 MB
    parts = split([big], tmp_path / "stage", part_mib=1.0)
    assert len(parts) == 3 and all(p.stat().st_size <= 2**20 for p in parts)
    (joined,) = join(tmp_path / "stage", tmp_path / "dest")
    assert joined.read_bytes() == big.read_bytes()
    parts[1].write_bytes(parts[1].read_bytes()[:-1] + b"x")
    with pytest.raises(ValueError, match="does not match its SHA-256"):
        join(tmp_path / "stage", tmp_path / "dest")
    parts[2].unlink()
    with pytest.raises(ValueError, match="parts not staged yet"):
        join(tmp_path / "stage", tmp_path / "dest")
