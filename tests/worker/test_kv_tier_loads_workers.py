"""A reload from the KV tiers racing a KV export, in real worker processes: a prefill worker
exports a prompt's blocks under a lease while it reloads another prompt (sharing the exported
one's leading blocks, or not) from its host tier into other blocks; the decode worker's pull
gets the exported prompt's KV (greedy answers equal the reference engine's), the reloaded prompt
answers the same, and no lease or block is left behind."""

import concurrent.futures as cf
import random

import pytest

from testing.cluster import expected_tokens, pd_generate, pd_pair
from testing.metrics import series_sum
from tests.polling import wait_for

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


def prompts(n, length=41, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


def tokens_of(pre: dict, events: list[dict]) -> list[int]:
    return [pre["first_token_id"]] + [t for ev in events for t in ev["token_ids"]]


@pytest.mark.redis
@pytest.mark.parametrize("shared", [False, True])
def test_a_reload_racing_a_kv_export(tiny_folder, reference, tmp_path, shared):
    first, *others = prompts(4, seed=5)
    exported = first[:20] + prompts(1, length=21, seed=6)[0] if shared else prompts(1, seed=7)[0]
    tiers = ["--num-blocks", "24", "--host-kv-gb", "0.001"]
    namespace = f"tier-loads-{random.getrandbits(32):08x}"
    with pd_pair(str(tiny_folder), tmp_path, namespace, tiers) as (p, d):
        pd_generate(p, d, "warm", first, GREEDY)
        for i, other in enumerate(others):  # push the first prompt out of P's device pool
            pd_generate(p, d, f"other-{i}", other, GREEDY)
        held = p.prefill("exported", exported, GREEDY, lease_seconds=30)  # leased for D's pull
        with cf.ThreadPoolExecutor(2) as pool:
            # P reloads the first prompt from host while D pulls the exported blocks from P.
            reload = pool.submit(p.prefill, "reload", first, GREEDY, lease_seconds=30)
            pulled = pool.submit(d.generate, "exported", exported, GREEDY,
                                 [held["first_token_id"]], held["kv_transfer_params"])
            pre, events = reload.result(60), pulled.result(60)
        assert tokens_of(held, events) == expected_tokens(reference, exported, GREEDY)
        assert pre["num_cached_tokens"] == 40 and pre["num_cached_tokens_by_medium"]["host"] > 0
        events = d.generate("reload", first, GREEDY, [pre["first_token_id"]],
                            pre["kv_transfer_params"])
        assert tokens_of(pre, events) == expected_tokens(reference, first, GREEDY)
        # Both pulls done: P's leases are notified and every block of P's is free again.
        wait_for(lambda: series_sum(p.metrics(), "tandem_kv_leased_blocks") == 0, 10, "leases")
        assert series_sum(p.metrics(), "tandem_kv_leases_total", outcome="expired") == 0
        wait_for(lambda: series_sum(p.metrics(), "tandem_worker_free_blocks") == 24, 10,
                 "P's blocks")
