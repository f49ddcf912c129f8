"""The OpenAI-compatible gateway with the prefix index and KV-aware routing.

Never imports torch (DESIGN.md); `tests/test_packaging.py` enforces it.
"""
