"""Shared pieces of the benchmarks: prompts, closed-loop load generation, medians."""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dspark_serve.training.data import PROMPTS_DIR, dev_sets, read_prompts

DATA = PROMPTS_DIR  # the vendored prompt sets (the benchmarks' default --data)

DOMAINS = ("gsm8k", "math500", "humaneval", "livecodebench", "mt-bench", "arena-hard")
ROOT = Path(__file__).resolve().parent.parent


def report_args(args) -> dict[str, str]:
    """A script's arguments as its result JSON records them: paths relative to the checkout (a
    result names no folder of the machine that measured it)."""
    rel = lambda v: os.path.relpath(v, ROOT) if isinstance(v, Path) else str(v)
    return {k: rel(v) for k, v in vars(args).items()}


def load_prompts(data_dir: Path, n: int, domains=DOMAINS, offset: int = 0) -> list[tuple[str, str]]:
    """n (domain, first user turn) pairs, round-robin over the dev sets so every point mixes domains."""
    files = dev_sets(data_dir)
    per = {d: read_prompts(files[d]) for d in domains if d in files}
    if not per:
        raise FileNotFoundError(f"no dev prompt sets of {list(domains)} in {data_dir}")
    out, i = [], offset
    while len(out) < n:
        for d, ps in per.items():
            if len(out) < n:
                out.append((d, ps[i % len(ps)]))
        i += 1
    return out


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else 0.0


