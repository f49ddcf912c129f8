"""The fused CPU layer ops (engine/cpu_ops.py, engine/cpu_ops.cpp): each against the torch code
it replaces, their bounds, the build and its fallback, and the engine's tokens with and without
them."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.cpu_ops import LIBRARY, SOURCE, build_digest, load_cpu_ops
from engine.model import RMSNorm
from engine.model_store import default_cache_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ops():
    ops = load_cpu_ops(default_cache_dir() / "cpu_ops")
    assert ops is not None, "this machine has a C++ compiler: the ops must build"
    return ops


@pytest.mark.parametrize("rows", [1, 4, 37])
def test_add_rms_norm_matches_the_torch_path(ops, rows):
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 96, generator=g) * 3, torch.randn(rows, 96, generator=g)
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
        normed, summed = ops.add_rms_norm(x, residual, norm.weight, 1e-5)
        assert torch.equal(summed, x + residual)  # the add is the same single rounding
        torch.testing.assert_close(normed, norm(x + residual), rtol=2e-6, atol=2e-6)
        first, copy = ops.add_rms_norm(x, None, norm.weight, 1e-5)  # the first layer
        assert torch.equal(copy, x) and copy.data_ptr() != x.data_ptr()
        torch.testing.assert_close(first, norm(x), rtol=2e-6, atol=2e-6)


def test_rope_store_rotates_like_the_torch_path_and_fills_the_slots(ops, rope_512):
    rope = rope_512
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, tokens = 4, 2, 64, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)
    positions = torch.tensor([0, 1, 9, 300, 511])
    # a layer's view of a two-layer cache [num_blocks, num_layers, 2, block_size, kvh, d]
    cache = torch.zeros(6, 2, 2, 4, kv_heads, d)
    layer = cache[:, 1]
    slots = torch.tensor([0, 5, 6, 22, 13])
    cos, sin = rope.rotation(positions, torch.float32)
    want = rope.rotate(qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d), cos,
                       sin)
    v = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d).clone()
    ops.rope_store(qkv, positions, rope.cos, rope.sin, layer, slots, heads)
    got = qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d)
    assert torch.equal(got, want)  # the same products and sums, bit for bit
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, 4)
        assert torch.equal(layer[block, 0, offset], want[t, heads:])
        assert torch.equal(layer[block, 1, offset], v[t])
    written = torch.zeros(6, 4, dtype=torch.bool)
    written.view(-1)[slots] = True
    assert not cache[:, 0].any()  # the other layer is untouched
    assert not layer.permute(0, 2, 1, 3, 4)[~written].any()  # and so are the other slots


def test_rope_store_refuses_positions_and_slots_out_of_bounds(ops):
    cos = sin = torch.ones(8, 4)
    cache = torch.zeros(2, 2, 4, 1, 4)
    qkv = torch.zeros(1, 12)
    with pytest.raises(RuntimeError, match="position"):
        ops.rope_store(qkv, torch.tensor([8]), cos, sin, cache, torch.tensor([0]), 1)
    with pytest.raises(RuntimeError, match="slot"):
        ops.rope_store(qkv, torch.tensor([0]), cos, sin, cache, torch.tensor([8]), 1)
    with pytest.raises(RuntimeError, match="qkv"):
        ops.rope_store(torch.zeros(1, 8), torch.tensor([0]), cos, sin, cache, torch.tensor([0]), 1)
    with pytest.raises(RuntimeError, match="float32"):
        ops.silu_mul(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert not cache.any()


def test_silu_mul_is_the_torch_path_bit_for_bit(ops):
    gate_up = torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(4)) * 4
    gate, up = gate_up.split(48, dim=-1)
    assert torch.equal(ops.silu_mul(gate_up), F.silu(gate) * up)  # torch's kernels, in C++


def _tokens(folder: Path, cpu_ops: bool) -> tuple[dict, LLMEngine]:
    engine = LLMEngine(EngineConfig(str(folder), num_blocks=256, block_size=4, cpu_ops=cpu_ops))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    out: dict = {}
    prompts = {f"r{i}": [(7 * i + 3 * j) % 200 + 1 for j in range(5 + 9 * i)] for i in range(4)}
    for step in range(200):
        if step % 3 == 0 and prompts:  # staggered: prefills share steps with decodes
            engine.add_request(*prompts.popitem(), params)
        for o in engine.step():
            if o.finish_reason:
                out[o.request_id] = (o.token_ids, [lp.logprob for lp in o.logprobs])
        if not prompts and not engine.has_unfinished():
            break
    return out, engine


def test_the_engine_gives_the_same_tokens_with_and_without_the_ops(tiny_folder):
    fused, engine = _tokens(tiny_folder, True)
    assert engine.runner.layer_ops is not None
    plain, engine = _tokens(tiny_folder, False)
    assert engine.runner.layer_ops is None
    assert len(fused) == 4
    for rid, (tokens, logprobs) in plain.items():
        assert fused[rid][0] == tokens
        torch.testing.assert_close(torch.tensor(fused[rid][1]), torch.tensor(logprobs),
                                   rtol=1e-4, atol=1e-4)


BUILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from engine.cpu_ops import load_cpu_ops
    ops = load_cpu_ops(Path(sys.argv[1]), Path(sys.argv[2]))
    print("built" if ops else "none")
""")


def _build(root: Path, source: Path) -> subprocess.CompletedProcess:
    # a fresh process: a library loaded once stays loaded in this one
    return subprocess.run([sys.executable, "-c", BUILD, str(root), str(source)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_a_build_is_made_once_and_a_failed_one_falls_back(tmp_path):
    done = _build(tmp_path / "ok", SOURCE)
    assert done.stdout.strip() == "built", done.stderr
    library = tmp_path / "ok" / build_digest(SOURCE) / LIBRARY
    assert library.is_file()
    mtime = library.stat().st_mtime_ns
    assert _build(tmp_path / "ok", SOURCE).stdout.strip() == "built"
    assert library.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert [p.name for p in library.parent.iterdir()] == [LIBRARY]  # no build leftovers

    broken = tmp_path / "broken.cpp"
    broken.write_text(SOURCE.read_text() + "\nthis is not C++;\n")
    done = _build(tmp_path / "broken", broken)
    assert done.stdout.strip() == "none"
    assert "could not be built" in done.stderr and "not C++" in done.stderr
    assert not list((tmp_path / "broken").rglob("*.so"))
