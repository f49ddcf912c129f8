"""Loading Hugging Face safetensors checkpoints into `LlamaForCausalLM`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.linear import packing_supported
from engine.model import LlamaForCausalLM

LOAD_FORMATS = ("auto", "dummy")  # auto: the folder's safetensors; dummy: random weights

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
        raise ValueError(f"tensor {name!r}: checkpoint shape {tuple(got)} != model "
                         f"shape {tuple(want)}")


def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights drawn where the model lives (vLLM's `load_format="dummy"`): no checkpoint
    is read, so a model of real size is ready in a second on a GPU. Scales keep activations of
    order one: embedding N(0, 1), matmul weights N(0, 1/fan_in), norms 1, biases 0."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            elif "embed_tokens" in name:
                param.normal_(0.0, 1.0, generator=gen)
            else:
                param.normal_(0.0, param.shape[1] ** -0.5, generator=gen)


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give each parameter and buffer of a model built on the meta device uninitialized storage
    on `device`, floating point ones in `dtype`: what `model.to(dtype).to_empty(device=device)`
    does, without running the meta device's Python kernels, which import sympy and torch.fx
    (a third of a second of every worker's start; tests/engine/test_model_init.py)."""
    made: dict[int, torch.Tensor] = {}  # a tensor shared by two modules stays shared

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = torch.empty(t.shape, device=device,
                                      dtype=dtype if t.is_floating_point() else t.dtype)
        return made[id(t)]

    for module in model.modules():
        # Assigning a registered name replaces it in place (a buffer stays non-persistent).
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(empty(param),
                                                     requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, empty(buffer))


def load_model(folder: Path, cfg: ModelConfig, max_positions: int, device: torch.device,
               dtype: torch.dtype, pack_weights: bool, load_format: str = "auto",
               seed: int = 0) -> LlamaForCausalLM:
    """The model of `folder` on `device`, weights loaded (or drawn at random with
    `load_format="dummy"`), matmuls packed where supported."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                         f"got {load_format!r}")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    materialize(model, device, dtype)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_weights(model, folder)
    model.model.rope.init_tables(device)
    if pack_weights and packing_supported(device, dtype):
        model.pack_weights()
    return model.eval()
