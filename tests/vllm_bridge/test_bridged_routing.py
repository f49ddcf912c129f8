"""The CI twin of tests/vllm_bridge/test_vllm_routing.py: the chain of processes a user runs, with
only vLLM faked. Two fake vLLM servers (tests/vllm_bridge/fake_engine.py: vLLM's routes, its SSE
answers, its KV events and its prefix cache), each with a real `tandem vllm-bridge` process, a
Redis namespace of the test's own, and real router processes that find the servers there (no
static list) and route on the blocks the bridges publish.

What is checked: before every checked turn each published set equals what its fake holds and
every router's replica has caught up; the turn then goes to the fake holding the longest prefix,
and the fake's own `cached_tokens` is exactly the hit the index predicted. That holds as
conversations grow, after a fake evicts (its set shrinks and a conversation follows its prefix
to the other fake), after a fake restarts (its set empties under a new epoch; its conversations
re-home and still answer) and after a fake dies (it leaves the router's workers once its bridge
sees it unhealthy, long before its registration's TTL could expire). The second test shows what
the speculative overlay is for: a sibling request routed before the first one's event has
arrived lands on the first one's fake only with the overlay on.

Nothing is timed: waits poll a condition under a guard (tests/polling.py), and where a request
must be in flight or an event not yet arrived, the fakes hold them (`FakeVLLM.hold`).
"""

from __future__ import annotations

import random
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial

import pytest

from common.hashing import BlockHasher
from common.model_identity import model_digest
from testing.cluster import TOKEN, Router
from testing.vllm_fleet import FleetIndex, VLLMBridge
from tests.polling import wait_for
from tests.vllm_bridge.fake_engine import FakeVLLM

pytestmark = pytest.mark.redis

BLOCK_SIZE = 4
CAPACITY = 36  # blocks per fake: one long turn below overflows it
ANSWER_LEN = 4
WAIT_S = 20.0  # a guard against hanging, never a condition
TTL_S = 30  # the bridges' registrations: a dead fake must leave long before it expires
BRIDGE_FLAGS = ["--health-interval-s", "0.2", "--unhealthy-after", "2",
                "--heartbeat-ttl-s", str(TTL_S)]
# The router's own health probes stay out of the way: a dead fake leaves through its bridge.
ROUTER_FLAGS = ["--expose-worker-ids", "--probe-interval-s", "600"]


@dataclass
class Node:
    fake: FakeVLLM
    bridge: VLLMBridge

    @property
    def worker_id(self) -> str:
        return self.bridge.worker_id


