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
    if os.environ.get("TRITON_INTERPRET") == "1":
        _fix_interpreter_index()
    import engine.triton_kernels as kernels

    return kernels


def _fix_interpreter_index() -> None:
    # Triton 3.6's interpreter turns a scalar into a Python int with int(array) on a 1-element
    # array, which numpy >= 2.4 refuses (a runtime loop bound such as range(start, end, BLOCK_N)
    # needs it); take the element instead.
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "tandem_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.tandem_fixed = True
    interpreter._patch_lang_tensor = patched
