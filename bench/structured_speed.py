"""What structured output costs per user: the embedded default (DSpark drafter with prompt
lookup, the load-aware policy) on the same prompts with and without a JSON schema, speculation
on in both arms, at 1 and at 8 concurrent requests. Three named schemas; the unconstrained arm
decodes exactly as many tokens as the constrained reply (ignore_eos: left alone, this model
writes 160 tokens of repetitive prose for these prompts, which prompt lookup drafts far more
easily than JSON; length-matched, both arms compare the same stretch of the reply); a wave's
prompts are prefilled once before both arms (both find them in the prefix cache), and the
arms' order alternates with the round. Per-user speed is a
request's tokens after its first over the time from its first token to its last; reported: the
ratio of the arms' median per-user speeds over the pairs where both replies have 8 tokens or
more (the median of per-pair ratios beside it), and the ratio of the arms' median step times
(what the grammar costs a step, whatever the two arms' different texts do to acceptance).
Mask time: each batched fill of the verified rows (per row), each drafter mask asked through
`allowed_after` (one row) and each packed mask a grammar cursor fills (one row: a greedy row's
refused argmax, drafting or verifying), p50 and p99. Step parts (ms per step, medians over the
waves, per arm): drafting, the length choice, verification (its forward alone as "forward") and
the commit (`bench.common.StepParts`).

    python -m bench.structured_speed --rounds 4 --out bench/results/structured-speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import StepParts, machine  # noqa: E402

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 40},
            "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
        },
        "required": ["name", "age", "city", "hobbies"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "product": {"type": "string", "maxLength": 30},
                        "quantity": {"type": "integer"},
                    },
                    "required": ["product", "quantity"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 4,
            },
            "express": {"type": "boolean"},
        },
        "required": ["order_id", "items", "express"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]},
            "start_hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "description": {"type": "string", "maxLength": 160},
        },
        "required": ["title", "day", "start_hour", "description"],
        "additionalProperties": False,
    },
}
PROMPTS: dict[str, list[str]] = {
    "person": [
        "Describe a fictional person as JSON with name, age, city and hobbies.",
        "Give me a JSON profile of a chef who lives in Lyon.",
        "Create a JSON record for a retired painter.",
        "Write a JSON object about a young engineer living in Oslo.",
        "JSON profile of a marathon runner, please.",
        "Invent a librarian and describe them in JSON.",
        "A JSON description of a jazz musician.",
        "Produce a JSON person: a farmer from Kansas.",
    ],
    "order": [
        "Create a JSON order for three notebooks and a pen.",
        "Write a JSON order with two items for a bakery.",
        "A JSON order for running shoes, express delivery.",
        "Make a JSON purchase order for office chairs.",
        "JSON order: four cups of coffee and a croissant.",
        "Give me a JSON order for garden tools.",
        "Write a JSON order of books for a school.",
        "Create a JSON order for a laptop and a mouse.",
    ],
    "event": [
        "Describe a birthday party as a JSON event.",
        "Write a JSON event for a team meeting on Monday morning.",
        "A JSON event for a concert in the park.",
        "Create a JSON event for a cooking class.",
        "JSON event: a charity run on Sunday.",
        "Make a JSON event for a book club evening.",
        "Give me a JSON event for a science fair.",
        "Write a JSON event for a yoga session.",
    ],
}


class MaskTimes:
    """Wraps the mask paths to time them: the verifier's batched fill (seconds per row of each
    call), a drafter's mask through `allowed_after` (one row a call) and a grammar cursor's
    packed mask (one row a call: a greedy row's refused argmax, in the drafter's walk and in
    verification)."""

    def __init__(self) -> None:
        import dspark_serve.verifier.grammar as grammar_mod
        import dspark_serve.verifier.verify as verify_mod
        from dspark_serve.ops.processors import GuardedConstraint

        self.verify_rows: list[float] = []
        self.draft_rows: list[float] = []
        self.cursor_rows: list[float] = []
        cursor = getattr(grammar_mod, "GrammarCursor", None)
        if cursor is not None:  # a checkout with cursors
            fill_one = cursor.fill

            def timed_fill_one(c: Any, bits: Any) -> Any:
                t0 = time.perf_counter()
                out = fill_one(c, bits)
                self.cursor_rows.append(time.perf_counter() - t0)
                return out

            cursor.fill = timed_fill_one
        if hasattr(verify_mod, "fill_masks"):
            fill = verify_mod.fill_masks

            def timed_fill(jobs: Any, vocab: int) -> Any:
                t0 = time.perf_counter()
                out = fill(jobs, vocab)
                rows = sum(len(d) + 1 for _, d in jobs)
                self.verify_rows.append((time.perf_counter() - t0) / max(rows, 1))
                return out

            verify_mod.fill_masks = timed_fill
        else:  # a checkout that masks the verified rows request by request
            allowed = GuardedConstraint.allowed

            def timed_allowed(guard: Any, drafts: Any, vocab: int) -> Any:
                t0 = time.perf_counter()
                out = allowed(guard, drafts, vocab)
                self.verify_rows.append((time.perf_counter() - t0) / (len(drafts) + 1))
                return out

            GuardedConstraint.allowed = timed_allowed  # type: ignore[method-assign]
        after = GuardedConstraint.allowed_after

        def timed_after(guard: Any, drafts: Any, vocab: int) -> Any:
            t0 = time.perf_counter()
            out = after(guard, drafts, vocab)
            self.draft_rows.append(time.perf_counter() - t0)
            return out

        GuardedConstraint.allowed_after = timed_after  # type: ignore[method-assign]

    def summary(self) -> dict[str, Any]:
        def q(xs: list[float], p: float) -> float | None:
            return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1e6 if xs else None

        return {
            "verify_us_per_row": {
                "p50": q(self.verify_rows, 0.5),
                "p99": q(self.verify_rows, 0.99),
                "calls": len(self.verify_rows),
            },
            "draft_us_per_row": {
                "p50": q(self.draft_rows, 0.5),
                "p99": q(self.draft_rows, 0.99),
                "calls": len(self.draft_rows),
            },
            "cursor_us_per_row": {
                "p50": q(self.cursor_rows, 0.5),
                "p99": q(self.cursor_rows, 0.99),
                "calls": len(self.cursor_rows),
            },
        }


STEPS: list[float] = []  # the last wave's step times
FAILED: dict[str, str] = {}  # request id -> the engine's error, for requests it failed
PARTS: list[StepParts] = []  # the engine's step parts, timed (set in main)
WAVE_PARTS: dict[str, float] = {}  # the last wave's step parts, ms per step


def run_wave(engine: Any, reqs: list[Any]) -> dict[str, float]:
    """Runs requests together; each one's per-user speed (tokens after the first per second)."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for r in reqs:
        engine.add_request(r)
    STEPS.clear()
    for parts in PARTS:
        parts.spent.clear()
    while engine.has_work():
        t0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        STEPS.append(now - t0)
        for o in outs:
            if o.error:
                FAILED[o.request_id] = o.error
            if o.token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
    WAVE_PARTS.clear()
    for parts in PARTS:
        WAVE_PARTS.update({k: v / max(len(STEPS), 1) * 1e3 for k, v in parts.spent.items()})
    speeds = {}
    for r in reqs:
        n = len(r.output_ids)
        if n > 2 and last[r.request_id] > first[r.request_id]:
            speeds[r.request_id] = (n - 1) / (last[r.request_id] - first[r.request_id])
    return speeds


