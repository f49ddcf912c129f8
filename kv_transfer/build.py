"""Compile `csrc/kv_kernels.cu` with nvcc into `_lib/libtandem_kv.so`.

    python -m kv_transfer.build [--out PATH] [--arch 80,90]

CUDA code must compile even on machines without a GPU (CI does this); running it needs one.
It imports neither torch nor the rest of the package, so the CUDA image's build stage (an
nvcc image with only Python) runs this same command (docker/Dockerfile, target `kernels`).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "csrc" / "kv_kernels.cu"
LIBRARY = Path(__file__).resolve().parent / "_lib" / "libtandem_kv.so"  # = kernels.library_path()
DEFAULT_ARCHS = ("80", "90")


def nvcc_path() -> str | None:
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)


def build(out: Path | None = None, archs: tuple[str, ...] = DEFAULT_ARCHS) -> Path:
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found; install the CUDA toolkit to build the kernels")
    out = out or LIBRARY
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17"]
    for arch in archs:
        cmd += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    cmd += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]  # PTX for newer GPUs
    cmd += ["-o", str(out), str(SOURCE)]
    subprocess.run(cmd, check=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--arch", default=",".join(DEFAULT_ARCHS))
    args = ap.parse_args()
    path = build(Path(args.out) if args.out else None, tuple(args.arch.split(",")))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
