"""`tandem prepare-model --hf-repo` (the chart's `model.source: huggingface` init containers)
against a Hub mirror over real HTTP: the worker's download serves the same tokens as the
original folder; the router's `--tokenizer-only` download carries no weights."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest
import uvicorn

from testing.processes import ROOT, free_port
from tests.deploy.hub_mirror import make_app


@contextlib.contextmanager
def mirror(repos: dict):
    """The mirror on a free loopback port, in a thread; its URL (HF_ENDPOINT)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(repos), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def hub(tiny_folder):
    with mirror({"acme/tiny": tiny_folder}) as url:
        yield url


def _prepare(hub: str, tmp_path, *args: str, repo: str = "acme/tiny",
             without_torch: bool = False) -> subprocess.CompletedProcess:
    """`tandem prepare-model --hf-repo REPO ARGS` in a fresh process; `without_torch` as in the
    router image, which has none."""
    env = {**os.environ, "HF_ENDPOINT": hub, "HF_HOME": str(tmp_path / "hf-home")}
    block = "sys.modules['torch'] = None; " if without_torch else ""
    code = f"import sys; {block}from tandem.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "prepare-model", "--hf-repo", repo, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_a_worker_download_serves_what_the_original_folder_serves(hub, tmp_path, tiny_folder):
    from engine import LLM, SamplingParams

    out = tmp_path / "models" / "tiny"
    r = _prepare(hub, tmp_path, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = LLM(str(out), num_blocks=64, block_size=4).generate(["a mirrored model"], params)[0]
    want = LLM(str(tiny_folder), num_blocks=64,
               block_size=4).generate(["a mirrored model"], params)[0]
    assert got.token_ids == want.token_ids


def test_a_router_download_without_torch_has_the_tokenizer_and_no_weights(
        hub, tmp_path, tiny_folder):
    from common.tokenizer import Tokenizer

    out = tmp_path / "router-model"
    r = _prepare(hub, tmp_path, "--out", str(out), "--tokenizer-only", without_torch=True)
    assert r.returncode == 0, r.stderr
    assert not list(out.glob("*.safetensors"))
    assert Tokenizer(out).encode("same ids") == Tokenizer(tiny_folder).encode("same ids")


def test_a_repository_without_weights_is_a_clear_error(tmp_path, tiny_folder):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (bare / f).write_bytes((tiny_folder / f).read_bytes())
    with mirror({"acme/bare": bare}) as url:
        r = _prepare(url, tmp_path, "--out", str(tmp_path / "y"), repo="acme/bare")
    assert r.returncode != 0 and "acme/bare has no *.safetensors" in r.stderr
