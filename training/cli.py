"""`dspark-train`: one subcommand per stage of the drafter pipeline.

    dspark-train gen-data   --out runs/smollm2       # target writes responses (+ cache)
    dspark-train cache-target --out runs/smollm2     # target taps for data without a cache
    dspark-train train      --out runs/smollm2 --name dspark [--markov-rank 0 for DFlash]
    dspark-train calibrate  --out runs/smollm2 --name dspark
    dspark-train export     --out runs/smollm2 --name dspark --dest drafter/checkpoints/...
    dspark-train evaluate   --drafter dspark=PATH --drafter dflash=PATH --results bench/results

Every stage shows a progress bar, writes `<out>/progress/<stage>.json`, and resumes after an
interruption (finished shards are skipped, training restarts from its last checkpoint).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark_serve.training.loss import CE_LABELS
from dspark_serve.training.progress import Progress

# The embedded target: 30 decoder layers; five taps spread over them (never the last layer,
# whose output is the target's own prediction).
DEFAULT_TAPS = "1,7,14,21,27"
# <empty_output>: a special token of the SmolLM2 vocabulary that chat text never contains.
DEFAULT_MASK_TOKEN = 16


def _taps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"taps must be comma-separated ints, got {text!r}") from None


def _set_threads(n: int) -> None:
    import torch

    if n > 0:
        torch.set_num_threads(n)


def cmd_gen_data(a: argparse.Namespace) -> None:
    from dspark_serve.scheduler.llm import LLM
    from dspark_serve.training.data import GenDataConfig, TapCapture, run_gen_data

    _set_threads(a.threads)
    from dspark_serve.training.data import TRAIN_PROMPTS

    cfg = GenDataConfig(
        prompts=a.prompts or str(TRAIN_PROMPTS),
        out_dir=a.out,
        max_prompt_tokens=a.max_prompt_tokens,
        min_prompt_tokens=a.min_prompt_tokens,
        max_new_tokens=a.max_new_tokens,
        max_prompts=a.max_prompts,
        batch_size=a.batch_size,
        temperature=a.temperature,
        seed=a.seed,
        holdout_every=a.holdout_every,
        worker=a.worker,
        num_workers=a.num_workers,
    )
    taps = None if a.no_cache else a.taps
    # The serving engine writes the data (continuous batching at full concurrency) and hands
    # the tap states of every token it feeds to the capture in the same pass.
    llm = LLM(
        model=a.model,
        device=a.device,
        dtype=a.dtype,
        max_num_seqs=a.max_num_seqs,
        max_model_len=a.max_prompt_tokens + a.max_new_tokens + 16,
        max_num_batched_tokens=a.max_num_batched_tokens,
        capture=None if taps is None else (lambda layers: TapCapture(taps, layers)),
    )
    bar = Progress(a.out, f"gen-data-{a.worker}", 1, "shard")
    n = run_gen_data(cfg, llm.engine, llm.tokenizer, taps, lambda d, t, tok: bar.update(d, t, new_tokens=tok))
    bar.close()
    print(f"gen-data: {n} shards in {a.out}/data" + ("" if taps is None else f" (+ cache in {a.out}/cache)"))


def cmd_make_prompts(a: argparse.Namespace) -> None:
    from dspark_serve.training.data import PROMPTS_DIR
    from dspark_serve.training.prompts import HeldOut, make_prompts, read_turns, write_prompts

    out = Path(a.prompts_out)
    held = [f for f in sorted(PROMPTS_DIR.glob("*.jsonl*")) if f.resolve() != out.resolve()]
    held_out = HeldOut(t for f in held for t in read_turns(f))
    counts = {"code": a.code, "math": a.math, "chat": a.chat, "json": a.json}
    rows = make_prompts(counts, held_out, seed=a.seed)
    write_prompts(rows, out)
    by = {d: sum(r["domain"] == d for r in rows) for d in counts}
    print(f"make-prompts: {len(rows)} prompts {by} in {out} (none copying {len(held)} held-out sets)")


def _add_make_prompts_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("--prompts-out", default="data/prompts/train-made.jsonl.gz", help="the JSONL.gz to write")
    g.add_argument("--code", type=int, default=2400, help="prompts about the standard library's functions")
    g.add_argument("--math", type=int, default=2400, help="exercises from templates")
    g.add_argument("--chat", type=int, default=1600, help="writing and explaining tasks over topics")
    g.add_argument("--json", type=int, default=0, help="structured-output and tool-call tasks")


def _load_target(a: argparse.Namespace):
    from dspark_serve.verifier.loader import load_target

    return load_target(a.model, device=a.device)


def cmd_cache_target(a: argparse.Namespace) -> None:
    from dspark_serve.training.cache import run_cache_target

    _set_threads(a.threads)
    target = _load_target(a)
    bar = Progress(a.out, "cache-target", 1, "shard")
    n = run_cache_target(a.out, target.model, a.taps, lambda d, t: bar.update(d, t))
    bar.close()
    print(f"cache-target: {n} shards in {a.out}/cache")


def _drafter_config(a: argparse.Namespace, target):
    from dspark_serve.drafter.dspark_model import DSparkConfig

    return DSparkConfig.for_target(
        target.model.config,
        num_draft_layers=a.layers,
        block_size=a.block_size,
        target_layer_ids=a.taps,
        mask_token_id=a.mask_token_id,
        markov_rank=a.markov_rank,
        markov_head_type=a.markov_head_type,
        enable_confidence_head=True,
        confidence_head_with_markov=a.markov_rank > 0,
        num_anchors=a.num_anchors,
    )


def _check_train_args(a: argparse.Namespace) -> None:
    if (a.grow_layers or a.grow_markov_rank or a.convert_markov_head) and not a.init_from:
        raise SystemExit(
            "train: --grow-layers, --grow-markov-rank and --convert-markov-head change the drafter "
            "given by --init-from"
        )


def _train_config(a: argparse.Namespace):
    from dspark_serve.training.train import TrainConfig

    return TrainConfig(
        steps=a.steps,
        batch_seqs=a.batch_seqs,
        num_anchors=a.num_anchors,
        lr=a.lr,
        warmup_ratio=a.warmup_ratio,
        checkpoint_every=a.checkpoint_every,
        bf16=not a.fp32,
        init_from_target=not a.no_init_from_target,
        seed=a.seed,
        follow_fraction=a.follow_fraction,
    )


def _loss_config(a: argparse.Namespace):
    from dspark_serve.training.loss import LossConfig

    return LossConfig(
        ce_alpha=a.ce_alpha,
        l1_alpha=a.l1_alpha,
        confidence_alpha=a.confidence_alpha,
        decay_gamma=a.decay_gamma,
        ce_labels=a.ce_labels,
    )


def _training_sequences(a: argparse.Namespace, ckpt: Path) -> list:
    """The training sequences of --out and every --extra-data folder (none when only scoring
    saved checkpoints: the vocabulary then comes from the run). The held-out sequences always
    come from --out."""
    from dspark_serve.training.train import load_train_data

    data: list = []
    if not (a.score_checkpoints and ckpt.exists()):
        for folder in [a.out, *a.extra_data]:
            data += load_train_data(folder, a.holdout_every)
    return data


@dataclass(frozen=True)
class _DraftStart:
    """What a training run starts from: the drafter's architecture, its draft vocabulary
    (None = the target's whole vocabulary) and, with --init-from on a fresh run, the
    exported drafter itself (None = built from the target)."""

    config: Any
    d2t: Any = None
    model: Any = None


def _draft_start(a: argparse.Namespace, cfg, target, data: list, ckpt: Path) -> _DraftStart:
    import torch

    from dspark_serve.training.train import (
        draft_model_from_checkpoint,
        draft_vocabulary,
        grow_draft_model,
        grown_config,
    )

    if a.init_from and not ckpt.exists():
        start = grow_draft_model(
            draft_model_from_checkpoint(a.init_from, target.model),
            target.model,
            a.grow_layers,
            a.grow_markov_rank,
            a.convert_markov_head,
        )
        print(f"train {a.name}: starting from {a.init_from} (its architecture and draft vocabulary)")
        return _DraftStart(start.config, start.d2t, start)
    if a.init_from:  # resuming such a run: the start's architecture, the run's own vocabulary
        from dspark_serve.drafter.dspark_model import read_config

        cfg = grown_config(read_config(a.init_from), a.grow_layers, a.grow_markov_rank, a.convert_markov_head)
        return _DraftStart(
            cfg, torch.load(ckpt, weights_only=False)["model"]["d2t"] if cfg.truncated else None
        )
    if a.draft_vocab:
        # A resumed run keeps the vocabulary it started with (the data may have grown since).
        d2t = (
            torch.load(ckpt, weights_only=False)["model"]["d2t"]
            if ckpt.exists()
            else draft_vocabulary(data, a.draft_vocab, always=[target.tokenizer.eos_token_id])
        )
        return _DraftStart(cfg.replace(draft_vocab_size=int(d2t.numel())), d2t)
    return _DraftStart(cfg)


def _train_steps(a: argparse.Namespace, model, data: list, tcfg, lcfg, work: Path, target) -> None:
    """Run (or resume) the optimizer steps with a progress bar, scoring the held-out
    sequences at every checkpoint."""
    from dspark_serve.training.cache import load_cache
    from dspark_serve.training.train import run_train

    bar = Progress(a.out, f"train-{a.name}", tcfg.steps, "step")
    held_out = (
        load_cache(Path(a.out) / "cache", holdout=True, holdout_every=a.holdout_every)[: a.held_out_seqs]
        if a.held_out_seqs
        else []
    )
    run_train(
        model,
        data,
        tcfg,
        lcfg,
        work,
        lambda s: bar.update(
            s.step,
            tcfg.steps,
            loss=s.loss,
            ce=s.ce,
            l1=s.l1,
            conf=s.confidence,
            tau=s.tau,
            s_per_step=s.seconds,
        ),
        target_head=target.model.get_output_embeddings(),
        held_out=held_out,
    )
    bar.close()


def cmd_train(a: argparse.Namespace) -> None:
    from dataclasses import replace

    from dspark_serve.training.train import (
        build_draft_model,
        load_step_weights,
        save_final,
        vocabulary_coverage,
    )

    _check_train_args(a)
    _set_threads(a.threads)
    target = _load_target(a)
    cfg = _drafter_config(a, target)
    tcfg, lcfg = _train_config(a), _loss_config(a)
    work = Path(a.out) / "train" / a.name
    ckpt = work / "ckpt.pt"
    data = _training_sequences(a, ckpt)
    print(
        f"train {a.name}: {len(data)} sequences, {sum(len(s.input_ids) - s.num_prompt for s in data)} "
        f"response tokens; drafter {cfg.num_hidden_layers} layers, markov_rank {cfg.markov_rank}"
    )
    start = _draft_start(a, cfg, target, data, ckpt)
    if start.d2t is not None and data:
        print(
            f"train {a.name}: draft vocabulary of {start.d2t.numel()} ids covers "
            f"{vocabulary_coverage(data, start.d2t):.2%} of the response tokens"
        )
    model = (
        start.model or build_draft_model(start.config, target.model, tcfg.init_from_target, start.d2t)
    ).to(a.device)
    if a.score_checkpoints:
        _score_checkpoints(a, model, work, tcfg, lcfg, target.model.get_output_embeddings())
        return
    if a.finalize_at:
        load_step_weights(model, work, a.finalize_at)
        tcfg = replace(tcfg, steps=a.finalize_at)
    else:
        _train_steps(a, model, data, tcfg, lcfg, work, target)
    path = save_final(model, work)
    (work / "final" / "train_args.json").write_text(
        json.dumps({"train": tcfg.__dict__, "loss": lcfg.__dict__, "sequences": len(data)}, indent=1)
    )
    print(f"train {a.name}: saved {path}")


def _score_checkpoints(a: argparse.Namespace, model, work: Path, tcfg, lcfg, target_head) -> None:
    """Held-out teacher-forced acceptance of every weights_step<N>.pt a run saved (a run
    started before held-out scoring existed gets its curve afterwards) -> <work>/held_out.json."""
    from dataclasses import asdict

    from dspark_serve.training.cache import load_cache
    from dspark_serve.training.train import evaluate_held_out, load_step_weights

    held = load_cache(Path(a.out) / "cache", holdout=True, holdout_every=a.holdout_every)[: a.held_out_seqs]
    if not held:
        raise SystemExit("train --score-checkpoints: no held-out cache shards")
    steps = sorted(int(p.stem.removeprefix("weights_step")) for p in work.glob("weights_step*.pt"))
    rows = []
    for step in steps:
        load_step_weights(model, work, step)
        ho = evaluate_held_out(model, held, tcfg.num_anchors, lcfg, tcfg.bf16, step, target_head)
        rows.append(asdict(ho))
        print(json.dumps(rows[-1]), flush=True)
    doc = {"run": a.name, "held_out_sequences": len(held), "checkpoints": rows}
    (work / "held_out.json").write_text(json.dumps(doc, indent=1))


def _load_drafter(path: str, target, device: str):
    from dspark_serve.drafter.dspark_model import load_dspark

    return load_dspark(
        path,
        target_embed=target.model.get_input_embeddings(),
        target_lm_head=target.model.get_output_embeddings(),
        device=device,
    )


def _calibration_report(path: str, seqs: list, samples, temps: list[float], before, after) -> dict:
    from dspark_serve.training.calibrate import pooled_ece
    from dspark_serve.training.evaluate import summarize_positions

    return {
        "drafter": path,
        "held_out_sequences": len(seqs),
        "blocks": int(samples.mask[:, 0].sum()),
        "labels": "teacher-forced expected prefix survival prod c*_k",
        "temperatures": temps,
        "ece_before": pooled_ece(before),
        "ece_after": pooled_ece(after),
        "per_position_before": summarize_positions(before),
        "per_position_after": summarize_positions(after),
    }


def cmd_calibrate(a: argparse.Namespace) -> None:
    import torch

    from dspark_serve.drafter.dspark_model import Calibration, save_calibration
    from dspark_serve.training.cache import load_cache
    from dspark_serve.training.calibrate import (
        STSConfig,
        collect_confidences,
        cumulative_survival,
        fit_sts,
        plot_reliability,
        pooled_ece,
        position_metrics,
    )
    from dspark_serve.training.evaluate import write_json

    _set_threads(a.threads)
    target = _load_target(a)
    path = a.drafter or str(Path(a.out) / "train" / a.name / "final")
    model = _load_drafter(path, target, a.device)
    model.calibration = None
    seqs = load_cache(Path(a.out) / "cache", holdout=True, holdout_every=a.holdout_every)[: a.max_seqs]
    if not seqs:
        raise SystemExit("calibrate: no held-out cache shards (run gen-data longer or lower --holdout-every)")
    bar = Progress(a.out, f"calibrate-{a.name}", 2, "phase")
    samples = collect_confidences(
        model, seqs, a.num_anchors, seed=a.seed, target_head=target.model.get_output_embeddings()
    )
    bar.update(1, 2, blocks=int(samples.mask[:, 0].sum()))
    temps = fit_sts(samples.logits, samples.prefix_labels, samples.mask, STSConfig())
    before = position_metrics(cumulative_survival(samples.logits), samples.prefix_labels, samples.mask)
    after = position_metrics(
        cumulative_survival(samples.logits, torch.tensor(temps)), samples.prefix_labels, samples.mask
    )
    save_calibration(Calibration(tuple(temps)), path)
    bar.update(2, 2, ece_before=pooled_ece(before), ece_after=pooled_ece(after))
    bar.close()
    report = _calibration_report(path, seqs, samples, temps, before, after)
    out = Path(a.out) / "calibration" / a.name
    write_json(out / "calibration_report.json", report)
    plot_reliability(
        before, after, f"{a.name}: held-out teacher-forced survival", str(out / "reliability.png")
    )
    print(json.dumps({k: report[k] for k in ("temperatures", "ece_before", "ece_after")}))


def cmd_export(a: argparse.Namespace) -> None:
    from dspark_serve.training.export import directory_size, export_drafter

    src = a.drafter or str(Path(a.out) / "train" / a.name / "final")
    target = _load_target(a)
    model = _load_drafter(src, target, "cpu")
    meta = None
    args_path = Path(src) / "train_args.json"
    if args_path.exists():
        meta = json.loads(args_path.read_text())
    export_drafter(model, a.dest, dtype=a.dtype, metadata=meta)
    size = directory_size(a.dest)
    print(f"export: {a.dest} ({size / 1e6:.1f} MB)")
    if size > a.max_mb * 1e6:
        raise SystemExit(f"export: {size / 1e6:.1f} MB exceeds --max-mb {a.max_mb}")


def cmd_evaluate(a: argparse.Namespace) -> None:
    from dspark_serve.training.evaluate import run_evaluation

    _set_threads(a.threads)
    target = _load_target(a)
    drafters = {}
    for spec in a.drafter:
        name, _, path = spec.partition("=")
        drafters[name] = path
    run_evaluation(
        target,
        drafters,
        a.datasets,
        a.results,
        max_prompts=a.max_prompts,
        max_new_tokens=a.max_new_tokens,
        temperatures=a.temperatures,
        ngram=not a.no_ngram,
        seed=a.seed,
        progress_out=a.out,
    )


def _add_common_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--out", default="runs/smollm2", help="work directory of this pipeline")
    sp.add_argument("--model", default=None, help="target (default: embedded SmolLM2-135M-Instruct)")
    sp.add_argument("--device", default="cpu")
    sp.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    sp.add_argument("--seed", type=int, default=0)


def _add_model_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--layers", type=int, default=2, help="draft transformer layers")
    sp.add_argument("--block-size", type=int, default=7)
    sp.add_argument("--taps", type=_taps, default=_taps(DEFAULT_TAPS), help="target_layer_ids")
    sp.add_argument("--mask-token-id", type=int, default=DEFAULT_MASK_TOKEN)
    sp.add_argument("--markov-rank", type=int, default=64, help="0 = DFlash (no sequential head)")
    sp.add_argument("--markov-head-type", default="vanilla", choices=("vanilla", "gated", "rnn"))


def _add_gen_data_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("--prompts", default=None, help="JSONL(.gz) of prompts (default: the vendored train set)")
    g.add_argument("--max-prompt-tokens", type=int, default=256)
    g.add_argument(
        "--min-prompt-tokens", type=int, default=0, help="skip prompts this long or shorter (0 = none)"
    )
    g.add_argument("--max-new-tokens", type=int, default=192)
    g.add_argument("--max-prompts", type=int, default=0, help="0 = all")
    g.add_argument("--batch-size", type=int, default=48, help="prompts per shard")
    g.add_argument("--max-num-seqs", type=int, default=64, help="requests the engine runs at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--dtype", default="auto", help="target dtype (auto: bfloat16 where native)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--holdout-every", type=int, default=10, help="every n-th shard held out for calibration")
    g.add_argument("--taps", type=_taps, default=_taps(DEFAULT_TAPS), help="target layers to cache")
    g.add_argument("--no-cache", action="store_true", help="store token ids only")
    g.add_argument("--worker", type=int, default=0, help="this process's index among --num-workers")
    g.add_argument("--num-workers", type=int, default=1, help="processes sharing the plan")


def _add_cache_target_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--taps", type=_taps, default=_taps(DEFAULT_TAPS))


def _add_train_schedule_args(t: argparse.ArgumentParser) -> None:
    t.add_argument("--name", default="dspark", help="run name (work dir <out>/train/<name>)")
    t.add_argument("--steps", type=int, default=400)
    t.add_argument("--batch-seqs", type=int, default=4)
    t.add_argument("--num-anchors", type=int, default=24, help="random anchors per sequence")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup-ratio", type=float, default=0.04)
    t.add_argument(
        "--follow-fraction",
        type=float,
        default=0.0,
        help="share of anchors moved to where the drafter's greedy block from them stops "
        "(the anchors serving drafts from; 0 = uniform)",
    )
    t.add_argument("--checkpoint-every", type=int, default=25)


def _add_train_loss_args(t: argparse.ArgumentParser) -> None:
    t.add_argument("--ce-alpha", type=float, default=0.1)
    t.add_argument("--l1-alpha", type=float, default=0.9)
    t.add_argument("--confidence-alpha", type=float, default=1.0)
    t.add_argument("--decay-gamma", type=float, default=None, help="default: the block size")
    t.add_argument(
        "--ce-labels",
        default="data",
        choices=CE_LABELS,
        help="cross-entropy labels: the tokens the target wrote (data) or its argmax at every slot",
    )


def _add_train_data_args(t: argparse.ArgumentParser) -> None:
    t.add_argument("--holdout-every", type=int, default=10)
    t.add_argument(
        "--extra-data",
        action="append",
        default=[],
        help="another gen-data work directory whose training shards join (repeatable; held-out from --out)",
    )
    t.add_argument(
        "--held-out-seqs",
        type=int,
        default=32,
        help="held-out sequences scored at every checkpoint (teacher-forced acceptance; 0 = none)",
    )
    t.add_argument("--fp32", action="store_true", help="no bfloat16 autocast")
    t.add_argument("--no-init-from-target", action="store_true")


def _add_train_start_args(t: argparse.ArgumentParser) -> None:
    t.add_argument(
        "--init-from",
        default=None,
        help="start from an exported drafter directory (its architecture, draft vocabulary and "
        "weights; fresh optimizer and schedule) instead of the target's layers; a run with a "
        "ckpt.pt resumes that instead",
    )
    t.add_argument(
        "--grow-layers",
        type=int,
        default=0,
        help="with --init-from: stack new layers on the start's, up to this many in all, each "
        "the identity until trained (0 = as the start)",
    )
    t.add_argument(
        "--grow-markov-rank",
        type=int,
        default=0,
        help="with --init-from: widen the start's Markov head to this rank, the bias unchanged "
        "until trained (0 = as the start)",
    )
    t.add_argument(
        "--convert-markov-head",
        default="",
        choices=("", "gated", "rnn"),
        help="with --init-from: turn the start's vanilla Markov head into a gated or recurrent "
        "one computing (nearly) the same bias until trained (empty = as the start)",
    )
    t.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="keep only the N ids the target writes most (truncated draft vocabulary; 0 = all)",
    )


def _add_train_mode_args(t: argparse.ArgumentParser) -> None:
    t.add_argument(
        "--score-checkpoints",
        action="store_true",
        help="skip training; score every saved checkpoint on the held-out sequences (held_out.json)",
    )
    t.add_argument(
        "--finalize-at",
        type=int,
        default=0,
        help="skip training; save the weights of checkpoint step N as the final drafter",
    )


def _add_train_args(t: argparse.ArgumentParser) -> None:
    _add_model_args(t)
    _add_train_schedule_args(t)
    _add_train_loss_args(t)
    _add_train_data_args(t)
    _add_train_start_args(t)
    _add_train_mode_args(t)


def _add_calibrate_args(k: argparse.ArgumentParser) -> None:
    k.add_argument("--name", default="dspark")
    k.add_argument("--drafter", default=None, help="checkpoint dir (default <out>/train/<name>/final)")
    k.add_argument("--holdout-every", type=int, default=10)
    k.add_argument("--num-anchors", type=int, default=64)
    k.add_argument("--max-seqs", type=int, default=200)


def _add_export_args(e: argparse.ArgumentParser) -> None:
    e.add_argument("--name", default="dspark")
    e.add_argument("--drafter", default=None, help="checkpoint dir (default <out>/train/<name>/final)")
    e.add_argument("--dest", required=True)
    e.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    e.add_argument("--max-mb", type=float, default=50.0)


def _add_evaluate_args(v: argparse.ArgumentParser) -> None:
    v.add_argument("--drafter", action="append", default=[], help="NAME=PATH (repeatable)")
    v.add_argument(
        "--datasets",
        nargs="+",
        default=None,
        help="dev JSONL(.gz) files (default: every vendored data/prompts/dev-*.jsonl.gz)",
    )
    v.add_argument("--results", default="bench/results/drafter_eval")
    v.add_argument("--max-prompts", type=int, default=8, help="per dataset (0 = all)")
    v.add_argument("--max-new-tokens", type=int, default=128)
    v.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    v.add_argument("--no-ngram", action="store_true")


def _online_setup(a: argparse.Namespace):
    """The target, the samples and the drafter's config (and d2t map) of a train-online run."""
    from dspark_serve.drafter.dspark_model import DSparkConfig
    from dspark_serve.training.online import read_samples, sample_vocabulary, tiny_setup

    if a.tiny:
        model, train, held = tiny_setup(a.seed)
        taps, layers, mask = (0, 2, 3), 1, 5
    else:
        model = _load_target(a).model
        train, held = read_samples(a.data or [Path(a.out) / "data"], a.holdout_every)
        taps, layers, mask = a.taps, a.layers, a.mask_token_id
    model.requires_grad_(False)
    cfg = DSparkConfig.for_target(
        model.config,
        num_draft_layers=layers,
        block_size=a.block_size,
        target_layer_ids=taps,
        mask_token_id=mask,
        markov_rank=a.markov_rank,
        markov_head_type=a.markov_head_type,
        enable_confidence_head=True,
        confidence_head_with_markov=a.markov_rank > 0,
        num_anchors=a.num_anchors,
    )
    d2t = None
    if a.draft_vocab:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        always = [eos] if isinstance(eos, int) else list(eos or [])
        d2t = sample_vocabulary(train, a.draft_vocab, always)
        cfg = cfg.replace(draft_vocab_size=int(d2t.numel()))
    return model, train, held, cfg, d2t


def cmd_train_online(a: argparse.Namespace) -> None:
    import torch

    from dspark_serve.training.online import OnlineConfig, run_online
    from dspark_serve.training.train import TrainConfig

    _set_threads(a.threads)
    model, train, held, cfg, d2t = _online_setup(a)
    train_cfg = TrainConfig(
        steps=a.steps,
        batch_seqs=a.batch_seqs,
        num_anchors=a.num_anchors,
        lr=a.lr,
        checkpoint_every=a.checkpoint_every,
        bf16=torch.device(a.device).type == "cuda",
        seed=a.seed,
    )
    run = OnlineConfig(train_cfg, a.minutes, calibration_seqs=a.calibration_seqs, max_file_mib=a.max_file_mib)
    work = Path(a.work or Path(a.out) / "online")
    print(f"train-online: {len(train)} training / {len(held)} held-out sequences on {a.device}")

    def progress(step: int, stats: dict) -> None:
        if step % 25 == 0:
            print(
                f"step {step}: " + ", ".join(f"{n} tau {v['tau']:.3f}" for n, v in stats.items()), flush=True
            )

    dest = a.dest or work / "export"
    loss = _loss_config(a)
    report = run_online(model.to(a.device), cfg, run, loss, train, held, work, dest, progress, d2t=d2t)
    print(f"train-online: {report.steps_done}/{report.steps_total} steps, exports {report.exports}")


def _add_train_online_args(o: argparse.ArgumentParser) -> None:
    _add_model_args(o)
    _add_train_loss_args(o)
    o.add_argument("--tiny", action="store_true", help="a tiny random target and data on the CPU (CI)")
    o.add_argument("--data", nargs="+", default=None, help="folders of token shards (default <out>/data)")
    o.add_argument("--work", default=None, help="checkpoint and log folder (default <out>/online)")
    o.add_argument("--dest", default=None, help="the exports' folder (default <work>/export)")
    o.add_argument("--steps", type=int, default=3000)
    o.add_argument("--batch-seqs", type=int, default=32)
    o.add_argument("--num-anchors", type=int, default=64)
    o.add_argument("--lr", type=float, default=6e-4)
    o.add_argument("--checkpoint-every", type=int, default=100)
    o.add_argument("--minutes", type=float, default=6.5, help="wall time of the command, export included")
    o.add_argument("--holdout-every", type=int, default=10)
    o.add_argument("--calibration-seqs", type=int, default=32)
    o.add_argument("--max-file-mib", type=float, default=16.0, help="split exported weights above this")
    o.add_argument("--draft-vocab", type=int, default=0, help="keep the N ids responses use most (0 = all)")


@dataclass(frozen=True)
class _Subcommand:
    """One stage of the pipeline on the command line: its name, help line, the arguments it
    adds to the common ones and the function that runs it."""

    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]


