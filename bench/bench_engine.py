"""Throughput and per-user speed of the engine on the dev prompts, measured in one run.

  # plain engine vs transformers' generate at concurrency 1, 4, 16
  python bench/bench_engine.py baseline --out bench/results/baseline.json
  # speculation: policies x concurrency x temperature, with JSON + two PNG plots
  python bench/bench_engine.py sweep --drafter ngram --out bench/results/sweep-ngram.json
  # plain decoding, forward variants x dtypes, interleaved in one process, vs generate
  python bench/bench_engine.py plain --forwards reference,fast --dtypes float32,bfloat16 \
      --concurrency 1,16 --out bench/results/plain-forward.json
  # the same script run from an older checkout (--forwards default), merged into one plot
  python bench/bench_engine.py merge --inputs new.json,old.json --labels ,pre-change: --out both.json

Per point: per-user tokens/s (median over requests of tokens / (finish - first token)), aggregate
tokens/s (all tokens / wall time), median TTFT, acceptance length tau and mean verification
budget. Compare ratios within one run: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import DATA, load_prompts, machine, median, report_args, run_engine_closed_loop  # noqa: E402
from dspark_serve.training.plots import save_png  # noqa: E402


def chat_ids(tok, text: str, max_prompt: int) -> list[int]:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)[-max_prompt:]


def hf_point(model, tok, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    """transformers' generate, static batches of `concurrency` left-padded prompts, greedy."""
    eos = tok.eos_token_id
    per_user, total, t_all = [], 0, time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        batch = prompts[i : i + concurrency]
        L = max(map(len, batch))
        ids = torch.tensor([[eos] * (L - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in batch])
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=eos,
            eos_token_id=eos,
        )
        dt = time.perf_counter() - t0
        for row in out[:, L:].tolist():
            n = row.index(eos) if eos in row else len(row)
            total += n
            per_user.append(n / dt)
    wall = time.perf_counter() - t_all
    return {
        "label": "hf-generate",
        "concurrency": concurrency,
        "per_user_tps": median(per_user),
        "aggregate_tps": total / wall,
        "completion_tokens": total,
        "wall_s": wall,
    }


def baseline(args) -> dict:
    from dspark_serve.scheduler.llm import LLM

    llm = LLM(drafter="none", max_num_seqs=max(args.concurrency), max_model_len=2048)
    tok, model = llm.tokenizer, llm.engine.runner.model
    rows = []
    for c in args.concurrency:
        n = max(args.min_prompts, args.waves * c)
        prompts = [chat_ids(tok, t, args.max_prompt) for _, t in load_prompts(args.data, n)]
        run_engine_closed_loop(llm.engine, prompts[:1], 1, 4, 0.0, "warmup")
        eng = dataclasses.asdict(
            run_engine_closed_loop(llm.engine, prompts, c, args.max_tokens, 0.0, "engine")
        )
        hf = hf_point(model, tok, prompts, c, args.max_tokens)
        rows += [eng, hf]
        print(
            f"c={c:3d} engine per-user {eng['per_user_tps']:7.1f} agg {eng['aggregate_tps']:7.1f} | "
            f"hf per-user {hf['per_user_tps']:7.1f} agg {hf['aggregate_tps']:7.1f}",
            flush=True,
        )
    return {"rows": rows}


