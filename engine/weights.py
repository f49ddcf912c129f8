"""Loading Hugging Face safetensors checkpoints into `LlamaForCausalLM`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.linear import packing_supported
from engine.model import LlamaForCausalLM

# checkpoint name fragment -> (fused parameter fragment, shard index within the fused tensor)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_weights(model: LlamaForCausalLM, folder: str | Path) -> None:
    """Fill every parameter of `model` from `folder/*.safetensors`; missing or extra names raise."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    params = dict(model.named_parameters())
    cfg = model.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shard_rows = {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                if name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied to the embedding
                tensor = f.get_tensor(name)
                target, rows = _target(name, shard_rows)
                if target not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
                param = params[target]
                with torch.no_grad():
                    if rows is None:
                        _check_shape(name, param.shape, tensor.shape)
                        param.copy_(tensor)
                    else:
                        start, size = rows
                        dst = param.narrow(0, start, size)
                        _check_shape(name, dst.shape, tensor.shape)
                        dst.copy_(tensor)
                loaded.add(f"{target}#{rows}")
    expected = set()
    for pname in params:
        frag = next((f for f in shard_rows if f".{f}." in pname), None)
        if frag is None:
            expected.add(f"{pname}#None")
        else:
            sizes = shard_rows[frag]
            expected.update(f"{pname}#{(sum(sizes[:i]), sizes[i])}" for i in range(len(sizes)))
    missing = sorted(expected - loaded)
    if missing:
        raise KeyError(f"checkpoint in {folder} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _target(name: str, shard_rows: dict[str, list[int]]) -> tuple[str, tuple[int, int] | None]:
    for frag, (fused, idx) in _STACKED.items():
        if f".{frag}." in name:
            sizes = shard_rows[fused]
            return name.replace(f".{frag}.", f".{fused}."), (sum(sizes[:idx]), sizes[idx])
    return name, None


def _check_shape(name: str, want: torch.Size, got: torch.Size) -> None:
    if tuple(want) != tuple(got):
        raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(got)} != model shape {tuple(want)}")


def load_model(folder: Path, cfg: ModelConfig, max_positions: int, device: torch.device,
               dtype: torch.dtype, pack_weights: bool) -> LlamaForCausalLM:
    """The model of `folder` on `device`, weights loaded, matmuls packed where supported."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    model = model.to(dtype).to_empty(device=device)
    load_weights(model, folder)
    model.model.rope.init_tables(device)
    if pack_weights and packing_supported(device, dtype):
        model.pack_weights()
    return model.eval()
