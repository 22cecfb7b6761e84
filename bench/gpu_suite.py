"""The CUDA path, measured: one self-contained run for a short session on one GPU.

  python bench/gpu_suite.py --out bench/results/gpu --commit SHA  # on the GPU machine (<= 360 s)
  python bench/gpu_suite.py --out /tmp/gpu-suite --tiny            # CPU, tiny shapes (a CI test)

Needs only torch, transformers and safetensors (Triton for the Triton modes, matplotlib for the
plots, if present); no network, no installed package: it drives the engine directly, never the
HTTP stack. Stages, in priority order, each guarded (a failure is recorded and the next stage
runs), with the JSON (naming the commit measured) rewritten after every stage and sweep point,
so a run cut short still reports:

  1. checks       the forward modes (eager SDPA, the Triton attention, Triton under CUDA graphs)
                  each greedy-equal to transformers alone and under speculation, which picks the
                  modes the later stages use (a mode that fails or cannot capture falls back to
                  the one before it, and the JSON says so); greedy equality of speculative and
                  plain decoding, rejection-sampling statistics, paged-KV rollback
                  (bench/device_checks.py)
  2. decode X     for each shape in priority order (4B-like, 8B-like, 0.6B-like; random bf16
                  weights made on the device): plain decoding and static:7 with the replay
                  drafter at one request, in every mode, after warming every graph bucket, the
                  modes interleaved over 3 rounds (medians); the share of the memory-bandwidth
                  roofline, greedy equality, host syncs and launches per step on CUDA
  3. long prompt  the same on the first shape with a long prompt
  4. build, profile, sweep, competing load, timings, plots: the cost table, the load sweep
                  (plain, static:7, dspark at each concurrency; the replay drafter with
                  per-request acceptance and noisy confidences, the DSpark drafter's forward in
                  the loop), the budget while another process loads the device, the drafter's
                  and the engine's timings, one step under torch.profiler, and the two PNGs, on
                  the fastest mode that passed

A global time budget (--budget-s) cuts later stages and sweep points short instead of running over.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runnable from a plain checkout, whatever is installed

import torch  # noqa: E402

import bench.replay  # noqa: E402, F401  (registers the "replay" drafter)
from bench.common import machine, median, run_engine_closed_loop  # noqa: E402
from bench.device_checks import MODES, ForwardMode, mode_runner  # noqa: E402
from bench.models import SHAPES, CharTokenizer, TargetShape, random_dspark, random_qwen3  # noqa: E402
from dspark_serve.drafter.base import AcceptedContext, DraftRequest  # noqa: E402
from dspark_serve.drafter.registry import build_drafter  # noqa: E402
from dspark_serve.ops.sampling_params import SamplingParams  # noqa: E402
from dspark_serve.scheduler.config import SchedulerConfig  # noqa: E402
from dspark_serve.scheduler.engine import Engine  # noqa: E402
from dspark_serve.scheduler.policy import CostTable  # noqa: E402
from dspark_serve.scheduler.profile import measure  # noqa: E402
from dspark_serve.scheduler.request import Request, Status  # noqa: E402
from dspark_serve.training.plots import save_png  # noqa: E402
from dspark_serve.verifier.model_runner import ModelRunner  # noqa: E402

JSON_NAME = "gpu_suite.json"
DEFAULT_CPU_TABLE = ROOT / "bench" / "results" / "sweep-dspark-gate.json"
POLICIES = ("none", "static:{block}", "dspark")


@dataclass(frozen=True)
class SuiteConfig:
    """What the suite runs and how big.

    device: "cuda", "cuda:N" or "cpu".
    dtype: weights and KV dtype of the targets ("bfloat16", "float16" or "float32").
    shapes: target shapes (bench/models.py SHAPES), the first one gets every stage.
    concurrency: requests in flight per sweep point, increasing.
    accept_rate: the replay drafter's per-position acceptance (and its confidence).
    block_size: drafts per block (static:<block_size> is the fixed full-block baseline).
    prompt_len / max_tokens: random prompt tokens and generated tokens per request.
    min_requests: requests per sweep point = max(concurrency, min_requests).
    max_num_batched_tokens: the engine's per-step token budget.
    kv_block_size: token slots per KV block.
    profile_batch_sizes / profile_context_lens / profile_repeats: the cost-table measurement.
    drafter_batches: batch sizes at which the DSpark drafter's step is timed.
    overhead_concurrency: concurrencies at which the engine's per-step split is measured.
    timing_steps: decode steps measured per overhead point / generated by HF generate.
    budget_s: wall-clock budget of the whole run; later work is skipped to stay inside it.
    reserve_s: seconds the sweep leaves for the timing stage.
    cpu_table: a JSON file holding a CPU cost table to plot next to the device one, or None.
    decode_shapes: the shapes of the decode stage, in priority order (each built, measured at
        one request in every forward mode the checks passed, and freed).
    decode_tokens / long_prompt_len: tokens generated per decode-stage request; the prompt of
        the long-prompt stage (on the first decode shape).
    rounds: interleaved rounds per decode-stage figure (its median is reported).
    hbm_tb_s: the device's memory bandwidth for the roofline share (0 = by its name).
    commit: the commit measured (written into the JSON).
    check_tokens: tokens per request in the forward-mode checks (tiny mode: fewer, since the
        Triton modes run under the interpreter on a CPU).
    contention_s / contention_concurrency: the competing-load stage's phase length (before,
        during and after another process loads the device) and its requests in flight.
    decode_modes: the forward modes the decode stages measure, of those the checks passed
        (empty: all of them).
    drafter_in_loop: every speculative step also runs the shape's DSpark drafter's forward on as
        many requests (its tokens unused, replayed ones verified), so its cost is in the figures.
    replay_rates / replay_noise / replay_scale: the sweep's replay drafter draws each request's
        acceptance from replay_rates (empty: accept_rate for all) and reports confidences with
        this logit noise and scale (bench/replay.py).
    threads: torch CPU threads (0 = torch's default); tiny mode uses 1, which on a shared CPU
        avoids oversubscription that slows tiny ops by orders of magnitude.
    seed: prompts, weights and the replay corruption.
    """

    device: str
    dtype: str
    shapes: tuple[str, ...]
    concurrency: tuple[int, ...]
    accept_rate: float = 0.8
    block_size: int = 7
    prompt_len: int = 128
    max_tokens: int = 128
    min_requests: int = 4
    max_num_batched_tokens: int = 4096
    kv_block_size: int = 16
    profile_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    profile_context_lens: tuple[int, ...] = (128, 512)
    profile_repeats: int = 3
    drafter_batches: tuple[int, ...] = (1, 32)
    overhead_concurrency: tuple[int, ...] = (1, 32)
    timing_steps: int = 64
    budget_s: float = 280.0
    reserve_s: float = 45.0
    cpu_table: str | None = None
    threads: int = 0
    seed: int = 0
    decode_shapes: tuple[str, ...] = ("qwen3-4b-like", "qwen3-8b-like", "qwen3-0.6b-like")
    decode_tokens: int = 96
    long_prompt_len: int = 4096
    rounds: int = 3
    hbm_tb_s: float = 0.0
    commit: str = "unknown"
    drafter_in_loop: bool = True
    check_tokens: int = 20
    contention_s: float = 10.0
    contention_concurrency: int = 8
    decode_modes: tuple[str, ...] = ()
    replay_rates: tuple[float, ...] = ()
    replay_noise: float = 0.0
    replay_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        unknown = [s for s in self.shapes if s not in SHAPES]
        if not self.shapes or unknown:
            raise ValueError(f"shapes must be among {sorted(SHAPES)}, got {self.shapes!r}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency must be positive ints, got {self.concurrency!r}")
        if not (0.0 <= self.accept_rate <= 1.0):
            raise ValueError(f"accept_rate must be in [0, 1], got {self.accept_rate!r}")
        unknown = [s for s in self.decode_shapes if s not in SHAPES]
        if unknown:
            raise ValueError(f"decode_shapes must be among {sorted(SHAPES)}, got {self.decode_shapes!r}")
        for name in (
            "rounds",
            "decode_tokens",
            "long_prompt_len",
            "block_size",
            "prompt_len",
            "max_tokens",
            "min_requests",
            "kv_block_size",
            "profile_repeats",
            "timing_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_num_batched_tokens < max(self.concurrency) * (1 + self.block_size):
            raise ValueError(
                f"max_num_batched_tokens {self.max_num_batched_tokens!r} cannot hold "
                f"{max(self.concurrency)} requests x {1 + self.block_size} tokens"
            )
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads!r}")
        if self.budget_s <= 0 or self.reserve_s < 0:
            raise ValueError(
                f"budget_s must be > 0 and reserve_s >= 0, got {self.budget_s!r}, {self.reserve_s!r}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def policies(self) -> tuple[str, ...]:
        return tuple(p.format(block=self.block_size) for p in POLICIES)

    @classmethod
    def gpu(cls, **kw) -> SuiteConfig:
        base = dict(
            device="cuda",
            dtype="bfloat16",
            shapes=("qwen3-0.6b-like", "qwen3-4b-like"),
            concurrency=(1, 8, 32, 128, 256),
            budget_s=360.0,
            replay_rates=(0.5, 0.8, 0.95),
            replay_noise=0.5,
            replay_scale=0.7,
        )
        base.update(kw)
        return cls(**base)

    @classmethod
    def tiny(cls, **kw) -> SuiteConfig:
        base = dict(
            device="cpu",
            dtype="float32",
            shapes=("tiny-a", "tiny-b"),
            concurrency=(1, 4),
            prompt_len=12,
            max_tokens=24,
            min_requests=4,
            max_num_batched_tokens=256,
            kv_block_size=4,
            profile_batch_sizes=(1, 2, 4, 8, 16, 32),
            profile_context_lens=(16, 48),
            profile_repeats=1,
            drafter_batches=(1, 4),
            overhead_concurrency=(1, 4),
            timing_steps=12,
            budget_s=150.0,
            reserve_s=5.0,
            threads=1,
            decode_shapes=("tiny-a",),
            decode_tokens=8,
            long_prompt_len=24,
            check_tokens=8,
            contention_s=1.5,
            contention_concurrency=4,
            decode_modes=("sdpa", "triton+graphs"),
        )
        base.update(kw)
        return cls(**base)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _gib(n: float) -> float:
    return round(n / 2**30, 3)


@dataclass
class Model:
    """One target shape as built on the device."""

    shape: TargetShape
    target: torch.nn.Module
    runner: ModelRunner
    dspark: object  # DSparkDrafter with random weights
    table: CostTable | None = None


class Suite:
    def __init__(self, cfg: SuiteConfig, out: Path) -> None:
        self.cfg = cfg
        self.out = out
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.dev = torch.device(cfg.device)
        self.t0 = time.monotonic()
        self.models: list[Model] = []
        self.modes: list[ForwardMode] = [MODES[0]]  # until the checks pass more
        self.report: dict = {
            "suite": "gpu_suite",
            "tiny": cfg.device == "cpu" and cfg.shapes[0].startswith("tiny"),
            "machine": machine(),
            "cpu_model": _cpu_model(),
            "device": self._device_name(),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "python": sys.version.split()[0],
            "commit": cfg.commit,
            "config": _jsonable({**dataclasses.asdict(cfg), "cpu_table": _rel(cfg.cpu_table)}),
            "started_unix": time.time(),
            "elapsed_s": 0.0,
            "complete": False,
            "stages": {},
        }

    # -- bookkeeping -----------------------------------------------------------------------
    def _device_name(self) -> str:
        if self.dev.type == "cuda":
            return torch.cuda.get_device_name(self.dev)
        return "cpu"

    def remaining(self) -> float:
        return self.cfg.budget_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.monotonic() - self.t0, 2)
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / (JSON_NAME + ".tmp")
        tmp.write_text(json.dumps(_jsonable(self.report), indent=1))
        os.replace(tmp, self.out / JSON_NAME)

    def stage(self, name: str, fn, needs: tuple[str, ...] = (), min_s: float = 1.0) -> dict:
        entry: dict = {"status": "running", "result": {}}
        self.report["stages"][name] = entry
        missing = [n for n in needs if self.report["stages"].get(n, {}).get("status") not in ("ok", "failed")]
        t0 = time.monotonic()
        if missing:
            entry.update(status="skipped", reason=f"needs stage(s) {missing}")
        elif self.remaining() < min_s:
            entry.update(status="skipped", reason=f"time budget: {self.remaining():.0f}s left")
        else:
            print(f"[{time.monotonic() - self.t0:6.1f}s] stage {name}", flush=True)
            try:
                ok = fn(entry["result"])
                _sync(self.dev)
                entry["status"] = "ok" if ok else "failed"
            except Exception as exc:  # recorded, and the next stage still runs
                entry.update(
                    status="error",
                    error=f"{type(exc).__name__}: {exc}",
                    traceback=traceback.format_exc()[-4000:],
                )
                print(entry["traceback"], file=sys.stderr, flush=True)
        entry["seconds"] = round(time.monotonic() - t0, 2)
        print(f"[{time.monotonic() - self.t0:6.1f}s] stage {name}: {entry['status']}", flush=True)
        self.save()
        return entry

    # -- 1. correctness on the device -------------------------------------------------------
    def checks(self, res: dict) -> bool:
        from bench.device_checks import (
            check_batch_invariance,
            check_drafter_backbone,
            check_forward_modes,
            check_greedy_equality,
            check_paged_kv_rollback,
            check_rejection_statistics,
        )

        ok = True
        for fn in (
            functools.partial(check_forward_modes, n=self.cfg.check_tokens, num_prompts=4),
            check_greedy_equality,
            check_rejection_statistics,
            check_paged_kv_rollback,
            functools.partial(check_batch_invariance, n=self.cfg.check_tokens),
            check_drafter_backbone,
        ):
            t0 = time.monotonic()
            try:
                r = fn(self.dev)
                res[r.name] = {"passed": r.passed, "seconds": round(time.monotonic() - t0, 2), **r.details}
                ok = ok and r.passed
                if r.name == "forward_modes":  # later stages use the modes that kept greedy equality
                    self.modes = [m for m in MODES if m.name in r.details["passed_modes"]] or [MODES[0]]
                    res["modes_used"] = [m.name for m in self.modes]
                    print(f"  forward modes used: {res['modes_used']}", flush=True)
            except Exception as exc:
                res[getattr(fn, "func", fn).__name__.removeprefix("check_")] = {
                    "passed": False,
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-3000:],
                }
                ok = False
            self.save()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        return ok

    # -- decoding at one request, per forward mode -------------------------------------------
    def hbm_tb_s(self) -> float | None:
        """The device's memory bandwidth (TB/s): the config's, else by the device's name."""
        if self.cfg.hbm_tb_s:
            return self.cfg.hbm_tb_s
        name = self.report["device"]
        for part, tb_s in (
            ("H200", 4.8),
            ("H100 NVL", 3.9),
            ("H100 PCIe", 2.0),
            ("H100", 3.35),
            ("A100", 2.0),
        ):
            if part in name:
                return tb_s
        return None

    def decode(self, res: dict, shape: TargetShape, long: bool = False) -> bool:
        """Plain decoding and static:<block> (replay drafter, acceptance `accept_rate`) at one
        request on `shape`, in every forward mode the checks passed: each engine warmed (every
        graph bucket the runs use captured), then `rounds` rounds, the modes and policies
        interleaved within each; medians, the share of the memory-bandwidth roofline, greedy
        equality across policies and modes, and on CUDA the host syncs and launches per step."""
        c = self.cfg
        prompt_len = c.long_prompt_len if long else c.prompt_len
        target = random_qwen3(shape, self.dev, c.torch_dtype, seed=c.seed)
        max_len = prompt_len + c.decode_tokens + c.block_size + 2
        blocks = -(-2 * max_len // c.kv_block_size) + 2
        prompts = self.prompts(shape, 1, salt=7, length=prompt_len)
        policies = ("none", f"static:{c.block_size}")
        engines = {}
        res.update(shape=shape.name, prompt_len=prompt_len, tokens=c.decode_tokens, rounds=c.rounds)
        modes = [m for m in self.modes if not c.decode_modes or m.name in c.decode_modes]
        load = self.drafter_load(target, shape)
        res["drafter_in_loop"] = load is not None
        for mode in modes:
            replay = build_drafter(
                "replay",
                references={},
                vocab_size=shape.vocab_size,
                block_size=c.block_size,
                accept_rate=c.accept_rate,
                seed=c.seed,
                load=load,
            )
            sched = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=c.max_num_batched_tokens)
            runner = mode_runner(target, mode, blocks, c.kv_block_size, max_len)
            eng = Engine(runner, CharTokenizer(), sched, max_model_len=max_len, drafter=replay)
            t0 = time.monotonic()
            for p in policies:  # warm-up: compilation, graph capture, allocators
                eng.set_policy(p)
                done: list[Request] = []
                run_engine_closed_loop(
                    eng, prompts, 1, c.decode_tokens, 0.0, f"w{p}", ignore_eos=True, finished=done
                )
                if p == "none":
                    replay.references.update({tuple(r.prompt_ids): r.output_ids for r in done})
            engines[mode.name] = (eng, replay)
            res.setdefault("warmup_s", {})[mode.name] = round(time.monotonic() - t0, 2)
        tps: dict[str, list[float]] = {}
        outs: dict[str, list[int]] = {}
        rates: dict[str, list[float]] = {}
        for rnd in range(c.rounds):
            for mname, (eng, replay) in engines.items():
                for p in policies:
                    eng.set_policy(p)
                    replay.reset_stats()
                    done = []
                    point = run_engine_closed_loop(
                        eng, prompts, 1, c.decode_tokens, 0.0, f"r{rnd}{p}", ignore_eos=True, finished=done
                    )
                    stats = replay.reset_stats()
                    key = f"{mname} {p}"
                    tps.setdefault(key, []).append(point.per_user_tps)
                    if stats.rate is not None:
                        rates.setdefault(key, []).append(stats.rate)
                    outs[key] = done[0].output_ids
            self.save()
        weights = shape.num_params - (
            0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
        )
        elt = torch.tensor([], dtype=c.torch_dtype).element_size()
        context = prompt_len + c.decode_tokens / 2
        kv = context * shape.num_hidden_layers * 2 * shape.num_key_value_heads * shape.head_dim * elt
        bytes_per_token = weights * elt + kv
        hbm = self.hbm_tb_s()
        rows = {}
        sdpa_plain = outs.get(f"{modes[0].name} none")
        for mname in engines:
            plain = statistics.median(tps[f"{mname} none"])
            static = statistics.median(tps[f"{mname} {policies[1]}"])
            rows[mname] = {
                "plain_tok_s": plain,
                "plain_rounds": tps[f"{mname} none"],
                "static_tok_s": static,
                "static_rounds": tps[f"{mname} {policies[1]}"],
                "static_over_plain": static / plain,
                "realised_accept_rate": statistics.median(rates[f"{mname} {policies[1]}"])
                if rates.get(f"{mname} {policies[1]}")
                else None,
                "roofline_share": plain * bytes_per_token / (hbm * 1e12) if hbm else None,
                "static_equals_plain": outs[f"{mname} {policies[1]}"] == outs[f"{mname} none"],
                "plain_agrees_with_first_mode": sum(
                    a == b for a, b in zip(outs[f"{mname} none"], sdpa_plain or [])
                )
                / max(len(outs[f"{mname} none"]), 1),
            }
            if self.dev.type == "cuda":
                rows[mname].update(self.step_counts(engines[mname][0], prompts[0]))
        res.update(modes=rows, bytes_per_token=bytes_per_token, hbm_tb_s=hbm)
        for mname, r in rows.items():
            share = f"{100 * r['roofline_share']:.0f}%" if r["roofline_share"] else "?"
            print(
                f"  {shape.name} {mname:14s} plain {r['plain_tok_s']:7.1f} tok/s ({share} of roofline), "
                f"static:{c.block_size} {r['static_tok_s']:7.1f} ({r['static_over_plain']:.2f}x)",
                flush=True,
            )
        del engines, target
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        return all(r["static_equals_plain"] for r in rows.values())

    def drafter_load(self, target, shape: TargetShape, dspark=None, requests: int = 1):
        """With drafter_in_loop: a callable that runs the shape's DSpark drafter's proposal for n
        (at most `requests`) requests whose contexts it holds, else None."""
        c = self.cfg
        if not c.drafter_in_loop:
            return None
        dr = dspark or random_dspark(target, shape, block_size=c.block_size, seed=c.seed)
        width = len(dr.tap_layers) * shape.hidden_size
        prompts = self.prompts(shape, requests, salt=700)
        ids = [f"loop{i}" for i in range(requests)]
        ctx = [
            AcceptedContext(rid, p, 0, torch.randn(len(p), width, device=self.dev, dtype=c.torch_dtype))
            for rid, p in zip(ids, prompts)
        ]
        dr.observe(ctx)
        greedy = SamplingParams(temperature=0.0)
        views = [
            DraftRequest(rid, p + [p[-1]], len(p), greedy, None, c.block_size) for rid, p in zip(ids, prompts)
        ]
        return lambda n: dr.propose(views[: max(1, min(n, len(views)))])

    def step_counts(self, eng: Engine, prompt: list[int], steps: int = 8) -> dict:
        """Host synchronisations (torch.cuda.set_sync_debug_mode) and kernel launches (the
        profiler's launch calls, a graph replay counting one) per plain decode step."""
        import warnings

        from torch.profiler import ProfilerActivity, profile

        eng.set_policy("none")
        r = Request("counted", prompt, SamplingParams(temperature=0.0), 2 * steps + 4, ignore_eos=True)
        eng.add_request(r)
        while r.status is not Status.DECODE:
            eng.step()
        eng.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    eng.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        launch_calls = (
            "cudaLaunchKernel",
            "cuLaunchKernel",
            "cuLaunchKernelEx",
            "cudaLaunchKernelExC",
            "cudaGraphLaunch",
        )
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in launch_calls)
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        while eng.has_work():
            eng.step()
        return {
            "host_syncs_per_step": syncs / steps,
            "launch_calls_per_step": launches / steps,
            "gpu_kernels_per_step": kernels / steps,
        }

    # -- 2. targets and drafters ------------------------------------------------------------
    def kv_tokens(self) -> int:
        c = self.cfg
        profile = 32 * (max(c.profile_context_lens) + max(c.profile_batch_sizes))
        sweep = max(c.concurrency) * (c.prompt_len + c.max_tokens + c.block_size + 2)
        return int(1.1 * max(profile, sweep))

    def build(self, res: dict) -> bool:
        c = self.cfg
        res["models"] = []
        for name in c.shapes:
            shape = SHAPES[name]
            if self.models and self.remaining() < c.reserve_s + 30:
                res["models"].append({"name": name, "skipped": "time budget"})
                continue
            t0 = time.monotonic()
            target = random_qwen3(shape, self.dev, c.torch_dtype, seed=c.seed)
            t_target = time.monotonic() - t0
            blocks = -(-self.kv_tokens() // c.kv_block_size)
            # the fastest mode that kept greedy equality; on a CPU Triton only interprets (slowly)
            mode = self.modes[-1] if self.dev.type == "cuda" else MODES[0]
            # the drafter's block pass graphed where the target's steps are
            dspark = random_dspark(
                target, shape, block_size=c.block_size, seed=c.seed, cuda_graphs=mode.cuda_graphs
            )
            runner = mode_runner(
                target, mode, blocks, c.kv_block_size, c.prompt_len + c.max_tokens + 2 * c.block_size + 8
            )
            _sync(self.dev)
            self.models.append(Model(shape, target, runner, dspark))
            info = {
                "name": name,
                "shape": dataclasses.asdict(shape),
                "params": sum(p.numel() for p in target.parameters()),
                "drafter_params": sum(
                    p.numel()
                    for n_, p in dspark.model.named_parameters()
                    if not n_.startswith(("embed_tokens", "lm_head"))
                ),
                "target_build_s": round(t_target, 2),
                "total_build_s": round(time.monotonic() - t0, 2),
                "kv_cache_tokens": blocks * c.kv_block_size,
                "dtype": c.dtype,
                "forward_mode": mode.name,
            }
            if self.dev.type == "cuda":
                info["cuda_allocated_gib"] = _gib(torch.cuda.memory_allocated(self.dev))
            res["models"].append(info)
            self.save()
        return bool(self.models)

    # -- 3. cost tables ---------------------------------------------------------------------
    def profile(self, res: dict) -> bool:
        c = self.cfg
        res["tables"] = {}
        for m in self.models:
            if m is not self.models[0] and self.remaining() < c.reserve_s + 15:
                res["tables"][m.shape.name] = {"skipped": "time budget"}
                continue
            t0 = time.monotonic()
            raw = measure(
                m.runner,
                batch_sizes=c.profile_batch_sizes,
                context_lens=c.profile_context_lens,
                repeats=c.profile_repeats,
            )
            raw["seconds"] = round(time.monotonic() - t0, 2)
            m.table = CostTable.from_dict(raw)
            res["tables"][m.shape.name] = raw
            self.save()
        res["cpu_table"] = load_cpu_table(c.cpu_table)
        return all(m.table is not None for m in self.models[:1])

    # -- 4. the load sweep -----------------------------------------------------------------
    def prompts(self, shape: TargetShape, n: int, salt: int, length: int = 0) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.cfg.seed * 1000 + salt)
        size = (n, length or self.cfg.prompt_len)
        return torch.randint(0, shape.vocab_size - 1, size, generator=g).tolist()

    def engine(self, m: Model, drafter, max_tokens: int | None = None) -> Engine:
        c = self.cfg
        sched = SchedulerConfig(
            max_num_seqs=max(max(c.concurrency), max(c.overhead_concurrency)),
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_waiting=4096,
            verify_policy="none",
        )
        return Engine(
            m.runner,
            CharTokenizer(),
            sched,
            max_model_len=c.prompt_len + (max_tokens or c.max_tokens) + c.block_size + 2,
            drafter=drafter,
            cost_table=m.table,
        )

    def sweep(self, res: dict) -> bool:
        c = self.cfg
        res.update(rows=[], cut=[], policies=list(c.policies), accept_rate=c.accept_rate)
        res.update(replay_rates=list(c.replay_rates), drafter_in_loop=c.drafter_in_loop)
        complete = True
        for mi, m in enumerate(self.models):
            if m.table is None:
                res["cut"].append({"shape": m.shape.name, "reason": "no cost table"})
                continue
            replay = build_drafter(
                "replay",
                references={},
                vocab_size=m.shape.vocab_size,
                block_size=c.block_size,
                accept_rate=c.accept_rate,
                seed=c.seed,
                rates=c.replay_rates,
                confidence_noise=c.replay_noise,
                confidence_scale=c.replay_scale,
                load=self.drafter_load(m.target, m.shape, m.dspark, max(c.concurrency)),
            )
            eng = self.engine(m, replay)
            if self.dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.dev)
            warm = self.prompts(m.shape, 2, salt=99)
            for p in c.policies:  # compile/allocator warm-up, not measured
                eng.set_policy(p)
                done: list[Request] = []
                run_engine_closed_loop(eng, warm, 2, 4, 0.0, f"warm-{p}", ignore_eos=True, finished=done)
                if p == "none":
                    replay.references.update({tuple(r.prompt_ids): r.output_ids for r in done})
            for conc in c.concurrency:
                prompts = self.prompts(m.shape, max(conc, c.min_requests), salt=conc)
                plain: dict[tuple[int, ...], list[int]] = {}
                for p in c.policies:
                    if self.remaining() < c.reserve_s:
                        res["cut"].append(
                            {
                                "shape": m.shape.name,
                                "concurrency": conc,
                                "policy": p,
                                "reason": f"time budget: {self.remaining():.0f}s left",
                            }
                        )
                        complete = mi > 0 and complete
                        continue
                    if p != "none" and not plain:
                        res["cut"].append(
                            {
                                "shape": m.shape.name,
                                "concurrency": conc,
                                "policy": p,
                                "reason": "no plain run to replay",
                            }
                        )
                        continue
                    replay.reset_stats()
                    done = []
                    try:  # one failing point (e.g. out of memory) must not end the sweep
                        eng.set_policy(p)
                        point = run_engine_closed_loop(
                            eng, prompts, conc, c.max_tokens, 0.0, p, ignore_eos=True, finished=done
                        )
                    except Exception as exc:
                        res.setdefault("errors", []).append(
                            {
                                "shape": m.shape.name,
                                "concurrency": conc,
                                "policy": p,
                                "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc()[-2000:],
                            }
                        )
                        for rid in list(eng.requests):
                            eng.abort(rid)
                        eng = self.engine(m, replay)
                        if self.dev.type == "cuda":
                            torch.cuda.empty_cache()
                        self.save()
                        continue
                    stats = replay.reset_stats()
                    outs = {tuple(r.prompt_ids): r.output_ids for r in done}
                    if p == "none":
                        plain = outs
                        replay.references.update(outs)
                    row = dataclasses.asdict(point)
                    row.update(
                        shape=m.shape.name,
                        policy=p,
                        rounds=stats.rounds,
                        positions_tried=stats.tried,
                        positions_accepted=stats.accepted,
                        realised_accept_rate=stats.rate,
                        diverged_requests=len(stats.diverged),
                        equal_to_plain=(
                            sum(outs[k] == v for k, v in plain.items() if k in outs) / max(len(outs), 1)
                        )
                        if plain
                        else None,
                        kv_free_after=eng.blocks.num_free_blocks == eng.blocks.num_blocks,
                    )
                    res["rows"].append(row)
                    print(
                        f"  {m.shape.name} c={conc:3d} {p:9s} per-user {row['per_user_tps']:8.1f} "
                        f"agg {row['aggregate_tps']:9.1f} tau {row['tau'] or 0:4.2f} "
                        f"accept {stats.rate if stats.rate is not None else float('nan'):.3f}",
                        flush=True,
                    )
                    self.save()
            if self.dev.type == "cuda":
                try:
                    peak = torch.cuda.max_memory_allocated(self.dev)
                    total = torch.cuda.get_device_properties(self.dev).total_memory
                    res.setdefault("memory", {})[m.shape.name] = self.memory_against_plan(m, eng, total, peak)
                except Exception as exc:  # a report, never the reason the sweep fails
                    res.setdefault("memory", {})[m.shape.name] = {"error": f"{type(exc).__name__}: {exc}"}
            del eng
        res["complete"] = complete and not res.get("errors")
        return bool(res["rows"]) and not res.get("errors")

    def memory_against_plan(self, m: Model, eng: Engine, device_bytes: int, peak: int) -> dict:
        """The sweep's peak device memory (every concurrency, the drafter in the loop) against
        what the start-up memory plan (`scheduler/memory_plan.py`) counts for this engine: the
        weights of target and drafter, the activation peak of its largest step, its drafter's
        context pools at the highest concurrency, and its KV cache."""
        from dspark_serve.scheduler.builder import drafter_footprint
        from dspark_serve.scheduler.memory_plan import TargetGeometry, parameter_bytes, plan_memory
        from dspark_serve.verifier.cuda_graphs import TOKEN_BUCKETS, GraphedForward

        c = self.cfg
        geometry = TargetGeometry.of(m.target.config)
        foot = drafter_footprint(m.dspark, geometry.hidden_size)
        sched = eng.cfg
        plan = plan_memory(
            device_bytes=device_bytes,
            utilization=1.0,
            weights=parameter_bytes((m.target, *foot.modules)),
            target=geometry,
            elt=torch.tensor([], dtype=c.torch_dtype).element_size(),
            max_model_len=eng.max_model_len,
            max_num_seqs=max(c.concurrency),
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_logit_rows=max(c.concurrency) * (2 + 2 * c.block_size),
            drafter_context_per_token=foot.context_per_token,
            graph_tokens=max(TOKEN_BUCKETS) if isinstance(m.runner.forward_impl, GraphedForward) else 0,
        )
        kv_tokens = m.runner.kv.num_blocks * m.runner.kv.block_size
        planned = dataclasses.replace(plan, kv_tokens=kv_tokens, tap_rows_per_token=0).total
        return {
            "peak_gib": _gib(peak),
            "planned_gib": _gib(planned),
            "within_plan": peak <= planned,
            "kv_cache_tokens": kv_tokens,
            "plan": {name: _gib(v) for name, v in dataclasses.replace(plan, kv_tokens=kv_tokens).rows()},
        }

    # -- the budget under a competing load ------------------------------------------------------
    def contention(self, res: dict) -> bool:
        """The dspark policy serving `contention_concurrency` requests (replay drafter) for three
        phases of `contention_s` seconds: alone, beside another process that loads the same
        device (big matmuls, about half of it), alone again. Per phase: mean verification budget,
        per-user tokens/s and the cost correction; and how long after the load starts and stops
        the budget (its moving mean over 10 steps) first moves by a fifth of its level."""
        import subprocess

        c, m = self.cfg, self.models[0]
        replay = build_drafter(
            "replay", references={}, vocab_size=m.shape.vocab_size, block_size=c.block_size,
            accept_rate=c.accept_rate, seed=c.seed,
        )  # fmt: skip
        eng = self.engine(m, replay)
        prompts = self.prompts(m.shape, c.contention_concurrency, salt=4242)
        done: list[Request] = []  # a plain pass: the continuations the replay drafter replays
        eng.set_policy("none")
        run_engine_closed_loop(
            eng, prompts, len(prompts), c.max_tokens, 0.0, "ref", ignore_eos=True, finished=done
        )
        replay.references.update({tuple(r.prompt_ids): r.output_ids for r in done})
        eng.set_policy("dspark")
        served = 0

        def top_up() -> None:  # keep contention_concurrency requests in flight
            nonlocal served
            while len(eng.requests) < len(prompts):
                p = prompts[served % len(prompts)]
                eng.add_request(
                    Request(
                        f"load{served}", p, SamplingParams(temperature=0.0), c.max_tokens, ignore_eos=True
                    )
                )
                served += 1

        n = 4096 if self.dev.type == "cuda" else 384
        code = (
            "import torch,sys\n"
            f"d=torch.device({str(self.dev)!r}); torch.set_num_threads(1)\n"
            f"a=torch.randn({n},{n},device=d); b=torch.randn({n},{n},device=d)\n"
            "while True:\n    a=(a@b).tanh_()\n"
        )
        steps: list[tuple[float, float, int, float]] = []  # (time, mean budget, tokens, correction)
        t0 = time.monotonic()
        rival = None
        try:
            while time.monotonic() - t0 < 3 * c.contention_s:
                t = time.monotonic() - t0
                if rival is None and c.contention_s <= t < 2 * c.contention_s:
                    rival = subprocess.Popen([sys.executable, "-c", code])
                if rival is not None and t >= 2 * c.contention_s and rival.poll() is None:
                    rival.kill()
                top_up()
                outs = eng.step()
                budgets = [r.last_budget for r in eng.running if r.last_budget is not None]
                made = sum(len(o.token_ids) for o in outs)
                corr = eng.speculation.correction.factor(c.contention_concurrency, c.contention_concurrency)
                steps.append((time.monotonic() - t0, sum(budgets) / max(len(budgets), 1), made, corr))
        finally:
            if rival is not None and rival.poll() is None:
                rival.kill()
            for rid in list(eng.requests):
                eng.abort(rid)
        phases = []
        for k in range(3):
            lo, hi = k * c.contention_s, (k + 1) * c.contention_s
            mine = [s for s in steps if lo <= s[0] < hi]
            span = (mine[-1][0] - mine[0][0]) if len(mine) > 1 else float("nan")
            phases.append({
                "steps": len(mine),
                "mean_budget": statistics.mean(s[1] for s in mine) if mine else None,
                "tokens_per_s": sum(s[2] for s in mine[1:]) / span if len(mine) > 1 else None,
                "correction": mine[-1][3] if mine else None,
            })  # fmt: skip
        res.update(phases=phases, concurrency=c.contention_concurrency, phase_s=c.contention_s)
        res["budget_moved_after_s"] = [_moved_after(steps, k * c.contention_s) for k in (1, 2)]
        return all(p["steps"] for p in phases)

    # -- 5. timings -------------------------------------------------------------------------
    def timings(self, res: dict) -> bool:
        m = self.models[0]
        res["shape"] = m.shape.name
        for name, fn in (
            ("drafter", self.time_drafter),
            ("engine_split", self.time_engine_split),
            ("hf_generate", self.time_hf_generate),
            ("profiler", self.profile_step),
        ):
            if self.remaining() < 3:
                res[name] = {"skipped": f"time budget: {self.remaining():.0f}s left"}
                continue
            try:
                res[name] = fn(m)
            except Exception as exc:
                res[name] = {
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-3000:],
                }
            self.save()
        if isinstance(res.get("hf_generate"), dict) and "engine_vs_hf" in res["hf_generate"]:
            res["engine_vs_hf_generate_c1"] = res["hf_generate"]["engine_vs_hf"]
        return all("error" not in v for v in res.values() if isinstance(v, dict))

    def _timed(self, fn, reps: int) -> float:
        """Median seconds of fn() over reps calls after one warm-up, with device syncs."""
        fn()
        times = []
        for _ in range(reps):
            _sync(self.dev)
            t0 = time.perf_counter()
            fn()
            _sync(self.dev)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def time_drafter(self, m: Model) -> dict:
        c, dr = self.cfg, m.dspark
        width = len(dr.tap_layers) * m.shape.hidden_size
        out = {
            "block_size": dr.block_size,
            "layers": m.shape.draft_layers,
            "markov_rank": m.shape.markov_rank,
            "context_tokens": c.prompt_len,
            "by_batch": {},
        }
        greedy = SamplingParams(temperature=0.0)
        for b in c.drafter_batches:
            prompts = self.prompts(m.shape, b, salt=500 + b)
            ids = [f"d{b}-{i}" for i in range(b)]
            dr.observe(
                [
                    AcceptedContext(
                        rid, p, 0, torch.randn(len(p), width, device=self.dev, dtype=c.torch_dtype)
                    )
                    for rid, p in zip(ids, prompts)
                ]
            )
            # The anchor is the last prompt token: the drafter holds the context before it.
            views = [
                DraftRequest(rid, p + [p[-1]], len(p), greedy, None, c.block_size)
                for rid, p in zip(ids, prompts)
            ]
            propose = self._timed(lambda: dr.propose(views), 10)
            backbone = self._timed(lambda: dr.block_hidden(views), 10)
            row = {
                "propose_ms": 1e3 * propose,
                "backbone_ms": 1e3 * backbone,
                "heads_and_sampling_ms": 1e3 * (propose - backbone),
            }
            graphs = getattr(dr, "graphs", None)
            if graphs is not None:  # the same pass and proposal eagerly, beside the graphed ones
                graphed, graphed_props = dr.block_hidden(views), dr.propose(views)
                dr.graphs = None
                try:
                    eager, eager_props = dr.block_hidden(views), dr.propose(views)
                    row["backbone_eager_ms"] = 1e3 * self._timed(lambda: dr.block_hidden(views), 10)
                    row["propose_eager_ms"] = 1e3 * self._timed(lambda: dr.propose(views), 10)
                finally:
                    dr.graphs = graphs
                row["graphed_max_abs_diff"] = float((graphed.float() - eager.float()).abs().max())
                row["graphed_tokens_equal"] = all(
                    torch.equal(a.tokens, b.tokens) for a, b in zip(graphed_props, eager_props)
                )
                row["graph_replays"] = graphs.replays
            out["by_batch"][str(b)] = row
            for rid in ids:
                dr.free(rid)
        return out

    def time_engine_split(self, m: Model) -> dict:
        """Per pure decode step: wall time, time inside the target forward (planning included,
        synced at both ends), the planning part alone, and the rest (scheduling, sampling,
        rejection, bookkeeping, drafting)."""
        c = self.cfg
        runner = m.runner
        out: dict = {"steps_per_point": c.timing_steps, "points": []}
        fwd_t: list[float] = []
        plan_t: list[float] = []
        fwd_impl = runner.forward_impl
        orig_forward, orig_plan = runner.forward, fwd_impl.plan

        def forward(*a, **k):
            _sync(self.dev)
            t0 = time.perf_counter()
            r = orig_forward(*a, **k)
            _sync(self.dev)
            fwd_t.append(time.perf_counter() - t0)
            return r

        def plan(*a, **k):
            t0 = time.perf_counter()
            r = orig_plan(*a, **k)
            plan_t.append(time.perf_counter() - t0)
            return r

        replay = build_drafter(
            "replay",
            references={},
            vocab_size=m.shape.vocab_size,
            block_size=c.block_size,
            accept_rate=c.accept_rate,
            seed=c.seed,
        )
        eng = self.engine(m, replay, max_tokens=c.timing_steps + 1)
        runner.forward = forward
        fwd_impl.plan = plan
        try:
            for conc in c.overhead_concurrency:
                prompts = self.prompts(m.shape, conc, salt=700 + conc)
                for p in ("none", "dspark"):
                    if self.remaining() < 3:
                        break
                    eng.set_policy(p)
                    reqs = [
                        Request(
                            f"t{conc}-{p}-{i}",
                            ids,
                            SamplingParams(temperature=0.0),
                            c.timing_steps + 1,
                            ignore_eos=True,
                        )
                        for i, ids in enumerate(prompts)
                    ]
                    for r in reqs:
                        eng.add_request(r)
                    walls, fwds, plans = [], [], []
                    t_start = time.perf_counter()
                    while eng.has_work():
                        decode_only = not eng.waiting and all(r.status is Status.DECODE for r in eng.running)
                        fwd_t.clear()
                        plan_t.clear()
                        t0 = time.perf_counter()
                        eng.step()
                        _sync(self.dev)
                        if decode_only and eng.running:
                            walls.append(time.perf_counter() - t0)
                            fwds.append(sum(fwd_t))
                            plans.append(sum(plan_t))
                    total = time.perf_counter() - t_start
                    toks = sum(len(r.output_ids) for r in reqs)
                    if p == "none":
                        replay.references.update({tuple(r.prompt_ids): r.output_ids for r in reqs})
                    point = {
                        "concurrency": conc,
                        "policy": p,
                        "decode_steps": len(walls),
                        "step_ms": 1e3 * median(walls),
                        "forward_ms": 1e3 * median(fwds),
                        "plan_ms": 1e3 * median(plans),
                        "outside_forward_ms": 1e3 * median(w - f for w, f in zip(walls, fwds)),
                        "tokens_per_s": toks / total,
                    }
                    point["outside_forward_share"] = (
                        point["outside_forward_ms"] / point["step_ms"] if point["step_ms"] else None
                    )
                    out["points"].append(point)
        finally:
            runner.forward = orig_forward
            fwd_impl.plan = orig_plan
        return out

    def time_hf_generate(self, m: Model) -> dict:
        """transformers' generate and the engine's plain decoding (no instrumentation), batch 1,
        greedy, the same prompt and token count, the prompt's forward included on both sides."""
        n = self.cfg.timing_steps + 1
        ids = self.prompts(m.shape, 1, salt=701)[0]
        prompt = torch.tensor([ids], device=self.dev)
        gen = lambda k: m.target.generate(
            prompt, max_new_tokens=k, min_new_tokens=k, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        eng = self.engine(m, None, max_tokens=n)

        def engine_run(k: int, rid: str) -> Request:
            r = Request(rid, ids, SamplingParams(temperature=0.0), k, ignore_eos=True)
            eng.add_request(r)
            while eng.has_work():
                eng.step()
            return r

        with torch.inference_mode():
            gen(4)
            _sync(self.dev)
            t0 = time.perf_counter()
            out = gen(n)
            _sync(self.dev)
            dt = time.perf_counter() - t0
        engine_run(4, "hf-warm")
        _sync(self.dev)
        t0 = time.perf_counter()
        r = engine_run(n, "hf-cmp")
        _sync(self.dev)
        dt_engine = time.perf_counter() - t0
        made = out.shape[1] - prompt.shape[1]
        hf_tokens = out[0, prompt.shape[1] :].tolist()
        return {
            "tokens": made,
            "seconds": dt,
            "tokens_per_s": made / dt,
            "engine_tokens": len(r.output_ids),
            "engine_seconds": dt_engine,
            "engine_tokens_per_s": len(r.output_ids) / dt_engine,
            "engine_vs_hf": (len(r.output_ids) / dt_engine) / (made / dt),
            "same_tokens_share": sum(a == b for a, b in zip(hf_tokens, r.output_ids)) / max(made, 1),
        }

    def profile_step(self, m: Model) -> dict:
        """One decode step at the largest overhead concurrency under torch.profiler: plain, then
        static:<block> with the replay drafter (verification of full blocks)."""
        from torch.profiler import ProfilerActivity, profile

        c = self.cfg
        conc = max(c.overhead_concurrency)
        replay = build_drafter(
            "replay",
            references={},
            vocab_size=m.shape.vocab_size,
            block_size=c.block_size,
            accept_rate=c.accept_rate,
            seed=c.seed,
        )
        eng = self.engine(m, replay, max_tokens=8)
        prompts = self.prompts(m.shape, conc, salt=900)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.dev.type == "cuda" else [])
        out: dict = {"concurrency": conc}
        for p in ("none", f"static:{c.block_size}"):
            if self.remaining() < 3:
                out[p] = {"skipped": "time budget"}
                continue
            eng.set_policy(p)
            reqs = [
                Request(f"p{p}-{i}", ids, SamplingParams(temperature=0.0), 8, ignore_eos=True)
                for i, ids in enumerate(prompts)
            ]
            for r in reqs:
                eng.add_request(r)
            while eng.waiting or any(r.status is not Status.DECODE for r in eng.running):
                eng.step()
            eng.step()  # one warm decode step
            _sync(self.dev)
            with profile(activities=acts) as prof, _labelled_c_matmul():
                t0 = time.perf_counter()
                eng.step()
                _sync(self.dev)
                wall = time.perf_counter() - t0
            while eng.has_work():
                eng.step()
            if p == "none":
                replay.references.update({tuple(r.prompt_ids): r.output_ids for r in reqs})
            out[p] = summarize_profile(prof, wall, self.dev.type == "cuda")
        return out

    # -- 6. plots and the summary -----------------------------------------------------------
    def plots(self, res: dict) -> bool:
        try:
            import matplotlib
        except ImportError:
            res["skipped"] = "matplotlib is not installed: no PNGs"
            return True
        matplotlib.use("Agg")
        res["files"] = []
        prof = self.report["stages"].get("profile", {}).get("result", {})
        if prof.get("tables"):
            res["files"].append(plot_cost_tables(prof, self.out / "cost_table.png", self.report["device"]))
        rows = self.report["stages"].get("sweep", {}).get("result", {}).get("rows")
        if rows:
            res["files"].append(
                plot_sweep(rows, self.out / "sweep.png", self.report["device"], self.cfg.accept_rate)
            )
        res["files"] = [os.path.basename(f) for f in res["files"]]
        return True

    def run(self) -> dict:
        self.save()
        self.stage("checks", self.checks, min_s=10)
        for name in self.cfg.decode_shapes:
            self.stage(f"decode {name}", lambda res, n=name: self.decode(res, SHAPES[n]), min_s=30)
        first = SHAPES[self.cfg.decode_shapes[0]]
        self.stage(f"long prompt {first.name}", lambda res: self.decode(res, first, long=True), min_s=30)
        self.stage("build", self.build, min_s=20)
        self.stage("profile", self.profile, needs=("build",), min_s=10)
        self.stage("sweep", self.sweep, needs=("profile",), min_s=10)
        self.stage("competing load", self.contention, needs=("profile",), min_s=3 * self.cfg.contention_s + 5)
        self.stage("timings", self.timings, needs=("build",), min_s=3)
        self.stage("plots", self.plots, min_s=0)
        self.report["summary"] = summarize(self.report)
        self.report["complete"] = True
        self.save()
        return self.report


