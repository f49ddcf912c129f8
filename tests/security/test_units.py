"""Unit tests of the hardening pieces, one layer at a time (the process-level tests beside this
file show the same rules end to end)."""

from __future__ import annotations

import math
import time

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from common.auth import bearer_matches, secrets_equal
from common.background import BackgroundErrors
from common.bounds import MAX_TOP_K, is_host, is_request_id
from common.hashing import BlockHasher, hash_tokens
from common.protocol import GenerateRequest, KVTransferParams, PrefillRequest, SamplingOptions
from common.registry import WorkerRegistration, registration_signature
from engine.sampling_params import SamplingParams
from kv_transfer import handle
from kv_transfer.lease import LeaseTable
from kv_transfer.netdev import interface_for, ucx_net_devices

TOKEN = "k" * 32
PROMPT = list(range(40))
HASHER = BlockHasher("m", 16)


def issued(**over) -> KVTransferParams:
    fields = dict(do_remote_prefill=True, remote_engine_id="prefill-1", remote_host="10.0.0.5",
                  remote_port=8200, remote_block_ids=[4, 5, 6], remote_request_id="r-1",
                  block_hashes=HASHER(PROMPT), num_tokens=len(PROMPT),
                  prompt_hash=hash_tokens(PROMPT), expires_at=time.time() + 30)
    return KVTransferParams(**{**handle.sign(fields, TOKEN), **over})


def test_a_signed_handle_verifies_for_its_own_prompt_only():
    handle.verify(issued(), TOKEN, PROMPT, HASHER(PROMPT), require_signature=True)
    other = PROMPT[:-1] + [999]
    with pytest.raises(handle.InvalidHandle, match="another prompt"):
        handle.verify(issued(), TOKEN, other, HASHER(other), require_signature=True)
    with pytest.raises(handle.InvalidHandle, match="tokens"):
        handle.verify(issued(), TOKEN, PROMPT + [1], HASHER(PROMPT + [1]), require_signature=True)


@pytest.mark.parametrize("over, reason", [
    ({"signature": None}, "not signed"),
    ({"remote_block_ids": [4, 5, 7]}, "signature"),
    ({"remote_host": "10.0.0.6"}, "signature"),
    ({"remote_port": 8201}, "signature"),
    ({"remote_engine_id": None}, "lacks"),
    ({"expires_at": 1.0}, "signature"),  # changing the expiry breaks the signature too
])
def test_tampered_handles_are_refused(over, reason):
    with pytest.raises(handle.InvalidHandle, match=reason):
        handle.verify(issued(**over), TOKEN, PROMPT, HASHER(PROMPT), require_signature=True)


def test_expired_and_foreign_key_handles_are_refused():
    with pytest.raises(handle.InvalidHandle, match="expired"):
        handle.verify(issued(), TOKEN, PROMPT, HASHER(PROMPT), True, now=time.time() + 31)
    with pytest.raises(handle.InvalidHandle, match="signature"):
        handle.verify(issued(), "another-token", PROMPT, HASHER(PROMPT), True)
    # Without a token (a loopback development cluster) the prompt checks still hold.
    unsigned = issued(signature=None)
    handle.verify(unsigned, None, PROMPT, HASHER(PROMPT), require_signature=False)
    with pytest.raises(handle.InvalidHandle):
        handle.verify(unsigned, None, PROMPT[::-1], HASHER(PROMPT[::-1]), require_signature=False)


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**63), ("top_k", MAX_TOP_K + 1), ("temperature", math.inf),
    ("temperature", math.nan), ("top_p", 0.0), ("seed", 2**63), ("max_tokens", 2**40),
    ("stop_token_ids", [2**40]), ("presence_penalty", math.inf), ("logprobs", 21),
    ("stop", ["x" * 10_000])])
def test_wire_and_engine_bounds_agree(field, value):
    with pytest.raises(ValidationError):
        SamplingOptions(**{field: value})
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_internal_request_bounds():
    for bad in ({"request_id": "a/b"}, {"request_id": "x" * 300}, {"prompt_token_ids": [2**32]},
                {"prompt_token_ids": []}, {"lease_seconds": 1e9}, {"lease_seconds": math.inf}):
        with pytest.raises(ValidationError):
            PrefillRequest(**{"request_id": "r", "prompt_token_ids": [1], **bad})
    with pytest.raises(ValidationError):
        GenerateRequest(request_id="r", prompt_token_ids=[1], output_token_ids=[-1])
    for host in ("127.0.0.1/steal?", "user@host", "a b", "http://x"):
        assert not is_host(host)
        with pytest.raises(ValidationError):
            KVTransferParams(remote_host=host)
    assert is_host("prefill-0.tandem.svc.cluster.local") and is_host("::1") and is_host("10.1.2.3")
    assert is_request_id("chatcmpl-abc.r1") and not is_request_id("a\nb")


def test_leases_are_capped():
    released = []
    table = LeaseTable(released.append, 30.0, max_seconds=60.0)
    with pytest.raises(ValueError, match="cap"):
        table.grant("r", [1], 61.0)
    with pytest.raises(ValueError):
        table.grant("r", [1], math.inf)
    table.grant("r", [1], 60.0)
    assert "r" in table
    with pytest.raises(ValueError):
        LeaseTable(released.append, 90.0, max_seconds=60.0)


def test_registrations_are_schema_checked_and_signed():
    fields = {"role": "decode", "url": "http://10.0.0.5:8100", "block_size": "16", "capacity": "64",
              "max_model_len": "None", "load": '{"running": 2}'}
    raw = {k.encode(): v.encode() for k, v in fields.items()}
    reg = WorkerRegistration.from_hash(raw)
    assert reg.block_size == 16 and reg.load.running == 2 and reg.max_model_len is None
    with pytest.raises(ValueError, match="signed"):
        WorkerRegistration.from_hash(raw, "decode-1", TOKEN)
    sig = registration_signature("decode-1", fields, TOKEN)
    signed = {**raw, b"signature": sig.encode(), b"load": b'{"running": 5}'}  # load may change
    assert WorkerRegistration.from_hash(signed, "decode-1", TOKEN).load.running == 5
    with pytest.raises(ValueError):  # signed for another worker id
        WorkerRegistration.from_hash(signed, "decode-2", TOKEN)
    for bad in ({b"block_size": b"x"}, {b"load": b"{not json"}, {b"load": b'{"running": -1}'},
                {b"role": b"wizard"}, {b"url": b"http://x/../admin?"}, {b"capacity": b"1e400"}):
        with pytest.raises(ValueError):
            WorkerRegistration.from_hash({**raw, **bad})


def test_background_errors_are_counted_by_task():
    registry = CollectorRegistry()
    errors = BackgroundErrors(registry)
    errors.record("kv_lease_watcher", ValueError("bad"))
    errors.record("kv_lease_watcher", "skipped item")
    assert registry.get_sample_value("tandem_background_errors_total",
                                     {"task": "kv_lease_watcher"}) == 2


def test_secrets_compare_any_characters():
    assert secrets_equal("tök€n", "tök€n") and not secrets_equal("\udcff", "x")
    assert not bearer_matches("Bearer \u00ff\u00fe", "token")
    assert bearer_matches("Bearer token", "token") and not bearer_matches("token", "token")
    assert bearer_matches(None, None)


def test_ucx_is_limited_to_the_workers_interface():
    assert interface_for("127.0.0.1") == "lo"
    assert ucx_net_devices("127.0.0.1").split(",")[0] == "lo"
    assert interface_for("0.0.0.0") is None and ucx_net_devices("0.0.0.0") is None
    assert interface_for("no-such-host.invalid") is None
