import struct

import pytest
import xxhash

from common.hashing import BlockHasher, hash_block, hash_blocks, hash_seed
from tests import golden


def reference_chain(tokens, block_size, model_id, salt=""):
    """Independent restatement of the docs/contract.md rule with struct, to pin the implementation.
    """
    seed = xxhash.xxh3_64_intdigest(f"{model_id}|{block_size}|{salt}".encode())
    out, prev = [], seed
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        prev = xxhash.xxh3_64_intdigest(
            struct.pack("<Q", prev) + struct.pack(f"<{block_size}I", *block)
        )
        out.append(prev)
    return out


def test_golden_seeds():
    assert hash_seed(golden.SMOLLM2_ID, 16) == golden.SMOLLM2_SEED
    assert hash_seed(golden.SMOLLM2_ID, 16, "tenant-a") == golden.SMOLLM2_SEED_SALTED
    assert hash_seed("tiny-random", 4) == golden.TINY_SEED_BS4


def test_golden_chains():
    h = BlockHasher(golden.SMOLLM2_ID, 16)
    assert h(list(range(40))) == golden.RANGE40_HASHES
    assert h(golden.CHAT_PROMPT_IDS) == golden.CHAT_PROMPT_HASHES
    assert BlockHasher("tiny-random", 4)(golden.EDGE_TOKENS) == golden.EDGE_HASHES


def test_a_cache_salt_starts_its_own_chain():
    h = BlockHasher(golden.SMOLLM2_ID, 16)
    salted = h(golden.CHAT_PROMPT_IDS, cache_salt="tenant-b")
    assert salted == golden.CHAT_PROMPT_HASHES_CACHE_SALTED
    # Restated: the root is xxh3_64(seed LE || "cache_salt:" || salt), then the usual chain.
    root = xxhash.xxh3_64_intdigest(struct.pack("<Q", golden.SMOLLM2_SEED) + b"cache_salt:tenant-b")
    assert salted == hash_blocks(golden.CHAT_PROMPT_IDS, 16, golden.SMOLLM2_SEED, root)
    assert not set(salted) & set(golden.CHAT_PROMPT_HASHES)
    assert h(golden.CHAT_PROMPT_IDS, cache_salt="") == golden.CHAT_PROMPT_HASHES  # no salt
    # A continued chain ignores the salt: the salt lives in the first block's parent only.
    assert h(golden.CHAT_PROMPT_IDS[16:], salted[0], cache_salt="x") == salted[1:]


@pytest.mark.parametrize("n", [0, 15, 16, 17, 33, 100])
def test_matches_reference_restatement(n):
    tokens = [(i * 7919) % 49152 for i in range(n)]
    assert hash_blocks(tokens, 16, hash_seed("m", 16)) == reference_chain(tokens, 16, "m")


def test_only_full_blocks_and_chain_continuation():
    h = BlockHasher("m", 4)
    tokens = list(range(11))
    full = h(tokens)
    assert len(full) == 2
    # Continuing the chain from block 0's hash gives the same later hashes.
    assert h(tokens[4:], parent_hash=full[0]) == full[1:]
    assert hash_block(h.seed, tokens[:4]) == full[0]


def test_seed_isolates_models_sizes_and_tenants():
    tokens = list(range(16))
    base = BlockHasher("m", 16)(tokens)
    assert BlockHasher("other", 16)(tokens) != base
    assert BlockHasher("m", 16, salt="t1")(tokens) != base
    assert BlockHasher("m", 8)(tokens)[1] != base[0]


def test_prefix_property():
    h = BlockHasher("m", 4)
    a = h([1, 2, 3, 4, 5, 6, 7, 8])
    b = h([1, 2, 3, 4, 9, 9, 9, 9])
    assert a[0] == b[0] and a[1] != b[1]


def test_rejects_out_of_range_tokens_and_bad_block_size():
    with pytest.raises(ValueError, match="uint32"):
        BlockHasher("m", 2)([1, -1])
    with pytest.raises(ValueError, match="uint32"):
        BlockHasher("m", 2)([1, 2**32])
    with pytest.raises(ValueError, match="block_size"):
        hash_seed("m", 0)