# -- helpers ------------------------------------------------------------------------------------
def _moved_after(steps: list[tuple[float, float, int, float]], at: float, window: int = 10) -> float | None:
    """Seconds after `at` until the moving mean budget (over `window` steps) first differs by a
    fifth from its level just before `at`; None if it never does."""
    before = [s[1] for s in steps if s[0] < at][-window:]
    if not before:
        return None
    level = statistics.mean(before)
    after = [s for s in steps if s[0] >= at]
    for i in range(window, len(after) + 1):
        mean = statistics.mean(s[1] for s in after[i - window : i])
        if abs(mean - level) > 0.2 * max(level, 0.5):
            return after[i - 1][0] - at
    return None


def _git_head() -> str:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _version(mod: str) -> str | None:
    try:
        return __import__(mod).__version__
    except Exception:
        return None


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float):
        return round(x, 6) if math.isfinite(x) else None
    if isinstance(x, (int, str, bool)) or x is None:
        return x
    return str(x)


def _rel(path: str | None) -> str | None:
    """A path as the report shows it: relative to the checkout when inside it."""
    if not path:
        return None
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name


def load_cpu_table(path: str | None) -> dict | None:
    """A CPU cost table to compare with: a profile JSON (batch_sizes, steps_per_second) or a
    benchmark JSON holding one under "cost_table"."""
    if not path or not Path(path).is_file():
        return None
    d = json.loads(Path(path).read_text())
    table = d.get("cost_table", d)
    if not isinstance(table, dict) or "batch_sizes" not in table:
        return None
    return {
        "source": _rel(path),
        "machine": d.get("machine"),
        "batch_sizes": table["batch_sizes"],
        "steps_per_second": table["steps_per_second"],
    }


