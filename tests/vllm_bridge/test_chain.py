"""BlockChain (vllm_bridge/chain.py): a vLLM worker's events, from the golden capture and hand-built
ones, become exactly the block hashes the router computes for the same prompts."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from common.block_events import BlockEvent
from common.hashing import BlockHasher
from tests.vllm_bridge import captures
from vllm_bridge.chain import COUNT_KEYS, BlockChain
from vllm_bridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
)

HASHER = BlockHasher(captures.MODEL_ID, captures.BLOCK_SIZE)


def golden() -> list[EventBatch]:
    return [decode_batch(p) for p in captures.payloads()]


def one(*events) -> EventBatch:
    return EventBatch(0.0, tuple(events), 0)


def run(fields, size: int = 4) -> BlockStored:
    """A BlockStored of plain tokens at block size `size` (kwargs of the dataclass)."""
    n = len(fields["block_hashes"])
    base = {"parent_block_hash": None, "token_ids": tuple(range(n * size)), "block_size": size,
            "extra_keys": None, "group_idx": 0, "medium": "GPU", "lora_name": None}
    return BlockStored(**(base | fields))


def mirror(state: set[int], published: list[BlockEvent]) -> set[int]:
    """What the publisher's Redis set becomes after `published` (common/publisher.py)."""
    for e in published:
        if e.kind == "stored":
            state |= set(e.block_hashes)
        elif e.kind == "removed":
            state -= set(e.block_hashes)
        else:
            state.clear()
    return state


def test_golden_events_give_the_routers_hashes_for_every_full_block():
    chain = BlockChain(HASHER)
    r1, r2, r4 = (HASHER(captures.computed_ids(n)) for n in ("r1", "r2", "r4"))
    assert r2[:3] == r1[:3]  # r2's prompt holds r1's answer: one chain
    b = golden()
    assert chain.apply(b[0]) == [BlockEvent("stored", tuple(r1[:2]))]
    assert chain.apply(b[1]) == [BlockEvent("stored", (r1[2],))]  # filled by r1's answer
    assert chain.apply(b[2]) == [BlockEvent("stored", (r2[3],))]
    assert chain.apply(b[3]) == [BlockEvent("stored", (r2[4],))]
    assert sorted(chain.hashes()) == sorted(r2[:5])
    # the router's hashes of the prompts it would send: all held
    assert set(HASHER(captures.prompt_ids("r1"))) | set(HASHER(captures.prompt_ids("r2"))) \
        <= set(chain.hashes())
    assert chain.apply(b[4]) == []  # full report of what is held already: nothing new
    assert chain.apply(b[5]) == [BlockEvent("removed", (r2[4],)),
                                 BlockEvent("stored", tuple(r4[:62]))]
    assert HASHER(captures.prompt_ids("r4")) == r4[:62]
    assert sorted(chain.hashes()) == sorted(r2[:4] + r4[:62])
    assert chain.apply(b[6]) == [BlockEvent("cleared")]
    assert chain.hashes() == [] and len(chain) == 0
    assert chain.counts == dict.fromkeys(COUNT_KEYS, 0) | {"stored": 67, "removed": 1,
                                                          "cleared": 1}


def test_unknown_parent_drops_the_blocks_and_a_full_report_repairs_them():
    """A late joiner: batch 0 lost. Batch 1 names its block as parent, batch 2 chains from
    batch 1's: both drop. r3's full report (batch 4, parent None) restores all four."""
    chain = BlockChain(HASHER)
    b = golden()
    assert chain.apply(b[1]) == [] and chain.apply(b[2]) == []
    assert chain.counts["unknown_parent"] == 2 and chain.hashes() == []
    r2 = HASHER(captures.computed_ids("r2"))
    assert chain.apply(b[4]) == [BlockEvent("stored", tuple(r2[:4]))]
    assert chain.apply(b[3]) == [BlockEvent("stored", (r2[4],))]  # its parent is known now
    assert chain.apply(b[4]) == []  # idempotent


def test_clear_forgets_everything_and_emits_nothing():
    chain = BlockChain(HASHER)
    b = golden()
    chain.apply(b[0])
    chain.clear()
    assert chain.hashes() == []
    assert chain.apply(b[1]) == [] and chain.counts["unknown_parent"] == 1


