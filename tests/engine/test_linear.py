"""oneDNN-prepacked matmuls (engine/linear.py): the same numbers as `F.linear`, used by default
on CPU float32, never where unsupported, and the engine's tokens do not change with them."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import LLM, SamplingParams
from engine.linear import _MAX_ROWS, PackedLinear, _bucket, pack_linears, packing_supported

needs_onednn = pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.float32),
                                  reason="this torch build has no oneDNN linear")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 300, 1100])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g)
    b = torch.randn(200, generator=g) if bias else None
    x = torch.randn(rows, 96, generator=g)
    with torch.inference_mode():
        got = PackedLinear(w, b)(x)
    assert got.shape == (rows, 200)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_pack_linears_replaces_every_linear_and_only_linears():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(5, 8)
    with torch.inference_mode():
        want = model(x)
        assert pack_linears(model) == 2
        got = model(x)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model[1], nn.ReLU)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packing_only_for_cpu_float32():
    assert not packing_supported(torch.device("cpu"), torch.bfloat16)
    assert not packing_supported(torch.device("cuda"), torch.float32)


@needs_onednn
def test_engine_packs_by_default_and_tokens_match_unpacked(tiny_folder):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[(7 * i * (j + 2)) % 256 for j in range(4 + 9 * i)] for i in range(1, 5)]
    packed = LLM(str(tiny_folder), num_blocks=128, block_size=4)
    plain = LLM(str(tiny_folder), num_blocks=128, block_size=4, pack_weights=False)
    model = packed.engine.model
    assert model.packed_head is not None
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert any(isinstance(m, nn.Linear) for m in plain.engine.model.modules())
    got = [o.token_ids for o in packed.generate(prompts, params)]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert got == want


def test_row_buckets_are_few_and_cover_every_count():
    # Every row count up to a chunk maps to a bucket at least as large; few distinct buckets
    # keep oneDNN's per-shape primitives and buffers bounded (see engine/linear.py).
    buckets = {_bucket(n) for n in range(1, _MAX_ROWS + 1)}
    assert all(_bucket(n) >= n for n in range(1, _MAX_ROWS + 1))
    assert len(buckets) <= 21 and max(buckets) == _MAX_ROWS


@needs_onednn
def test_packed_linear_memory_stays_bounded_over_many_row_counts():
    # Before bucketing, RSS grew by ~12 MB per distinct row count (3.8 GB over 1..2048).
    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    layer = PackedLinear(torch.randn(1536, 576), None)
    with torch.inference_mode():
        for n in range(1, 1200, 37):
            layer(torch.randn(n, 576))
        before = rss_mib()
        for n in range(2, 1200, 3):
            layer(torch.randn(n, 576))
    assert rss_mib() - before < 150