def summarize_profile(prof, wall: float, cuda: bool) -> dict:
    """Top kernels (CUDA) or ops (CPU) by self time, and the step's time outside them."""
    events = list(prof.events())
    out: dict = {"step_wall_ms": 1e3 * wall}
    if cuda:
        kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
        spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
        busy, gaps, cur_s, cur_e = 0.0, [], None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                    gaps.append(s - cur_e)
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            busy += cur_e - cur_s
        by_name: dict[str, list[float]] = {}
        for e in kernels:
            by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
        top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:10]
        out.update(
            kernel_count=len(kernels),
            kernel_busy_ms=busy / 1e3,
            gpu_idle_ms=max(0.0, 1e3 * wall - busy / 1e3),
            gpu_idle_share=max(0.0, 1 - busy / 1e3 / (1e3 * wall)) if wall else None,
            kernel_gaps=len(gaps),
            largest_gaps_us=sorted(gaps, reverse=True)[:5],
            top_kernels=[{"name": n[:90], "calls": len(v), "total_us": sum(v)} for n, v in top],
        )
    else:
        avg = prof.key_averages()
        top = sorted(avg, key=lambda a: -a.self_cpu_time_total)[:10]
        out.update(
            op_count=sum(a.count for a in avg),
            top_ops=[
                {"name": a.key[:90], "calls": a.count, "self_cpu_us": a.self_cpu_time_total} for a in top
            ],
        )
    return out