def plain(args) -> dict:
    """Plain decoding (no drafter) for every forward variant x dtype at every concurrency, plus
    transformers' generate on the same prompts. Variants of one dtype live in one process and
    take turns (`--rounds` times, medians kept), so a noisy machine hits them alike.
    A variant name is ModelConfig.forward (`reference`, `fast`), optionally with `+linear`,
    `+int8` (`fast+torch`), `+attention` (`fast+matmul`, `fast+sdpa`, `fast+paged`) or `+gemmN`
    (`fast+gemm128`: ModelConfig.gemm_rows), or `default` (pass nothing: for running this script
    on older code)."""
    from dspark_serve.scheduler.llm import LLM
    from dspark_serve.verifier.config import ATTENTION_KINDS

    rows = []
    for dtype in args.dtypes:
        llms = {}
        for var in args.forwards:
            kw = {}
            if var != "default":
                fwd, *mods = var.split("+")
                kw["forward"] = fwd
                for m in mods:
                    if m.startswith("gemm") and m[4:].isdigit():  # fast+gemm128: ModelConfig.gemm_rows
                        kw["gemm_rows"] = int(m[4:])
                        continue
                    key = "quantize" if m == "int8" else "attention" if m in ATTENTION_KINDS else "linear"
                    kw[key] = m
            llms[var] = LLM(
                drafter="none", dtype=dtype, max_num_seqs=max(args.concurrency), max_model_len=2048, **kw
            )
        first = next(iter(llms.values()))
        tok, model = first.tokenizer, first.engine.runner.model
        for c in args.concurrency:
            n = max(args.min_prompts, args.waves * c)
            prompts = [chat_ids(tok, t, args.max_prompt) for _, t in load_prompts(args.data, n)]
            runs: dict[str, list] = {v: [] for v in list(llms) + ["hf-generate"]}
            for _ in range(args.rounds):
                for var, llm in llms.items():
                    run_engine_closed_loop(llm.engine, prompts[:1], 1, 4, 0.0, "warmup")
                    runs[var].append(
                        dataclasses.asdict(
                            run_engine_closed_loop(llm.engine, prompts, c, args.max_tokens, 0.0, var)
                        )
                    )
                if not args.no_hf:
                    runs["hf-generate"].append(hf_point(model, tok, prompts, c, args.max_tokens))
            for var, rs in runs.items():
                if not rs:
                    continue
                row = dict(
                    rs[0],
                    label=var,
                    dtype=dtype,
                    concurrency=c,
                    per_user_tps=median(r["per_user_tps"] for r in rs),
                    aggregate_tps=median(r["aggregate_tps"] for r in rs),
                    rounds=[{k: r[k] for k in ("per_user_tps", "aggregate_tps")} for r in rs],
                    runner=llms[var].engine.runner.describe()
                    if var in llms and hasattr(llms[var].engine.runner, "describe")
                    else var,
                )
                rows.append(row)
                print(
                    f"{dtype:8s} c={c:3d} {var:16s} per-user {row['per_user_tps']:7.1f} "
                    f"agg {row['aggregate_tps']:7.1f}  rounds {row['rounds']}",
                    flush=True,
                )
        del llms
    return {"rows": rows}


def merge(args) -> dict:
    """Rows of several plain-mode results in one file (and one plot), labels prefixed."""
    rows, sources = [], []
    labels = args.labels or [""] * len(args.inputs)
    for path, prefix in zip(args.inputs, labels):
        data = json.loads(path.read_text())
        sources.append({"file": path.name, "machine": data.get("machine"), "seconds": data.get("seconds")})
        rows += [dict(r, label=prefix + r["label"]) for r in data["rows"]]
    return {"rows": rows, "sources": sources, "machine": sources[0]["machine"] if sources else machine()}


def plot_plain(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    concs = sorted({r["concurrency"] for r in rows})
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, axes = plt.subplots(1, len(concs), figsize=(6 * len(concs), 4.5), squeeze=False)
    for ax, c in zip(axes[0], concs):
        metric = "per_user_tps" if c == 1 else "aggregate_tps"
        w = 0.8 / len(labels)
        for j, lab in enumerate(labels):
            vals = [
                next(
                    (
                        r[metric]
                        for r in rows
                        if r["label"] == lab and r["dtype"] == d and r["concurrency"] == c
                    ),
                    0.0,
                )
                for d in dtypes
            ]
            xs = [i + j * w for i in range(len(dtypes))]
            ax.bar(xs, vals, w, label=lab)
            for x, v in zip(xs, vals):
                ax.annotate(f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=7)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(dtypes))], dtypes)
        ax.set(
            ylabel="per-user tokens/s" if c == 1 else "aggregate tokens/s",
            title=f"plain decoding, concurrency {c}",
        )
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle(result["machine"], fontsize=8)
    fig.tight_layout()
    p = out.with_suffix(".png")
    save_png(fig, p, dpi=110)
    return [str(p)]


def set_arm(eng, arm: str, base) -> None:
    """An arm is a policy spec, optionally with scheduler settings of its own after '@'
    (`dspark@price_overhead=false`); settings the arm does not name are `base`'s (the
    engine's scheduler settings as built)."""
    spec, _, extra = arm.partition("@")
    changes = {}
    for item in filter(None, extra.split("+")):
        key, _, value = item.partition("=")
        default = getattr(base, key)  # an unknown name is an AttributeError
        flag = value.lower() in ("1", "true", "on")
        changes[key] = flag if isinstance(default, bool) else type(default)(value)
    eng.speculation.cfg = dataclasses.replace(base, **changes)
    eng.set_policy(spec)


