"""Model shapes of real size, as Hugging Face config dicts, for benchmarks and GPU checks that
build a model with random weights instead of downloading one (`engine.tiny.build_tiny_random`
with `config=SHAPES[name]`, or a model built in memory from `ModelConfig.from_dict`)."""

from __future__ import annotations

from engine.tiny import TINY_CONFIG

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
          "max_position_embeddings": 8192}

SHAPES: dict[str, dict] = {
    "tiny": dict(TINY_CONFIG),
    # SmolLM2-1.7B: 1.71 B parameters, MHA, SmolLM2's 49,152-token vocabulary.
    "smollm2-1.7b": {**_LLAMA, "vocab_size": 49152, "hidden_size": 2048,
                     "intermediate_size": 8192, "num_hidden_layers": 24,
                     "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 64,
                     "rope_theta": 130000.0, "tie_word_embeddings": True,
                     "bos_token_id": 1, "eos_token_id": 2},
    # Llama-3-8B: GQA with 8 KV heads, 128,256-token vocabulary.
    "llama3-8b": {**_LLAMA, "vocab_size": 128256, "hidden_size": 4096,
                  "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                  "rope_theta": 500000.0, "tie_word_embeddings": False,
                  "bos_token_id": 128000, "eos_token_id": 128001},
}
