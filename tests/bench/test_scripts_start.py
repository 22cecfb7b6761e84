"""Every benchmark script starts (its imports resolve) from a checkout: `--help` exits 0."""

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


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help_runs(script, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "usage" in proc.stdout.lower(), proc.stderr[-2000:]
