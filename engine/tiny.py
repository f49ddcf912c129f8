"""`tiny-random`: a small Llama with seeded random weights and a byte-level tokenizer, built in
code and written as an ordinary Hugging Face folder, so fast tests exercise the real load path."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

TINY_ID = "tiny-random"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "bos_token_id": 257,
    "eos_token_id": 258,
}


def build_tiny_random(out: Path, seed: int = 0, config: dict | None = None, *,
                      device: str = "cpu", dtype: str = "float32",
                      tokenizer_from: Path | None = None) -> Path:
    """Write config, seeded random weights and tokenizer into `out` (same seed, same bytes).

    `config` overrides the tiny shape (a real model's shape makes a random model of real size;
    `device="cuda"` draws its weights on the GPU, where gigabytes take seconds); `dtype` is the
    stored dtype; `tokenizer_from` copies a real model folder's tokenizer and chat template
    instead of writing the byte-level one (its vocabulary must fit the config's).

    Atomic: the folder is built under a temporary name and renamed into place, so processes that
    start together (a prefill and a decode worker) never read a half-written folder; if another
    one got there first, its (identical) folder is kept."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    _write(tmp, seed, config, device, dtype, tokenizer_from)
    try:
        os.rename(tmp, out)  # replaces an empty folder; refuses a full one
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "tokenizer.json").is_file():
            raise
    return out


def _write(out: Path, seed: int, config: dict | None, device: str, dtype: str,
           tokenizer_from: Path | None) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = {**TINY_CONFIG, **(config or {})}
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    store = getattr(torch, dtype)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def rand(*shape: int, scale: float = 0.08) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen, device=device).mul_(scale)
        return x.to(store).cpu()

    state = {"model.embed_tokens.weight": rand(v, h, scale=1.0), "model.norm.weight": 1 + rand(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state |= {
            p + "input_layernorm.weight": 1 + rand(h),
            p + "post_attention_layernorm.weight": 1 + rand(h),
            p + "self_attn.q_proj.weight": rand(q, h, scale=0.3),
            p + "self_attn.k_proj.weight": rand(kv, h, scale=0.3),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        }
        if cfg.get("model_type") == "qwen2" or cfg.get("attention_bias"):
            state |= {
                p + "self_attn.q_proj.bias": rand(q),
                p + "self_attn.k_proj.bias": rand(kv),
                p + "self_attn.v_proj.bias": rand(kv),
            }
    if not cfg["tie_word_embeddings"]:
        state["lm_head.weight"] = rand(v, h, scale=0.5)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer_from is None:
        write_tokenizer(out)
        return
    copy_tokenizer(Path(tokenizer_from), out)


def copy_tokenizer(src: Path, dest: Path) -> None:
    """`src`'s tokenizer and chat template files (those it has), copied into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dest / name)


def write_tokenizer(out: Path) -> None:
    """The byte-level tokenizer (ids 0-255 bytes, 256-258 specials) and its config; a larger
    model vocabulary is fine: ids past the tokenizer decode to nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_SPECIALS)  # ids 256, 257, 258
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|im_start|>",
                "eos_token": "<|im_end|>",
                "chat_template": _CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