def test_published_set_always_equals_the_chains_hashes_over_the_capture():
    chain, state = BlockChain(HASHER), set()
    for b in golden():
        state = mirror(state, chain.apply(b))
        assert state == set(chain.hashes())


@pytest.mark.parametrize(("extra_keys", "kept"), [
    ((None, None, None), 3),
    ((None, ("image-1", 0), None), 1),  # multimodal from block 1: blocks 1, 2 left out
    (("tenant-salt", None, None), 0),  # cache_salt keys the first block only, and so the chain
])
def test_blocks_from_the_first_extra_key_on_are_left_out(extra_keys, kept):
    chain = BlockChain(BlockHasher("m", 4))
    got = chain.apply(one(run({"block_hashes": (1, 2, 3), "extra_keys": extra_keys})))
    want = BlockHasher("m", 4)(list(range(12)))[:kept]
    assert got == ([BlockEvent("stored", tuple(want))] if kept else [])
    assert chain.counts["extra_keys"] == 3 - kept
    # a child of a left-out block has an unknown parent
    child = chain.apply(one(run({"block_hashes": (4,), "parent_block_hash": 3})))
    assert (child == []) == (kept < 3)
    assert chain.counts["unknown_parent"] == (kept < 3)


def test_lora_blocks_are_left_out_even_without_extra_keys():
    """Releases before extra_keys marked LoRA blocks by lora_id / lora_name only."""
    chain = BlockChain(BlockHasher("m", 4))
    assert chain.apply(one(run({"block_hashes": (1,), "lora_name": "ad"}))) == []
    assert chain.apply(one(run({"block_hashes": (2,), "lora_id": 3}))) == []
    assert chain.counts["extra_keys"] == 2 and chain.hashes() == []


def test_another_block_size_is_skipped():
    chain = BlockChain(BlockHasher(captures.MODEL_ID, 16))
    for b in golden():
        assert chain.apply(b) in ([], [BlockEvent("cleared")])
    assert chain.counts["block_size"] == 2 + 1 + 1 + 1 + 4 + 62 and chain.hashes() == []


@pytest.mark.parametrize(("change", "why"), [
    ({"group_idx": 1}, "other_group"), ({"medium": "NVMe-oF"}, "other_medium"),
    ({"kv_cache_spec_kind": "sliding_window"}, "other_group")])
def test_other_groups_media_and_specs_are_skipped(change, why):
    chain = BlockChain(BlockHasher("m", 4))
    assert chain.apply(one(run({"block_hashes": (1, 2), **change}))) == []
    assert chain.counts[why] == 2
    # unstated medium and spec (older releases) are group 0 on the GPU
    got = chain.apply(one(run({"block_hashes": (1, 2), "medium": None})))
    assert got[0].kind == "stored" and len(chain) == 2


def test_a_removal_in_another_group_leaves_group_0_alone():
    """Hybrid models emit one event per KV cache group with the hashes shared across groups."""
    chain = BlockChain(BlockHasher("m", 4))
    chain.apply(one(run({"block_hashes": (1,)})))
    assert chain.apply(one(BlockRemoved((1,), "GPU", 1), BlockRemoved((1,), "CPU", 0),
                           BlockRemoved((1,), "S3", 0))) == []  # not on the host: nothing
    assert len(chain) == 1 and chain.counts["other_group"] == chain.counts["other_medium"] == 1


def test_masked_blocks_are_skipped():
    chain = BlockChain(BlockHasher("m", 4))
    assert chain.apply(one(run({"block_hashes": (1,), "token_ids": tuple(range(8))}))) == []
    assert chain.counts["masked"] == 1


def test_two_vllm_hashes_of_one_own_hash_are_refcounted():
    chain = BlockChain(BlockHasher("m", 4))
    own = BlockHasher("m", 4)(list(range(4)))
    assert chain.apply(one(run({"block_hashes": (101,)}))) == [BlockEvent("stored", tuple(own))]
    assert chain.apply(one(run({"block_hashes": (202,)}))) == []
    assert chain.apply(one(BlockRemoved((101,), "GPU", 0))) == []
    assert chain.hashes() == own
    assert chain.apply(one(BlockRemoved((202,), "GPU", 0), BlockRemoved((202,), "GPU", 0))) == \
        [BlockEvent("removed", tuple(own))]
    assert chain.hashes() == []


