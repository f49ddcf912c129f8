import pytest

from engine.tokenizer import ChatTemplateError, Tokenizer

TEXT = "Grüße, 世界! naïve café — 🚀 done."


@pytest.fixture
def tiny_tok(tiny_folder):
    return Tokenizer(tiny_folder)


def test_roundtrip_and_incremental_decode_with_multibyte_text(tiny_tok):
    ids = tiny_tok.encode(TEXT)
    assert len(ids) > len(TEXT)  # byte-level: multi-byte characters span several tokens
    assert tiny_tok.decode(ids) == TEXT
    stream = tiny_tok.decode_stream()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) == TEXT
    assert "" in pieces  # incomplete UTF-8 sequences wait for their next byte


def test_special_tokens_skipped_in_text(tiny_tok):
    ids = tiny_tok.encode_chat([{"role": "user", "content": "hi"}])
    assert tiny_tok.decode(ids) == "user\nhi\nassistant\n"
    assert tiny_tok.eos_token_id == 258 and tiny_tok.bos_token_id == 257


def test_chat_template_errors(tiny_tok):
    with pytest.raises(ChatTemplateError, match="must not be empty"):
        tiny_tok.apply_chat_template([])


@pytest.mark.slow
def test_smollm2_incremental_decode_matches_full(smollm2_folder):
    tok = Tokenizer(smollm2_folder)
    ids = tok.encode(TEXT)
    stream = tok.decode_stream()
    assert "".join(stream.step(i) for i in ids) == tok.decode(ids) == TEXT


@pytest.mark.slow
def test_smollm2_default_system_prompt_from_template(smollm2_folder):
    tok = Tokenizer(smollm2_folder)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