@contextlib.contextmanager
def _labelled_c_matmul() -> Iterator[None]:
    """On a CPU the linears run through the C kernel, called by ctypes, which torch.profiler
    does not see: label its calls ("small_gemm") while a step is profiled, then restore it."""
    from dspark_serve.ops.cpu_kernels import SmallGemmLinear

    call = SmallGemmLinear.__call__

    def labelled(self: SmallGemmLinear, x: torch.Tensor) -> torch.Tensor:
        with torch.profiler.record_function("small_gemm"):
            return call(self, x)

    SmallGemmLinear.__call__ = labelled  # type: ignore[method-assign]
    try:
        yield
    finally:
        SmallGemmLinear.__call__ = call  # type: ignore[method-assign]


def summarize(report: dict) -> dict:
    """The issue's aims, computed from what ran (None where a figure is missing)."""
    stages = report["stages"]
    rows = stages.get("sweep", {}).get("result", {}).get("rows", [])
    timings = stages.get("timings", {}).get("result", {})
    first = rows[0]["shape"] if rows else None

    def get(policy, conc, key):
        for r in rows:
            if r["shape"] == first and r["policy"] == policy and r["concurrency"] == conc:
                return r[key]
        return None

    def ratio(a, b):
        return a / b if a is not None and b else None

    concs = sorted({r["concurrency"] for r in rows if r["shape"] == first})
    lo, hi = (concs[0], concs[-1]) if concs else (None, None)
    static = next(
        (p for p in stages.get("sweep", {}).get("result", {}).get("policies", []) if p.startswith("static")),
        None,
    )
    s = {
        "shape": first,
        "low_concurrency": lo,
        "high_concurrency": hi,
        "stage_status": {k: v.get("status") for k, v in stages.items()},
        "plain_vs_hf_generate_c1": timings.get("engine_vs_hf_generate_c1"),
        "dspark_vs_plain_per_user_low": ratio(
            get("dspark", lo, "per_user_tps"), get("none", lo, "per_user_tps")
        ),
        "dspark_vs_plain_aggregate_high": ratio(
            get("dspark", hi, "aggregate_tps"), get("none", hi, "aggregate_tps")
        ),
        "static_vs_plain_per_user_low": ratio(
            get(static, lo, "per_user_tps"), get("none", lo, "per_user_tps")
        ),
        "static_vs_plain_aggregate_high": ratio(
            get(static, hi, "aggregate_tps"), get("none", hi, "aggregate_tps")
        ),
        "realised_accept_rate": {
            f"{r['policy']}@{r['concurrency']}": r["realised_accept_rate"]
            for r in rows
            if r["shape"] == first and r["realised_accept_rate"] is not None
        },
    }
    aims = {
        "plain_vs_hf_generate_c1": 1.5,
        "dspark_vs_plain_per_user_low": 2.5,
        "dspark_vs_plain_aggregate_high": 1.1,
    }
    s["aims_met"] = {k: (s[k] >= v if s[k] is not None else None) for k, v in aims.items()}
    return s