def test_a_vllm_hash_stored_again_with_other_tokens_moves():
    chain = BlockChain(BlockHasher("m", 4))
    a, b = BlockHasher("m", 4)(list(range(4))), BlockHasher("m", 4)(list(range(1, 5)))
    chain.apply(one(run({"block_hashes": (7,)})))
    got = chain.apply(one(run({"block_hashes": (7,), "token_ids": tuple(range(1, 5))})))
    assert got == [BlockEvent("removed", tuple(a)), BlockEvent("stored", tuple(b))]
    assert chain.hashes() == b


def test_removals_of_unknown_hashes_emit_nothing():
    chain = BlockChain(HASHER)
    assert chain.apply(one(BlockRemoved((1, 2), "GPU", 0))) == []
    assert chain.counts["removed"] == 0


def test_overflow_clears_and_bounds_memory():
    chain = BlockChain(HASHER, max_blocks=4)
    b = golden()
    chain.apply(b[0])
    chain.apply(b[1])
    chain.apply(b[2])
    assert chain.apply(b[3]) == [BlockEvent("cleared")] == chain.apply(b[5])
    assert len(chain) == 0 and chain.counts["overflow"] == 2
    # the events after an overflow in the same batch still count
    chain = BlockChain(BlockHasher("m", 4), max_blocks=2)
    got = chain.apply(one(run({"block_hashes": (1, 2, 3)}), run({"block_hashes": (9,)})))
    assert got == [BlockEvent("cleared"), BlockEvent("stored", tuple(BlockHasher("m", 4)(
        list(range(4)))))]
    assert len(chain) == 1
    with pytest.raises(ValueError):
        BlockChain(HASHER, max_blocks=0)


def test_adjacent_events_of_one_kind_are_merged_in_order():
    chain = BlockChain(BlockHasher("m", 4))
    h = BlockHasher("m", 4)(list(range(12)))
    got = chain.apply(one(run({"block_hashes": (1,)}),
                          run({"block_hashes": (2, 3), "parent_block_hash": 1,
                               "token_ids": tuple(range(4, 12))}),
                          *(BlockRemoved((v,), "GPU", 0) for v in (3, 2)),
                          run({"block_hashes": (2,), "parent_block_hash": 1,
                               "token_ids": tuple(range(4, 8))})))
    assert got == [BlockEvent("stored", tuple(h)), BlockEvent("removed", (h[2], h[1])),
                   BlockEvent("stored", (h[1],))]


def test_random_histories_keep_the_published_set_equal_to_the_chain():
    """Stores (new runs and repeats, from known, unknown and absent parents), removals and
    clears in random order: what the publisher ends up holding is always `hashes()`."""
    rng = random.Random(7)
    hasher = BlockHasher("m", 2)
    chain, state = BlockChain(hasher, max_blocks=40), set()
    runs: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # vLLM hash -> (parent, tokens)
    for step in range(400):
        events = []
        for _ in range(rng.randint(1, 4)):
            roll = rng.random()
            if roll < 0.55:
                parent = rng.choice([None, *list(runs)[-8:], 10_000 + step])
                n = rng.randint(1, 4)
                tokens = tuple(rng.randrange(6) for _ in range(2 * n))
                hashes = tuple(rng.randrange(60) for _ in range(n))  # repeats and collisions
                events.append(BlockStored(hashes, parent, tokens, 2, None, 0, "GPU", None))
                runs.update(dict.fromkeys(hashes, (parent, tokens)))
            elif roll < 0.97 and runs:
                events.append(BlockRemoved(tuple(rng.sample(list(runs), 1)), "GPU", 0))
            else:
                events.append(AllBlocksCleared())
        state = mirror(state, chain.apply(one(*events)))
        assert state == set(chain.hashes())
        assert len(chain) <= 40
    assert chain.counts["stored"] > 50 and chain.counts["removed"] > 20


def test_events_are_frozen():
    ev = run({"block_hashes": (1,)})
    with pytest.raises(AttributeError):
        ev.block_size = 8  # type: ignore[misc]
    assert replace(ev, block_size=8).block_size == 8
