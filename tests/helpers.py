"""Tiny random targets and a byte-level tokenizer, built inside tests (nothing downloaded).

They live in `bench.models`, which the benchmarks (run outside the tests) share."""

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
