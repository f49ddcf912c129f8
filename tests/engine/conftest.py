"""Triton on a machine without a GPU: the kernels run in Triton's interpreter on CPU tensors.

TRITON_INTERPRET must be set before `engine.triton_kernels` is imported (the decorator reads it),
so it is set here, at collection, when no CUDA device is present; with one, the kernels compile.
"""

import os

import pytest


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def triton_kernels():
    """engine.triton_kernels, compiled on a GPU or interpreted on CPU (triton must be installed:
    it ships with torch's CUDA wheels; `pip install triton` on a CPU machine)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    import engine.triton_kernels as kernels

    if os.environ.get("TRITON_INTERPRET") == "1":
        kernels.fix_interpreter_scalars()
    return kernels
