"""Exact KV-aware routing over real vLLM CPU servers: each server runs with KV events
on and a `tandem vllm-bridge` beside it, registered in a real Redis namespace; Tandem's router
finds them there (no static list) and routes on the blocks the bridges publish.

What is checked, against vLLM's own word: before every follow-up turn the published block set of
each server equals what the server itself reported holding (its KV events, mirrored by the test:
tests/vllm_bridge/vllm_mirror.py); the turn then goes to the server holding the longest prefix,
and vLLM's `prompt_tokens_details.cached_tokens` for it is exactly the match the index predicted.
That holds on a small KV cache that evicts, and after one server restarts (its set empties under
a new epoch; its conversations re-home and still answer). The P/D test: a prefill + decode pair
with the NixlConnector, where the decode server's pulled blocks appear in its set.

Marked `vllm` (`make test-vllm`): it needs the vLLM venv (`bash bench/setup_vllm_cpu.sh`), and two
servers on two cores take minutes to start. The router runs with `--speculative-ttl-s 0`, so its
matches are the published index alone and the predictions here are exact.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import pytest

from common.hashing import BlockHasher
from common.model_identity import model_digest
from common.openai_request import prompt_token_ids
from common.tokenizer import Tokenizer
from loadgen.workload import multi_turn
from router.openai_models import ChatCompletionRequest
from testing.cluster import TOKEN, Router
from testing.metrics import series_sum
from testing.vllm_fleet import FleetIndex, VLLMBridge
from testing.vllm_server import MODEL, VLLMOptions, VLLMServer, vllm_python
from tests.polling import wait_for
from tests.vllm_bridge.vllm_mirror import VLLMEventMirror

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32  # chat turns span several blocks (the CPU default, 128, would be one or two)
NUM_BLOCKS = 48  # per server: the filler prompts below overflow it


@dataclass
class Node:
    server: VLLMServer
    bridge: VLLMBridge
    mirror: VLLMEventMirror

    @property
    def worker_id(self) -> str:
        return self.bridge.worker_id


@dataclass
class Fleet:
    nodes: list[Node]
    router: Router
    index: FleetIndex
    hasher: BlockHasher
    tokenizer: Tokenizer

    def node(self, worker_id: str) -> Node:
        return next(n for n in self.nodes if n.worker_id == worker_id)

    def assert_synced(self, timeout: float = 30) -> None:
        """Each published set equals what its server reported holding (waiting for the bridge to
        catch up), and the test's mirror missed no batch."""
        for n in self.nodes:
            wait_for(lambda n=n: self.index.blocks(n.worker_id)
                                 == n.mirror.own_hashes(self.hasher.seed),
                     timeout, f"{n.worker_id}'s published set != what vLLM reported holding")
            assert n.mirror.gaps == 0

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages})
        return prompt_token_ids(self.tokenizer, body)

    def chat(self, messages: list[dict], max_tokens: int = 16) -> dict:
        r = self.router.client.post("/v1/chat/completions", timeout=300, json={
            "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()


@dataclass
class Conversation:
    messages: list[dict]
    questions: list[str]
    homes: list[str] = field(default_factory=list)  # the worker of each turn

    def ask(self, fleet: Fleet, check: bool = True) -> dict:
        """The next question. `check`: the index is in sync first, and the turn must go where
        the longest prefix is, with exactly that many tokens cached by vLLM."""
        self.messages.append({"role": "user", "content": self.questions.pop(0)})
        prompt = fleet.prompt_ids(self.messages)
        hashes = fleet.hasher(prompt)
        if check:
            fleet.assert_synced()
            matches = {n.worker_id: fleet.index.leading_match(n.worker_id, hashes)
                       for n in fleet.nodes}
        out = fleet.chat(self.messages)
        trace = out["tandem"]
        worker = trace["decode_worker"]
        if check:
            best = max(matches.values())
            if list(matches.values()).count(best) == 1:
                assert worker == max(matches, key=matches.get), (matches, trace)
            # vLLM always computes the last prompt token: at most (len - 1) // size blocks hit.
            hit = min(matches[worker], (len(prompt) - 1) // BLOCK_SIZE)
            assert trace["num_cached_tokens"] == hit * BLOCK_SIZE, (matches, trace)
        self.homes.append(worker)
        self.messages.append({"role": "assistant",
                              "content": out["choices"][0]["message"]["content"]})
        return trace


@contextmanager
def bridged_fleet(folder, tmp_path, roles: tuple[str, str], nixl: bool = False):
    if not vllm_python().exists():
        pytest.skip(f"no vLLM venv at {vllm_python()}: run `bash bench/setup_vllm_cpu.sh`")
    namespace = f"vllm-routing-{uuid.uuid4().hex[:8]}"
    with ExitStack() as stack:
        index = FleetIndex(namespace)
        stack.callback(index.delete)
        servers = []
        for core in (0, 1):
            s = VLLMServer(folder, tmp_path, VLLMOptions(
                core=core, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, kv_events=True,
                topic=f"kv@vllm{core}@{MODEL}", nixl=nixl))
            stack.callback(s.close)
            servers.append(s)
        for s in servers:
            s.wait_ready()
        nodes = []
        for s, role in zip(servers, roles, strict=True):
            mirror = VLLMEventMirror(s.events_endpoint, BLOCK_SIZE)  # before any request
            stack.callback(mirror.close)
            bridge = VLLMBridge(s, role, namespace, tmp_path, token=TOKEN)
            stack.callback(bridge.close)
            nodes.append(Node(s, bridge, mirror))
        index.wait_registered([n.worker_id for n in nodes])
        router = Router(folder, namespace, cache_dir=tmp_path, block_size=16,
                        extra=["--expose-worker-ids", "--speculative-ttl-s", "0"])
        stack.callback(router.close)
        router.wait_workers(2, timeout=60)
        # The router hashes these workers' prompts at their block size, seeded by the digest
        # they registered (the model folder's, as a Tandem worker's).
        reg = index.registration(nodes[0].worker_id)
        hasher = BlockHasher(reg["model_digest"], BLOCK_SIZE)
        assert reg["model_digest"] == model_digest(folder)
        assert reg.get("hash_seed") in (None, "", "None", str(hasher.seed))
        yield Fleet(nodes, router, index, hasher, Tokenizer(folder))


def conversations(n: int, turns: int, seed: int) -> list[Conversation]:
    return [Conversation([{"role": "system", "content": s.system}], [t.user for t in s.turns])
            for s in multi_turn(n, turns=turns, seed=seed, system_words=60, user_words=20)]


def test_follow_ups_go_to_the_holder_through_evictions_and_a_restart(smollm2_folder, tmp_path):
    with bridged_fleet(smollm2_folder, tmp_path, ("colocated", "colocated")) as fleet:
        convs = conversations(4, turns=6, seed=29)
        # First turns together, so the router's in-flight counts spread them over both servers.
        with ThreadPoolExecutor(4) as pool:
            firsts = list(pool.map(lambda c: c.ask(fleet, check=False), convs))
        assert all(t["num_cached_tokens"] == 0 for t in firsts)  # nothing shared yet
        assert {c.homes[0] for c in convs} == {n.worker_id for n in fleet.nodes}

        # Follow-ups: each to the server holding its prefix, every hit confirmed by vLLM.
        for c in convs:
            before = c.homes[-1]
            trace = c.ask(fleet)
            assert trace["decode_worker"] == before and trace["num_cached_tokens"] >= 3 * BLOCK_SIZE

        # Evictions: long one-turn fillers overflow both caches.
        fillers = conversations(8, turns=1, seed=7)
        for f in fillers:
            f.messages[0]["content"] *= 6  # ~600 tokens: 19 blocks of the 48
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda f: f.ask(fleet, check=False), fillers))
        fleet.assert_synced()
        assert all(n.mirror.num_removed > 0 for n in fleet.nodes), "nothing was evicted"
        for c in convs:
            c.ask(fleet)  # wherever the index says, and exactly that cached

        # One server restarts: its set empties under a new epoch before any request reaches it.
        node = fleet.node(convs[0].homes[-1])
        epoch = fleet.index.epoch(node.worker_id)
        node.server.stop()
        node.mirror.restarted()
        node.server.start()
        node.server.wait_ready()
        wait_for(lambda: fleet.index.epoch(node.worker_id) not in (None, epoch), 60,
                 "no new epoch after the restart")
        assert fleet.index.blocks(node.worker_id) == set()
        fleet.router.wait_workers(2, timeout=60)
        for c in convs:
            c.ask(fleet)  # its conversations hold nothing anywhere now: 0 cached, any server
        for c in convs:
            trace = c.ask(fleet)  # re-homed: back on the holder, with hits
            assert trace["decode_worker"] == c.homes[-2] and trace["num_cached_tokens"] > 0


def test_pd_pair_publishes_the_decode_servers_pulled_blocks(smollm2_folder, tmp_path):
    with bridged_fleet(smollm2_folder, tmp_path, ("prefill", "decode"), nixl=True) as fleet:
        _, dec = fleet.nodes
        conv = conversations(1, turns=2, seed=3)[0]
        conv.messages.append({"role": "user", "content": conv.questions.pop(0)})
        prompt = fleet.prompt_ids(conv.messages)
        out = fleet.chat(conv.messages)
        assert out["tandem"]["plan"] == "disagg"
        assert out["tandem"]["decode_worker"] == dec.worker_id
        wait_for(lambda: series_sum(dec.server.metrics(), "vllm:nixl_bytes_transferred_sum") > 0,
                 20, "the decode server pulled nothing over NIXL")
        conv.messages.append({"role": "assistant",
                              "content": out["choices"][0]["message"]["content"]})
        # The decode server never computed the prompt: it pulled it over NIXL and reported the
        # pulled blocks as its own; the bridge published them.
        blocks = fleet.hasher(prompt)
        assert len(blocks) >= 3
        fleet.assert_synced()
        assert set(blocks) <= fleet.index.blocks(dec.worker_id)
        assert fleet.index.leading_match(dec.worker_id, blocks) == len(blocks)

        # The next turn is routed with that prefix matched on the decode server, and vLLM's own
        # prefix-cache counter there confirms the hit.
        hits_before, _ = dec.server.prefix_cache()
        conv.messages.append({"role": "user", "content": conv.questions.pop(0)})
        out = fleet.chat(conv.messages)
        assert out["tandem"]["decode_worker"] == dec.worker_id, out["tandem"]
        wait_for(lambda: dec.server.prefix_cache()[0] - hits_before >= len(blocks) * BLOCK_SIZE, 20,
                 "the decode server's prefix cache did not hit the pulled blocks")
