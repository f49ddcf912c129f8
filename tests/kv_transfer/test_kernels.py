"""Kernel references on CPU; the CUDA kernels compile here (nvcc) and match the references on a GPU.

The CUDA kernels (csrc/kv_kernels.cu) have no CPU build. Each `gpu` test here has a CPU twin that
sends the same inputs through the same entry points, where the torch references run, and checks
them against oracles of their own (per-block indexing, numpy axis swaps, scales by numpy's
float64 division): what the GPU tests hold the kernels to is itself checked on every run. The
kernels' own paths (chunk sizes, FP8 variants, the fallbacks for odd shapes) run on a GPU only.
"""

import subprocess

import pytest
import torch

from kv_transfer import kernels
from kv_transfer.build import nvcc_path

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def cache(dtype=torch.float16, device="cpu", num_blocks=12):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(num_blocks, 3, 2, 16, 3, 64, generator=g) * 4).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_scatter_reference_roundtrip(dtype):
    c = cache(dtype)
    ids = [9, 2, 3, 11]
    staging = kernels.gather_blocks(c, ids)
    assert staging.shape == (4, 3, 2, 16, 3, 64) and staging.is_contiguous()
    for i, b in enumerate(ids):
        assert torch.equal(staging[i], c[b])
    dst = torch.zeros_like(c)
    kernels.scatter_blocks(dst, [0, 5, 6, 7], staging)
    assert torch.equal(dst[[0, 5, 6, 7]], c[ids])
    assert dst[[1, 2, 3, 4, 8, 9, 10, 11]].abs().sum() == 0
    with pytest.raises(ValueError, match="staging holds 4 blocks, 2 ids"):
        kernels.scatter_blocks(dst, [0, 1], staging)


def test_layout_conversion_reference():
    x = cache()[:4]  # [n, L, 2, BS, H, D]
    hnd = kernels.nhd_to_hnd(x)
    assert hnd.shape == (4, 3, 2, 3, 16, 64)
    assert torch.equal(hnd[1, 0, 1, 2, 5], x[1, 0, 1, 5, 2])
    assert torch.equal(kernels.hnd_to_nhd(hnd), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_reference_halves_bytes_within_e4m3_error(dtype):
    x = kernels.gather_blocks(cache(dtype), [1, 4])
    q, scales = kernels.fp8_pack(x)
    assert q.dtype == torch.uint8 and q.shape == x.shape and scales.shape == x.shape[:-3]
    assert q.numel() * q.element_size() * 2 <= x.numel() * x.element_size()
    back = kernels.fp8_unpack(q, scales, dtype).float()
    ref = x.float()
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each run's scale-normalised value.
    runs_err = (back - ref).abs().reshape(-1, 16 * 3 * 64).amax(1)
    runs_max = ref.abs().reshape(-1, 16 * 3 * 64).amax(1)
    assert (runs_err <= runs_max * 2**-4 + 1e-6).all()
    zeros = torch.zeros(1, 1, 2, 16, 3, 64, dtype=dtype)
    qz, sz = kernels.fp8_pack(zeros)
    assert (sz == 1).all() and (kernels.fp8_unpack(qz, sz, dtype) == 0).all()


def test_fp8_scales_are_the_correctly_rounded_quotient_on_every_device():
    """The rounding both sides follow: scale = amax / 448 by IEEE division. numpy's float64
    quotient rounded to float32 is the correctly rounded one (53 >= 2 * 24 + 2 bits); a scale
    times a rounded reciprocal of 448 (what torch's `t / 448.0` does on CUDA) differs from it
    for many amax values, which is what this test would catch."""
    import numpy as np

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 2, 16, 3, 64, generator=g) * torch.rand(64, 2, 1, 1, 1, generator=g) * 100
    q, scales = kernels.fp8_pack(x)
    amax = x.reshape(128, -1).abs().amax(1).numpy()
    exact = (amax.astype(np.float64) / 448).astype(np.float32)
    assert np.array_equal(scales.reshape(-1).numpy(), exact)
    assert (amax * np.float32(1 / 448) != exact).any()
    # q is e4m3(x * (1 / scale)), the reciprocal by IEEE division too.
    inv = (np.float64(1) / exact.astype(np.float64)).astype(np.float32)
    want = torch.from_numpy(x.reshape(128, -1).numpy() * inv[:, None]).to(torch.float8_e4m3fn)
    assert torch.equal(q.reshape(128, -1), want.view(torch.uint8))


