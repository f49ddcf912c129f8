"""Where `Gateway.route` takes each worker's prefix match from (one layer: hand-built workers, an
index double, no processes): Tandem workers and bridged vLLM workers from the published index,
static vLLM workers from the approximate index, bridged vLLM workers also from this router's
recent decisions until their own report arrives."""

from __future__ import annotations

import asyncio

import pytest

from common.hashing import BlockHasher
from router.gateway import Gateway
from router.models import ServedModel
from router.settings import RouterSettings
from router.speculative import SpeculativeIndex
from router.tiered_match import MatchByMedium
from router.worker_info import WorkerInfo

MODEL = "tiny-random"


class PublishedIndex:
    """The published index as the gateway sees it: worker id -> block hashes held."""

    def __init__(self, held: dict[str, list[int]]) -> None:
        self.held = held
        self.asked: list[str] = []
        self.recorded: list[str] = []

    async def match(self, block_hashes, worker_ids):
        self.asked += worker_ids
        out = {}
        for w in worker_ids:
            n = 0
            for h in block_hashes:
                if h not in self.held.get(w, ()):
                    break
                n += 1
            out[w] = n
        return out

    async def match_by_medium(self, block_hashes, worker_ids):
        return {w: MatchByMedium(n) for w, n in (await self.match(block_hashes,
                                                                  worker_ids)).items()}

    def record(self, worker_id, block_hashes):
        self.recorded.append(worker_id)


@pytest.fixture
def gateway(tiny_folder):
    gw = Gateway.from_settings(RouterSettings(model=MODEL, tokenizer_path=tiny_folder,
                                              policy="kv_aware"))
    model = gw.catalog.models[MODEL]
    model.identity, model.hasher = ("d" * 16, 4), BlockHasher("d" * 16, 4)
    return gw, model


def colocated(wid: str, backend: str, static: bool) -> WorkerInfo:
    w = WorkerInfo(wid, "colocated", f"http://{wid}", backend=backend, static=static, block_size=4,
                   accepted=frozenset({MODEL}))
    return w


def route(gw: Gateway, model: ServedModel, prompt: list[int]):
    return asyncio.run(gw.route(model, prompt))


PROMPT = list(range(1, 33))  # 8 blocks of 4


def test_a_bridged_vllm_worker_is_matched_on_the_published_index(gateway):
    gw, model = gateway
    hashes = model.hasher(PROMPT)
    cold, warm = colocated("vllm-a", "vllm", False), colocated("vllm-b", "vllm", False)
    gw.directory.workers = {w.worker_id: w for w in (cold, warm)}
    gw.index = PublishedIndex({"vllm-b": hashes[:6]})
    plan = route(gw, model, PROMPT)
    assert plan.decode.worker_id == "vllm-b" and plan.cached_blocks == 6
    assert sorted(gw.index.asked) == ["vllm-a", "vllm-b"]
    # Its prefill's report is not in yet: this router's own decision stands in for it, on the
    # speculative index, never on the published one (which only its bridge writes).
    assert gw.index.recorded == []
    assert asyncio.run(gw.recent.match(hashes, ["vllm-b"])) == {"vllm-b": len(hashes)}
    # The approximate index is for static vLLM workers only.
    assert asyncio.run(model.approx_index.match(hashes, ["vllm-b"])) == {"vllm-b": 0}


def test_the_speculative_entry_routes_a_sibling_before_the_report_arrives(gateway):
    gw, model = gateway
    a, b = colocated("vllm-a", "vllm", False), colocated("vllm-b", "vllm", False)
    gw.directory.workers = {w.worker_id: w for w in (a, b)}
    gw.index = PublishedIndex({})  # nothing reported yet
    first = route(gw, model, PROMPT).decode.worker_id
    # The same conversation again: with nothing published, only the router's recent decision
    # can send it where its prefix is being computed.
    for _ in range(3):
        plan = route(gw, model, PROMPT + [7, 7, 7, 7])
        assert plan.decode.worker_id == first and plan.cached_blocks >= 8


