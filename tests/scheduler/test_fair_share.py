"""Fair slots (`SchedulerConfig.fair_slots`): while a request waits with every slot taken, an
owner holding more slots than the waiting one's plus one gives its newest back, and the waiting
owner with the fewest slots is admitted first; off, or under the priority policy, first come,
first served as before. The engine-level check (a short chat beside two n=16 hogs, through the
real engine, output unchanged) is `test_a_short_request_is_not_starved_by_two_wide_ones`."""

from __future__ import annotations

from dspark_serve.scheduler.block_manager import BlockManager
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.request import Request
from dspark_serve.scheduler.scheduler import Scheduler
from tests.scheduler.test_scheduler import GREEDY, run_batch


def owned(rid: str, owner: str, prompt: int = 4, max_tokens: int = 100, tenant: str = "") -> Request:
    return Request(rid, list(range(1, prompt + 1)), GREEDY, max_tokens, owner=owner, tenant=tenant)


def steps(s: Scheduler, n: int) -> None:
    for _ in range(n):
        run_batch(s, s.schedule())


def hogs_then_a_chat(fair: bool) -> tuple[Scheduler, Request]:
    """Two owners of four choices each fill eight slots; then a one-request owner arrives."""
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, fair_slots=fair), BlockManager(num_blocks=200, block_size=4)
    )
    for owner in ("hog1", "hog2"):
        for i in range(4):
            s.add(owned(f"{owner}-{i}", owner))
    steps(s, 3)
    assert len(s.running) == 8 and not s.waiting
    chat = owned("chat", "")
    s.add(chat)
    return s, chat


def test_a_waiting_owner_gets_a_slot_from_the_largest_holder():
    s, chat = hogs_then_a_chat(fair=True)
    first = s.schedule()  # the largest holder's newest gives its slot back
    assert [r.request_id for r in first.preempted] == ["hog2-3"]
    run_batch(s, first)
    second = s.schedule()  # the chat (its owner holds none) goes before the preempted choice
    assert [r.request_id for r, _ in second.admitted] == ["chat"]
    assert s.slots_held() == {"hog1": 4, "hog2": 3, "chat": 1}
    assert s.num_fair_preemptions == 1
    run_batch(s, second)
    steps(s, 5)  # balanced (no owner holds more than a waiting one's plus one): no more preemption
    assert s.num_fair_preemptions == 1 and [r.request_id for r in s.waiting] == ["hog2-3"]


def test_without_fair_slots_the_chat_waits_for_a_slot_to_free():
    s, chat = hogs_then_a_chat(fair=False)
    steps(s, 5)
    assert chat in s.waiting and s.num_preemptions == 0
    s2 = Scheduler(
        SchedulerConfig(max_num_seqs=8, scheduling_policy="priority"),
        BlockManager(num_blocks=200, block_size=4),
    )
    assert not s2.fair  # the priority policy orders by priority, not by owner


def test_an_owner_unset_counts_each_request_alone():
    """Requests without an owner are each their own: eight single requests are as fair as it
    gets (no one holds more than a waiting one's plus one), so a ninth waits its turn."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8), BlockManager(num_blocks=200, block_size=4))
    for i in range(9):
        s.add(owned(f"r{i}", ""))
    steps(s, 4)
    assert len(s.running) == 8 and [r.request_id for r in s.waiting] == ["r8"] and s.num_fair_preemptions == 0


def test_a_tenant_with_many_requests_gives_a_slot_to_another_tenant():
    """Slots are shared by tenant (an API key, or a client address) first: eight single requests
    of one key fill the slots, a request of another key arrives and gets one of them at once
    (without tenants the eight are each their own owner, as fair as it gets, and it would wait);
    later the first key's next request waits behind the second key's, though it came first."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8), BlockManager(num_blocks=200, block_size=4))
    for i in range(8):
        s.add(owned(f"a{i}", "", tenant="key:a"))
    steps(s, 3)
    s.add(owned("a8", "", tenant="key:a"))
    s.add(owned("b0", "", tenant="key:b"))
    first = s.schedule()
    assert [r.request_id for r in first.preempted] == ["a7"]  # key a's newest
    run_batch(s, first)
    second = s.schedule()
    assert [r.request_id for r, _ in second.admitted] == ["b0"]  # before a7 and a8, which came first
    assert s.tenant_slots() == {"key:a": 7, "key:b": 1}
    run_batch(s, second)
    steps(s, 4)  # 7 against 1 with key a waiting: key a is not below key b's plus one: no more
    assert s.num_fair_preemptions == 1

    same = Scheduler(SchedulerConfig(max_num_seqs=8), BlockManager(num_blocks=200, block_size=4))
    for i in range(9):
        same.add(owned(f"a{i}", "", tenant="key:a"))
    steps(same, 4)  # one tenant: its requests are each their own owner within it, as before
    assert [r.request_id for r in same.waiting] == ["a8"] and same.num_fair_preemptions == 0


