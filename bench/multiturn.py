"""Multi-turn chat with and without prefix caching, in one run on one engine.

  python bench/multiturn.py --out bench/results/multiturn-prefix-cache.json

16 concurrent conversations of 5 turns share a system prompt of a few hundred tokens; each turn
resends the whole history (system prompt, earlier questions and the engine's own answers,
rendered by the chat template as a client would) and the next question is sent when the answer
arrives (closed loop). The same conversations run with prefix caching off and on, alternating
`--repeats` times; per mode: time to first token (median and mean), aggregate throughput
(completion tokens / wall time), acceptance length tau, prefix-cache hit rate and preemptions.
Greedy decoding, so both modes answer the same questions the same way.

It also measures what restoring the drafter's context after a cache hit costs
(`scheduler/prefix.py`): the drafter absorbing the cached tap states of an N-token prefix vs
the target prefilling those N tokens, and the bytes per token of the target's KV, of the cached
tap states and of the drafter's own context K/V.
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

from bench.common import DATA, load_prompts, machine  # noqa: E402
from dspark_serve.drafter.base import AcceptedContext  # noqa: E402
from dspark_serve.ops.sampling_params import SamplingParams  # noqa: E402
from dspark_serve.scheduler.request import Request  # noqa: E402

SYSTEM = (
    "You are a careful, friendly assistant for a team of engineers and students. Answer in "
    "plain English, keep answers short unless asked for detail, and show the key steps of any "
    "calculation. When a question is about code, give a small working example and explain what "
    "each part does. When a question is ambiguous, say which reading you chose and why. Never "
    "invent facts, citations, version numbers or file names; say so when you do not know. "
    "Prefer standard library solutions over third-party packages, and mention the complexity "
    "of an algorithm when it matters. Use metric units. Format lists with short bullet points, "
    "and put code in fenced blocks with the language named. If the user asks for a summary, "
    "give at most five bullets. If the user asks you to continue, pick up exactly where the "
    "last answer stopped. Be polite but do not apologise repeatedly; do not repeat the "
    "question back. Each conversation is independent of the others, and the history of this "
    "conversation is sent with every turn, so refer back to earlier answers when that helps. "
    "Keep a neutral tone, avoid marketing language, and do not use emojis. These rules apply "
    "to every turn of the conversation, including follow-up questions and corrections."
)


def render(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def run_mode(eng, tok, questions: list[list[str]], max_tokens: int, caching: bool, tag: str) -> dict:
    eng.set_prefix_caching(caching)
    n_conv, n_turn = len(questions), len(questions[0])
    history = [[{"role": "system", "content": SYSTEM}] for _ in range(n_conv)]
    turn = [0] * n_conv
    live: dict[str, tuple[int, Request]] = {}
    ttft, prompt_lens, tokens, rounds, accepted = [], [], 0, 0, 0
    before = eng.blocks.stats()
    pre0 = eng.scheduler.num_preemptions
    answers: list[list[list[int]]] = [[] for _ in range(n_conv)]

    def send(c: int) -> None:
        history[c].append({"role": "user", "content": questions[c][turn[c]]})
        ids = render(tok, history[c])
        r = Request(f"{tag}-c{c}-t{turn[c]}", ids, SamplingParams(temperature=0.0), max_tokens)
        prompt_lens.append(len(ids))
        eng.add_request(r)
        live[r.request_id] = (c, r)

    t0 = time.perf_counter()
    for c in range(n_conv):
        send(c)
    while eng.has_work():
        for out in eng.step():
            if not out.finished or out.request_id not in live:
                continue
            c, r = live.pop(out.request_id)
            ttft.append(r.first_token_time - r.arrival_time)
            tokens += len(r.output_ids)
            rounds += r.spec.rounds
            accepted += r.spec.accepted
            answers[c].append(list(r.output_ids))
            history[c].append(
                {"role": "assistant", "content": tok.decode(r.output_ids, skip_special_tokens=True)}
            )
            turn[c] += 1
            if turn[c] < n_turn:
                send(c)
    wall = time.perf_counter() - t0
    st = eng.blocks.stats()
    q, h = st.queries - before.queries, st.hits - before.hits
    return {
        "prefix_caching": caching,
        "conversations": n_conv,
        "turns": n_turn,
        "requests": len(ttft),
        "completion_tokens": tokens,
        "wall_s": wall,
        "aggregate_tps": tokens / wall,
        "ttft_median_s": statistics.median(ttft),
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p90_s": sorted(ttft)[int(0.9 * (len(ttft) - 1))],
        "tau": (accepted + rounds) / rounds if rounds else None,
        "prompt_tokens_mean": statistics.fmean(prompt_lens),
        "prefix_queries": q,
        "prefix_hits": h,
        "hit_rate": h / q if q else 0.0,
        "evictions": st.evictions - before.evictions,
        "preemptions": eng.scheduler.num_preemptions - pre0,
        "answers_digest": hash(json.dumps(answers)) & 0xFFFFFFFF,
    }


@torch.inference_mode()
def restore_cost(eng, n: int, reps: int) -> dict:
    """Drafter context from cached taps vs the target's prefill of the same n tokens."""
    runner, dr = eng.runner, eng.drafter
    ids = torch.randint(0, runner.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    taps = tuple(dr.tap_layers)
    fwd, obs = [], []
    for i in range(reps):
        rid = f"restore-{i}"
        eng.blocks.append(rid, n)
        t = time.perf_counter()
        out = runner.forward([eng.blocks.segment(rid, ids, 0, n - 1)], taps)
        fwd.append(time.perf_counter() - t)
        hidden = out.hidden.clone()
        t = time.perf_counter()
        dr.observe([AcceptedContext(rid, ids, 0, hidden)])
        obs.append(time.perf_counter() - t)
        dr.free(rid)
        eng.blocks.free(rid)
    mc = dr.model.config
    elt = hidden.element_size()
    draft_kv = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * elt
    return {
        "tokens": n,
        "target_prefill_s": statistics.median(fwd),
        "drafter_observe_s": statistics.median(obs),
        "ratio_observe_over_prefill": statistics.median(obs) / statistics.median(fwd),
        "bytes_per_token": {
            "target_kv": runner.kv_bytes_per_token(runner.config, runner.dtype),
            "cached_taps": hidden.shape[1] * elt,
            "drafter_context_kv": draft_kv,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--question-chars", type=int, default=200, help="each question is cut to this many characters"
    )
    ap.add_argument("--repeats", type=int, default=1, help="off/on pairs, alternating")
    ap.add_argument("--drafter", default="dspark")
    ap.add_argument("--drafter-path", default=None)
    ap.add_argument("--kv-cache-tokens", type=int, default=32768)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from dspark_serve.scheduler.llm import LLM

    llm = LLM(
        drafter=args.drafter,
        drafter_path=args.drafter_path,
        max_num_seqs=args.conversations,
        max_model_len=2048,
        kv_cache_tokens=args.kv_cache_tokens,
    )
    eng, tok = llm.engine, llm.tokenizer
    qs = [t[: args.question_chars] for _, t in load_prompts(DATA, args.conversations * args.turns)]
    questions = [qs[c * args.turns : (c + 1) * args.turns] for c in range(args.conversations)]
    system_tokens = len(render(tok, [{"role": "system", "content": SYSTEM}]))
    # warm-up (kernels, allocator) outside the measured runs
    eng.set_prefix_caching(False)
    llm.generate([render(tok, [{"role": "user", "content": "Hello"}])], SamplingParams(temperature=0.0), 8)
    runs = []
    for rep in range(args.repeats):
        for caching in (False, True):
            r = run_mode(eng, tok, questions, args.max_tokens, caching, f"r{rep}{int(caching)}")
            runs.append(r)
            print(
                f"caching={caching!s:5} ttft median {r['ttft_median_s']:.3f}s mean {r['ttft_mean_s']:.3f}s "
                f"agg {r['aggregate_tps']:.1f} tok/s tau {r['tau'] or 0:.3f} hit rate {r['hit_rate']:.3f} "
                f"preempt {r['preemptions']}",
                flush=True,
            )
    eng.set_prefix_caching(True)
    restore = restore_cost(eng, 512, 3) if eng.drafter is not None and eng.drafter.tap_layers else None

    def agg(caching: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["prefix_caching"] == caching)

    summary = {
        "ttft_median_ratio_on_over_off": agg(True, "ttft_median_s") / agg(False, "ttft_median_s"),
        "ttft_mean_ratio_on_over_off": agg(True, "ttft_mean_s") / agg(False, "ttft_mean_s"),
        "throughput_ratio_on_over_off": agg(True, "aggregate_tps") / agg(False, "aggregate_tps"),
    }
    if runs[0]["tau"]:
        summary["tau_ratio_on_over_off"] = agg(True, "tau") / agg(False, "tau")
    result = {
        "machine": machine(),
        "model": llm.model_name,
        "drafter": args.drafter,
        "system_prompt_tokens": system_tokens,
        "max_tokens": args.max_tokens,
        "runner": eng.runner.describe(),
        "dtype": str(eng.runner.dtype),
        "runs": runs,
        "summary": summary,
        "drafter_context_restore": restore,
    }
    print(json.dumps({"summary": summary, "drafter_context_restore": restore}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
