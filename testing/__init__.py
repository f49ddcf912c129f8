"""The test harness: real `tandem` processes on loopback (workers, routers, Redis servers and
clusters, vLLM servers and their bridges, network namespaces) for the tests and the benchmarks.

Not installed: pyproject.toml's package list leaves it out, so no wheel or image carries it.
Tests (run from the repository root) and bench/ scripts (which put the root first on sys.path)
import it from the checkout; no installed package may (tests/test_layout.py).
"""