SUBCOMMANDS = (
    _Subcommand(
        "make-prompts",
        "stage 0: training prompts made here, copying no benchmark or dev prompt",
        _add_make_prompts_args,
        cmd_make_prompts,
    ),
    _Subcommand(
        "gen-data", "stage 1: the target answers the training prompts", _add_gen_data_args, cmd_gen_data
    ),
    _Subcommand(
        "cache-target",
        "stage 1b: cache target taps for data shards without one",
        _add_cache_target_args,
        cmd_cache_target,
    ),
    _Subcommand("train", "stage 2: train a drafter from the cache", _add_train_args, cmd_train),
    _Subcommand(
        "calibrate",
        "stage 3: Sequential Temperature Scaling on held-out data",
        _add_calibrate_args,
        cmd_calibrate,
    ),
    _Subcommand(
        "export", "stage 4: DeepSpec-format directory without shared weights", _add_export_args, cmd_export
    ),
    _Subcommand(
        "evaluate", "acceptance length + calibration on the dev sets", _add_evaluate_args, cmd_evaluate
    ),
    _Subcommand(
        "train-online",
        "one accelerator: DSpark and its DFlash twin from token ids, the target run on the fly",
        _add_train_online_args,
        cmd_train_online,
    ),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dspark-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    for command in SUBCOMMANDS:
        sp = sub.add_parser(command.name, help=command.help)
        _add_common_args(sp)
        command.add_args(sp)
        sp.set_defaults(func=command.run)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