def test_gather_into_a_staging_slice_and_bad_staging_refused():
    c = cache(torch.bfloat16)
    region = torch.zeros(8, *c.shape[1:], dtype=c.dtype)
    out = kernels.gather_blocks(c, [4, 1, 9], out=region[2:5])
    assert out.data_ptr() == region[2].data_ptr()
    assert torch.equal(region[2:5], c[[4, 1, 9]]) and region[[0, 1, 5, 6, 7]].abs().sum() == 0
    with pytest.raises(ValueError, match="does not hold 2 blocks"):
        kernels.gather_blocks(c, [4, 1], out=region[2:5])
    with pytest.raises(ValueError, match="fp8 variant"):
        kernels.fp8_pack(c[:1], variant="fast")


def test_a_library_of_another_abi_is_never_called(tmp_path, monkeypatch):
    """A stale libtandem_kv.so (its functions take other arguments) falls back to the references."""
    import shutil

    if shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    src = tmp_path / "old.c"
    src.write_text("int tandem_kv_abi(void) { return 1; }\nint tandem_gather_blocks(void) "
                   "{ return 0; }\n")
    lib = tmp_path / "libtandem_kv.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    monkeypatch.setattr(kernels, "library_path", lambda: lib)
    kernels._lib.cache_clear()
    try:
        assert kernels._lib() is None
    finally:
        kernels._lib.cache_clear()


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_cuda_kernels_compile(tmp_path):
    out = tmp_path / "libtandem_kv.so"
    from kv_transfer.build import build

    build(out)
    syms = subprocess.run(["nm", "-D", str(out)], capture_output=True, text=True).stdout
    for fn in ("tandem_kv_abi", "tandem_gather_blocks", "tandem_scatter_blocks", "tandem_transpose",
               "tandem_fp8_pack", "tandem_fp8_unpack"):
        assert fn in syms


@pytest.fixture(scope="module")
def cuda_lib():
    from kv_transfer.build import build

    if not kernels.library_path().is_file():
        build()
    kernels._lib.cache_clear()
    assert kernels.cuda_kernels_available()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_kernels_match_references(cuda_lib, dtype):
    c = cache(dtype, "cuda", num_blocks=64)
    ids = [63, 0, 17, 18, 19, 5]
    staging_k = kernels.gather_blocks(c, ids, use_kernel=True)
    staging_r = kernels.gather_blocks(c, ids, use_kernel=False)
    assert torch.equal(staging_k, staging_r)
    dst_k, dst_r = torch.zeros_like(c), torch.zeros_like(c)
    kernels.scatter_blocks(dst_k, [1, 2, 3, 4, 5, 6], staging_k, use_kernel=True)
    kernels.scatter_blocks(dst_r, [1, 2, 3, 4, 5, 6], staging_r, use_kernel=False)
    assert torch.equal(dst_k, dst_r)
    assert torch.equal(kernels.nhd_to_hnd(staging_k, use_kernel=True),
                       kernels.nhd_to_hnd_ref(staging_k))
    hnd = kernels.nhd_to_hnd_ref(staging_k)
    assert torch.equal(kernels.hnd_to_nhd(hnd, use_kernel=True), staging_k)
    qr, sr = kernels.fp8_pack(staging_k, use_kernel=False)
    for variant in kernels.FP8_VARIANTS:
        qk, sk = kernels.fp8_pack(staging_k, use_kernel=True, variant=variant)
        assert torch.equal(sk, sr), variant
        assert torch.equal(qk, qr), variant
    assert torch.equal(kernels.fp8_unpack(qk, sk, dtype, use_kernel=True),
                       kernels.fp8_unpack(qr, sr, dtype, use_kernel=False))
    for chunk in (16, 4096, 100_000):  # chunk sizes that split blocks unevenly
        assert torch.equal(kernels.gather_blocks(c, ids, use_kernel=True, chunk_bytes=chunk),
                           staging_r)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(5, 2, 2, 16, 8, 128), (3, 1, 2, 7, 5, 12), (4, 1, 2, 3, 1, 5)])
def test_gpu_kernels_match_references_on_odd_shapes(cuda_lib, shape):
    """Rows that are not 16-byte multiples, runs that do not fill a warp: the fallback paths."""
    g = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        x = (torch.randn(shape, generator=g) * 3).to(dtype).cuda()
        assert torch.equal(kernels.nhd_to_hnd(x, use_kernel=True), kernels.nhd_to_hnd_ref(x))
        hnd = kernels.nhd_to_hnd_ref(x)
        assert torch.equal(kernels.hnd_to_nhd(hnd, use_kernel=True), x)
        qr, sr = kernels.fp8_pack(x, use_kernel=False)
        for variant in kernels.FP8_VARIANTS:
            qk, sk = kernels.fp8_pack(x, use_kernel=True, variant=variant)
            assert torch.equal(sk, sr) and torch.equal(qk, qr), (dtype, variant)
        assert torch.equal(kernels.fp8_unpack(qr, sr, dtype, use_kernel=True),
                           kernels.fp8_unpack_ref(qr, sr, dtype))
        ids = list(range(shape[0]))[::-1]
        assert torch.equal(kernels.gather_blocks(x, ids, use_kernel=True), x[ids])


