"""The CPU path's fused layer ops: engine/cpu_ops.cpp, built once with the machine's C++
compiler and loaded into torch.

A CPU decode step of SmolLM2 runs some 900 small kernels besides its 121 matmuls (RMSNorm alone
is six, RoPE four, SiLU-and-multiply two, each residual add one), and each starts with cold
caches after a matmul has streamed its weights through them: the kernels cost about twice what
they cost alone. These three ops do a layer's share in four calls, the interface of the GPU
path's Triton kernels (engine/fused_ops.py), so the model runs its fused forward on both.

`load_cpu_ops(build_root)` compiles the source into `build_root/<digest>/` (the digest covers
the source, torch's version and the flags, so an upgrade rebuilds) unless a build is there, and
returns the ops, or None where no compiler works: the engine then runs the plain torch ops,
slower but the same tokens. A build takes ~8 s on two cores; `python -m engine.cpu_ops` does it
ahead of time. Only float32 on CPU.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from engine.model_store import default_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
LIBRARY = "libtandem_cpu_ops.so"
# -ffp-contract=off: each product and sum rounds on its own, as torch's kernels do (no FMA).
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd", "-ffp-contract=off",
         f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
BUILD_TIMEOUT_S = 600


class CpuLayerOps:
    """The fused ops under engine/fused_ops.py's names, which the model calls them by:
    `add_rms_norm(x, residual, weight, eps) -> [normed, residual]`,
    `rope_store(qkv, positions, cos, sin, kv_cache, slot_mapping, num_heads)` (in place) and
    `silu_mul(gate_up)`: the torch ops themselves, their overloads bound once."""

    def __init__(self, library: Path) -> None:
        self.library = library
        ops = torch.ops.tandem_cpu
        self.add_rms_norm = ops.add_rms_norm.default
        self.rope_store = ops.rope_store.default
        self.silu_mul = ops.silu_mul.default


def build_digest(source: Path = SOURCE) -> str:
    h = hashlib.sha256(source.read_bytes())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{' '.join(FLAGS)}".encode())
    return h.hexdigest()[:16]


def cpu_layer_ops(enabled: bool, device: torch.device, dtype: torch.dtype,
                  kv_dtype: torch.dtype, attention: str) -> CpuLayerOps | None:
    """The ops where they apply (CPU, float32 weights and cache, the SDPA path), built once per
    user whatever the model cache: a build serves every model folder."""
    if not (enabled and device.type == "cpu" and dtype == torch.float32
            and kv_dtype == torch.float32 and attention == "sdpa"):
        return None
    return load_cpu_ops(default_cache_dir() / "cpu_ops")


def load_cpu_ops(build_root: Path, source: Path = SOURCE) -> CpuLayerOps | None:
    """The ops from `build_root`, built there first if needed; None if they cannot be built.
    A process loads them once: later calls find them registered."""
    try:
        library = build_root / build_digest(source) / LIBRARY
        if not _registered():
            if not library.exists():
                _build(source, library)
            torch.ops.load_library(str(library))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("the fused CPU ops could not be built (%s); running the plain torch ops", e)
        return None
    return CpuLayerOps(library)


def _registered() -> bool:
    try:
        torch.ops.tandem_cpu.silu_mul  # noqa: B018 (raises until the library is loaded)
    except (AttributeError, RuntimeError):
        return False
    return True


def _build(source: Path, library: Path) -> None:
    """Compile into a private folder and move the library into place in one rename, so that a
    process killed mid-build, or two building at once, never leave a partial library."""
    from torch.utils.cpp_extension import include_paths, library_paths

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler (c++ or g++) on PATH")
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        out = Path(tmp) / LIBRARY
        lib_dirs = library_paths()
        cmd = [compiler, *FLAGS, *(f"-I{p}" for p in include_paths()), str(source), "-o",
               str(out), *(f"-L{p}" for p in lib_dirs), *(f"-Wl,-rpath,{p}" for p in lib_dirs),
               "-lc10", "-ltorch_cpu"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise OSError(f"{compiler} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        os.replace(out, library)
    log.info("built the fused CPU ops into %s", library)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    ops = load_cpu_ops(default_cache_dir() / "cpu_ops")
    print(ops.library if ops else "not built")
    sys.exit(0 if ops else 1)
