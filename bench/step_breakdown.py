"""Where one engine step's time goes, printed beside the machine's limit (the roofline).

  python bench/step_breakdown.py --dtype float32 --out bench/results/step-breakdown-float32.json
  python bench/step_breakdown.py --dtype bfloat16 --out bench/results/step-breakdown-bfloat16.json

Plain steps: target forwards of decode shapes (B requests x 1 token), verify shapes (B requests x
(1 + k) tokens) and one prefill chunk, over a context of --context tokens. Speculative steps:
whole engine steps with the shipped DSpark drafter at a few concurrencies on real prompts.

Per shape: wall time (fastest of --repeats, no profiler), then a torch.profiler pass whose
operator self-times are sorted into matmuls (linear layers, LM head), attention (everything the
runner's `_attention` runs: KV writes, gathers, SDPA), other kernels (norms, rotary, adds,
activations, embedding, indexing), the drafter, sampling (target probabilities + rejection) and
the rest: Python and dispatch, the wall time the operators do not account for (the profiler's
own overhead inflates operator times a little, so this is a lower bound).

Roofline beside it: weight bytes / measured memory bandwidth (a decode step must read every
weight once) and matmul FLOPs / measured matmul peak, both measured here by microbenchmarks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import DATA, load_prompts, machine, start_decoding, timed_steps  # noqa: E402

MATMUL_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::matmul",
    "aten::linear",
    "aten::bmm",
    "aten::_weight_int8pack_mm",
    "mkldnn::_linear_pointwise",
    "aten::mkldnn_linear",
    "aten::_mkl_linear",
    "aten::addmv",
    "aten::mv",
    "small_gemm",  # the C kernel (no torch op): labelled by label_c_kernels()
}
LABELS = ("attention", "drafter", "sampling", "forward")


# -- microbenchmarks ------------------------------------------------------------------------
def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: a sum over a buffer far larger than the caches."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    best = min(_timeit(lambda: x.sum()) for _ in range(repeats))
    return nbytes / best


def measure_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 3) -> float:
    """Matmul FLOP/s at dtype (square n x n)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    best = min(_timeit(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best


def _timeit(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- profiler attribution -------------------------------------------------------------------
def _label_of(ev) -> str | None:
    p = ev.cpu_parent
    while p is not None:
        if p.name in LABELS:
            return p.name
        p = p.cpu_parent
    return None


def attribute(prof) -> dict:
    """Self CPU time (s) of every operator, sorted into categories by its nearest label."""
    out = dict(matmul=0.0, attention=0.0, other_kernels=0.0, drafter=0.0, sampling=0.0, outside=0.0)
    for ev in prof.events():
        if ev.name in LABELS or ev.name.startswith("ProfilerStep") or ev.name == "step":
            continue
        t = ev.self_cpu_time_total / 1e6
        lab = _label_of(ev)
        if lab == "attention":
            out["attention"] += t
        elif lab in ("drafter", "sampling"):
            out[lab] += t
        elif lab == "forward":
            out["matmul" if ev.name in MATMUL_OPS else "other_kernels"] += t
        else:
            out["outside"] += t
    return out


def wrap(obj, name: str, label: str, timers: dict) -> None:
    """Replace obj.name by a wrapper that labels it for the profiler and accumulates its wall time."""
    fn = getattr(obj, name)

    def wrapped(*a, **k):
        t0 = time.perf_counter()
        with torch.profiler.record_function(label):
            r = fn(*a, **k)
        timers[label] = timers.get(label, 0.0) + time.perf_counter() - t0
        return r

    setattr(obj, name, wrapped)


def label_c_kernels() -> None:
    """The C kernels are called through ctypes, so the profiler sees no operator for them: label
    each call (its self time is the kernel's; a oneDNN fallback inside the matmul is timed as its
    own op). The attention kernel sits under the runner's "attention" label, the elementwise ones
    count as other kernels."""
    from dspark_serve.ops import cpu_kernels as ck

    def labelled(cls, method: str, name: str) -> None:
        call = getattr(cls, method)

        def wrapped(self, *a, **k):
            with torch.profiler.record_function(name):
                return call(self, *a, **k)

        setattr(cls, method, wrapped)

    labelled(ck.SmallGemmLinear, "__call__", "small_gemm")
    labelled(ck.PagedAttention, "__call__", "c_paged_attention")
    labelled(ck.RopeStore, "__call__", "c_rope_store")
    labelled(ck.FusedElementwise, "add_rmsnorm", "c_add_rmsnorm")
    labelled(ck.FusedElementwise, "silu_mul", "c_silu_mul")


# -- shapes -----------------------------------------------------------------------------------
def forward_shape(runner, batch: int, tokens: int, context: int, repeats: int, timers: dict) -> dict:
    from dspark_serve.scheduler.block_manager import BlockManager

    kv = BlockManager(runner.kv.num_blocks, runner.kv.block_size)

    ids = [f"bd{i}" for i in range(batch)]
    for rid in ids:
        kv.append(rid, context + tokens)
    segs = [kv.segment(rid, [100 + i] * tokens, context, 0) for i, rid in enumerate(ids)]
    walls = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        runner.forward(segs)
        walls.append(time.perf_counter() - t0)
    wall = min(walls[1:])
    timers.clear()
    n_prof = 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n_prof):
            runner.forward(segs)
    for rid in ids:
        kv.free(rid)
    att = {k: v / n_prof for k, v in attribute(prof).items()}
    kernels = att["matmul"] + att["attention"] + att["other_kernels"]
    return dict(
        kind="forward",
        batch=batch,
        tokens_per_request=tokens,
        context=context,
        total_tokens=batch * tokens,
        wall_s=wall,
        median_wall_s=statistics.median(walls[1:]),
        matmul_s=att["matmul"],
        attention_s=att["attention"],
        other_kernels_s=att["other_kernels"],
        drafter_s=0.0,
        sampling_s=0.0,
        python_dispatch_s=max(0.0, wall - kernels),
    )


def engine_shape(llm, prompts, concurrency: int, steps: int, timers: dict) -> dict:
    """Engine steps with `concurrency` requests decoding (prefill finished first)."""
    from dspark_serve.ops.sampling_params import SamplingParams
    from dspark_serve.scheduler.request import Request

    eng = llm.engine
    reqs = [
        Request(f"sp{concurrency}-{i}", p, SamplingParams(temperature=0.0), 1024, ignore_eos=True)
        for i, p in enumerate(prompts[:concurrency])
    ]
    start_decoding(eng, reqs)
    timers.clear()
    walls, made = timed_steps(eng, reqs, steps)
    unprofiled = dict(timers)  # the wrappers' wall times without the profiler's overhead
    timers.clear()
    n_prof = max(3, steps // 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n_prof):
            eng.step()
    mt = dict(timers)
    for r in reqs:
        eng.abort(r.request_id)
    att = {k: v / n_prof for k, v in attribute(prof).items()}
    wall = statistics.median(walls)
    accounted = (
        att["matmul"]
        + att["attention"]
        + att["other_kernels"]
        + att["drafter"]
        + att["sampling"]
        + att["outside"]
    )
    return dict(
        kind="engine_step",
        batch=concurrency,
        speculating=eng.speculating,
        wall_s=wall,
        tokens_per_step=made / steps,
        matmul_s=att["matmul"],
        attention_s=att["attention"],
        other_kernels_s=att["other_kernels"],
        drafter_s=att["drafter"],
        sampling_s=att["sampling"],
        engine_kernels_s=att["outside"],
        drafter_wall_s=mt.get("drafter", 0.0) / n_prof,
        drafter_wall_unprofiled_s=unprofiled.get("drafter", 0.0) / steps,
        sampling_wall_s=mt.get("sampling", 0.0) / n_prof,
        forward_wall_s=mt.get("forward", 0.0) / n_prof,
        python_dispatch_s=max(0.0, wall - accounted),
    )


def roofline(row: dict, weight_bytes: float, matmul_params: float, bw: float, peak: float) -> None:
    tokens = row.get("total_tokens") or row["batch"] * (1 + 0)
    row["roofline_bytes_s"] = weight_bytes / bw
    row["roofline_flops_s"] = 2 * matmul_params * tokens / peak
    row["roofline_s"] = max(row["roofline_bytes_s"], row["roofline_flops_s"])
    row["fraction_of_roofline"] = row["roofline_s"] / row["wall_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    ap.add_argument("--spec-concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--no-spec", action="store_true", help="skip the speculative engine steps")
    ap.add_argument("--extra", default="", help="key=value,... passed to LLM() (e.g. compile=off)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from dspark_serve.scheduler.llm import LLM

    extra = dict(kv.split("=", 1) for kv in args.extra.split(",") if kv)
    t0 = time.time()
    bw = measure_bandwidth()
    peak = measure_peak(getattr(torch, args.dtype))
    print(
        f"measured read bandwidth {bw / 1e9:.1f} GB/s, {args.dtype} matmul peak {peak / 1e9:.0f} GFLOP/s",
        flush=True,
    )
    drafter = "none" if args.no_spec else "dspark"
    llm = LLM(
        drafter=drafter, dtype=args.dtype, max_num_seqs=32, max_model_len=2048, kv_cache_tokens=65536, **extra
    )
    eng, runner = llm.engine, llm.engine.runner
    model = runner.model
    elt = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    embed = model.get_input_embeddings().weight
    lm = model.get_output_embeddings().weight
    tied = lm.data_ptr() == embed.data_ptr()
    matmul_params = sum(
        p.numel() for p in model.parameters() if p.dim() == 2 and p.data_ptr() != embed.data_ptr()
    ) + (lm.numel() if tied else 0)
    norm_params = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    weight_bytes = (matmul_params + norm_params) * elt
    print(
        f"weights read per step: {weight_bytes / 1e6:.0f} MB -> {weight_bytes / bw * 1e3:.2f} ms "
        f"({bw / weight_bytes:.0f} steps/s at the bandwidth limit)",
        flush=True,
    )
    timers: dict = {}
    label_c_kernels()
    wrap(runner, "forward", "forward", timers)
    for name in ("_attention", "_attention_reference"):  # fast / reference forward
        if hasattr(runner, name):
            wrap(runner, name, "attention", timers)
    import dspark_serve.verifier.verify as verifymod

    wrap(verifymod, "probs_from_logits", "sampling", timers)
    wrap(verifymod, "rejection_sample", "sampling", timers)
    if eng.drafter is not None:
        wrap(eng.drafter, "propose", "drafter", timers)
        wrap(eng.drafter, "observe", "drafter", timers)

    rows = []
    shapes = [(b, 1) for b in args.batches] + [(1, 8), (4, 4), (1, 128)]
    for b, t in shapes:
        ctx = args.context if t < 64 else 0
        row = forward_shape(runner, b, t, ctx, args.repeats, timers)
        roofline(row, weight_bytes, matmul_params, bw, peak)
        rows.append(row)
        _print(row)
    if not args.no_spec:
        from bench.bench_engine import chat_ids

        prompts = [
            chat_ids(llm.tokenizer, t, 512) for _, t in load_prompts(args.data, max(args.spec_concurrency))
        ]
        for policy in ("none", "dspark"):
            eng.set_policy(policy)
            for c in args.spec_concurrency:
                row = engine_shape(llm, prompts, c, args.steps, timers)
                row["policy"] = policy
                row["total_tokens"] = c  # the roofline of a step is the weight read, once
                roofline(row, weight_bytes, matmul_params, bw, peak)
                rows.append(row)
                _print(row)
    result = dict(
        machine=machine(),
        dtype=args.dtype,
        bandwidth_Bps=bw,
        matmul_peak_flops=peak,
        weight_bytes=weight_bytes,
        matmul_params=matmul_params,
        rows=rows,
        args={k: str(v).replace(str(ROOT) + "/", "") for k, v in vars(args).items()},
        seconds=time.time() - t0,
        runner=getattr(runner, "describe", lambda: "reference (pre-change)")(),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("wrote", args.out)


def _print(r: dict) -> None:
    ms = lambda k: f"{r.get(k, 0.0) * 1e3:6.2f}"
    head = f"{r['kind']:11s} B={r['batch']:2d}" + (
        f" x{r['tokens_per_request']:3d}" if r["kind"] == "forward" else f" {r.get('policy', ''):6s}"
    )
    print(
        f"{head} wall {ms('wall_s')} ms | matmul {ms('matmul_s')} attn {ms('attention_s')} "
        f"other {ms('other_kernels_s')} drafter {ms('drafter_s')} sampling {ms('sampling_s')} "
        f"python {ms('python_dispatch_s')} | roofline {ms('roofline_s')} ms "
        f"({r['fraction_of_roofline'] * 100:4.1f}%)",
        flush=True,
    )


if __name__ == "__main__":
    main()
