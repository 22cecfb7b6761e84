"""The load-aware loop on a virtual clock: the engine's own speculation component (draft gate,
verification-length policy, online cost correction, step overhead) driven step by step with a
stand-in drafter whose drafts survive at a known rate, and step times from a cost curve the
caller gives (the machine's truth), while the policy is handed another (the profiled table).
What the real engine would measure, the simulation books: so a table that is wrong in shape
(the H200's profile priced a verify step of two tokens a request far above a decode step, where
graphs made it nearly free) can be replayed on a CPU, and whether the loop finds its way to the
machine's frontier is a question with an answer in milliseconds.

  python bench/load_sim.py --requests 8 --steps 2000 --table h200

prints tokens per simulated second for plain decoding, every static length and the default,
and the default's mean verified drafts a request over the run's last quarter.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dspark_serve.drafter.base import AcceptedContext, DraftProposal, DraftRequest  # noqa: E402
from dspark_serve.ops.sampling_params import SamplingParams  # noqa: E402
from dspark_serve.scheduler.config import SchedulerConfig  # noqa: E402
from dspark_serve.scheduler.load import LoadState  # noqa: E402
from dspark_serve.scheduler.policy import CostTable  # noqa: E402
from dspark_serve.scheduler.request import Request  # noqa: E402
from dspark_serve.scheduler.speculation import Speculation  # noqa: E402

Curve = Callable[[int, int], float]
"""Seconds of one target forward of `rows` rows from `requests` requests."""


@dataclass
class SimDrafter:
    """Drafts whose every position survives with `rate` (given the ones before it did), reported
    as confidence `rate` at every position (calibrated)."""

    rate: float = 0.8
    block_size: int = 7
    name: str = "sim"
    tap_layers: tuple[int, ...] = ()
    online_confidence: bool = False
    calibrator: None = None
    decides_per_request: bool = False

    def propose(self, requests: list[DraftRequest]) -> list[DraftProposal]:
        return [
            DraftProposal(
                tokens=torch.zeros(r.max_draft, dtype=torch.long),
                confidences=torch.full((r.max_draft,), self.rate),
            )
            for r in requests
        ]

    def observe(self, contexts: list[AcceptedContext]) -> None:
        pass

    def observe_acceptance(self, request_id: str, proposed: int, accepted: int) -> None:
        pass

    def catch_up_seconds(self, request_ids: list[str]) -> float | None:
        return 0.0

    def free(self, request_id: str) -> None:
        pass


@dataclass(frozen=True)
class Machine:
    """The simulated machine: its forward (`forward`), the drafter's time a drafting step
    (`draft_seconds`, per step) and what every step spends besides both (`step_seconds`)."""

    forward: Curve
    draft_seconds: float = 0.0
    step_seconds: float = 0.0


@dataclass
class SimResult:
    policy: str
    tokens_per_second: float
    budgets: list[float] = field(repr=False)  # mean verified drafts a request, per step

    def late_budget(self) -> float:
        """Mean verified drafts a request over the last quarter of the steps."""
        tail = self.budgets[len(self.budgets) * 3 // 4 :]
        return statistics.fmean(tail) if tail else 0.0


def simulate(
    policy: str,
    table: CostTable,
    machine: Machine,
    requests: int,
    steps: int,
    rate: float = 0.8,
    seed: int = 0,
    clock_from: int = 0,
) -> SimResult:
    """`steps` pure decode steps of `requests` requests under `policy`, priced with `table`,
    timed by `machine`. Tokens per second count the steps from `clock_from` on."""
    drafter = SimDrafter(rate=rate)
    cfg = SchedulerConfig(verify_policy=policy, max_num_seqs=max(requests, 1))
    spec = Speculation(drafter, cfg, max_model_len=1 << 30, cost_table=table)  # type: ignore[arg-type]
    live = [
        Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0), max_tokens=1 << 30, ignore_eos=True)
        for i in range(requests)
    ]
    rng = random.Random(seed)
    tokens, seconds, budgets = 0, 0.0, []
    for step in range(steps):
        load = LoadState(num_running=requests)
        drafts = spec.draft(live, load)
        proposal = spec.choose_lengths(live, drafts, room=1 << 30, load=load)
        made = 0
        for i, r in enumerate(live):
            n = proposal.lengths[i]
            kept = 0
            while kept < n and rng.random() < rate:
                kept += 1
            spec.settle(r, n, kept)
            r.output_ids.extend([0] * (kept + 1))
            made += kept + 1
        rows = requests + sum(proposal.lengths)
        forward = machine.forward(rows, requests)
        took = forward + machine.step_seconds + (machine.draft_seconds if proposal.drafting else 0.0)
        spec.record_step(proposal, requests, False, made, took, forward)
        budgets.append(sum(proposal.lengths) / requests)
        if step >= clock_from:
            tokens += made
            seconds += took
    return SimResult(policy, tokens / seconds if seconds > 0 else 0.0, budgets)


# The cost tables the H200 profiled at commit 36a0636 (bench/results/gpu/gpu_suite.json at that
# commit): decode-shaped batch sizes and one request's blocks, steps per second.
H200_TABLES = {
    "qwen3-0.6b-like": (
        (88.2, 48.8, 46.8, 46.8, 46.8, 44.9, 39.5, 39.5, 39.5, 35.0, 35.0, 3.9),
        (99.8, 60.4, 60.4, 60.4, 60.1, 58.9),
    ),
    "qwen3-4b-like": (
        (73.7, 47.2, 47.2, 47.2, 44.3, 36.7, 25.5, 24.8, 22.9, 21.3, 19.1, 2.9),
        (49.0, 31.0, 28.2, 28.2, 27.7, 27.7),
    ),
}


def h200_table(shape: str = "qwen3-0.6b-like") -> CostTable:
    """The table the H200 profiled for `shape` (`H200_TABLES`): a decode step of one token a
    request fast, any block of two or more tokens much dearer, and then flat."""
    decode, block = H200_TABLES[shape]
    return CostTable(
        batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
        steps_per_second=decode,
        block_sizes=(1, 2, 4, 8, 16, 32),
        block_steps_per_second=block,
    )


def graphed_forward(base: float = 0.011, per_row: float = 2e-6, knee: int = 2048) -> Curve:
    """A forward that costs `base` seconds until `knee` rows, a little more per row (the
    memory-bound GPU step that CUDA graphs give), then grows with the rows past the knee."""

    def forward(rows: int, requests: int) -> float:
        return base + per_row * rows + max(0, rows - knee) * base / knee

    return forward


def table_forward(table: CostTable) -> Curve:
    """The machine is what the table says (the table is right)."""
    return lambda rows, requests: 1.0 / table.profiled_sps(rows, requests)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=0.8)
    ap.add_argument("--table", choices=["h200", "right"], default="h200")
    ap.add_argument("--shape", choices=sorted(H200_TABLES), default="qwen3-0.6b-like")
    ap.add_argument("--draft-ms", type=float, default=1.0)
    args = ap.parse_args()
    table = h200_table(args.shape)
    forward = graphed_forward() if args.table == "h200" else table_forward(table)
    machine = Machine(forward, draft_seconds=args.draft_ms / 1e3)
    warm = args.steps // 4
    for policy in ["none", *(f"static:{k}" for k in range(1, 8)), "dspark"]:
        res = simulate(policy, table, machine, args.requests, args.steps, args.rate, clock_from=warm)
        print(f"{policy:9s} {res.tokens_per_second:8.1f} tok/s  late budget {res.late_budget():4.2f}")


if __name__ == "__main__":
    main()
