"""Every benchmark script starts (its imports resolve) from a checkout: `--help` exits 0."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(
    p.name for p in (ROOT / "bench").glob("*.py") if p.name != "__init__.py" and "__main__" in p.read_text()
)


def test_the_scripts_are_found():
    assert {"bench_engine.py", "acceptance.py", "step_breakdown.py", "gpu_suite.py"} <= set(SCRIPTS)


# One process runs every script's `--help` as `python bench/<script> --help` would (its folder
# first on sys.path, run as __main__), so torch and the project are imported once, not per script.
DRIVER = """
import contextlib, io, json, runpy, sys, traceback
out = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    sys.path.insert(0, path.rsplit("/", 1)[0])
    buf, err, code = io.StringIO(), io.StringIO(), None
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code or 0
    except BaseException:
        code, err = 1, io.StringIO(err.getvalue() + traceback.format_exc())
    sys.path.pop(0)
    out[path] = {"code": code, "stdout": buf.getvalue(), "stderr": err.getvalue()[-2000:]}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def help_runs(tmp_path_factory) -> dict[str, dict]:
    """Each script's `--help` result: its exit code (None: it returned without exiting), stdout
    and the tail of stderr, run from a directory outside the checkout."""
    paths = [str(ROOT / "bench" / s) for s in SCRIPTS]
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, *paths],
        cwd=tmp_path_factory.mktemp("help"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(proc.stdout.splitlines()[-1])
    return {Path(p).name: r for p, r in runs.items()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_runs(script, help_runs):
    run = help_runs[script]
    assert run["code"] == 0 and "usage" in run["stdout"].lower(), run["stderr"]


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
    # rows of older files have no pooled per-user speed: none is reported
    assert m["pooled_per_user_tps"] is None and "pooled_per_user_vs_plain_rounds" not in m
    for x in rows:  # the default pooled slower than plain by one ratio in every round
        x["pooled_per_user_tps"] = 9.0 if x["label"] == "dspark" else 10.0
    rows[4]["pooled_per_user_tps"] = 5.0  # a slow plain run in round 2
    m = {x["label"]: x for x in sweep_medians(rows)}["dspark"]
    assert m["pooled_per_user_tps"] == 9.0
    assert m["pooled_per_user_vs_plain"] == pytest.approx(0.9)
    assert m["pooled_per_user_vs_plain_rounds"] == pytest.approx(0.9)


def test_pooled_per_user_speed_counts_every_requests_time():
    """The per-user median can hide requests made slower; the pooled figure is every
    request's tokens over every request's time from its first token to its finish."""
    import time

    from bench.common import run_engine_closed_loop
    from dspark_serve.scheduler.request import Status

    class Engine:  # a fake: odd-numbered requests make more tokens a step than even ones
        def __init__(self):
            self.live = []

        def add_request(self, r):
            self.live.append(r)

        def step(self):
            time.sleep(0.02)
            for r in self.live:
                k = int(r.request_id.split("-")[1])
                r.output_ids.extend([1] * (1 + 3 * (k % 2)))
                if r.first_token_time is None:
                    r.first_token_time = time.monotonic()
                if len(r.output_ids) >= r.max_tokens:
                    r.status = Status.FINISHED
            self.live = [r for r in self.live if not r.finished]

    fin = []
    res = run_engine_closed_loop(Engine(), [[1, 2, 3]] * 4, 4, 12, 0.0, "x", finished=fin)
    spans = sum(r.finish_time - r.first_token_time for r in fin)
    assert res.pooled_per_user_tps == pytest.approx(sum(len(r.output_ids) for r in fin) / spans)
    # two fast requests finish early: the median speed is theirs or between, the pooled one
    # weighs the slow requests' longer time
    assert res.pooled_per_user_tps < res.per_user_tps


def test_as_cpu_runs_a_command_as_the_narrower_level():
    """bench/as_cpu.py: the command sees the level's flags and its libraries' variables."""
    probe = (
        "import json, os; from dspark_serve.ops.platform import cpu_flags, level_of; "
        "print(json.dumps([level_of(cpu_flags()).name, os.environ.get('OPENBLAS_CORETYPE'), "
        "sorted(f for f in cpu_flags() if f.startswith(('avx512', 'amx')))]))"
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "as_cpu.py"), "baseline", "--", sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == ["baseline", "Nehalem", []]