def as_bits(t: torch.Tensor):
    """`t` as a numpy array of its bits (numpy has no bfloat16): equality is bit-exact."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.contiguous().view(ints).numpy()


def fp8_oracle(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 pack by the module docstring's rule, the scales by numpy's float64 division."""
    import numpy as np

    runs = x.reshape(-1, x.shape[-3] * x.shape[-2] * x.shape[-1]).float().numpy()
    amax = np.abs(runs).max(axis=1)
    scales = np.where(amax > 0, (amax.astype(np.float64) / 448).astype(np.float32),
                      np.float32(1))
    inv = (np.float64(1) / scales.astype(np.float64)).astype(np.float32)
    q = torch.from_numpy(runs * inv[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return q.reshape(x.shape), torch.from_numpy(scales).reshape(x.shape[:-3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_twin_of_the_kernels_against_references(dtype):
    """test_gpu_kernels_match_references's inputs and calls on CPU, each against an oracle."""
    import numpy as np

    c = cache(dtype, "cpu", num_blocks=64)
    ids = [63, 0, 17, 18, 19, 5]
    staging = kernels.gather_blocks(c, ids)
    assert torch.equal(staging, torch.stack([c[i] for i in ids]))
    dst = torch.zeros_like(c)
    kernels.scatter_blocks(dst, [1, 2, 3, 4, 5, 6], staging)
    for j, i in enumerate(ids):
        assert torch.equal(dst[1 + j], c[i])
    assert dst[0].abs().sum() == 0 and dst[7:].abs().sum() == 0
    hnd = kernels.nhd_to_hnd(staging)
    assert np.array_equal(as_bits(hnd), np.swapaxes(as_bits(staging), -3, -2))
    assert torch.equal(kernels.hnd_to_nhd(hnd), staging)
    want_q, want_s = fp8_oracle(staging)
    for variant in kernels.FP8_VARIANTS:  # a kernel's choice: the same numbers on every path
        q, scales = kernels.fp8_pack(staging, variant=variant)
        assert torch.equal(scales, want_s) and torch.equal(q, want_q), variant
    back = kernels.fp8_unpack(want_q, want_s, dtype)
    runs = want_q.view(torch.float8_e4m3fn).float().reshape(want_s.numel(), -1)
    assert torch.equal(back, (runs * want_s.reshape(-1, 1)).to(dtype).reshape(back.shape))
    for chunk in (16, 4096, 100_000):
        assert torch.equal(kernels.gather_blocks(c, ids, chunk_bytes=chunk), staging)


@pytest.mark.parametrize("shape", [(5, 2, 2, 16, 8, 128), (3, 1, 2, 7, 5, 12), (4, 1, 2, 3, 1, 5)])
def test_cpu_twin_of_the_kernels_on_odd_shapes(shape):
    """test_gpu_kernels_match_references_on_odd_shapes's inputs on CPU, against oracles."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        x = (torch.randn(shape, generator=g) * 3).to(dtype)
        hnd = kernels.nhd_to_hnd(x)
        assert np.array_equal(as_bits(hnd), np.swapaxes(as_bits(x), -3, -2))
        assert torch.equal(kernels.hnd_to_nhd(hnd), x)
        want_q, want_s = fp8_oracle(x)
        for variant in kernels.FP8_VARIANTS:
            q, scales = kernels.fp8_pack(x, variant=variant)
            assert torch.equal(scales, want_s) and torch.equal(q, want_q), (dtype, variant)
        ids = list(range(shape[0]))[::-1]
        assert torch.equal(kernels.gather_blocks(x, ids), torch.stack([x[i] for i in ids]))


def test_the_build_module_needs_no_torch_and_agrees_with_the_loader():
    """The CUDA image builds the kernels in an nvcc image without torch (docker/Dockerfile)."""
    import subprocess
    import sys

    from kv_transfer import build
    from kv_transfer.kernels import library_path

    assert build.LIBRARY == library_path()
    code = ("import sys, runpy; sys.modules['torch'] = None; "
            "sys.argv = ['build', '--help']; runpy.run_module('kv_transfer.build', "
            "run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=build.SOURCE.parents[2])
    assert r.returncode == 0 and "--arch" in r.stdout, r.stderr
