"""One chat completion asked of a router's OpenAI API (`tandem demo`'s question)."""

from __future__ import annotations

import json
import urllib.request


def chat(url: str, model: str, messages: list[dict], max_tokens: int = 64,
         api_key: str | None = None) -> dict:
    """The router at `url` answers `messages` greedily (temperature 0); its JSON response."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())
