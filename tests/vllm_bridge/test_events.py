"""vLLM's KV event wire format (vllm_bridge/events.py) against real vLLM 0.32 payloads
(tests/vllm_bridge/golden, captured by bench/capture_vllm_events.py) and hand-built ones."""

from __future__ import annotations

import random

import msgspec
import pytest

from tests.vllm_bridge import captures
from vllm_bridge import events as ev
from vllm_bridge.encoding import encode_batch
from vllm_bridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
)

pack = msgspec.msgpack.encode


def stored(**changes):
    """A well-formed 0.32 BlockStored map (2 blocks of 4), with `changes` applied."""
    base = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
            "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
            "kv_cache_spec_kind": "full_attention"}
    return {k: v for k, v in (base | changes).items() if v is not ...}


def batch(*events, ts=1.0, rank=0) -> bytes:
    return pack([ts, list(events), rank])


def test_every_captured_batch_decodes_and_encodes_back_byte_for_byte():
    seqs = []
    for seq, topic, payload in captures.batches():
        got = decode_batch(payload)
        assert (got.data_parallel_rank, got.num_unknown) == (0, 0)
        assert topic == captures.server()["topic"]
        assert encode_batch(got) == payload  # our map form is vLLM 0.32's, field for field
        seqs.append(seq)
    assert seqs == list(range(len(seqs))) and len(seqs) == 7


