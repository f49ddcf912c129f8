"""Hand-built workers for the one-layer policy tests (no processes)."""

from __future__ import annotations

from router.worker_info import WorkerInfo

BS = 16


def worker(wid: str, role: str = "decode", **kw) -> WorkerInfo:
    """A worker of a model with 16-token blocks, prefilling 1,000 tokens/s, with the digest and
    block size that make it a peer-pull source; `kw` is set on it as attributes."""
    w = WorkerInfo(wid, role, f"http://{wid}", block_size=BS, prefill_tokens_per_s=1000.0,
                   digest="0123456789abcdef", block_bytes=100_000)
    for k, v in kw.items():
        setattr(w, k, v)
    return w
