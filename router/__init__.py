"""The OpenAI-compatible gateway with the prefix index and KV-aware routing.

Never imports torch (docs/contract.md); `tests/test_packaging.py` enforces it.
"""
