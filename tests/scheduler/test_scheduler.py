"""Admission and batching alone: KV taken as tokens arrive (no worst-case reservation),
preemption of the newest request, prefix-cache hits, max_num_seqs, the prefill budget."""

from dspark_serve.ops.sampling_params import SamplingParams
from dspark_serve.scheduler.block_manager import BlockManager
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.request import Request, Status
from dspark_serve.scheduler.scheduler import Scheduler

GREEDY = SamplingParams(temperature=0.0)


def req(rid: str, prompt: int, max_tokens: int) -> Request:
    return Request(rid, list(range(prompt)), GREEDY, max_tokens)


def run_batch(s: Scheduler, batch) -> None:
    """What the engine does with a batch's KV: append decodes' anchors and prefill chunks."""
    for r in batch.decodes:
        s.blocks.append(r.request_id, 1)
        r.num_computed += 1
        r.output_ids.append(7)
    for r, n in batch.prefills:
        s.blocks.append(r.request_id, n)
        r.num_computed += n
        if r.num_computed == r.num_prefill_tokens:
            r.status = Status.DECODE
            if len(r.output_ids) == 0:
                r.output_ids.append(7)


def test_admits_what_the_prompt_fits_not_the_worst_case():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(num_blocks=10, block_size=4))
    a, b, c, d = req("a", 10, 100), req("b", 10, 100), req("c", 8, 100), req("d", 4, 4)
    for r in (a, b, c, d):
        s.add(r)
    batch = s.schedule()
    # their prompts (3 + 3 + 2 + 1 blocks) fit the 10 blocks, their worst cases (28 + 28 + 27
    # + 2 blocks) would not: nothing is reserved for output that may never come
    assert s.running == [a, b, c, d] and not s.waiting
    assert [n for _, n in batch.prefills] == [10, 10, 8, 4]
    run_batch(s, batch)
    assert s.reserved_blocks == 9
    s.remove(d)
    s.blocks.free("d")
    assert s.reserved_blocks == 8


def test_running_out_of_kv_preempts_the_newest_request_which_resumes_by_recomputing():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(num_blocks=6, block_size=4))
    a, b = req("a", 8, 20), req("b", 8, 20)
    s.add(a)
    s.add(b)
    run_batch(s, s.schedule())  # 2 + 2 blocks; both now decode
    for _ in range(4):  # positions 8..11 go into a third block each: 6 used
        run_batch(s, s.schedule())
    assert s.blocks.num_free_blocks == 0 and len(a.output_ids) == 5
    batch = s.schedule()  # a needs a block: b, the newest, gives its 3 back
    assert batch.preempted == [b] and batch.decodes == [a] and not batch.prefills
    assert b.status is Status.WAITING and b.num_computed == 0 and b.num_preemptions == 1
    assert list(s.waiting) == [b] and not s.blocks.has("b") and s.num_preemptions == 1
    run_batch(s, batch)
    s.remove(a)
    s.blocks.free("a")
    batch = s.schedule()  # b resumes: prompt + output but its last token
    assert batch.prefills == [(b, 8 + 5 - 1)] and b.prefill_ids == b.token_ids[:-1]


def test_admission_shares_a_cached_prefix_and_skips_its_prefill():
    bm = BlockManager(num_blocks=16, block_size=4, enable_caching=True)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm)
    a = req("a", 14, 4)
    s.add(a)
    batch = s.schedule()
    run_batch(s, batch)
    bm.commit("a", a.prompt_ids, a.num_computed)
    b = Request("b", list(range(12)) + [99, 98, 97], GREEDY, 4)
    s.add(b)
    batch = s.schedule()
    assert batch.admitted == [(b, 12)] and b.num_computed == 12
    assert (b, 3) in batch.prefills
    assert bm.table("b").blocks[:3] == bm.table("a").blocks[:3]


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
    p1.num_computed = 26  # 4 left: the rest of the budget goes to the next prompt
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
    assert not s.has_work()