MAX_TOKENS = 160
LENGTHS: dict[tuple[str, str], int] = {}  # (schema, prompt) -> the constrained reply's tokens


def one_round(
    llm: Any, schema: str, concurrency: int, rnd: int, ids: Callable[[], str]
) -> list[dict[str, Any]]:
    """Every prompt of `schema` in waves of `concurrency`, both arms; the arms' order alternates
    with the round (the unconstrained arm's lengths are the constrained replies', which greedy
    decoding makes the same every round; the warm-up learns them)."""
    from dspark_serve.ops.sampling_params import SamplingParams
    from dspark_serve.scheduler.request import Request

    eng, tok = llm.engine, llm.tokenizer
    prompts = PROMPTS[schema]
    greedy = SamplingParams(temperature=0.0)
    rows = []
    for start in range(0, len(prompts), concurrency):
        wave = prompts[start : start + concurrency]
        toks = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for p in wave
        ]
        run_wave(eng, [Request(ids(), list(t), greedy, 1) for t in toks])  # both arms find the prompts cached

        def constrained() -> tuple[list[Any], dict[str, float]]:
            reqs = [Request(ids(), list(t), greedy, MAX_TOKENS) for t in toks]
            for r in reqs:
                r.constraint = eng.compile_grammar("json_schema", json.dumps(SCHEMAS[schema]))
            speeds = run_wave(eng, reqs)
            step_ms["constrained"] = statistics.median(STEPS) * 1e3
            parts_ms["constrained"] = dict(WAVE_PARTS)
            for p, r in zip(wave, reqs):
                LENGTHS[(schema, p)] = len(r.output_ids)
            return reqs, speeds

        def free() -> tuple[list[Any], dict[str, float]]:
            lengths = [max(2, LENGTHS[(schema, p)]) for p in wave]
            reqs = [Request(ids(), list(t), greedy, n, ignore_eos=True) for t, n in zip(toks, lengths)]
            speeds = run_wave(eng, reqs)
            step_ms["unconstrained"] = statistics.median(STEPS) * 1e3
            parts_ms["unconstrained"] = dict(WAVE_PARTS)
            return reqs, speeds

        step_ms: dict[str, float] = {}
        parts_ms: dict[str, dict[str, float]] = {}
        if rnd % 2 == 0 or any((schema, p) not in LENGTHS for p in wave):
            (con, c_speed), (fre, f_speed) = constrained(), free()
        else:
            (fre, f_speed), (con, c_speed) = free(), constrained()
        for c, f in zip(con, fre):
            if c.request_id in c_speed and f.request_id in f_speed:
                rows.append(
                    {
                        "schema": schema,
                        "concurrency": concurrency,
                        "round": rnd,
                        "tokens": len(c.output_ids),
                        "unconstrained_tokens": len(f.output_ids),
                        "valid_json": _valid(c.output_ids, tok),
                        "finish_reason": c.finish_reason,
                        "error": FAILED.get(c.request_id),
                        "constrained_tps": c_speed[c.request_id],
                        "unconstrained_tps": f_speed[f.request_id],
                        "ratio": c_speed[c.request_id] / f_speed[f.request_id],
                        "constrained_step_ms": step_ms["constrained"],
                        "unconstrained_step_ms": step_ms["unconstrained"],
                        "constrained_parts_ms": parts_ms["constrained"],
                        "unconstrained_parts_ms": parts_ms["unconstrained"],
                        "constrained_accepted_per_round": c.spec.accepted / max(c.spec.rounds, 1),
                        "unconstrained_accepted_per_round": f.spec.accepted / max(f.spec.rounds, 1),
                    }
                )
    return rows