def test_speculative_entries_expire():
    now = [0.0]
    recent = SpeculativeIndex(ttl_s=2.0, max_blocks_per_worker=3, clock=lambda: now[0])
    recent.record("w", [1, 2, 3, 4])
    # oldest (1) dropped: bounded
    assert asyncio.run(recent.match([2, 3, 4], ["w", "x"])) == {"w": 3, "x": 0}
    now[0] = 1.5
    recent.record("w", [2])  # refreshed: lives on after 3 and 4 expire
    now[0] = 2.5
    assert asyncio.run(recent.match([2], ["w"])) == {"w": 1}
    assert asyncio.run(recent.match([3], ["w"])) == {"w": 0}
    recent.forget({})
    assert asyncio.run(recent.match([2], ["w"])) == {"w": 0}
    off = SpeculativeIndex(ttl_s=0)
    off.record("w", [1])
    assert asyncio.run(off.match([1], ["w"])) == {"w": 0}


def test_static_vllm_workers_stay_on_the_approximate_index(gateway):
    gw, model = gateway
    static = colocated("static-colocated-0", "vllm", True)
    tandem = colocated("tandem-1", "tandem", False)
    gw.directory.workers = {w.worker_id: w for w in (static, tandem)}
    gw.index = PublishedIndex({"static-colocated-0": model.hasher(PROMPT)})  # never asked
    model.approx_index.record("static-colocated-0", model.hasher(PROMPT)[:5])
    plan = route(gw, model, PROMPT)
    assert gw.index.asked == ["tandem-1"]
    assert plan.decode.worker_id == "static-colocated-0" and plan.cached_blocks == 5



def test_workers_of_one_model_at_two_block_sizes_are_matched_in_their_own_blocks(gateway):
    gw, model = gateway
    tandem = colocated("tandem-1", "tandem", False)  # block size 4
    vllm = colocated("vllm-b", "vllm", False)
    vllm.block_size = 8
    gw.directory.workers = {w.worker_id: w for w in (tandem, vllm)}
    eights = model.hasher_for(8)(PROMPT)
    assert len(eights) == 4 and model.hasher_for(8).seed != model.hasher.seed
    gw.index = PublishedIndex({"vllm-b": eights[:3], "tandem-1": model.hasher(PROMPT)[:2]})
    plan = route(gw, model, PROMPT)
    # 3 blocks of 8 (24 tokens) beat 2 blocks of 4 (8 tokens); the plan counts its worker's blocks.
    assert plan.decode.worker_id == "vllm-b" and plan.cached_blocks == 3
    assert asyncio.run(gw.recent.match(eights, ["vllm-b"])) == {"vllm-b": 4}


def test_a_prefill_and_a_decode_worker_pair_only_within_one_backend_and_block_size(gateway):
    gw, model = gateway
    tandem_p = WorkerInfo("tandem-p", "prefill", "http://tp", block_size=4,
                          accepted=frozenset({MODEL}))
    tandem_d = WorkerInfo("tandem-d", "decode", "http://td", block_size=4,
                          accepted=frozenset({MODEL}))
    vllm_d = WorkerInfo("vllm-d", "decode", "http://vd", backend="vllm", block_size=8,
                        accepted=frozenset({MODEL}))
    gw.index = PublishedIndex({"vllm-d": model.hasher_for(8)(PROMPT)})
    for workers in ((tandem_p, vllm_d), (tandem_p, tandem_d, vllm_d)):
        gw.directory.workers = {w.worker_id: w for w in workers}
        for _ in range(4):
            plan = route(gw, model, PROMPT)
            legs = [plan.decode] + ([plan.prefill] if plan.prefill else [])
            assert len({(w.backend, w.block_size) for w in legs}) == 1, plan