def sweep(args) -> dict:
    from dspark_serve.scheduler.llm import LLM

    llm = LLM(
        drafter=args.drafter,
        drafter_path=args.drafter_path,
        block_size=args.block_size,
        max_num_seqs=max(args.concurrency),
        max_model_len=2048,
        **({"gemm_rows": args.gemm_rows} if args.gemm_rows else {}),
    )
    eng = llm.engine
    base_cfg = eng.speculation.cfg
    block = eng.drafter.block_size
    policies = [p.replace("block", str(block)) for p in args.policies]
    rows = []
    prompts_all = [
        chat_ids(llm.tokenizer, t, args.max_prompt)
        for _, t in load_prompts(args.data, max(args.min_prompts, args.waves * max(args.concurrency)))
    ]
    eng.set_policy("none")
    run_engine_closed_loop(eng, prompts_all[:1], 1, 4, 0.0, "warmup")
    for temp in args.temperatures:
        for c in args.concurrency:
            prompts = prompts_all[: max(args.min_prompts, args.waves * c)]
            # Rounds interleave the policies (none, dspark, none, dspark, ...) so a slow spell of
            # the shared machine hits both sides; the medians compare them. Odd rounds run the
            # policies in reverse, so a drift of the machine's speed within a round does not
            # always fall on the same side of a pair (plain first, the default last).
            for rnd in range(args.rounds):
                for p in policies if rnd % 2 == 0 else policies[::-1]:
                    set_arm(eng, p, base_cfg)
                    seed = None if args.unseeded else 0
                    r = dataclasses.asdict(
                        run_engine_closed_loop(eng, prompts, c, args.max_tokens, temp, p, seed=seed)
                    )
                    r["round"] = rnd
                    rows.append(r)
                    print(
                        f"T={temp} c={c:3d} {p:14s} per-user {r['per_user_tps']:7.1f} pooled "
                        f"{r['pooled_per_user_tps'] or 0:7.1f} agg "
                        f"{r['aggregate_tps']:7.1f} tau {r['tau'] or 0:4.2f} "
                        f"budget {r['mean_budget'] or 0:4.2f}",
                        flush=True,
                    )
    return {
        "rows": rows,
        "medians": sweep_medians(rows),
        "drafter": args.drafter,
        "block_size": block,
        "cost_table": eng.speculation.cost_table.to_dict() if eng.speculation.cost_table else None,
        # seconds a drafting step spent besides the forward, per decoding requests, at the end
        "step_overhead": {str(n): eng.speculation.overhead.seconds(n) for n in args.concurrency},
    }


def _median_of(rows: list[dict], key: str) -> float | None:
    """The median of `key` over rows that have it (older result files lack newer keys)."""
    xs = [x[key] for x in rows if x.get(key) is not None]
    return statistics.median(xs) if xs else None


