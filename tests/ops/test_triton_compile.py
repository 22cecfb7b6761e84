"""The GPU kernels through the real Triton compiler, without a GPU: every launch the engine can
make for the served model shapes (`bench/triton_compile.py`, from `ops/triton_launch.py`'s
functions, the ones the launchers take their constexprs from) compiles for sm_80 and sm_90 in
bf16 and fp16 with no register spill and within the target's shared memory; and the launchers
draw their constexprs from that list (a launch missing from it fails here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.triton_compile import ARCHES, SERVED_SHAPES, all_launches  # noqa: E402
from dspark_serve.ops import triton_attention as ta  # noqa: E402
from dspark_serve.ops.triton_launch import SHARED_LIMIT, ModelShape, engine_launches  # noqa: E402


def compiler_reason() -> str | None:
    """Why Triton's CUDA compiler cannot run here (None: it can)."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        return "Triton is not installed: its compiler cannot be run"
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not all((bin_dir / tool).exists() for tool in ("ptxas", "cuobjdump")):
        return f"Triton's CUDA tools are missing from {bin_dir}"
    return None


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    """Every launch compiled for every target, by bench/triton_compile.py in a child process
    (this one runs Triton's interpreter, whose jitted functions the compiler does not take)."""
    reason = compiler_reason()
    if reason is not None:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "triton_compile.py"), "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow  # the real compiler: about a second a launch
@pytest.mark.parametrize("arch", ARCHES, ids=[f"sm{a}" for a in ARCHES])
def test_every_engine_launch_compiles_without_spills(arch, compiled):
    records = [r for r in compiled if r["arch"] == arch]
    assert len(records) == len(all_launches())  # every listed launch compiled for this target
    bad = [r for r in records if r["spilled"] or r["shared"] > SHARED_LIMIT[arch] or r["registers"] > 255]
    assert not bad, "\n".join(map(str, bad))
    assert {r["kernel"] for r in records} == {
        "paged_attention_kernel",
        "add_rmsnorm_kernel",
        "silu_mul_kernel",
        "rope_store_kernel",
        "matmul_kernel",
    }


class Recorder:
    """Stands for the kernels module: records each launch's kernel and constexprs."""

    def __init__(self):
        self.launched: list[tuple[str, dict]] = []

    def __getattr__(self, name):
        rec = self

        class Kernel:
            def __getitem__(self, grid):
                return lambda *args, **constexprs: rec.launched.append((name, constexprs))

        return Kernel()


def test_the_launchers_take_their_constexprs_from_the_listed_launches(monkeypatch):
    """Each launcher, run for a small shape, launches with constexprs of a launch in
    `engine_launches` for that shape (a launcher that picked its own would fail here)."""
    shape = ModelShape("tiny", 8, 2, 32, 64, 96)
    rec = Recorder()
    monkeypatch.setattr(ta, "kernels", lambda: rec)
    monkeypatch.setattr(ta, "_kernel", lambda: rec.paged_attention_kernel)
    dtype = torch.float16
    E = ta.TritonElementwise(shape.num_heads, shape.num_kv_heads, shape.head_dim)
    h = torch.zeros(3, shape.hidden, dtype=dtype)
    E.add_rmsnorm(h, h.clone(), torch.ones(shape.hidden, dtype=dtype), 1e-6)
    E.add_rmsnorm(
        torch.zeros(5, shape.head_dim, dtype=dtype), None, torch.ones(shape.head_dim, dtype=dtype), 1e-6
    )
    E.silu_mul(torch.zeros(3, 2 * shape.intermediate, dtype=dtype))
    q = torch.zeros(3, shape.num_heads, shape.head_dim, dtype=dtype)
    kv = torch.zeros(3, shape.num_kv_heads, shape.head_dim, dtype=dtype)
    cache = torch.zeros(shape.num_kv_heads, 64, shape.head_dim, dtype=dtype)
    rope = torch.zeros(3, shape.head_dim, dtype=dtype)
    E(q, kv, kv.clone(), rope, rope.clone(), torch.zeros(3, dtype=torch.int64), cache, cache.clone())
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
    for max_q, invariant, causal in (
        (1, False, True),
        (7, False, True),
        (40, False, True),
        (2, True, True),
        (7, False, False),
    ):
        segs = ta.VarlenSegments(i32([0, max_q]), i32([0]), i32([[0, 1, 2, 3]]), max_q, max_q)
        qs = torch.zeros(max_q, shape.num_heads, shape.head_dim, dtype=dtype)
        ta.paged_attention(qs, cache, cache, qs.clone(), segs, 16, 1.0, invariant=invariant, causal=causal)
    from dspark_serve.ops import triton_linear

    monkeypatch.setattr(triton_linear, "kernels", lambda: rec)
    w = torch.zeros(16, 32, dtype=dtype)
    for bias, float_out in ((None, False), (torch.zeros(16, dtype=dtype), True)):
        triton_linear.InvariantTritonLinear(w, bias, float_out)(torch.zeros(2, 32, dtype=dtype))
    listed = {(x.kernel, tuple(x.options.items())) for x in engine_launches(shape, dtype, 16, 64)}
    launched = {(name, tuple(c.items())) for name, c in rec.launched}
    assert len(rec.launched) == 11 and launched <= listed, sorted(map(str, launched - listed))
    assert {name for name, _ in launched} == {k for k, _ in listed}


def test_the_served_shapes_split_their_heads_evenly():
    assert all(s.num_heads % s.num_kv_heads == 0 and s.head_dim % 16 == 0 for s in SERVED_SHAPES)
    assert os.environ.get("TRITON_INTERPRET") in (None, "0", "1")
