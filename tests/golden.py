"""Golden block-hash vectors (docs/contract.md "Block hashing"). Router-side and worker-side tests
both assert these; changing them breaks every deployed prefix index, so never edit them to pass."""

SMOLLM2_ID = "smollm2-135m-instruct"
SMOLLM2_SEED = 13725951810839458487
SMOLLM2_SEED_SALTED = 8836687359766975606  # salt "tenant-a"
TINY_SEED_BS4 = 7755565565534020734  # ("tiny-random", block_size 4)

RANGE40_HASHES = [8320841460429119538, 8685827984283696321]  # list(range(40)), bs 16

# SmolLM2 chat prompt (system "You are a concise assistant." + the France question), bs 16.
CHAT_PROMPT_IDS = [
    1, 9690, 198, 2683, 359, 253, 19484, 11173, 30, 2, 198, 1, 4093, 198, 1780, 314,
    260, 3575, 282, 4649, 47, 19842, 281, 582, 6330, 30, 2, 198, 1, 520, 9531, 198,
]
CHAT_PROMPT_HASHES = [17413795949532665931, 13716292164495309595]
# The same prompt with the request's cache salt "tenant-b" (chain root, not seed).
CHAT_PROMPT_HASHES_CACHE_SALTED = [4310680950765999965, 16470130689102767216]

EDGE_TOKENS = [0, 1, 4294967295, 7, 65536, 3, 2, 1]  # bs 4: uint32 extremes
EDGE_HASHES = [7739737544346983792, 10452559199783062959]
