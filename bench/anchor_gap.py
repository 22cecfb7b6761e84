"""Why teacher-forced acceptance overstates what serving gets: the anchors serving drafts from.

    python bench/anchor_gap.py --prompts 8 --out bench/results/anchor-gap.json

Per dev set: the engine generates greedily at static:7 with the DSpark drafter (its acceptance
length is `engine`); then the same drafter, teacher-forced on those very outputs, is scored
(a) at every response position as anchor (`uniform`, what held-out training metrics average)
and (b) along the chain of follow anchors from each response's first token (`renewal`: a
block from anchor a with m leading hits is followed by one from a + 1 + m, as in serving).
`renewal` matching `engine` says the serving path loses nothing against the training forward;
the gap between `uniform` and `renewal` is what anchors after a miss cost.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import DATA, DOMAINS, load_prompts, machine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="per dev set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--drafter-path", default=None, help="default: the embedded DSpark drafter")
    ap.add_argument("--drafts", type=int, default=7, help="drafts verified per block (static:N)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/anchor-gap.json")
    args = ap.parse_args()

    import torch

    from bench.bench_engine import chat_ids
    from dspark_serve.ops.sampling_params import SamplingParams
    from dspark_serve.scheduler.llm import LLM
    from dspark_serve.training.cache import (
        CachedSequence,
        anchored_batch,
        pad_sequences,
        target_states,
    )
    from dspark_serve.training.train import draft_model_from_checkpoint, greedy_hits
    from dspark_serve.verifier.loader import load_target

    llm = LLM(
        drafter="dspark",
        drafter_path=args.drafter_path,
        verify_policy=f"static:{args.drafts}",
        max_num_seqs=8,
        max_model_len=1024,
        kv_cache_tokens=65536,
    )
    # The target again, outside the engine, at the engine's dtype ("auto"), for full-sequence
    # teacher-forced states (as training data is cached).
    loaded = load_target(None, device="cpu", dtype="auto")
    shipped = "drafter/checkpoints/smollm2-135m-dspark"
    path = args.drafter_path or shipped
    model = draft_model_from_checkpoint(path if args.drafter_path else ROOT / shipped, loaded.model).eval()
    taps, bs = model.config.target_layer_ids, model.config.block_size
    result: dict = {"machine": machine(), "drafter": path, "prompts_per_set": args.prompts, "sets": {}}
    for d in DOMAINS:
        texts = [t for _, t in load_prompts(DATA, args.prompts, domains=(d,))]
        prompts = [chat_ids(llm.tokenizer, t, 512) for t in texts]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0), args.max_tokens)
        rounds = sum(o.spec.rounds for o in outs if o.spec)
        accepted = sum(o.spec.accepted for o in outs if o.spec)
        uniform: list[int] = []
        renewal: list[int] = []
        for p, o in zip(prompts, outs):
            ids = p + o.token_ids
            tap, last = target_states(loaded.model, ids, taps)
            padded = pad_sequences([CachedSequence(torch.tensor(ids), len(p), tap, last)])
            anchors = torch.arange(len(p), len(ids) - 1).unsqueeze(0)
            if anchors.numel() == 0:
                continue
            batch = anchored_batch(padded, anchors, torch.ones_like(anchors, dtype=torch.bool), bs)
            hits = greedy_hits(model, batch, bf16=True)[0, :, : args.drafts]
            lead = hits.to(torch.int64).cumprod(-1).sum(-1).tolist()  # leading hits per anchor
            uniform += [1 + m for m in lead]
            a = 0
            while a < len(lead):
                renewal.append(1 + lead[a])
                a += 1 + lead[a]
        row = {
            "engine": (accepted + rounds) / rounds if rounds else None,
            "engine_rounds": rounds,
            "uniform": sum(uniform) / len(uniform),
            "uniform_blocks": len(uniform),
            "renewal": sum(renewal) / len(renewal),
            "renewal_blocks": len(renewal),
        }
        result["sets"][d] = row
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
        print(d, json.dumps(shown), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
