"""Tiny random targets and a byte-level tokenizer, built inside tests (nothing downloaded).

They live in `bench.models`, which the benchmarks (run outside the tests) share."""

from bench.models import ByteTokenizer, hf_greedy, runner_for, tiny_model  # noqa: F401