MIN_TOKENS = 8  # a pair counts when both replies have this many tokens (speed over fewer is noise)


def summarize(rows: list[dict[str, Any]], levels: list[int], schemas: list[str]) -> dict[str, Any]:
    """Per concurrency and schema (and all schemas): the ratio of the arms' median per-user
    speeds, the median of the paired ratios, the ratio of median step times, acceptance."""
    summary = {}
    for c in levels:
        for schema in [*schemas, "all"]:
            sel = [
                r
                for r in rows
                if r["concurrency"] == c
                and (schema == "all" or r["schema"] == schema)
                and min(r["tokens"], r["unconstrained_tokens"]) >= MIN_TOKENS
            ]
            if not sel:
                continue
            con = statistics.median(r["constrained_tps"] for r in sel)
            free = statistics.median(r["unconstrained_tps"] for r in sel)
            summary[f"c{c}-{schema}"] = {
                "pairs": len(sel),
                "per_user_ratio": con / free,
                "median_pair_ratio": statistics.median(r["ratio"] for r in sel),
                "median_constrained_tps": con,
                "median_unconstrained_tps": free,
                "step_ms_ratio": statistics.median(r["constrained_step_ms"] for r in sel)
                / statistics.median(r["unconstrained_step_ms"] for r in sel),
                "parts_ms": {arm: _median_parts([r[f"{arm}_parts_ms"] for r in sel]) for arm in ARMS},
                "valid_json": sum(r["valid_json"] for r in sel) / len(sel),
                "failed": [r["error"] for r in sel if r.get("error")],  # requests the engine failed
                "median_tokens": statistics.median(r["tokens"] for r in sel),
                "median_unconstrained_tokens": statistics.median(r["unconstrained_tokens"] for r in sel),
                "constrained_accepted_per_round": statistics.mean(
                    r["constrained_accepted_per_round"] for r in sel
                ),
                "unconstrained_accepted_per_round": statistics.mean(
                    r["unconstrained_accepted_per_round"] for r in sel
                ),
            }
    return summary


ARMS = ("constrained", "unconstrained")


def _median_parts(waves: list[dict[str, float]]) -> dict[str, float]:
    """Each step part's median over the waves (ms per step)."""
    return {k: statistics.median(w.get(k, 0.0) for w in waves) for k in sorted({k for w in waves for k in w})}


def _valid(ids: list[int], tok: Any) -> bool:
    try:
        json.loads(tok.decode(ids, skip_special_tokens=True))
        return True
    except ValueError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--schemas", default=",".join(SCHEMAS))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--drafter-path", default=None, help="the DSpark checkpoint (default: the embedded one)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import itertools

    import torch

    from dspark_serve.scheduler.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(
        drafter="dspark+ngram",
        drafter_path=args.drafter_path,
        max_model_len=2048,
        kv_cache_tokens=65536,
        max_num_seqs=32,
        max_num_batched_tokens=512,
    )
    PARTS.append(StepParts(llm.engine))
    counter = itertools.count()
    ids = lambda: f"b{next(counter)}"
    for schema in args.schemas.split(","):  # warm-up: kernels, grammar caches
        one_round(llm, schema, 8, 0, ids)
    times = MaskTimes()
    rows: list[dict[str, Any]] = []
    levels = [int(c) for c in args.concurrency.split(",")]
    for rnd in range(args.rounds):
        for c in levels:
            for schema in args.schemas.split(","):
                new = one_round(llm, schema, c, rnd, ids)
                rows += new
                ratio = statistics.median(r["ratio"] for r in new)
                print(f"round {rnd} c={c} {schema}: median ratio {ratio:.3f}", flush=True)
    summary = summarize(rows, levels, args.schemas.split(","))
    report = {
        "machine": machine(),
        "command": "python -m bench.structured_speed " + " ".join(sys.argv[1:]),
        "summary": summary,
        "masks": times.summary(),
        "rows": rows,
    }
    print(json.dumps({"summary": summary, "masks": report["masks"]}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