def plot_cost_tables(prof: dict, path: Path, device: str) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    curves = [(f"{name} ({device})", t) for name, t in prof["tables"].items() if "batch_sizes" in t]
    if prof.get("cpu_table"):
        ct = prof["cpu_table"]
        curves.append((f"CPU table: {ct['source']}", ct))
    for label, t in curves:
        b, sps = t["batch_sizes"], t["steps_per_second"]
        ax[0].plot(b, sps, "o-", label=label, ms=3)
        ax[1].plot(b, [x * y for x, y in zip(b, sps)], "o-", label=label, ms=3)
    ax[0].set(
        xscale="log",
        yscale="log",
        xlabel="batch tokens B",
        ylabel="target steps/s SPS(B)",
        title="cost table",
    )
    ax[1].set(
        xscale="log",
        yscale="log",
        xlabel="batch tokens B",
        ylabel="tokens/s = B x SPS(B)",
        title="throughput of one forward",
    )
    for a in ax:
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path, dpi=90)
    plt.close(fig)
    return str(path)


def plot_sweep(rows: list[dict], path: Path, device: str, accept_rate: float) -> str:
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(len(shapes), 3, figsize=(15, 4 * len(shapes)), squeeze=False)
    for si, shape in enumerate(shapes):
        a0, a1, a2 = axes[si]
        for p in dict.fromkeys(r["policy"] for r in rows):
            pts = sorted(
                (r for r in rows if r["shape"] == shape and r["policy"] == p), key=lambda r: r["concurrency"]
            )
            a0.plot([r["per_user_tps"] for r in pts], [r["aggregate_tps"] for r in pts], "o-", label=p, ms=3)
            for r in pts:
                a0.annotate(str(r["concurrency"]), (r["per_user_tps"], r["aggregate_tps"]), fontsize=6)
            a1.plot([r["concurrency"] for r in pts], [r["aggregate_tps"] for r in pts], "o-", label=p, ms=3)
            a2.plot(
                [r["concurrency"] for r in pts], [r["mean_budget"] or 0 for r in pts], "o-", label=p, ms=3
            )
        a0.set(
            xlabel="per-user tokens/s",
            ylabel="aggregate tokens/s",
            xscale="log",
            yscale="log",
            title=f"{shape}: frontier (labels: concurrency)",
        )
        a1.set(
            xlabel="concurrency",
            ylabel="aggregate tokens/s",
            xscale="log",
            yscale="log",
            title=f"replay drafter, acceptance {accept_rate:g}",
        )
        a2.set(
            xlabel="concurrency",
            ylabel="drafts verified per request per step",
            xscale="log",
            title="verification budget vs load",
        )
        for a in (a0, a1, a2):
            a.grid(alpha=0.3, which="both")
            a.legend(fontsize=7)
    fig.suptitle(device, fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=80)
    plt.close(fig)
    return str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_suite.json and the PNGs")
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny shapes, concurrency 1 and 4")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget (default 280; tiny 120)")
    ap.add_argument("--shapes", default=None, help="comma-separated target shapes")
    ap.add_argument("--concurrency", default=None, help="comma-separated concurrencies")
    ap.add_argument("--accept-rate", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="target dtype (default bfloat16; tiny float32)")
    ap.add_argument(
        "--cpu-table",
        default=str(DEFAULT_CPU_TABLE),
        help="JSON with a CPU cost table to plot next to the device one ('' = none)",
    )
    ap.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD, if a checkout)")
    ap.add_argument("--decode-shapes", default=None, help="comma-separated shapes of the decode stages")
    args = ap.parse_args(argv)
    kw: dict = {
        "accept_rate": args.accept_rate,
        "cpu_table": args.cpu_table or None,
        "commit": args.commit or _git_head(),
    }
    if args.decode_shapes:
        kw["decode_shapes"] = tuple(s.strip() for s in args.decode_shapes.split(",") if s.strip())
    if args.budget_s is not None:
        kw["budget_s"] = args.budget_s
    if args.shapes:
        kw["shapes"] = tuple(s.strip() for s in args.shapes.split(",") if s.strip())
    if args.concurrency:
        kw["concurrency"] = tuple(int(x) for x in args.concurrency.split(","))
    if args.max_tokens:
        kw["max_tokens"] = args.max_tokens
    if args.dtype:
        kw["dtype"] = args.dtype
    if args.tiny:
        cfg = SuiteConfig.tiny(**({"device": args.device} if args.device else {}), **kw)
    else:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        cfg = SuiteConfig.gpu(device=device, **kw)
    report = Suite(cfg, args.out).run()
    print(json.dumps(report["summary"], indent=1))
    print("wrote", args.out / JSON_NAME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
