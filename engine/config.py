"""Engine configuration: what the model is (`ModelConfig`, read from config.json) and how the
engine runs it (`EngineConfig`, built once at the edge by the CLI or a service's settings)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, normalised across Llama-family configs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # transformers >= 5 nests rope settings under rope_parameters; older configs are flat.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope else None)
        if scaling is not None:
            scaling = dict(scaling)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            scaling["rope_type"] = rope_type
            if rope_type == "default":
                scaling = None
        attention_bias = bool(cfg.get("attention_bias", False))
        qwen2 = model_type == "qwen2"
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 has biases on q/k/v only; Llama's attention_bias covers q/k/v/o.
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    def stop_ids(self, tokenizer_eos_id: int | None) -> tuple[int, ...]:
        """The ids that end a sequence: the config's EOS ids, then the tokenizer's, once each."""
        extra = () if tokenizer_eos_id is None else (tokenizer_eos_id,)
        return tuple(dict.fromkeys(self.eos_token_ids + extra))

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model folder {path}")
        cfg = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            gen = json.loads(gen_file.read_text())
            if gen.get("eos_token_id") is not None:
                cfg["eos_token_id"] = _merge_ids(cfg.get("eos_token_id"), gen["eos_token_id"])
        return cls.from_dict(cfg)


def _merge_ids(a: Any, b: Any) -> list[int]:
    out: list[int] = []
    for x in (a, b):
        for i in x if isinstance(x, list) else [x]:
            if i is not None and i not in out:
                out.append(i)
    return out


@dataclass
class EngineConfig:
    """How one engine instance runs. Built once at the edge; library code never reads env vars.

    `num_blocks` wins over `kv_memory_bytes`; with neither, 1 GiB of KV cache is allocated.
    """

    model: str
    model_id: str | None = None
    cache_dir: Path | None = None
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_bytes: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Prompts longer than this are prefilled one at a time (engine/scheduler.py); None: no limit.
    long_prefill_token_threshold: int | None = 512
    max_long_prefills: int = 1
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    hash_salt: str | None = None
    seed: int = 0
    num_threads: int | None = None
    # Reorder weights once for oneDNN where supported (CPU float32): 1.6-2.5x faster matmuls at
    # decode batch sizes (engine/linear.py).
    pack_weights: bool = True
    # Fused C++ layer ops on CPU float32 (RMSNorm with the residual add, RoPE with the KV store,
    # SiLU-and-multiply: engine/cpu_ops.py), built once per user into ~/.cache/tandem/cpu_ops/
    # (not under `cache_dir`: a build serves every model folder); where no compiler builds them,
    # the plain torch ops.
    cpu_ops: bool = True
    # Back the KV cache with this file (on CPU, a shared mapping in /dev/shm) instead of private
    # memory, so the worker's API process, which runs the KV transfer, maps the same blocks as
    # the engine-core process that computes them (engine/core_client.py).
    kv_cache_path: str | None = None
    # Decode attention: "triton" (paged kernels reading the cache in place; engine/
    # triton_kernels.py) or "sdpa" (gather + SDPA, engine/attention.py). None: triton on CUDA,
    # sdpa on CPU (where Triton runs only in its interpreter).
    attention_backend: str | None = None
    # No CUDA graphs: every step eager (vLLM's --enforce-eager). On CPU graphs are never used.
    enforce_eager: bool = False
    # Overlap the host with the device in steady decode (engine/decode_pipeline.py). None: on
    # with CUDA graphs (CUDA, triton, not enforce_eager), off otherwise; True: on anywhere (the
    # CPU tests of the overlapped loop).
    async_scheduling: bool | None = None
    # "auto": the folder's safetensors; "dummy": random weights drawn on the device, no
    # checkpoint needed (benchmarks of a model shape: engine/shapes.py, bench/engine.py).
    load_format: str = "auto"
    # A request whose reader has left more than this many of its tokens unread is parked: out
    # of the batch until the reader catches up, aborted after `parked_timeout_s` parked
    # (engine/output_stream.py; the async clients apply it). None: never parked.
    max_unread_tokens: int | None = None
    parked_timeout_s: float = 30.0
    # "fair": the batch shared between the clients requests are tagged with
    # (engine/fair_share.py); "fcfs": tags ignored, first come, first served.
    scheduling_policy: str = "fair"
    # KV tiers below the device pool (engine/kv_tiers.py): blocks evicted from it are kept in
    # host memory (this many bytes; 0: no host tier) and spill from there to block files in
    # `disk_kv_dir` (at most `disk_kv_bytes`; None: no disk tier), from where a later prefix
    # hit reloads them. The disk tier survives a restart on the same folder.
    host_kv_bytes: int = 0
    disk_kv_dir: str | None = None
    disk_kv_bytes: int = 10 << 30
    # A reload predicted (at the tier's measured rate) to take at most this long runs at
    # admission, on the engine's thread; a longer one (or one not measured yet) runs off the
    # step while the sequence waits in the scheduler's loading state (engine/kv_cache_manager.py).
    inline_load_s: float = 0.002
    # The SDPA path keeps decode rows' keys and values contiguous between steps, in at most this
    # many bytes, instead of gathering them from the blocks in every layer of every step
    # (engine/decode_kv_mirror.py); 0: gathered every time.
    decode_kv_mirror_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be >= 1 (or None)")
        if self.max_long_prefills < 1:
            raise ValueError("max_long_prefills must be >= 1")
        if self.max_unread_tokens is not None and self.max_unread_tokens < 1:
            raise ValueError("max_unread_tokens must be >= 1 (or None)")
        if not self.parked_timeout_s > 0:
            raise ValueError("parked_timeout_s must be > 0")
        if self.scheduling_policy not in ("fair", "fcfs"):
            raise ValueError("scheduling_policy must be fair or fcfs, "
                             f"got {self.scheduling_policy!r}")
        if self.host_kv_bytes < 0 or self.disk_kv_bytes < 0:
            raise ValueError("host_kv_bytes and disk_kv_bytes must be >= 0")
        if self.decode_kv_mirror_bytes < 0:
            raise ValueError("decode_kv_mirror_bytes must be >= 0")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.attention_backend not in (None, "sdpa", "triton"):
            raise ValueError("attention_backend must be sdpa or triton, "
                             f"got {self.attention_backend!r}")

    @property
    def attention(self) -> str:
        """The attention backend in effect."""
        if self.attention_backend is not None:
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "sdpa"

    @property
    def overlaps_steps(self) -> bool:
        """Whether decode steps overlap the host (see `async_scheduling`)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return (self.device.startswith("cuda") and self.attention == "triton"
                and not self.enforce_eager)

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"