def test_captured_batches_carry_the_requests_tokens_and_chain():
    """What vLLM reported, step by step, for the scripted requests (bench/capture_vllm_events.py).
    """
    b = [decode_batch(p).events for p in captures.payloads()]
    r1, r2, r4 = captures.computed_ids("r1"), captures.computed_ids("r2"), captures.prompt_ids("r4")
    (s0,), (s1,), (s2,), (s3,), (s4,), (rm, s5), (cleared,) = b
    # r1's 83-token prompt: 2 full blocks; its answer fills a third (decode-filled blocks count)
    assert (s0.parent_block_hash, s0.token_ids, s0.block_size) == (None, tuple(r1[:64]), 32)
    assert (s0.medium, s0.group_idx, s0.kv_cache_spec_kind, s0.extra_keys) == \
        ("GPU", 0, "full_attention", (None, None))
    assert (s1.parent_block_hash, s1.token_ids) == (s0.block_hashes[1], tuple(r1[64:96]))
    # r2 reused r1's 3 blocks (its prompt holds r1's answer) and added one, then one decoded
    assert captures.requests()["r2"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    assert (s2.parent_block_hash, s2.token_ids) == (s1.block_hashes[0], tuple(r2[96:128]))
    assert (s3.parent_block_hash, s3.token_ids) == (s2.block_hashes[0], tuple(r2[128:160]))
    # r3, full report mode: the whole cached prefix of its prompt again, from token 0
    assert s4.parent_block_hash is None and s4.token_ids == tuple(r2[:128])
    assert s4.block_hashes == s0.block_hashes + s1.block_hashes + s2.block_hashes
    # r4 (2000 tokens) needed 63 of the 67 usable blocks: the LRU block went first, then its 62
    assert rm == BlockRemoved(s3.block_hashes, "GPU", 0)
    assert s5.parent_block_hash is None and s5.token_ids == tuple(r4[:62 * 32])
    assert len(s5.block_hashes) == 62
    assert cleared == AllBlocksCleared()  # the reset, published at r5's step


def test_captured_replay_answers():
    """The replay ROUTER answers a DEALER [b"", topic, seq, payload] per buffered batch from the
    start seq, then [b"", b"", -1, b""]; a start past the end gets the end marker alone."""
    end = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    live = captures.batches()
    replays = captures.replays()
    assert sorted(replays) == [0, 3, len(live)]
    for start, msgs in replays.items():
        assert msgs[-1] == end
        assert [(int.from_bytes(m[2], "big"), m[1].decode(), m[3]) for m in msgs[:-1]] == \
            [b for b in live if b[0] >= start]
        assert all(m[0] == b"" for m in msgs)


def test_captured_server_facts():
    """What the bridge can discover over HTTP: the events endpoints and the block size."""
    facts = captures.server()
    assert facts["cache_config_info"]["block_size"] == "32"
    assert facts["cache_config_info"]["num_gpu_blocks"] == "68"
    assert facts["cache_config_info"]["prefix_caching_hash_algo"] == "sha256"
    sources = msgspec.json.decode(facts["kv_event_sources"]["body"])
    assert sources["0"]["topic"] == facts["topic"]
    assert sources["0"]["endpoint"].startswith("tcp://*:")  # the wildcard: the host is ours to add


def test_array_form_decodes_to_the_same_events():
    for payload in captures.payloads():
        want = decode_batch(payload)
        arrays = encode_batch(want, arrays=True)
        assert arrays != payload
        assert decode_batch(arrays) == want


def test_hand_built_array_forms_of_older_releases():
    """Releases before PR 42892: tagged arrays, trailing defaults left out; the oldest had no
    medium, no lora_name and no data-parallel rank."""
    toks = list(range(8))
    oldest = pack([2.5, [["BlockStored", [7, 8], 6, toks, 4, None], ["BlockRemoved", [5]],
                         ["AllBlocksCleared"]]])
    got = decode_batch(oldest)
    assert got == EventBatch(2.5, (
        BlockStored((7, 8), 6, tuple(toks), 4, None, 0, None, None),
        BlockRemoved((5,), None, 0), AllBlocksCleared()), None, 0)
    later = pack([3.0, [["BlockStored", [7, 8], None, toks, 4, 3, "GPU", "ad", [["ad"], ["ad"]], 0,
                         "full_attention", None, "future field"],
                        ["BlockRemoved", [7], "GPU", 0, "LOCAL"]], 1])
    s, r = decode_batch(later).events
    assert (s.lora_id, s.lora_name, s.extra_keys, s.kv_cache_spec_kind) == \
        (3, "ad", (["ad"], ["ad"]), "full_attention")
    assert r == BlockRemoved((7,), "GPU", 0)
    assert decode_batch(later).data_parallel_rank == 1


def test_a_map_encoded_batch_decodes_too():
    """A transitional vLLM main branch sent the batch itself as a map."""
    got = decode_batch(pack({"ts": 1.0, "events": [stored()], "data_parallel_rank": 2}))
    assert got.data_parallel_rank == 2 and got.events[0].block_hashes == (11, 12)


def test_raw_digest_hashes():
    """VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: whole digests as msgpack bin."""
    d1, d2 = bytes(range(32)), bytes(range(1, 33))
    got = decode_batch(batch(stored(block_hashes=[d1, d2], parent_block_hash=b"\xff" * 32)))
    assert got.events[0].block_hashes == (d1, d2)
    assert got.events[0].parent_block_hash == b"\xff" * 32
    assert decode_batch(encode_batch(got)) == got


def test_unknown_types_are_counted_and_unknown_fields_ignored():
    payload = batch({"type": "BlockPinned", "block_hashes": [1]}, ["SomethingNew", 1, 2],
                    stored(locality="LOCAL", session_id="s", brand_new={"x": 1}),
                    {"type": "AllBlocksCleared", "reason": "reset"})
    got = decode_batch(payload)
    assert got.num_unknown == 2
    assert [type(e) for e in got.events] == [BlockStored, AllBlocksCleared]


def test_optional_fields_default():
    """`group_idx` None (releases before groups) means group 0; medium and LoRA fields may be
    left out."""
    got = decode_batch(batch(stored(group_idx=None, medium=..., lora_id=..., lora_name=...,
                                    extra_keys=..., kv_cache_spec_kind=...)))
    assert got.events[0] == BlockStored((11, 12), None, tuple(range(8)), 4, None, 0, None, None)


def test_masked_blocks_leave_tokens_without_hashes():
    """vLLM skips null (sliding-window) blocks in the hashes, not in the token ids."""
    got = decode_batch(batch(stored(block_hashes=[11], extra_keys=[None])))
    assert len(got.events[0].token_ids) == 8 and got.events[0].block_hashes == (11,)


MALFORMED = {
    "not msgpack": b"\xc1",
    "truncated": captures.payloads()[0][:-3],
    "a scalar": pack(5),
    "a string": pack("batch"),
    "empty batch": pack([]),
    "ts not a number": pack(["now", [], 0]),
    "ts NaN": pack([float("nan"), [], 0]),
    "events not a list": pack([1.0, {"type": "AllBlocksCleared"}, 0]),
    "rank negative": pack([1.0, [], -1]),
    "rank a string": pack([1.0, [], "0"]),
    "event a scalar": batch(7),
    "event without a type": batch({"block_hashes": [1]}),
    "type not a string": batch({"type": 3}),
    "array event empty": batch([]),
    "stored without hashes": batch(stored(block_hashes=...)),
    "stored without tokens": batch(stored(token_ids=...)),
    "array stored too short": batch(["BlockStored", [1], None]),
    "hash negative": batch(stored(block_hashes=[-1, 12])),
    "hash a float": batch(stored(block_hashes=[1.5, 12])),
    "hash a string": batch(stored(block_hashes=["ab", 12])),
    "hash digest empty": batch(stored(block_hashes=[b"", 12])),
    "hash digest too long": batch(stored(block_hashes=[b"x" * 65, 12])),
    "parent a list": batch(stored(parent_block_hash=[1])),
    "token negative": batch(stored(token_ids=[-1, *range(7)])),
    "token past uint32": batch(stored(token_ids=[1 << 32, *range(7)])),
    "token a string": batch(stored(token_ids=["a", *range(7)])),
    "tokens short of the blocks": batch(stored(token_ids=list(range(7)))),
    "tokens not whole blocks": batch(stored(token_ids=list(range(9)))),
    "tokens fewer than the blocks need": batch(stored(block_hashes=[1, 2, 3], extra_keys=...)),
    "block size 0": batch(stored(block_size=0, token_ids=[])),
    "block size past the bound": batch(stored(block_size=65537)),
    "block size a string": batch(stored(block_size="4")),
    "extra keys for other blocks": batch(stored(extra_keys=[None])),
    "extra keys a map": batch(stored(extra_keys={"a": 1})),
    "group negative": batch(stored(group_idx=-1)),
    "group huge": batch(stored(group_idx=1 << 20)),
    "medium a number": batch(stored(medium=1)),
    "medium too long": batch(stored(medium="G" * 2000)),
    "lora name a list": batch(stored(lora_name=["a"])),
    "removed hashes a number": batch({"type": "BlockRemoved", "block_hashes": 5}),
    "removed hash negative": batch({"type": "BlockRemoved", "block_hashes": [-5]}),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_payloads_raise_value_error(name):
    with pytest.raises(ValueError):
        decode_batch(MALFORMED[name])


def test_size_bounds():
    with pytest.raises(ValueError, match="exceeds"):
        decode_batch(b"\x93" + b"\x00" * ev.MAX_PAYLOAD_BYTES)
    too_many_events = batch(*[{"type": "AllBlocksCleared"}] * (ev.MAX_EVENTS_PER_BATCH + 1))
    with pytest.raises(ValueError, match="length"):
        decode_batch(too_many_events)
    n = ev.MAX_HASHES_PER_EVENT + 1
    with pytest.raises(ValueError, match="length"):
        decode_batch(batch(stored(block_hashes=[1] * n, token_ids=[0] * n, block_size=1,
                                  extra_keys=...)))
    n = ev.MAX_TOKENS_PER_EVENT + 1
    with pytest.raises(ValueError, match="length"):
        decode_batch(batch(stored(block_hashes=[1], token_ids=[0] * n, block_size=1,
                                  extra_keys=...)))
    # at the bounds, accepted
    n = ev.MAX_HASHES_PER_EVENT
    got = decode_batch(batch(stored(block_hashes=list(range(n)), token_ids=[0] * n,
                                    block_size=1, extra_keys=...)))
    assert len(got.events[0].block_hashes) == n
    got = decode_batch(batch(stored(block_hashes=[(1 << 64) - 1], token_ids=[(1 << 32) - 1],
                                    block_size=1, extra_keys=...)))
    assert got.events[0].block_hashes == ((1 << 64) - 1,)


def test_mutated_payloads_decode_or_raise_value_error_only():
    """Whatever a peer sends, the decoder answers a batch or a ValueError (the bridge's loop
    counts and skips those), never another exception."""
    rng = random.Random(29)
    seeds = captures.payloads()
    outcomes = {"ok": 0, "ValueError": 0}
    for _ in range(3000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(3)
            i = rng.randrange(len(data))
            if op == 0:
                data[i] = rng.randrange(256)
            elif op == 1:
                del data[i:i + rng.randint(1, 8)]
            else:
                data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        try:
            decode_batch(bytes(data))
            outcomes["ok"] += 1
        except ValueError:
            outcomes["ValueError"] += 1
    assert outcomes["ok"] > 0 and outcomes["ValueError"] > 0
