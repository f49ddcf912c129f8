"""Prefix handles (kv_transfer/handle.py, docs/contract.md "Peer prefix pulls"): signed for one
requester and one prompt's leading blocks, never interchangeable with a P/D handle."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.protocol import KVTransferParams
from kv_transfer import handle
from tests.golden import CHAT_PROMPT_HASHES

TOKEN = "golden-token"
FIELDS = {"remote_request_id": "r1.prefix", "remote_engine_id": "decode-a",
          "remote_host": "10.0.0.1", "remote_port": 8100, "remote_block_ids": [3, 4],
          "block_hashes": CHAT_PROMPT_HASHES, "requester": "decode-b",
          "expires_at": 1700000000.5}
# What every worker must compute for FIELDS under TOKEN: holder and puller agree on it.
GOLDEN_SIGNATURE = "1f50010c25674b60621d9e1115aeeb9be3f1135b44df527ab032ec658a973de7"
NOW = 1700000000.0


def signed(**changes) -> KVTransferParams:
    return KVTransferParams(**handle.sign_prefix({**FIELDS, **changes}, TOKEN))


def verify(kvp, requester="decode-b", hashes=(*CHAT_PROMPT_HASHES, 99), now=NOW):
    return handle.verify_prefix(kvp, TOKEN, requester, list(hashes), True, now=now)


def test_golden_signature():
    assert handle.sign_prefix(FIELDS, TOKEN)["signature"] == GOLDEN_SIGNATURE


def test_a_good_handle_names_its_leading_blocks():
    assert verify(signed()) == 2


@pytest.mark.parametrize("case", ["requester", "hashes", "expired", "tampered", "short"])
def test_refused(case):
    kvp, kw = signed(), {}
    if case == "requester":
        kw["requester"] = "decode-c"
    elif case == "hashes":
        kw["hashes"] = [CHAT_PROMPT_HASHES[0], 5, 6]
    elif case == "expired":
        kw["now"] = FIELDS["expires_at"] + 1
    elif case == "tampered":
        kvp = KVTransferParams(**{**kvp.model_dump(), "remote_block_ids": [5, 6]})
    elif case == "short":
        kw["hashes"] = CHAT_PROMPT_HASHES[:1]
    with pytest.raises(handle.InvalidHandle):
        verify(kvp, **kw)


def test_prefix_and_pd_handles_are_not_interchangeable():
    pd_fields = {**FIELDS, "num_tokens": 32, "prompt_hash": 1}
    pd = KVTransferParams(**handle.sign(pd_fields, TOKEN))
    with pytest.raises(handle.InvalidHandle):
        verify(KVTransferParams(**{**pd.model_dump(), "kind": "prefix"}))
    prefix = signed(num_tokens=32, prompt_hash=1)
    with pytest.raises(handle.InvalidHandle, match="signature"):
        handle.verify(prefix, TOKEN, list(range(32)), CHAT_PROMPT_HASHES, True, now=NOW)


def test_the_contract_lists_the_signed_fields():
    text = (Path(__file__).parents[2] / "docs" / "contract.md").read_text()
    block = text.split("<!-- prefix-signed-fields -->")[1].split("\n\n")[0]
    assert tuple(re.findall(r"`([a-z_]+)`", block)) == handle.PREFIX_SIGNED_FIELDS


def test_a_spent_handle_is_refused_until_it_expires_and_the_ledger_is_bounded():
    from common.protocol import KVTransferParams
    from kv_transfer.handle import SpentHandles

    def kvp(n, expires_at):
        return KVTransferParams(remote_engine_id="e", remote_request_id=f"r{n}",
                                signature=f"{n:064x}", expires_at=expires_at)

    ledger = SpentHandles(capacity=2)
    assert ledger.spend(kvp(1, 100.0), now=0.0)
    assert not ledger.spend(kvp(1, 100.0), now=50.0)  # a replay
    assert ledger.spend(kvp(2, 10.0), now=0.0)
    assert not ledger.spend(kvp(3, 100.0), now=5.0)  # full of unexpired handles: refused
    assert ledger.spend(kvp(3, 100.0), now=20.0)  # handle 2 expired: room again
    assert not ledger.spend(kvp(1, 100.0), now=20.0)  # ... and 1 is still remembered
