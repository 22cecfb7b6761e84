"""Every benchmark script starts (its imports resolve) from a checkout: `--help` exits 0."""

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    p.name for p in (ROOT / "bench").glob("*.py") if p.name != "__init__.py" and "__main__" in p.read_text()
)


def test_the_scripts_are_found():
    assert {"bench_engine.py", "acceptance.py", "step_breakdown.py", "gpu_suite.py"} <= set(SCRIPTS)


def run_help(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--help"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def help_runs(request, tmp_path_factory):
    """The selected scripts' `--help` runs, as many at a time as there are CPUs: each is a
    process that spends its time importing, so they overlap instead of queueing one by one."""
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
    runs: dict[str, Future[subprocess.CompletedProcess[str]]] = {}
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.path == request.path and callspec is not None and "script" in callspec.params:
            script = callspec.params["script"]
            runs[script] = pool.submit(run_help, script, tmp_path_factory.mktemp(script))
    yield runs
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_runs(script, help_runs):
    proc = help_runs[script].result()
    assert proc.returncode == 0 and "usage" in proc.stdout.lower(), proc.stderr[-2000:]


def test_sweep_medians_pair_each_round_with_its_own_plain_run():
    from bench.bench_engine import sweep_medians

    def row(label, rnd, per_user, aggregate):
        return dict(
            label=label,
            round=rnd,
            temperature=0.0,
            concurrency=4,
            per_user_tps=per_user,
            aggregate_tps=aggregate,
            tau=2.0 if label != "none" else None,
            mean_budget=1.0,
        )

    # the machine ran 2x faster in round 1: paired, the default is 1.1x plain in every round
    rows = [row("none", 0, 10, 100), row("dspark", 0, 11, 110), row("none", 1, 20, 200)]
    rows += [row("dspark", 1, 22, 220), row("none", 2, 40, 400), row("dspark", 2, 44, 440)]
    m = {x["label"]: x for x in sweep_medians(rows)}["dspark"]
    assert m["aggregate_vs_plain_rounds"] == pytest.approx(1.1)
    assert m["per_user_vs_plain_rounds"] == pytest.approx(1.1)
    assert m["aggregate_tps"] == 220 and m["aggregate_vs_plain"] == pytest.approx(1.1)
    # a slow spell in one plain run moves the ratio of medians, not the paired median
    rows[4] = row("none", 2, 10, 100)
    m = {x["label"]: x for x in sweep_medians(rows)}["dspark"]
    assert m["aggregate_vs_plain_rounds"] == pytest.approx(1.1)
    assert m["aggregate_vs_plain"] == pytest.approx(2.2)