def sweep_medians(rows: list[dict]) -> list[dict]:
    """Per (temperature, concurrency, policy): the median over rounds of per-user and aggregate
    tokens/s, each one's ratio to plain decoding (policy `none`) at the same point, and the
    median over rounds of the ratio to the plain run of the same round (`*_vs_plain_rounds`:
    paired, so less moved by the machine's speed drifting between rounds)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["temperature"], r["concurrency"], r["label"]), []).append(r)
    med = {
        k: {
            "temperature": k[0],
            "concurrency": k[1],
            "label": k[2],
            "rounds": len(v),
            "per_user_tps": statistics.median(x["per_user_tps"] for x in v),
            "aggregate_tps": statistics.median(x["aggregate_tps"] for x in v),
            "pooled_per_user_tps": _median_of(v, "pooled_per_user_tps"),
            "tau": statistics.median(x["tau"] for x in v) if all(x["tau"] for x in v) else None,
            "mean_budget": statistics.median((x["mean_budget"] or 0) for x in v),
        }
        for k, v in groups.items()
    }
    plain = {(r["temperature"], r["concurrency"], r.get("round", 0)): r for r in rows if r["label"] == "none"}
    for (t, c, label), m in med.items():
        base = med.get((t, c, "none"))
        if base is not None:
            m["per_user_vs_plain"] = m["per_user_tps"] / base["per_user_tps"]
            m["aggregate_vs_plain"] = m["aggregate_tps"] / base["aggregate_tps"]
            if m["pooled_per_user_tps"] and base["pooled_per_user_tps"]:
                m["pooled_per_user_vs_plain"] = m["pooled_per_user_tps"] / base["pooled_per_user_tps"]
        for key in ("per_user_tps", "aggregate_tps", "pooled_per_user_tps"):
            paired = [
                x[key] / b[key]
                for x in groups[(t, c, label)]
                if (b := plain.get((t, c, x.get("round", 0)))) is not None and x.get(key) and b.get(key)
            ]
            if paired:
                m[key.replace("_tps", "_vs_plain_rounds")] = statistics.median(paired)
    return list(med.values())


def plot(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.get("medians") or result["rows"]
    paths = []
    for temp in sorted({r["temperature"] for r in rows}):
        fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
        for label in dict.fromkeys(r["label"] for r in rows):
            pts = sorted(
                (r for r in rows if r["label"] == label and r["temperature"] == temp),
                key=lambda r: r["concurrency"],
            )
            ax[0].plot([r["per_user_tps"] for r in pts], [r["aggregate_tps"] for r in pts], "o-", label=label)
            for r in pts:
                ax[0].annotate(str(r["concurrency"]), (r["per_user_tps"], r["aggregate_tps"]), fontsize=7)
            ax[1].plot(
                [r["concurrency"] for r in pts], [r["mean_budget"] or 0 for r in pts], "o-", label=label
            )
        ax[0].set(
            xlabel="per-user tokens/s",
            ylabel="aggregate tokens/s",
            title=f"throughput vs per-user speed (T={temp}; labels: concurrency)",
        )
        ax[1].set(
            xlabel="concurrency",
            ylabel="mean verification budget (drafts/request/step)",
            xscale="log",
            title="verification budget vs load",
        )
        for a in ax:
            a.grid(alpha=0.3)
            a.legend(fontsize=8)
        fig.suptitle(f"{result.get('drafter')} drafter - {result['machine']}", fontsize=8)
        fig.tight_layout()
        p = out.with_name(out.stem + f"-T{temp:g}.png")
        save_png(fig, p, dpi=110)
        paths.append(str(p))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["baseline", "sweep", "plain", "merge"])
    ap.add_argument(
        "--inputs",
        type=lambda s: [Path(x) for x in s.split(",")],
        default=[],
        help="merge mode: plain-mode JSON files",
    )
    ap.add_argument(
        "--labels",
        type=lambda s: s.split(","),
        default=None,
        help="merge mode: a prefix per input for its row labels",
    )
    ap.add_argument("--data", type=Path, default=DATA, help="folder of dev-*.jsonl prompt sets")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0])
    ap.add_argument(
        "--unseeded",
        action="store_true",
        help="sweep: sampled requests carry no seed (rejection sampling against the drafter's q; "
        "seeded ones, the default, sample keyed by position and draft greedily)",
    )
    ap.add_argument(
        "--policies",
        type=lambda s: s.split(","),
        default=["none", "static:1", "static:block", "threshold:0.5", "dspark"],
        help="arms: policy specs, each optionally with scheduler settings after '@', joined by '+' "
        "(dspark@price_overhead=false+draft_headroom=1)",
    )
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--drafter-path", default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--waves", type=int, default=2, help="prompts per point = waves x concurrency")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument(
        "--forwards",
        type=lambda s: s.split(","),
        default=["reference", "fast"],
        help="plain mode: forward variants (reference, fast, fast+torch, fast+int8, fast+matmul, default)",
    )
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    ap.add_argument(
        "--rounds", type=int, default=1, help="plain: turns per variant; sweep: interleaved rounds per point"
    )
    ap.add_argument("--no-hf", action="store_true", help="plain mode: skip transformers' generate")
    ap.add_argument("--gemm-rows", type=int, default=0, help="sweep: ModelConfig.gemm_rows (0: by the CPU)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.concurrency is None:
        args.concurrency = {"baseline": [1, 4, 16], "plain": [1, 16]}.get(args.mode, [1, 2, 4, 8, 16, 32])
    t0 = time.time()
    result = {"baseline": baseline, "sweep": sweep, "plain": plain, "merge": merge}[args.mode](args)
    result.setdefault("machine", machine())  # merge mode keeps the measuring runs' machine
    result.update(args=report_args(args), seconds=time.time() - t0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))  # first: a failing plot keeps the figures
    if args.mode == "sweep":
        result["plots"] = plot(result, args.out)
    elif args.mode in ("plain", "merge"):
        result["plots"] = plot_plain(result, args.out)
    args.out.write_text(json.dumps(result, indent=1))
    print("wrote", args.out, *result.get("plots", []))


if __name__ == "__main__":
    main()
