"""A real vLLM CPU server for the tests and the benchmarks (`python -m vllm.entrypoints.openai.
api_server` from the separate vLLM venv, `bash bench/setup_vllm_cpu.sh`): one core each, optional
KV events (a ZMQ PUB and a replay ROUTER, both bound on every interface: vLLM binds only on a
wildcard or ipc://, and connects to any other address), a small KV cache for
evictions, the NixlConnector for P/D, and a restart on the same ports (so its id, URL and event
endpoints stay the same, as a restarted pod keeps its address)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from testing.metrics import scrape
from testing.processes import ROOT, free_port, wait_http_ok

MODEL = "smollm2-135m-instruct"
DEFAULT_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def vllm_python() -> Path:
    """The vLLM venv's python: TANDEM_VLLM_PYTHON, else `.venv-vllm` (tests skip without it)."""
    return Path(os.environ.get("TANDEM_VLLM_PYTHON") or DEFAULT_PYTHON)


@dataclass
class VLLMOptions:
    """How one server is started; every field maps to one vLLM flag or variable."""

    core: int | None = None  # VLLM_CPU_OMP_THREADS_BIND: one core each, two servers on two
    block_size: int | None = None  # --block-size (CPU default 128; multiples of 32)
    num_blocks: int | None = None  # --num-gpu-blocks-override: a small cache evicts
    kv_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (what the cache may take before the override)
    kv_events: bool = False  # --kv-events-config: PUB on tcp://*:events_port, replay on replay_port
    topic: str = ""
    nixl: bool = False  # --kv-transfer-config NixlConnector on host memory (P/D)
    max_model_len: int = 1024
    max_num_seqs: int = 4
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: /reset_prefix_cache
    prompt_tokens_details: bool = True  # usage.prompt_tokens_details.cached_tokens in answers
    served_name: str = MODEL
    extra: list[str] = field(default_factory=list)


class VLLMServer:
    """One vLLM OpenAI server in its own session (its engine core and worker stop with it)."""

    def __init__(self, folder: Path, log_dir: Path, options: VLLMOptions | None = None,
                 python: Path | None = None) -> None:
        self.folder, self.log_dir = folder, log_dir
        self.options = o = options or VLLMOptions()
        self.python = python or vllm_python()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events_port = free_port() if o.kv_events else None
        self.replay_port = free_port() if o.kv_events else None
        self.nixl_port = free_port() if o.nixl else None
        self.log_path = log_dir / f"vllm-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.start()

    @property
    def events_endpoint(self) -> str | None:
        """Where a subscriber connects (vLLM bound it on every interface)."""
        return f"tcp://127.0.0.1:{self.events_port}" if self.events_port else None

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None

    def command(self) -> list[str]:
        o = self.options
        cmd = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(self.folder), "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", o.served_name, "--dtype", "float32",
               "--max-model-len", str(o.max_model_len), "--max-num-seqs", str(o.max_num_seqs)]
        if o.block_size:
            cmd += ["--block-size", str(o.block_size)]
        if o.num_blocks:
            cmd += ["--num-gpu-blocks-override", str(o.num_blocks)]
        if o.prompt_tokens_details:
            cmd += ["--enable-prompt-tokens-details"]
        if o.kv_events:
            cmd += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{self.events_port}",
                "replay_endpoint": f"tcp://*:{self.replay_port}", "topic": o.topic})]
        if o.nixl:
            cmd += ["--kv-transfer-config", json.dumps(
                {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})]
        return cmd + o.extra

    def env(self) -> dict[str, str]:
        o = self.options
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(o.kv_space_gib)}
        if o.core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(o.core)
        if o.nixl:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.nixl_port)
        if o.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return env

    def start(self) -> None:
        """Starts the server (the same ports every time); `wait_ready` waits for it."""
        assert self.proc is None or self.proc.poll() is not None, "stop the server first"
        if self._log is not None:
            self._log.close()
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.command(), env=self.env(), stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> None:
        wait_http_ok(self.proc, self.log_path, lambda: httpx.get(f"{self.url}/health", timeout=2),
                     "vLLM", timeout, interval=1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stops the whole process group (API server, engine core, worker)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        # The engine core may outlive the API server for a moment: the group must be gone
        # before the same ports are bound again.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def restart(self, timeout: float = 600) -> None:
        self.stop()
        self.start()
        self.wait_ready(timeout)

    def close(self) -> None:
        self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None

    def metrics(self) -> dict[str, float]:
        with httpx.Client(base_url=self.url, timeout=10) as c:
            return scrape(c)

    def prefix_cache(self) -> tuple[float, float]:
        """vLLM's own prefix-cache counters since it started: (hit tokens, queried tokens)."""
        m = self.metrics()

        def total(name: str) -> float:
            return sum(v for k, v in m.items() if k.partition("{")[0] == name)

        return total("vllm:prefix_cache_hits_total"), total("vllm:prefix_cache_queries_total")

    def reset_prefix_cache(self) -> None:
        """Empties the prefix cache (needs `dev_mode`)."""
        r = httpx.post(f"{self.url}/reset_prefix_cache", timeout=30)
        r.raise_for_status()
