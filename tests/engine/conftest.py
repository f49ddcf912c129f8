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


@pytest.fixture(scope="session")
def rope_512():
    """RoPE tables of a small Llama config (4 heads, 2 KV heads of 64) for positions 0..511."""
    from engine.config import ModelConfig
    from engine.rope import RotaryEmbedding

    cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 256,
                                 "intermediate_size": 8, "num_hidden_layers": 1,
                                 "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "max_position_embeddings": 512})
    rope = RotaryEmbedding(cfg, 512)
    rope.init_tables("cpu")
    return rope
