"""Block packing ops with a torch reference (CPU, and CUDA fallback) and CUDA kernels.

    gather_blocks(cache [NB, L, 2, BS, H, D], ids [n], out=None) -> staging [n, L, 2, BS, H, D]
    scatter_blocks(cache, ids, staging)                  (inverse)
    nhd_to_hnd(x [..., BS, H, D]) -> [..., H, BS, D]     and hnd_to_nhd
    fp8_pack(x [..., BS, H, D]) -> (q uint8 same shape, scales float32 [...])  e4m3, one scale per
                                   (BS, H, D) run;  fp8_unpack(q, scales, dtype)

FP8 rounding, the same in the reference and the kernel (bit for bit, on CPU and CUDA):
scale = amax / 448 by IEEE division in fp32 (1 for an all-zero run), inv = 1 / scale by IEEE
division, q = e4m3(x * inv) rounded to nearest even, x' = dtype(float(q) * scale). The divisor is
a tensor on purpose: `t / 448.0` on CUDA multiplies by torch's rounded reciprocal of the scalar,
which put 11 of 24 scales one bit off the kernel's on the first GPU run.

On CUDA tensors the kernels from `csrc/kv_kernels.cu` run when `libtandem_kv.so` has been built
(`python -m kv_transfer.build`) with this file's ABI; otherwise the references run on the GPU.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FP8_MAX = 448.0
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
LIB_NAME = "libtandem_kv.so"
ABI = 2  # = TANDEM_KV_ABI in csrc/kv_kernels.cu: a library built from other sources is not called
FP8_VARIANTS = {"auto": 0, "cta": 1, "warp": 2, "scalar": 3}


# ---- torch references ------------------------------------------------------------------------

def gather_blocks_ref(cache_: torch.Tensor, block_ids: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        return cache_.index_select(0, block_ids)
    return torch.index_select(cache_, 0, block_ids, out=out)


def scatter_blocks_ref(cache_: torch.Tensor, block_ids: torch.Tensor,
                       staging: torch.Tensor) -> None:
    cache_.index_copy_(0, block_ids, staging)


def nhd_to_hnd_ref(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-3, -2).contiguous()


def hnd_to_nhd_ref(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-3, -2).contiguous()


def fp8_pack_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    runs = x.reshape(-1, x.shape[-3] * x.shape[-2] * x.shape[-1]).float()
    amax = runs.abs().amax(dim=1)
    # Tensor divisors: true IEEE division on every device (see the module docstring).
    scales = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    inv = torch.ones_like(scales) / scales
    q = (runs * inv[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return q.reshape(x.shape), scales.reshape(x.shape[:-3])


def fp8_unpack_ref(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    runs = q.reshape(scales.numel(), -1).view(torch.float8_e4m3fn).float()
    return (runs * scales.reshape(-1, 1)).to(dtype).reshape(q.shape)


# ---- CUDA library ----------------------------------------------------------------------------

def library_path() -> Path:
    return Path(__file__).resolve().parent / "_lib" / LIB_NAME


@cache
def _lib() -> ctypes.CDLL | None:
    path = library_path()
    if not path.is_file():
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("could not load %s: %s", path, e)
        return None
    abi = getattr(lib, "tandem_kv_abi", None)
    if abi is None or abi() != ABI:
        # Its functions take other arguments: calling them would corrupt memory.
        log.warning("%s was built from other sources (ABI %s, want %d); rebuild it with "
                    "`python -m kv_transfer.build`; using the torch references", path,
                    None if abi is None else abi(), ABI)
        return None
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    for fn in ("tandem_gather_blocks", "tandem_scatter_blocks"):
        getattr(lib, fn).argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ptr]
    lib.tandem_transpose.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, cint, ptr]
    lib.tandem_fp8_pack.argtypes = [ptr, ptr, ptr, i64, i64, cint, cint, ptr]
    lib.tandem_fp8_unpack.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_int, ptr]
    return lib


def cuda_kernels_available() -> bool:
    return torch.cuda.is_available() and _lib() is not None


def _use_kernel(t: torch.Tensor) -> bool:
    return t.is_cuda and _lib() is not None


def _stream(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(t.device).cuda_stream)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"CUDA kernel {what} failed with error {rc}")


def _ids(block_ids, device) -> torch.Tensor:
    """[n] int64 on `device`. A list or CPU array goes to a GPU through (cached) pinned memory,
    non-blocking on the current stream: a pageable upload synchronises that stream, which held
    the event loop until the side stream's earlier copies (a TCP unit's D2H) had finished."""
    if isinstance(block_ids, torch.Tensor) and block_ids.device == device:
        return block_ids.to(torch.int64)
    ids = torch.as_tensor(block_ids, dtype=torch.int64)
    if device.type != "cuda":
        return ids.to(device)
    return ids.pin_memory().to(device, non_blocking=True)


# ---- dispatching API ---------------------------------------------------------------------------

def _check_staging(cache_: torch.Tensor, staging: torch.Tensor, n: int) -> None:
    if staging.shape != (n, *cache_.shape[1:]) or staging.dtype != cache_.dtype:
        raise ValueError(f"staging of shape {tuple(staging.shape)} ({staging.dtype}) does not hold "
                         f"{n} blocks of {tuple(cache_.shape[1:])} ({cache_.dtype})")
    if staging.device != cache_.device or not staging.is_contiguous():
        raise ValueError("staging must be contiguous and on the cache's device")


def gather_blocks(cache_: torch.Tensor, block_ids, use_kernel: bool | None = None,
                  out: torch.Tensor | None = None, chunk_bytes: int = 0) -> torch.Tensor:
    """The blocks `block_ids` of `cache_`, back to back, in `out` (e.g. a registered staging
    region's slice) or a new tensor. `chunk_bytes`: bytes of a block one CTA copies (0: picked
    by the kernel so that even 16 blocks fill every SM)."""
    ids = _ids(block_ids, cache_.device)
    if out is not None:
        _check_staging(cache_, out, ids.numel())
    if not (_use_kernel(cache_) if use_kernel is None else use_kernel):
        return gather_blocks_ref(cache_, ids, out)
    if out is None:
        out = torch.empty((ids.numel(), *cache_.shape[1:]), dtype=cache_.dtype,
                          device=cache_.device)
    block_bytes = cache_[0].numel() * cache_.element_size()
    _check(_lib().tandem_gather_blocks(cache_.data_ptr(), out.data_ptr(), ids.data_ptr(),
                                       ids.numel(), cache_.shape[0], block_bytes, chunk_bytes,
                                       _stream(cache_)),
           "gather")
    return out


def scatter_blocks(cache_: torch.Tensor, block_ids, staging: torch.Tensor,
                   use_kernel: bool | None = None, chunk_bytes: int = 0) -> None:
    ids = _ids(block_ids, cache_.device)
    if staging.shape[0] != ids.numel():
        raise ValueError(f"staging holds {staging.shape[0]} blocks, {ids.numel()} ids given")
    if not (_use_kernel(cache_) if use_kernel is None else use_kernel):
        scatter_blocks_ref(cache_, ids, staging)
        return
    staging = staging.contiguous()
    _check_staging(cache_, staging, ids.numel())
    block_bytes = cache_[0].numel() * cache_.element_size()
    _check(_lib().tandem_scatter_blocks(cache_.data_ptr(), staging.data_ptr(), ids.data_ptr(),
                                        ids.numel(), cache_.shape[0], block_bytes, chunk_bytes,
                                        _stream(cache_)), "scatter")


def _transpose(x: torch.Tensor, nhd_to_hnd: bool) -> torch.Tensor:
    x = x.contiguous()
    t, h, d = x.shape[-3:] if nhd_to_hnd else (x.shape[-2], x.shape[-3], x.shape[-1])
    out_shape = (*x.shape[:-3], h, t, d) if nhd_to_hnd else (*x.shape[:-3], t, h, d)
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    runs = x.numel() // (t * h * d)
    _check(_lib().tandem_transpose(x.data_ptr(), out.data_ptr(), runs, t, h, d, x.element_size(),
                                   int(nhd_to_hnd), _stream(x)), "transpose")
    return out


def nhd_to_hnd(x: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    if not (_use_kernel(x) if use_kernel is None else use_kernel):
        return nhd_to_hnd_ref(x)
    return _transpose(x, True)


def hnd_to_nhd(x: torch.Tensor, use_kernel: bool | None = None) -> torch.Tensor:
    if not (_use_kernel(x) if use_kernel is None else use_kernel):
        return hnd_to_nhd_ref(x)
    return _transpose(x, False)


def fp8_pack(x: torch.Tensor, use_kernel: bool | None = None,
             variant: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """`variant` (kernel only): "cta" one CTA per run, "warp" one warp per run (short runs),
    "scalar", or "auto" (warp for runs of up to 3,072 16-bit elements, else cta)."""
    if variant not in FP8_VARIANTS:
        raise ValueError(f"unknown fp8 variant {variant!r}; choose from {', '.join(FP8_VARIANTS)}")
    if x.dtype not in _DTYPE_CODES:
        raise ValueError(f"fp8_pack takes {', '.join(map(str, _DTYPE_CODES))}, not {x.dtype}")
    if not (_use_kernel(x) if use_kernel is None else use_kernel):
        return fp8_pack_ref(x)
    x = x.contiguous()
    run_elems = x.shape[-3] * x.shape[-2] * x.shape[-1]
    runs = x.numel() // run_elems
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(x.shape[:-3], dtype=torch.float32, device=x.device)
    _check(_lib().tandem_fp8_pack(x.data_ptr(), q.data_ptr(), scales.data_ptr(), runs, run_elems,
                                  _DTYPE_CODES[x.dtype], FP8_VARIANTS[variant], _stream(x)),
           "fp8_pack")
    return q, scales


def fp8_unpack(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
               use_kernel: bool | None = None) -> torch.Tensor:
    if scales.numel() == 0 or q.numel() % scales.numel():
        raise ValueError(f"{q.numel()} fp8 bytes do not split into {scales.numel()} runs")
    if not (_use_kernel(q) if use_kernel is None else use_kernel):
        return fp8_unpack_ref(q, scales, dtype)
    q, scales = q.contiguous(), scales.contiguous().float()
    runs = scales.numel()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    _check(_lib().tandem_fp8_unpack(q.data_ptr(), scales.data_ptr(), out.data_ptr(), runs,
                                    q.numel() // runs, _DTYPE_CODES[dtype], _stream(q)),
           "fp8_unpack")
    return out
