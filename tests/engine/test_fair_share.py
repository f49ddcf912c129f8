"""Sharing the batch between clients (engine/fair_share.py through engine/scheduler.py): a
client that holds every sequence slot, or every block, gives one up to another client's request
at the next step; within one client the batch stays first come, first served."""

from __future__ import annotations

from engine import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from tests.engine.scheduling import BLOCK, make_scheduler, plan


def add(s: Scheduler, rid: str, client: str | None, num_tokens: int = 6) -> Sequence:
    seq = Sequence(rid, [(5 * i + len(rid)) % 200 for i in range(num_tokens)],
                   SamplingParams(max_tokens=1000), client=client)
    s.add(seq)
    return seq


def test_a_full_batch_gives_a_slot_to_another_clients_request():
    s = make_scheduler(max_num_seqs=4)
    hogs = [add(s, f"a{i}", "aaaa") for i in range(4)]
    assert set(plan(s)) == {"a0", "a1", "a2", "a3"}
    add(s, "b0", "bbbb")
    out = plan(s)
    # The newest of the client running the most gave way; the newcomer's prompt is computed.
    assert out.get("b0") == 6 and "a3" not in out
    assert hogs[3].status is SequenceStatus.WAITING and hogs[3].num_preemptions == 1
    assert [q.request_id for q in s.running] == ["a0", "a1", "a2", "b0"]


def test_without_a_client_tag_a_full_batch_stays_first_come_first_served():
    s = make_scheduler(max_num_seqs=4)
    for i in range(4):
        add(s, f"a{i}", None)
    plan(s)
    add(s, "b0", None)
    assert "b0" not in plan(s)  # as before: it waits for a slot
    assert s.num_preemptions == 0


def test_the_same_client_never_preempts_itself():
    s = make_scheduler(max_num_seqs=2)
    add(s, "a0", "aaaa")
    add(s, "a1", "aaaa")
    plan(s)
    add(s, "a2", "aaaa")
    assert "a2" not in plan(s) and s.num_preemptions == 0


def test_shares_settle_without_swapping_back_and_forth():
    """Two clients with more requests than slots end at an even split, and stay there."""
    s = make_scheduler(max_num_seqs=4)
    for i in range(4):
        add(s, f"a{i}", "aaaa")
    plan(s)
    for i in range(4):
        add(s, f"b{i}", "bbbb")
    for _ in range(4):
        plan(s)
    preemptions = s.num_preemptions
    counts = {c: sum(q.client == c for q in s.running) for c in ("aaaa", "bbbb")}
    assert counts == {"aaaa": 2, "bbbb": 2}
    for _ in range(10):
        plan(s)
    assert s.num_preemptions == preemptions  # 2 against 2: nobody gives way any more


def test_the_least_served_client_is_admitted_first():
    s = make_scheduler(max_num_seqs=8)
    add(s, "a0", "aaaa")
    plan(s)
    for i in range(1, 4):
        add(s, f"a{i}", "aaaa")
    add(s, "b0", "bbbb")
    s.max_num_seqs = 2  # one slot left: it goes to the client running nothing
    assert set(plan(s)) == {"a0", "b0"}


def test_short_blocks_are_taken_from_the_client_holding_most():
    # 8 blocks of 4 tokens: client a's two sequences hold them all.
    s = make_scheduler(num_blocks=8, max_num_seqs=8)
    a0, a1 = add(s, "a0", "aaaa", 4 * BLOCK), add(s, "a1", "aaaa", 4 * BLOCK - 1)
    plan(s)
    assert s.kv.pool.num_free_blocks == 0
    add(s, "b0", "bbbb", 2)
    # a0's next token needs a block: a1, the newest of the client holding most, gives its own.
    assert plan(s) == {"a0": 1}
    assert a1.status is SequenceStatus.WAITING and not a1.block_table
    # The next step admits b0 before a1, which waits in front of it: b0's client runs nothing.
    assert "b0" in plan(s) and a1.status is SequenceStatus.WAITING
    assert a0.status is SequenceStatus.RUNNING


def test_an_import_takes_blocks_from_the_client_holding_most():
    s = make_scheduler(num_blocks=8, max_num_seqs=8)
    add(s, "a0", "aaaa", 4 * BLOCK)
    a1 = add(s, "a1", "aaaa", 4 * BLOCK - 1)
    plan(s)
    imported = Sequence("b0", [1, 2, 3, 4, 5], SamplingParams(), client="bbbb")
    assert s.allocate_fairly(imported, 4)
    assert a1.status is SequenceStatus.WAITING and imported.block_table
    same = Sequence("a2", [1, 2, 3, 4, 5], SamplingParams(), client="aaaa")
    assert not s.allocate_fairly(same, 16)  # nobody holds two more than client a


def test_an_import_into_a_full_batch_waits_with_its_blocks():
    s = make_scheduler(max_num_seqs=1)
    add(s, "a0", None)
    plan(s)
    seq = Sequence("b0", [1, 2, 3, 4, 5], SamplingParams(), client=None)
    assert s.allocate(seq, 4)
    seq.num_computed_tokens = 4
    s.add_computed(seq)
    assert len(s.running) == 1 and seq.status is SequenceStatus.WAITING and seq.block_table
