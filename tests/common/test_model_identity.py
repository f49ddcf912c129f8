"""The one reader of a model folder's vocabulary size (common/model_identity.py), which the
router and the vLLM bridge both use: a multimodal config's `text_config` too (the bridge's own
copy once missed it), and None for whatever is no valid size."""

from __future__ import annotations

import json

import pytest

from common.bounds import MAX_TOKEN_ID
from common.model_identity import config_vocab_size


def folder_with(tmp_path, config) -> str:
    text = config if isinstance(config, str) else json.dumps(config)
    (tmp_path / "config.json").write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize("config,want", [
    ({"vocab_size": 49152}, 49152),
    # A multimodal model (Llava, Gemma 3, Mistral 3, ...): the text model's vocabulary.
    ({"model_type": "llava", "text_config": {"vocab_size": 32064}}, 32064),
    ({"vocab_size": 151936, "text_config": {"vocab_size": 1}}, 151936),  # the top level first
    ({"vocab_size": None, "text_config": {"vocab_size": 262208}}, 262208),
    ({"vocab_size": MAX_TOKEN_ID + 1}, MAX_TOKEN_ID + 1),
    ({"model_type": "llama"}, None),
    ({"text_config": None}, None),
    ({"text_config": ["vocab_size"]}, None),
    ({"vocab_size": 0}, None),
    ({"vocab_size": -5}, None),
    ({"vocab_size": MAX_TOKEN_ID + 2}, None),
    ({"vocab_size": "49152"}, None),
    ({"vocab_size": 49152.0}, None),
    ({"vocab_size": True}, None),
    ([1, 2], None),
    ("{not json", None),
])
def test_vocab_size_of_a_config(tmp_path, config, want):
    assert config_vocab_size(folder_with(tmp_path, config)) == want


def test_no_config_is_no_size(tmp_path):
    assert config_vocab_size(tmp_path) is None
    assert config_vocab_size(tmp_path / "missing") is None


def test_the_router_and_the_bridge_read_it_with_this_function():
    import router.models
    import vllm_bridge.bridge

    assert router.models.config_vocab_size is config_vocab_size
    assert vllm_bridge.bridge.config_vocab_size is config_vocab_size
