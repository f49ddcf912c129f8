"""The `tandem` field's cached tokens by KV tier (router/openai_format.py), from what the worker
that computed the prompt reported (router/dispatch.py `Trace.record_cached`)."""

from __future__ import annotations

from router.openai_format import timing_field
from router.trace import Trace


def test_the_split_by_tier_is_the_workers():
    t = Trace("disagg")
    t.record_cached(48, {"device": 16, "host": 32, "disk": 0})
    field = timing_field(t, 0.0)
    assert field["num_cached_tokens"] == 48
    assert field["num_cached_tokens_by_medium"] == {"device": 16, "host": 32, "disk": 0}


def test_a_miss_is_all_zeros_and_an_unsplit_hit_is_null():
    t = Trace("colocated")
    t.record_cached(0, None)  # a Tandem worker sends no split when nothing was cached
    assert timing_field(t, 0.0)["num_cached_tokens_by_medium"] == {"device": 0, "host": 0,
                                                                   "disk": 0}
    t.record_cached(32, None)  # a vLLM backend: cached tokens, tier unknown
    field = timing_field(t, 0.0)
    assert field["num_cached_tokens"] == 32 and field["num_cached_tokens_by_medium"] is None


def test_the_trace_keeps_its_own_copy():
    reported = {"device": 0, "host": 0, "disk": 16}
    t = Trace("disagg")
    t.record_cached(16, reported)
    reported["disk"] = 0
    assert t.num_cached_tokens_by_medium == {"device": 0, "host": 0, "disk": 16}
