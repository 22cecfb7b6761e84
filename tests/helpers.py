"""Tiny random targets and a byte-level tokenizer, built inside tests (nothing downloaded).

They live in `bench.models`, which the benchmarks (run outside the tests) share."""

import torch

from bench.models import ByteTokenizer, hf_greedy, runner_for, tiny_model  # noqa: F401


class FakeDrafterBase:
    """The bookkeeping half of a test drafter: absorbs no context, records each verification
    outcome as (request id, proposed, accepted) in `feedback`, keeps no per-request state.
    Subclasses set name / tap_layers / block_size / calibrator / online_confidence and propose."""

    def __init__(self) -> None:
        self.feedback: list[tuple[str, int, int]] = []

    def observe(self, contexts):
        pass

    def observe_acceptance(self, rid, proposed, accepted):
        self.feedback.append((rid, proposed, accepted))

    def catch_up_seconds(self, rids):
        return 0.0

    def free(self, rid):
        pass


def dense_attention(q, keys, values, start, scale):
    """q [n, H, D] at positions start.., keys/values [start + n, Hkv, D]: causal, float64."""
    n, H, D = q.shape
    rep = H // keys.shape[1]
    k = keys.double().repeat_interleave(rep, dim=1)
    v = values.double().repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(start, start + n)[:, None]
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, -1)


def paged_segments_runner(kern, kc, vc, scale):
    """run(segs, q_rows) for a paged attention kernel over the caches kc / vc: segs are
    (start, n, block table row) per segment, q_rows [T, H, D] -> out [T, H, D] (NaN where no
    segment writes)."""

    def i32(xs):
        return torch.tensor(xs, dtype=torch.int32)

    def run(segs, q_rows):
        out = torch.full_like(q_rows, float("nan"))
        row0 = [sum(n for _, n, _ in segs[:i]) for i in range(len(segs))]
        width = max(len(t) for _, _, t in segs)
        table = i32([list(t) + [0] * (width - len(t)) for _, _, t in segs])
        lens, starts = i32([n for _, n, _ in segs]), i32([s for s, _, _ in segs])
        kern(q_rows, kc, vc, out, i32(row0), lens, starts, table, scale)
        return out

    return run