def test_within_a_tenant_the_largest_owner_gives_a_slot_back():
    """Tenants balanced (four slots each), the waiting request's own tenant shares by owner: the
    key whose n=3 request holds three of its four slots gives one back to its own newcomer; the
    other key's slots are not touched."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8), BlockManager(num_blocks=200, block_size=4))
    for i in range(3):
        s.add(owned(f"wide-{i}", "wide", tenant="key:a"))
    s.add(owned("a-single", "", tenant="key:a"))
    for i in range(4):
        s.add(owned(f"b{i}", "", tenant="key:b"))
    steps(s, 3)
    assert s.tenant_slots() == {"key:a": 4, "key:b": 4}
    s.add(owned("a-late", "", tenant="key:a"))
    first = s.schedule()
    assert [r.request_id for r in first.preempted] == ["wide-2"]  # its largest owner's newest
    run_batch(s, first)
    assert [r.request_id for r, _ in s.schedule().admitted] == ["a-late"]
    assert s.tenant_slots() == {"key:a": 4, "key:b": 4}


def test_a_short_request_is_not_starved_by_two_wide_ones():
    """Through the engine on a tiny model: two owners of four long choices fill the eight slots,
    a one-token chat arrives; with fair slots it finishes within a few steps (without them only
    after a choice ends), and every text equals plain greedy decoding alone (a choice preempted
    for the chat resumes by recomputing: its output is unchanged)."""
    import torch

    from dspark_serve.scheduler.engine import Engine
    from tests.helpers import ByteTokenizer, hf_greedy, runner_for, tiny_model

    model = tiny_model("llama")
    g = torch.Generator().manual_seed(3)

    def run(fair: bool) -> tuple[int, list[Request]]:
        engine = Engine(
            runner_for(model, num_blocks=200),
            ByteTokenizer(),
            SchedulerConfig(max_num_seqs=8, fair_slots=fair),
            max_model_len=512,
        )
        prompt = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(4)).tolist()
        hogs = [
            Request(f"{o}-{i}", prompt, GREEDY, max_tokens=30, ignore_eos=True, owner=o)
            for o in ("hog1", "hog2")
            for i in range(4)
        ]
        for r in hogs:
            engine.add_request(r)
        for _ in range(3):
            engine.step()
        chat = Request("chat", torch.randint(0, 256, (5,), generator=g).tolist(), GREEDY, max_tokens=1)
        engine.add_request(chat)
        waited = 0
        while not chat.finished:
            engine.step()
            waited += 1
        while engine.has_work():
            engine.step()
        return waited, [*hogs, chat]

    waited, reqs = run(fair=True)
    waited_fcfs, _ = run(fair=False)
    assert waited <= 3 < waited_fcfs
    for r in reqs:
        assert r.output_ids == hf_greedy(model, r.prompt_ids, r.max_tokens)
    assert sum(r.num_preemptions for r in reqs) == 1
