"""Placement under cache pressure (issue 42), through the real kv_aware policy: new prompts go
where they evict least, near ties go to the worker with more empty blocks, a worker that rejoins
empty takes new conversations while follow-ups stay where their prefix is. Each worker's cache is
the engine's real block pool, served as a worker serves a turn, and its load is what the worker
then reports (`free_blocks`, `evictable_blocks`); the router's own placements count against a
report until the next one, as in a router whose reports lag a heartbeat."""

from __future__ import annotations

import json
import random

import pytest

from common.hashing import BlockHasher
from common.registry import WorkerRegistration
from engine.block_pool import BlockPool
from router.eviction_cost import evicted_blocks, note_placement
from router.policy import make_policy, plan_for
from router.settings import RouterSettings
from router.worker_info import WorkerInfo

BS = 16
NUM_BLOCKS = 32  # per worker: four first turns of 96 tokens (6 blocks each) fill most of it
HASH = BlockHasher("placement-test", BS)


class PoolWorker:
    """A colocated worker: its `WorkerInfo` as the router has it, and its engine block pool."""

    def __init__(self, wid: str, num_blocks: int = NUM_BLOCKS) -> None:
        self.info = WorkerInfo(wid, "colocated", f"http://{wid}", block_size=BS,
                               prefill_tokens_per_s=1000.0, capacity=num_blocks)
        self.pool = BlockPool(num_blocks)
        self.report()

    def report(self) -> None:
        """A heartbeat: the load the worker publishes (the engine's figures)."""
        self.info.report({"free_blocks": self.pool.num_free_blocks,
                          "evictable_blocks": self.pool.num_evictable_blocks,
                          "num_blocks": self.pool.num_blocks})

    def match(self, prompt: list[int]) -> int:
        """Its leading match, as the index (its published block set) gives it."""
        return len(self.pool.lookup(HASH(prompt)))

    def serve(self, prompt: list[int]) -> int:
        """One turn, as the engine runs it: the cached prefix is reused, the rest allocated
        (evicting least recently used cached blocks), full blocks cached, all freed after.
        Returns the tokens it found cached."""
        hashes = HASH(prompt)
        hits = self.pool.lookup(hashes)
        self.pool.touch(hits)
        new = self.pool.allocate(-(-len(prompt) // BS) - len(hits))
        blocks = hits + new
        for block_id, h in zip(blocks[len(hits):len(hashes)], hashes[len(hits):], strict=False):
            self.pool.cache_block(block_id, h)
        self.pool.free(blocks[::-1])
        return len(hits) * BS


def route(pol, workers: list[PoolWorker], prompt: list[int]) -> PoolWorker:
    matches = {w.info.worker_id: w.match(prompt) for w in workers}
    plan = plan_for(pol, len(prompt), matches, [w.info for w in workers], len(prompt) // BS, BS)
    return next(w for w in workers if w.info is plan.decode)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 49_000) for _ in range(n)]


def first_turns(rng: random.Random, n: int = 8) -> list[list[int]]:
    return [tokens(rng, 96) for _ in range(n)]


def run_turn(pol, workers, prompt, report: bool = True) -> PoolWorker:
    w = route(pol, workers, prompt)
    w.serve(prompt)
    if report:
        w.report()
    return w


def test_eight_first_turns_over_two_equal_workers_split_four_four():
    pol = make_policy("kv_aware", RouterSettings())
    workers = [PoolWorker("w-a"), PoolWorker("w-b")]
    homes = [run_turn(pol, workers, p).info.worker_id for p in first_turns(random.Random(1))]
    split = (homes.count("w-a"), homes.count("w-b"))
    print("split over two workers:", split)
    assert split == (4, 4), homes
    # Both caches now hold their four conversations: 24 of 32 blocks each.
    assert [w.pool.num_evictable_blocks for w in workers] == [24, 24]


def test_without_headroom_reports_every_tie_ends_on_the_worker_id():
    """What the issue saw: with nothing on the cache's fill to go by, every new conversation
    ties and the tie ends on the worker id (this is why workers report their headroom)."""
    pol = make_policy("kv_aware", RouterSettings())
    workers = [PoolWorker("w-a"), PoolWorker("w-b")]
    homes = []
    for p in first_turns(random.Random(1)):
        w = route(pol, workers, p)
        w.serve(p)
        homes.append(w.info.worker_id)  # no report: load stays {}, as a worker before the field
        for x in workers:
            x.info.load = {}
    assert homes == ["w-a"] * 8


def test_placements_count_against_a_lagging_report():
    """Reports lag by up to a heartbeat: sequential first turns faster than that still split,
    since the router counts the blocks it sent each worker against its last report."""
    s = RouterSettings()
    pol = make_policy("kv_aware", s)
    workers = [PoolWorker("w-a"), PoolWorker("w-b")]
    homes = []
    for p in first_turns(random.Random(2)):
        matches = {w.info.worker_id: w.match(p) for w in workers}
        plan = plan_for(pol, len(p), matches, [w.info for w in workers], len(p) // BS, BS)
        note_placement(plan, len(p), matches, s.placement_memory_s)  # what the gateway does
        w = next(w for w in workers if w.info is plan.decode)
        w.serve(p)  # ... and no report comes in between
        homes.append(w.info.worker_id)
    assert (homes.count("w-a"), homes.count("w-b")) == (4, 4), homes
    # The next report includes them; the memory of them runs out by itself.
    a = workers[0].info
    assert a.headroom() == (32 - 24, 24)
    assert a.headroom(now=1e12) == (32, 0)  # forgotten (the report still says all free)


def test_a_worker_that_rejoins_empty_takes_new_conversations_and_the_full_one_its_follow_ups():
    # Without peer pulls: with them, a follow-up may go to the empty worker, which pulls the
    # conversation from the full one (tests/router/test_peer_pull_plan.py); these workers pull not.
    rng = random.Random(3)
    pol = make_policy("kv_aware", RouterSettings(peer_pulls=False))
    a, b = PoolWorker("w-a"), PoolWorker("w-b")
    convs = first_turns(rng)
    for p in convs:
        run_turn(pol, [a, b], p)
    # w-b restarts empty; w-a alone takes new conversations until its cache is full.
    b = PoolWorker("w-b")
    live = [a]
    for _ in range(2):
        run_turn(pol, live, tokens(rng, 96))
    assert a.pool.num_evictable_blocks == NUM_BLOCKS  # full: no empty block left
    # w-b rejoins (a fresh registration of the same id, empty). A follow-up of a conversation
    # w-a still holds stays there; every new conversation goes to w-b, which evicts nothing.
    live = [a, b]
    homes_new, homes_follow = [], []
    for _ in range(4):
        homes_new.append(run_turn(pol, live, tokens(rng, 96)).info.worker_id)
        # A conversation w-a still holds whole (its follow-ups evict some of the others).
        conv = next((p for p in convs if a.match(p) == 6), None)
        if conv is not None:
            convs.remove(conv)
            follow_up = conv + tokens(rng, 32)
            w = route(pol, live, follow_up)
            homes_follow.append((w.info.worker_id, w.serve(follow_up)))
            w.report()
    print("after the restart: new conversations on", homes_new, "follow-ups on", homes_follow)
    assert homes_new == ["w-b"] * 4
    assert homes_follow == [("w-a", 96)] * len(homes_follow) and len(homes_follow) >= 2


def test_a_new_prompt_goes_where_it_evicts_least():
    """Both workers must evict for this prompt: the one whose placement evicts fewer blocks
    wins, even when it is a little busier (the eviction is priced at its recompute time)."""
    pol = make_policy("kv_aware", RouterSettings())
    full, roomy = PoolWorker("w-full"), PoolWorker("w-roomy")
    rng = random.Random(4)
    for _ in range(5):
        full.serve(tokens(rng, 96))  # 30 blocks cached of 32
    for _ in range(3):
        roomy.serve(tokens(rng, 96))  # 18 blocks cached
    full.report()
    roomy.report()
    roomy.info.load["waiting_tokens"] = 20  # 20 ms of queue at 1000 tok/s
    prompt = tokens(rng, 320)  # 20 blocks: w-full evicts 18, w-roomy 6
    assert evicted_blocks(full.info, 20) == 18 and evicted_blocks(roomy.info, 20) == 6
    assert route(pol, [full, roomy], prompt) is roomy
    # With eviction not priced, only the queue counts: the idle one wins.
    off = make_policy("kv_aware", RouterSettings(eviction_weight=0))
    assert route(off, [full, roomy], prompt) is full


def test_headroom_as_a_registration_carries_it_is_bounded():
    def load_of(load: dict) -> WorkerInfo:
        raw = {b"role": b"colocated", b"url": b"http://h:1", b"load": json.dumps(load).encode()}
        reg = WorkerRegistration.from_hash(raw, "h")
        return WorkerInfo("h", reg.role, reg.url, load=reg.load.model_dump())

    assert load_of({"free_blocks": 10, "evictable_blocks": 4}).headroom() == (6, 4)
    # More evictable than free is impossible: taken as all free blocks.
    assert load_of({"free_blocks": 10, "evictable_blocks": 99}).headroom() == (0, 10)
    # A worker before the field: its free blocks count as empty.
    assert load_of({"free_blocks": 10}).headroom() == (10, 0)
    assert WorkerInfo("x", "decode", "http://x").headroom() == (0, 0)  # reports nothing
    for bad in (-1, 1 << 41, "many", 1.5):
        with pytest.raises(ValueError):
            load_of({"free_blocks": 10, "evictable_blocks": bad})


def test_a_newer_report_settles_the_placements_sent_before_it():
    w = WorkerInfo("w", "colocated", "http://w")
    w.report({"free_blocks": 100, "evictable_blocks": 0}, now=0.0)
    w.note_placed(10, memory_s=60, now=1.0)
    w.report({"free_blocks": 100, "evictable_blocks": 0}, now=1.5)  # the same: not shown yet
    assert w.headroom(now=1.6) == (90, 10)
    w.note_placed(20, memory_s=60, now=1.7)  # sent after that read
    # A changed report was written after the read at 1.5: it shows the 10, maybe not the 20.
    w.report({"free_blocks": 100, "evictable_blocks": 10}, now=2.0)
    assert (w.placed_blocks, w.headroom(now=2.1)) == (20, (70, 30))
    w.report({"free_blocks": 100, "evictable_blocks": 30}, now=2.5)
    assert (w.placed_blocks, w.headroom(now=2.6)) == (0, (70, 30))


def test_placement_memory_is_bounded_and_expires():
    w = WorkerInfo("w", "colocated", "http://w", load={"free_blocks": 100, "num_blocks": 100})
    w.note_placed(30, memory_s=4.0, now=10.0)
    w.note_placed(50, memory_s=4.0, now=12.0)
    assert w.headroom(now=13.0) == (20, 80)
    assert w.headroom(now=14.5) == (50, 50)  # the first one is forgotten
    assert w.headroom(now=16.0) == (100, 0)
    w.note_placed(10, memory_s=0.0, now=20.0)  # off
    w.note_placed(0, memory_s=4.0, now=20.0)
    assert w.placed_blocks == 0 and not w.placements
    for i in range(5000):
        w.note_placed(1, memory_s=1e9, now=30.0 + i)
    assert len(w.placements) == w.placed_blocks == 4096


def test_a_bridge_reports_its_vllm_servers_cached_blocks_as_evictable():
    from vllm_bridge.server import ServerMetrics

    m = ServerMetrics(num_gpu_blocks=64, kv_cache_usage=0.25, running=1)
    assert m.load(30) == {"running": 1, "waiting": 0, "num_blocks": 64, "free_blocks": 48,
                          "evictable_blocks": 30}
    assert m.load(60)["evictable_blocks"] == 48  # no more than the free ones
    assert "evictable_blocks" not in m.load()  # the events' count unknown
    assert "evictable_blocks" not in ServerMetrics(num_gpu_blocks=64).load(30)  # nor its usage