@dataclass
class Fleet:
    nodes: list[Node]  # the live ones, by worker id
    routers: list[Router]
    index: FleetIndex
    hasher: BlockHasher  # the router's, for these workers
    model: str

    def node(self, worker_id: str) -> Node:
        return next(n for n in self.nodes if n.worker_id == worker_id)

    def held(self, node: Node) -> set[int]:
        """What the fake holds, in the router's block hashes."""
        return {self.hasher(list(prefix))[-1] for prefix in node.fake.held_prefixes()}

    def sync(self) -> None:
        """Until each published set equals what its fake holds and every router's replica
        holds them all."""
        for n in self.nodes:
            wait_for(lambda n=n: self.index.blocks(n.worker_id) == self.held(n), WAIT_S,
                     f"{n.worker_id}'s published set to equal its cache", interval=0.02)
        total = sum(len(self.index.blocks(n.worker_id)) for n in self.nodes)
        for r in self.routers:
            wait_for(lambda r=r: r.client.get("/ready").json()["index"]["entries"] == total,
                     WAIT_S, "the router's replica to catch up", interval=0.02)

    def workers(self, router: Router) -> set[str]:
        return set(router.client.get("/ready").json()["workers"])

    def complete(self, router: Router, prompt: list[int]) -> dict:
        r = router.client.post("/v1/completions", timeout=WAIT_S, json={
            "model": self.model, "prompt": prompt, "max_tokens": ANSWER_LEN, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["tandem"]


@dataclass
class Conversation:
    prompt: list[int]
    questions: list[list[int]]
    homes: list[str] = field(default_factory=list)  # the fake of each turn
    cached: list[int] = field(default_factory=list)  # what it hit, by its own count

    def next_prompt(self) -> list[int]:
        return self.prompt + self.questions[0]

    def ask(self, fleet: Fleet, router: Router, check: bool = True) -> dict:
        """The next turn: the last prompt, its answer and the next question. `check`: the index
        is in sync first, and the turn must go where the longest prefix is, with exactly that
        many tokens cached by the fake."""
        prompt = self.prompt + self.questions.pop(0)
        if check:
            fleet.sync()
            hashes = fleet.hasher(prompt)
            matches = {n.worker_id: fleet.index.leading_match(n.worker_id, hashes)
                       for n in fleet.nodes}
        trace = fleet.complete(router, prompt)
        worker = trace["decode_worker"]
        served = next(s for s in reversed(fleet.node(worker).fake.served)
                      if s.prompt == tuple(prompt))
        assert trace["num_cached_tokens"] == served.num_cached_tokens  # the fake's, relayed
        if check:
            best = max(matches.values())
            if list(matches.values()).count(best) == 1:
                assert worker == max(matches, key=matches.get), (matches, trace)
            # The last prompt token is always computed: at most (len - 1) // size blocks hit.
            hit = min(matches[worker], (len(prompt) - 1) // BLOCK_SIZE)
            assert served.num_cached_tokens == hit * BLOCK_SIZE, (matches, trace)
        self.homes.append(worker)
        self.cached.append(served.num_cached_tokens)
        self.prompt = prompt + list(served.output)
        return trace


@contextmanager
def held(fleet: Fleet):
    """Every fake holds its streams (after the first token) and its events; `send(fn)` runs a
    request in a thread and returns once it has reached a fake. On exit the events go out, the
    requests finish, and the first one that failed raises."""
    pool = ThreadPoolExecutor(4)
    futures: list[Future] = []

    def num_served() -> int:
        return sum(len(n.fake.served) for n in fleet.nodes)

    def send(fn) -> None:
        before = num_served()
        futures.append(pool.submit(fn))
        wait_for(lambda: num_served() > before or futures[-1].done(), WAIT_S,
                 "the request at a fake")

    for n in fleet.nodes:
        n.fake.hold()
    try:
        yield send
    finally:
        for n in fleet.nodes:
            n.fake.release()
        pool.shutdown(wait=True)
    for future in futures:
        future.result()


@contextmanager
def bridged_fakes(folder, tmp_path, ttls: tuple[float | None, ...]):
    """Two fakes with a bridge each, registered in a namespace of the test's own, and one router
    per entry of `ttls` (its --speculative-ttl-s; None: the default)."""
    namespace = f"bridged-routing-{uuid.uuid4().hex[:8]}"
    with ExitStack() as stack:
        index = FleetIndex(namespace)
        stack.callback(index.delete)
        nodes = []
        for i in range(2):
            fake = FakeVLLM(folder, block_size=BLOCK_SIZE, capacity=CAPACITY,
                            output_len=ANSWER_LEN, topic=f"kv@fake{i}@{folder.name}")
            stack.callback(fake.close)
            bridge = VLLMBridge(fake, "colocated", namespace, tmp_path, token=TOKEN,
                                extra=BRIDGE_FLAGS)
            stack.callback(bridge.close)
            nodes.append(Node(fake, bridge))
        index.wait_registered([n.worker_id for n in nodes], timeout=WAIT_S)
        routers = []
        for ttl in ttls:
            speculative = [] if ttl is None else ["--speculative-ttl-s", str(ttl)]
            router = Router(folder, namespace, cache_dir=tmp_path, block_size=BLOCK_SIZE,
                            extra=ROUTER_FLAGS + speculative)
            stack.callback(router.close)
            routers.append(router)
        for router in routers:
            router.wait_workers(2, timeout=WAIT_S)
        # The bridges named the model as Tandem workers do (its folder's digest), so the router
        # hashes these workers' prompts as a Tandem worker's, at their block size.
        hasher = BlockHasher(model_digest(folder), BLOCK_SIZE)
        for n in nodes:
            reg = index.registration(n.worker_id)
            assert (reg["backend"], reg["url"], reg["role"]) == ("vllm", n.fake.url, "colocated")
            assert (reg["model_digest"], reg["block_size"], reg["hash_seed"]) == (
                model_digest(folder), str(BLOCK_SIZE), str(hasher.seed))
        yield Fleet(sorted(nodes, key=lambda n: n.worker_id), routers, index, hasher, folder.name)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 250) for _ in range(n)]


def test_follow_ups_go_to_the_holder_through_evictions_a_restart_and_a_death(tiny_folder, tmp_path):
    rng = random.Random(29)
    with bridged_fakes(tiny_folder, tmp_path, ttls=(0,)) as fleet:
        router = fleet.routers[0]  # no speculative overlay: it routes on the published sets alone
        assert fleet.workers(router) == {n.worker_id for n in fleet.nodes}
        system = tokens(rng, 6 * BLOCK_SIZE)
        p, q = (Conversation(list(system), [tokens(rng, 6) for _ in range(6)]) for _ in "pq")
        r, u = (Conversation(tokens(rng, 16), [tokens(rng, 6) for _ in range(6)]) for _ in "ru")

        # First turns, each routed while those before it are in flight and their events unsent:
        # no prefix known anywhere, the router's in-flight counts spread them.
        with held(fleet) as send:
            for c in (p, q, r, u):
                send(partial(c.ask, fleet, router, check=False))
        assert p.homes == r.homes != q.homes == u.homes
        assert [c.cached for c in (p, q, r, u)] == [[0]] * 4
        a, b = fleet.node(p.homes[0]), fleet.node(q.homes[0])  # p and q share `system`

        # Follow-ups: each to the fake holding its prefix, every hit confirmed by the fake.
        for c in (p, q, r, u):
            c.ask(fleet, router)
            assert c.homes[-1] == c.homes[0] and c.cached[-1] >= 5 * BLOCK_SIZE

        # r's long turn overflows a (p's 10 blocks and r's 8, plus r's 25 new, in 36), which
        # evicts its least recently used blocks: 7 of p's, tail first.
        fleet.sync()
        nxt = fleet.hasher(p.next_prompt())
        on_b = fleet.index.leading_match(b.worker_id, nxt)
        assert fleet.index.leading_match(a.worker_id, nxt) > on_b == len(system) // BLOCK_SIZE
        r.questions[0] = tokens(rng, 96)
        r.ask(fleet, router)
        assert r.homes[-1] == a.worker_id and a.fake.cache.num_evicted == 7
        fleet.sync()  # a's published set shrank with its cache
        assert len(fleet.index.blocks(a.worker_id)) == CAPACITY
        assert (fleet.index.leading_match(a.worker_id, nxt)
                < fleet.index.leading_match(b.worker_id, nxt))
        p.ask(fleet, router)  # so p follows its prefix (`system`, from q) to b
        assert p.homes[-1] == b.worker_id and p.cached[-1] == len(system)

        # b restarts (seqs from 0, an empty cache, a new process start time): its set empties
        # under a new epoch, and the conversations it held re-home and still answer.
        epoch = fleet.index.epoch(b.worker_id)
        b.fake.restart()
        wait_for(lambda: fleet.index.registration(b.worker_id).get("started_at")
                 == str(b.fake.server.start_time), WAIT_S, "the restarted fake's registration")
        assert fleet.index.epoch(b.worker_id) != epoch
        assert fleet.index.blocks(b.worker_id) == set()
        router.wait_workers(2, timeout=WAIT_S)
        for c in (p, q, u):
            c.ask(fleet, router)  # wherever the index says: it knows b holds nothing
        for c in (p, q, u):
            c.ask(fleet, router)  # back where the last turn went, with hits
            assert c.homes[-1] == c.homes[-2] and c.cached[-1] > 0

        # a dies (/health answers 503): its bridge deregisters it after two failed probes and
        # the router drops it at its next refresh, long before the TTL would have expired it.
        a.fake.die()
        wait_for(lambda: not fleet.index.registration(a.worker_id), TTL_S / 2,
                 "the bridge to deregister the dead fake")
        wait_for(lambda: fleet.workers(router) == {b.worker_id}, TTL_S / 2,
                 "the router to drop the dead fake")
        fleet.nodes.remove(a)
        for c in (p, q, u):
            c.ask(fleet, router)
            assert c.homes[-1] == b.worker_id


def test_a_sibling_before_the_event_lands_on_the_holder_only_with_the_overlay(
        tiny_folder, tmp_path):
    """Two routers over the same fakes, --speculative-ttl-s 0 and the default. Through each, a
    request with a new prefix is held in flight on its fake with its event unsent, and a sibling
    with the same prefix is routed meanwhile: the published index knows nothing of the prefix
    yet, so only the router's record of its own decision (the overlay) sends the sibling to the
    holder, where the fake confirms the hit. Once the events are in, both routers find it."""
    rng = random.Random(45)
    with bridged_fakes(tiny_folder, tmp_path, ttls=(0, None)) as fleet:
        for router, overlay in zip(fleet.routers, (False, True), strict=True):
            system = tokens(rng, 6 * BLOCK_SIZE)
            first, sibling, later = (Conversation(list(system), [tokens(rng, 6)]) for _ in range(3))
            fleet.sync()
            with held(fleet) as send:
                send(partial(first.ask, fleet, router, check=False))
                send(partial(sibling.ask, fleet, router, check=False))
                hashes = fleet.hasher(system)
                assert all(fleet.index.leading_match(n.worker_id, hashes) == 0 for n in fleet.nodes)
            if overlay:
                assert sibling.homes == first.homes and sibling.cached == [len(system)]
            else:  # no prefix known: the tie goes to the fake without a request in flight
                assert sibling.homes != first.homes and sibling.cached == [0]
            later.ask(fleet, router)  # checked: on a holder, hitting the whole prefix
            assert later.cached == [len(system)]
