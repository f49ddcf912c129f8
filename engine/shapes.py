"""Llama model shapes for measuring the engine on a GPU without a download: a Hugging Face
config and the byte-level tokenizer, no weights (`EngineConfig(load_format="dummy")` fills
random ones on the device). Token ids past the tokenizer's 259 decode to nothing."""

from __future__ import annotations

import json
from pathlib import Path

from engine.tiny import TINY_CONFIG, write_tokenizer

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
          "max_position_embeddings": 8192, "bos_token_id": 257, "eos_token_id": 258}

SHAPES: dict[str, dict] = {
    # HuggingFaceTB/SmolLM2-1.7B: 1.71 B parameters, 3.4 GB in bf16.
    "smollm2-1.7b": {**_LLAMA, "vocab_size": 49152, "hidden_size": 2048,
                     "intermediate_size": 8192, "num_hidden_layers": 24,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 64,
                     "rope_theta": 130000.0, "tie_word_embeddings": True},
    # meta-llama/Meta-Llama-3-8B: 8.0 B parameters, 16 GB in bf16.
    "llama3-8b": {**_LLAMA, "vocab_size": 128256, "hidden_size": 4096,
                  "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                  "rope_theta": 500000.0, "tie_word_embeddings": False},
    # The tiny-random shape, for quick runs on CPU.
    "tiny": dict(TINY_CONFIG),
}


def write_shape_folder(name: str, out: Path) -> Path:
    """A model folder of shape `name` (config.json and tokenizer, no weights) at `out`."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    write_tokenizer(out)
    return out
