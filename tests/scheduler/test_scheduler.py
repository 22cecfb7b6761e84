"""Admission and batching alone: worst-case KV reservation, max_num_seqs, the prefill budget."""
from scheduler.config import SchedulerConfig
from scheduler.request import Request, Status
from scheduler.scheduler import Scheduler
from verifier.block_manager import BlockManager
from verifier.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def req(rid: str, prompt: int, max_tokens: int) -> Request:
    return Request(rid, list(range(prompt)), GREEDY, max_tokens)


def test_admits_only_what_the_worst_case_kv_fits_and_releases_it():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(num_blocks=10, block_size=4))
    a, b, c = req("a", 10, 10), req("b", 10, 10), req("c", 4, 4)   # 5, 5 and 2 blocks
    for r in (a, b, c):
        s.add(r)
    s.schedule()
    assert s.running == [a, b] and list(s.waiting) == [c] and s.reserved_blocks == 10
    assert a.status is Status.PREFILL and c.status is Status.WAITING   # FIFO: c waits behind
    s.remove(a)
    assert s.reserved_blocks == 5
    s.schedule()
    assert s.running == [b, c] and not s.waiting and s.reserved_blocks == 7


def test_max_num_seqs_and_queue_capacity():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_waiting=3), BlockManager(100, 4))
    for i in range(3):
        s.add(req(f"r{i}", 2, 2))
    assert s.queue_full
    s.schedule()
    assert len(s.running) == 2 and len(s.waiting) == 1 and not s.queue_full


def test_prefill_chunks_share_the_budget_left_by_decodes_and_their_drafts():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=20), BlockManager(100, 4))
    d1, d2, p1, p2 = req("d1", 3, 8), req("d2", 3, 8), req("p1", 30, 4), req("p2", 30, 4)
    for r in (d1, d2, p1, p2):
        s.add(r)
    s.schedule()
    for r in (d1, d2):
        r.status, r.num_computed = Status.DECODE, 3
    batch = s.schedule(draft_reserve=2)
    assert batch.decodes == [d1, d2]
    # 20 - 2 decodes x (1 anchor + 2 reserved drafts) = 14 prefill tokens, first come first
    assert [(r.request_id, n) for r, n in batch.prefills] == [("p1", 14)] and batch.prefill_tokens == 14
    p1.num_computed = 26   # 4 left: the rest of the budget goes to the next prompt
    batch = s.schedule(draft_reserve=0)
    assert [(r.request_id, n) for r, n in batch.prefills] == [("p1", 4), ("p2", 14)]


def test_removing_a_waiting_request():
    s = Scheduler(SchedulerConfig(max_num_seqs=1), BlockManager(100, 4))
    a, b = req("a", 2, 2), req("b", 2, 2)
    s.add(a)
    s.add(b)
    s.schedule()
    s.remove(b)
    assert not s.waiting and s.running == [a] and s.has_work()
    s.remove(a)
    assert not s.has_work() and s.reserved_blocks == 0
