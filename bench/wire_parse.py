"""Cost of parsing the workers' answers on the router's hot path: one NDJSON `StreamEvent` line
per token chunk, one `PrefillResponse` per disaggregated request. Compares the typed parse the
router does (pydantic's `model_validate_json` into common/protocol.py's models) with the untyped
`orjson.loads` it replaced and, when it is installed, msgspec into equivalent Structs.

    .venv/bin/python bench/wire_parse.py [--n 200000]

Prints JSON (microseconds per parse, medians of 5 rounds) and writes bench/results/wire_parse.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from common.protocol import PrefillResponse, StreamEvent  # noqa: E402

EVENT = b'{"request_id":"chatcmpl-5f1c2a9e0b7d4c3a8e6f1b2c","token_ids":[12345]}'
FINAL = (b'{"request_id":"chatcmpl-5f1c2a9e0b7d4c3a8e6f1b2c","token_ids":[2],'
         b'"finish_reason":"stop","num_cached_tokens":192,"timing":{"queue_s":0.001,'
         b'"prefill_s":0.0,"transfer_s":0.004,"transfer_bytes":2211840,"decode_s":1.2}}')
PREFILL = orjson.dumps({
    "request_id": "chatcmpl-5f1c2a9e0b7d4c3a8e6f1b2c", "first_token_id": 791,
    "num_cached_tokens": 0,
    "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "prefill-127.0.0.1-8200",
                           "remote_block_ids": list(range(40)), "remote_host": "127.0.0.1",
                           "remote_port": 8200,
                           "remote_request_id": "chatcmpl-5f1c2a9e0b7d4c3a8e6f1b2c",
                           "block_hashes": [2**63 + i for i in range(40)], "num_tokens": 645,
                           "prompt_hash": 2**62, "expires_at": 1.8e9, "lease_expires_at": 1.8e9,
                           "signature": "a" * 64}})


try:  # optional: measured when installed, never a dependency of ours
    import msgspec

    class TimingStruct(msgspec.Struct):
        queue_s: float = 0.0
        prefill_s: float = 0.0
        transfer_s: float = 0.0
        transfer_bytes: int = 0
        decode_s: float = 0.0

    class EventStruct(msgspec.Struct):
        request_id: str
        token_ids: list[int] = []
        finish_reason: str | None = None
        num_cached_tokens: int | None = None
        timing: TimingStruct | None = None
        error: str | None = None
except ImportError:
    msgspec = None


def per_call_us(fn, payload: bytes, n: int) -> float:
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn(payload)
        rounds.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200_000)
    args = ap.parse_args()
    parsers = {"orjson_dict": orjson.loads,
               "pydantic_event": StreamEvent.model_validate_json,
               "pydantic_prefill": PrefillResponse.model_validate_json}
    if msgspec is not None:
        parsers["msgspec_event"] = msgspec.json.Decoder(EventStruct).decode
    result = {"n": args.n, "us_per_parse": {}}
    for name, fn in parsers.items():
        payloads = ({"prefill": PREFILL} if "prefill" in name
                    else {"event": EVENT, "final_event": FINAL})
        if name == "orjson_dict":
            payloads["prefill"] = PREFILL
        for label, payload in payloads.items():
            n = args.n // 10 if label == "prefill" else args.n
            result["us_per_parse"][f"{name}:{label}"] = round(per_call_us(fn, payload, n), 3)
    write_result(ROOT / "bench" / "results" / "wire_parse.json", result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