def timing_args(ap, repeats: int = 5):
    """The options every microbenchmark shares (--repeats, --threads, --out): parse them and
    apply --threads. -> the parsed arguments."""
    import torch

    ap.add_argument("--repeats", type=int, default=repeats, help="passes per point (the fastest counts)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def save_result(args, result: dict) -> None:
    """`result` with the machine and the run's arguments beside it, written to args.out as JSON
    (paths as the checkout sees them: relative inside it, only the file's name outside)."""

    def shown(v: object) -> object:
        if not isinstance(v, Path):
            return v
        full = v.resolve()
        return str(full.relative_to(ROOT)) if full.is_relative_to(ROOT) else v.name

    result = {**result, "machine": machine(), "args": {k: shown(v) for k, v in vars(args).items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))


def start_decoding(engine, requests, warm_steps: int = 3) -> None:
    """Add `requests` to the engine and step until every one of them decodes, then `warm_steps`
    more: what a steady-state measurement starts from."""
    from dspark_serve.scheduler.request import Status

    for r in requests:
        engine.add_request(r)
    while any(r.status is not Status.DECODE for r in requests):
        engine.step()
    for _ in range(warm_steps):
        engine.step()


def timed_steps(engine, requests, steps: int) -> tuple[list[float], int]:
    """`steps` engine steps timed one by one -> (each step's seconds, tokens the requests made)."""
    walls, made = [], 0
    for _ in range(steps):
        n0 = sum(len(r.output_ids) for r in requests)
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
        made += sum(len(r.output_ids) for r in requests) - n0
    return walls, made


# (owner, attribute, label): an engine step's parts as the engine calls them
STEP_PARTS = (
    ("speculation", "draft", "draft"),
    (None, "_choose_lengths", "choose_lengths"),
    (None, "verify", "verify"),
    (None, "_commit", "commit"),
)


class StepParts:
    """Times the parts of an engine's steps (`STEP_PARTS`; "forward": the verify step's
    forward alone) into `spent` (seconds, summed), by wrapping the engine's own methods."""

    def __init__(self, engine) -> None:
        import collections

        self.spent: collections.Counter[str] = collections.Counter()
        for where, name, label in STEP_PARTS:
            owner = engine if where is None else getattr(engine, where)
            setattr(owner, name, self._timed(getattr(owner, name), label))

    def _timed(self, fn, label: str):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.spent[label] += time.perf_counter() - t0
            if label == "verify":
                self.spent["forward"] += out.forward_seconds
            return out

        return wrapper


def machine() -> str:
    import os

    import torch

    from dspark_serve.ops.platform import cpu_flags, cpu_model, emulated_level

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    # The CPU model and the flags that change speed (vector width, native bf16, AMX) go with
    # every figure: results from machines with other flags are not comparable. The flags are
    # the CPU's own; a run as a narrower level (bench/as_cpu.py) says so.
    flags = sorted(f for f in cpu_flags("/proc/cpuinfo") if f.startswith(("avx", "amx")))
    level = emulated_level()
    run_as = f", run as {level.name} (DSPARK_CPU_LEVEL)" if level is not None else ""
    return (
        f"{cpu_model()}, {os.cpu_count()} cores, flags {' '.join(flags) or 'n/a'}{run_as}, "
        f"torch {torch.__version__}, {dev}, threads={torch.get_num_threads()}"
    )


@dataclass
class PointResult:
    label: str
    concurrency: int
    temperature: float
    requests: int
    completion_tokens: int
    wall_s: float
    per_user_tps: float  # median over requests of tokens / (finish - first token)
    aggregate_tps: float  # all completion tokens / wall time
    ttft_s: float  # median time to first token
    tau: float | None = None  # mean tokens per verification round (drafting rounds)
    mean_budget: float | None = None  # mean drafts verified per request per decode step
    extra: dict = field(default_factory=dict)
    # every request's tokens over every request's time from first token to finish: per-user
    # speed pooled, where the median hides requests made slower (a tail decoding alone is fast)
    pooled_per_user_tps: float | None = None


def run_engine_closed_loop(
    engine,
    prompt_ids: list[list[int]],
    concurrency: int,
    max_tokens: int,
    temperature: float,
    label: str,
    seed: int | None = 0,
    ignore_eos: bool = False,
    finished: list | None = None,
) -> PointResult:
    """Keep `concurrency` requests in flight on an in-process engine until all prompts are done.
    Sampled requests get seeds seed + i (reproducible runs: keyed sampling, plain decoding's
    text whatever is drafted; they draft greedily), or none with seed None (as most API requests
    come: rejection sampling against the drafter's q).
    Finished requests are appended to `finished` when given."""
    from dspark_serve.ops.sampling_params import SamplingParams
    from dspark_serve.scheduler.request import Request

    sp = lambda i: SamplingParams(
        temperature=temperature, seed=None if temperature == 0 or seed is None else seed + i
    )
    queue = list(enumerate(prompt_ids))
    live, done = [], []
    t0 = time.perf_counter()
    while queue or live:
        while queue and len(live) < concurrency:
            i, ids = queue.pop(0)
            r = Request(f"{label}-{i}", ids, sp(i), max_tokens, ignore_eos=ignore_eos)
            engine.add_request(r)
            live.append(r)
        engine.step()
        for r in [r for r in live if r.finished]:
            r.finish_time = time.monotonic()
            live.remove(r)
            done.append(r)
    wall = time.perf_counter() - t0
    if finished is not None:
        finished.extend(done)
    decoded = [r for r in done if len(r.output_ids) > 1]
    per_user = [len(r.output_ids) / max(r.finish_time - r.first_token_time, 1e-6) for r in decoded]
    spans = sum(r.finish_time - r.first_token_time for r in decoded)
    toks = sum(len(r.output_ids) for r in done)
    rounds = sum(r.spec.rounds for r in done)
    steps = sum(r.spec.steps for r in done)
    tau = (sum(r.spec.accepted for r in done) + rounds) / rounds if rounds else None
    budget = sum(r.spec.drafted for r in done) / steps if steps else None
    return PointResult(
        label,
        concurrency,
        temperature,
        len(done),
        toks,
        wall,
        median(per_user),
        toks / wall,
        median(r.first_token_time - r.arrival_time for r in done),
        tau,
        budget,
        extra={"rounds": rounds},
        pooled_per_user_tps=sum(len(r.output_ids) for r in decoded) / spans if spans > 0 else None,
    )


def greedy_stream_body(model: str, prompt: str, max_tokens: int) -> dict:
    """A greedy streamed chat request of exactly max_tokens tokens (usage in the last chunk): the
    body the HTTP benchmarks time."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass(frozen=True)
class StreamedChat:
    """One streamed chat completion as a client saw it: completion tokens (the usage chunk),
    when it was sent, when each piece of text arrived (perf_counter), pieces per delta field."""

    tokens: int
    sent: float
    times: list[float]
    fields: dict[str, int]

    @property
    def ttft_s(self) -> float:
        return (self.times[0] if self.times else self.sent) - self.sent

    @property
    def per_user_tps(self) -> float | None:
        """(tokens - 1) / (last piece - first piece): the decode speed after the first token."""
        span = self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0
        return (self.tokens - 1) / span if span > 0 and self.tokens > 1 else None


def stream_chat(url: str, body: dict, timeout: float = 600) -> StreamedChat:
    """POST a streaming chat completion (`body` with stream and include_usage) -> StreamedChat."""
    import httpx

    fields = {"reasoning_content": 0, "content": 0}
    times: list[float] = []
    tokens = 0
    sent = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for ch in chunk.get("choices") or []:
                delta = ch.get("delta") or {}
                for f in fields:
                    if delta.get(f):
                        fields[f] += 1
                        times.append(time.perf_counter())
    return StreamedChat(tokens, sent, times, fields)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, poll: float = 0.5) -> None:
    """Until `url`/health answers 200; exits the script if the process ends or time runs out."""
    import httpx

    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            sys.exit(f"the server at {url} did not become ready")
        time.sleep(poll)


@contextlib.contextmanager
def running_server(
    port: int, flags: list[str], ready_timeout: float = 900.0, api_key: str | None = None
) -> Iterator[ServedProcess]:
    """A `dspark-serve` on `port` with `flags` (a subprocess from this checkout), once /health
    answers 200; terminated on exit. api_key: the key the flags configure (to read /v1/models)."""
    import httpx

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "dspark_serve.server.cli", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, ready_timeout)
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        model = httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"]
        yield ServedProcess(proc, url, model)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@dataclass(frozen=True)
class ServedProcess:
    proc: subprocess.Popen[bytes]
    url: str
    model: str


def metric_value(text: str, name: str, labels: str = "") -> float | None:
    """The first sample in a /metrics text of `name` (a metric's name, or a whole series as
    written) whose labels contain `labels`, or None."""
    for m in re.finditer(rf"^{re.escape(name)}((?:{{[^}}]*}})?) ([0-9.e+-]+)$", text, re.M):
        if labels in m.group(1):
            return float(m.group(2))
    return None
