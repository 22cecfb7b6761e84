"""Correctness checks of the engine on one device, as plain functions (no pytest needed), so the
GPU suite can run them where the tests never ran: greedy equality of speculative and plain
decoding, the distribution of rejection sampling, and paged-KV rollback.

Each returns a `CheckResult`; `passed` is False when the device gets it wrong.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from bench.models import ByteTokenizer, hf_greedy, runner_for, tiny_model
from bench.replay import ReplayDrafter
from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.block_manager import BlockManager
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.engine import Engine
from dspark_serve.scheduler.request import Request
from dspark_serve.verifier.model_runner import ModelRunner
from dspark_serve.verifier.rejection import rejection_sample

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class CheckResult:
    name: str
    passed: bool
    details: dict = field(default_factory=dict)


def drain(engine: Engine, requests: list[Request]) -> None:
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        engine.step()


def _greedy_outputs(
    model, prompts: dict[str, list[int]], n: int, drafter=None, policy: str = "none"
) -> tuple[dict[str, list[int]], Engine, list[Request]]:
    engine = Engine(
        runner_for(model),
        ByteTokenizer(),
        SchedulerConfig(verify_policy=policy, max_num_batched_tokens=40),  # chunked prefill
        max_model_len=512,
        drafter=drafter,
    )
    reqs = [Request(k, p, GREEDY, max_tokens=n, ignore_eos=True) for k, p in prompts.items()]
    drain(engine, reqs)
    return {r.request_id: r.output_ids for r in reqs}, engine, reqs


def check_greedy_equality(device: torch.device, n: int = 24) -> CheckResult:
    """On a tiny float32 Qwen3: plain engine == HF generate, and speculative decoding with a
    replay drafter (static and dspark policies) and a random DSpark drafter == plain."""
    from bench.models import TINY_A, random_dspark

    model = tiny_model("qwen3").to(device)
    prompts = {f"r{i}": list(range(30 + i, 30 + i + m)) for i, m in enumerate((4, 19, 33, 8))}
    plain, _, _ = _greedy_outputs(model, prompts, n)
    hf = {k: hf_greedy(model, p, n) for k, p in prompts.items()}
    refs = {tuple(p): plain[k] for k, p in prompts.items()}
    runs: dict[str, dict] = {}
    for policy in ("static:4", "dspark"):
        dr = ReplayDrafter(refs, vocab_size=257, block_size=4, accept_rate=0.7)
        out, engine, reqs = _greedy_outputs(model, prompts, n, dr, policy)
        runs[f"replay/{policy}"] = {
            "equal": out == plain,
            "accepted": sum(r.spec.accepted for r in reqs),
            "rounds": sum(r.spec.rounds for r in reqs),
            "kv_freed": engine.blocks.num_free_blocks == engine.blocks.num_blocks,
        }
    del engine
    dsp = random_dspark(model, dataclasses.replace(TINY_A, vocab_size=257), block_size=5)
    out, engine, reqs = _greedy_outputs(model, prompts, n, dsp, "static:5")
    runs["dspark-random/static:5"] = {
        "equal": out == plain,
        "drafted": sum(r.spec.drafted for r in reqs),
        "kv_freed": engine.blocks.num_free_blocks == engine.blocks.num_blocks,
    }
    passed = (
        plain == hf
        and all(r["equal"] and r["kv_freed"] for r in runs.values())
        and all(r["accepted"] > 0 for k, r in runs.items() if k.startswith("replay"))
        and runs["dspark-random/static:5"]["drafted"] > 0
    )
    details = {"plain_equals_hf_generate": plain == hf, "runs": runs, "tokens_per_request": n}
    if device.type != "cpu":  # the same model on the CPU gives the same tokens
        cpu_plain, _, _ = _greedy_outputs(tiny_model("qwen3"), prompts, n)
        details["device_equals_cpu"] = cpu_plain == plain
        passed = passed and cpu_plain == plain
    return CheckResult("greedy_equality", passed, details)


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def _joint_first_two(p1, P2, q1, Q2, n: int, broken: bool) -> torch.Tensor:
    """Empirical joint of the first two output tokens when two drafts from (q1, Q2[x1]) are
    verified against (p1, P2[x1]) in one round; rows that end after one token take their second
    token from P2 in a plain step. `broken` pretends q equals p, so every draft passes."""
    V = p1.numel()
    dev = p1.device
    x1 = torch.multinomial(q1.expand(n, V), 1).squeeze(1)
    x2 = torch.multinomial(Q2[x1], 1).squeeze(1)
    target = torch.stack([p1.expand(n, V), P2[x1], torch.full((n, V), 1.0 / V, device=dev)], 1)
    draft_probs = target[:, :2].clone() if broken else torch.stack([q1.expand(n, V), Q2[x1]], 1)
    # every row verifies both drafts, so the flat layout is the [n, 3] / [n, 2] blocks row-major
    res = rejection_sample(
        target.reshape(n * 3, V),
        torch.stack([x1, x2], 1).reshape(-1),
        draft_probs.reshape(n * 2, V),
        torch.full((n,), 2, dtype=torch.long),
    )
    out = res.output_tokens.view(n, 3)
    t1 = out[:, 0]
    t2 = out[:, 1].clone()
    short = res.num_output < 2
    t2[short] = torch.multinomial(P2[t1[short]], 1).squeeze(1)
    counts = torch.bincount(t1 * V + t2, minlength=V * V).double()
    return (counts / n).cpu()


def check_rejection_statistics(
    device: torch.device, n: int = 200_000, vocab: int = 6, seed: int = 0
) -> CheckResult:
    """The joint of the first two tokens of speculative sampling matches the target's
    (total variation under a bound several times the sampling noise), and a sampler that
    takes q for p is caught by the same bound."""
    torch.manual_seed(seed)

    def dirichlet(*shape):
        x = -torch.rand(*shape, device=device).log()
        return x / x.sum(-1, keepdim=True)

    p1, P2, q1, Q2 = dirichlet(vocab), dirichlet(vocab, vocab), dirichlet(vocab), dirichlet(vocab, vocab)
    exact = (p1.unsqueeze(1) * P2).flatten().double().cpu()
    tv = _tv(_joint_first_two(p1, P2, q1, Q2, n, broken=False), exact)
    tv_broken = _tv(_joint_first_two(p1, P2, q1, Q2, n, broken=True), exact)
    # Sampling noise of a 36-cell TV at n=200k is ~0.004.
    bound = 0.02
    return CheckResult(
        "rejection_statistics",
        tv < bound < tv_broken,
        {"tv": tv, "tv_broken_sampler": tv_broken, "bound": bound, "trials": n, "vocab": vocab},
    )


def check_paged_kv_rollback(device: torch.device, dtype: torch.dtype = torch.float32) -> CheckResult:
    """Write KV for 5 drafts, roll back to 2 of them, let another request reuse the freed
    blocks, then continue: the next logits equal those of one clean forward of the kept tokens."""
    model = tiny_model("qwen3").to(device=device, dtype=dtype)
    prompt, drafts, nxt = list(range(40, 50)), [7, 8, 9, 10, 11], 12
    kept = drafts[:2]

    a = ModelRunner(model, num_blocks=16, block_size=4)
    ka = BlockManager(a.kv.num_blocks, a.kv.block_size)
    ka.append("a", len(prompt))
    a.forward([ka.segment("a", prompt, 0, len(prompt))])
    ka.append("a", len(drafts))
    a.forward([ka.segment("a", drafts, len(prompt), len(drafts))])
    before = ka.num_free_blocks
    ka.truncate("a", len(prompt) + len(kept))
    freed = ka.num_free_blocks - before
    ka.append("b", 12)  # takes the freed blocks and overwrites them
    a.forward([ka.segment("b", list(range(100, 112)), 0, 12)])
    ka.append("a", 1)
    got = a.forward([ka.segment("a", [nxt], len(prompt) + len(kept), 0)]).logits[-1]

    seq = prompt + kept + [nxt]
    b = ModelRunner(model, num_blocks=16, block_size=4)
    kb = BlockManager(b.kv.num_blocks, b.kv.block_size)
    kb.append("a", len(seq))
    want = b.forward([kb.segment("a", seq, 0, len(seq) - 1)]).logits[-1]
    err = (got - want).abs().max().item()
    tol = 1e-3 if dtype == torch.float32 else 5e-2 * want.abs().max().item()
    same_argmax = int(got.argmax()) == int(want.argmax())
    return CheckResult(
        "paged_kv_rollback",
        err < tol and same_argmax and freed >= 1,
        {"max_abs_err": err, "tol": tol, "same_argmax": same_argmax, "blocks_freed_by_rollback": freed},
    )


@dataclass(frozen=True)
class ForwardMode:
    """How the target's fast forward runs on the device: its attention, CUDA graphs, and whether
    it is batch-invariant (`ModelConfig.batch_invariant`)."""

    attention: str
    cuda_graphs: bool
    batch_invariant: bool = False

    @property
    def name(self) -> str:
        return (
            self.attention
            + ("+graphs" if self.cuda_graphs else "")
            + ("+invariant" if self.batch_invariant else "")
        )


MODES = (
    ForwardMode("sdpa", False),
    ForwardMode("triton", False),
    ForwardMode("triton", True),
    ForwardMode("triton", True, batch_invariant=True),
)
"""Eager torch attention, then the Triton kernel, then the Triton kernel under CUDA graphs, then
that batch-invariant (its cost beside the others')."""


def mode_runner(
    model, mode: ForwardMode, num_blocks: int, block_size: int, max_model_len: int
) -> ModelRunner:
    return ModelRunner(
        model,
        num_blocks=num_blocks,
        block_size=block_size,
        attention=mode.attention,
        cuda_graphs=mode.cuda_graphs,
        max_model_len=max_model_len,
        batch_invariant=mode.batch_invariant,
    )


def check_batch_invariance(device: torch.device, n: int = 24) -> CheckResult:
    """With the batch-invariant forward (on CUDA: Triton attention and matmul under CUDA graphs;
    on a CPU: the C kernels, or Triton's interpreter without a compiler), a tiny Qwen3 in bf16
    (fp16 under the interpreter, whose bf16 dot is wrong) gives plain decoding's greedy text
    alone, in a batch, and under speculation (replay drafter, static:4), and seeded sampling
    the same text with and without it. The default forward's agreement on the same comparisons
    is reported beside it (not required)."""
    from dspark_serve.ops import triton_attention
    from dspark_serve.ops.cpu_kernels import load_kernels

    kernels = "triton" if device.type == "cuda" or load_kernels() is None else "c"
    if kernels == "triton" and not triton_attention.available():
        unavailable = "no Triton (or no CUDA and no interpreter)"
        return CheckResult("batch_invariance", False, {"unavailable": unavailable})
    dtype = torch.float16 if kernels == "triton" and triton_attention.interpreted() else torch.bfloat16
    model = tiny_model("qwen3").to(device=device, dtype=dtype)
    with torch.no_grad():  # flatter logits than tiny_model's: near-ties along the texts
        model.lm_head.weight.mul_(0.25)
    prompts = {f"r{i}": list(range(30 + i, 30 + i + m)) for i, m in enumerate((4, 19, 33, 8))}
    seeded = SamplingParams(temperature=0.8, seed=7)
    graphs = device.type == "cuda"

    def texts(invariant: bool, sampling, policy: str, together: bool, refs=None) -> dict[str, list[int]]:
        drafter = None if refs is None else ReplayDrafter(refs, vocab_size=257, block_size=4, accept_rate=0.7)
        mode = ForwardMode("triton" if kernels == "triton" else "auto", graphs, batch_invariant=invariant)
        out: dict[str, list[int]] = {}
        engine = mode_engine(model, mode, policy, drafter)
        groups = [list(prompts.items())] if together else [[kv] for kv in prompts.items()]
        for group in groups:
            reqs = [Request(k, p, sampling, max_tokens=n, ignore_eos=True) for k, p in group]
            drain(engine, reqs)
            out.update({r.request_id: r.output_ids for r in reqs})
        return out

    details: dict = {"kernels": kernels, "dtype": str(dtype).removeprefix("torch."), "cuda_graphs": graphs}
    passed = True
    for invariant in (True, False):
        alone = texts(invariant, GREEDY, "none", together=False)
        refs = {tuple(prompts[k]): v for k, v in alone.items()}
        sampled = texts(invariant, seeded, "none", together=False)
        same = {
            "plain_batched": texts(invariant, GREEDY, "none", True) == alone,
            "spec_alone": texts(invariant, GREEDY, "static:4", False, refs) == alone,
            "spec_batched": texts(invariant, GREEDY, "static:4", True, refs) == alone,
            "seeded_spec_batched": texts(invariant, seeded, "static:4", True, refs) == sampled,
        }
        details["invariant" if invariant else "default"] = same
        if invariant:
            passed = all(same.values())
    return CheckResult("batch_invariance", passed, details)


def mode_engine(model, mode: ForwardMode, policy: str, drafter=None) -> Engine:
    """An engine over `model` in `mode` with byte tokens, chunked prefill (40 tokens a step)."""
    return Engine(
        mode_runner(model, mode, 256, 4, 512),
        ByteTokenizer(),
        SchedulerConfig(verify_policy=policy, max_num_batched_tokens=40),
        max_model_len=512,
        drafter=drafter,
    )


def check_forward_modes(device: torch.device, n: int = 20, num_prompts: int = 5) -> CheckResult:
    """Each forward mode, alone and under speculative decoding (replay drafter, static:4), gives
    transformers' greedy tokens on a tiny float32 Qwen3 (the Triton kernel multiplies in IEEE
    float32 there), with chunked prefill, requests joining running decodes and every KV block
    back at the end; in bfloat16 its tokens are compared with eager SDPA's (agreement reported,
    not required: kernels may round differently). `details["passed_modes"]` lists the modes a
    later stage may use; a mode that cannot run here (no Triton, no CUDA) is reported so."""
    from dspark_serve.ops import triton_attention

    model = tiny_model("qwen3").to(device)
    lengths = (4, 19, 33, 8, 2)[:num_prompts]
    prompts = {f"r{i}": list(range(30 + i, 30 + i + m)) for i, m in enumerate(lengths)}
    hf = {k: hf_greedy(model, p, n) for k, p in prompts.items()}
    refs = {tuple(p): hf[k] for k, p in prompts.items()}
    bf16 = tiny_model("qwen3").to(device=device, dtype=torch.bfloat16)
    bf16_ref: dict[str, list[int]] | None = None
    modes: dict[str, dict] = {}
    for mode in MODES:
        if mode.attention == "triton" and not triton_attention.available():
            modes[mode.name] = {"passed": False, "unavailable": "no Triton (or no CUDA and no interpreter)"}
            continue
        entry: dict = {}
        try:
            for policy in ("none", "static:4"):
                drafter = (
                    ReplayDrafter(refs, vocab_size=257, block_size=4, accept_rate=0.7)
                    if policy != "none"
                    else None
                )
                engine = mode_engine(model, mode, policy, drafter)
                reqs = [Request(k, p, GREEDY, max_tokens=n, ignore_eos=True) for k, p in prompts.items()]
                drain(engine, reqs)
                entry[policy] = {
                    "equal_to_hf": all(r.output_ids == hf[r.request_id] for r in reqs),
                    "kv_freed": engine.blocks.num_free_blocks == engine.blocks.num_blocks,
                }
                replays = getattr(engine.runner.forward_impl, "replays", None)
                if replays is not None:
                    entry[policy]["graph_replays"] = replays
            if mode.attention == "triton" and triton_attention.interpreted():
                entry["bf16_tokens_agreeing_with_sdpa"] = "not compared: the interpreter's bf16 dot is wrong"
            else:
                engine = Engine(
                    mode_runner(bf16, mode, 256, 4, 512),
                    ByteTokenizer(),
                    SchedulerConfig(),
                    max_model_len=512,
                )
                reqs = [Request(k, p, GREEDY, max_tokens=n, ignore_eos=True) for k, p in prompts.items()]
                drain(engine, reqs)
                out = {r.request_id: r.output_ids for r in reqs}
                bf16_ref = bf16_ref or out
                same = sum(a == b for k in out for a, b in zip(out[k], bf16_ref[k]))
                entry["bf16_tokens_agreeing_with_sdpa"] = same / sum(len(v) for v in out.values())
            runs = [entry[p] for p in ("none", "static:4")]
            entry["passed"] = all(r["equal_to_hf"] and r["kv_freed"] for r in runs) and (
                not mode.cuda_graphs or all(r.get("graph_replays", 0) > 0 for r in runs)
            )
        except Exception as exc:  # this mode fails; the others are still checked
            entry.update(passed=False, error=f"{type(exc).__name__}: {exc}")
        modes[mode.name] = entry
    passed_modes = [m for m in MODES if modes[m.name].get("passed")]
    return CheckResult(
        "forward_modes",
        bool(passed_modes) and passed_modes[0] == MODES[0],
        {"modes": modes, "passed_modes": [m.name for m in passed_modes], "tokens_per_request": n},
    )


def check_drafter_backbone(device: torch.device) -> CheckResult:
    """The DSpark drafter's fast backbone on this device (on CUDA: fused products and the
    target's Triton kernels, reading the context pools in place) against its modules, on a
    tiny Qwen3's random drafter: block hidden states of requests with contexts of several
    lengths, in float32 (tight) and bf16 (loose)."""
    import copy

    from bench.models import TINY_A, random_dspark
    from dspark_serve.drafter.base import AcceptedContext, DraftRequest
    from dspark_serve.drafter.dspark_model.fast import FastDraftBackbone

    details: dict = {}
    passed = True
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 6e-2)):
        target = tiny_model("qwen3").to(device=device, dtype=dtype)
        fast = random_dspark(target, dataclasses.replace(TINY_A, vocab_size=257), block_size=5)
        ref = copy.copy(fast)  # the same model served through its modules
        ref.backbone = fast.model
        ref.contexts = type(fast.contexts)(fast.model, "dspark", 16)
        ref.cache = ref.contexts.cache
        g = torch.Generator().manual_seed(3)
        width = len(fast.tap_layers) * target.config.hidden_size
        outs = []
        for dr in (fast, ref):
            lengths = (3, 17, 40)
            hidden = torch.randn(len(lengths), 41, width, generator=g).to(device=device, dtype=dtype)
            ids = torch.randint(0, 250, (len(lengths), 41), generator=g)
            dr.observe(
                [
                    AcceptedContext(f"r{i}", ids[i, :n].tolist(), 0, hidden[i, :n])
                    for i, n in enumerate(lengths)
                ]
            )
            reqs = [
                DraftRequest(f"r{i}", ids[i, : n + 1].tolist(), 1, GREEDY, None, 100)
                for i, n in enumerate(lengths)
            ]
            outs.append(dr.block_hidden(reqs).float())
            g = torch.Generator().manual_seed(3)  # the same data for the second drafter
        err = (outs[0] - outs[1]).abs().max().item()
        ok = err < tol * max(1.0, outs[1].abs().max().item())
        details[str(dtype).removeprefix("torch.")] = {
            "fast_backbone": isinstance(fast.backbone, FastDraftBackbone),
            "triton": getattr(fast.backbone, "triton", False),
            "max_abs_err": err,
            "passed": ok,
        }
        passed = passed and ok
    return CheckResult("drafter_backbone", passed, details)


def run_all(device: torch.device) -> list[CheckResult]:
    return [
        check_greedy_equality(device),
        check_rejection_statistics(device),
        check_paged_kv_rollback(device),
        check_forward_modes(device),
        check_batch_invariance(device),
        check_drafter_backbone(device),
    ]
