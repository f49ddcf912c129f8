"""What bench/serving.py and bench/serving_mixed.py run against: each target (vLLM CPU, Tandem
colocated, Tandem P/D, vLLM P/D) started on fresh processes, each process in its own session so
the whole group stops together."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from tandem.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODEL = "smollm2-135m-instruct"


class Procs:
    """Processes of one target, each in its own session so the whole group is stopped."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, cmd: list[str],
              env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, env={**os.environ, **(env or {})})
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def wait_ok(url: str, procs: Procs, timeout: float = 600, check=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[:4]} exited with {p.returncode}; logs in {procs.logs}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                body = r.read()
                if check is None or check(body):
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready in {timeout} s; logs in {procs.logs}")


def vllm_cmd(python: str, folder: Path, port: int, max_len: int, extra: list[str]) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", str(max_len), *extra]


def start_target(target: str, args, folder: Path, procs: Procs, max_len: int) -> str:
    """Starts `target`; returns the base URL aiperf talks to."""
    vllm_env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    if target == "vllm":
        port = free_port()
        procs.start("vllm", vllm_cmd(args.vllm_python, folder, port, max_len, []),
                    {**vllm_env, "OMP_NUM_THREADS": str(args.threads)})
        wait_ok(f"http://127.0.0.1:{port}/health", procs)
        return f"http://127.0.0.1:{port}"
    # `-thread` / `-proc`: the Tandem targets with the engine on a thread of the worker or in
    # its own process (TANDEM_ENGINE_PROCESS reaches every worker `tandem up` starts).
    # `-t<N>`: this target's engine on N threads instead of `--threads` (colocated-t1: one
    # core for the model, the other left to the API and the load, as vLLM CPU binds itself).
    threads = args.threads
    if (m := re.fullmatch(r"(.+)-t(\d+)", target)) and m[1].startswith("colocated"):
        target, threads = m[1], int(m[2])
    engine_env = {}
    for suffix, value in (("-thread", "false"), ("-proc", "true")):
        if target.endswith(suffix) and target.startswith(("colocated", "pd")):
            target, engine_env = target.removesuffix(suffix), {"TANDEM_ENGINE_PROCESS": value}
    if target == "colocated":
        port = free_port()
        procs.start(target, [str(ROOT / ".venv" / "bin" / "tandem"), "colocated", "--model",
                             str(folder), "--port", str(port), "--threads", str(threads),
                             "--kv-memory", "2", "--max-model-len", str(max_len)], engine_env)
        wait_ok(f"http://127.0.0.1:{port}/ready", procs)
        return f"http://127.0.0.1:{port}"
    if target == "pd":
        port = free_port()
        # By name, not path: the router serves the model under the name it was given.
        procs.start("tandem-up", [str(ROOT / ".venv" / "bin" / "tandem"), "up", "--model", MODEL,
                                  "--port", str(port), "--prefill", "1", "--decode", "1",
                                  "--threads", "1", "--namespace",
                                  f"bench-serving-{uuid.uuid4().hex[:8]}"],
                    engine_env)
        wait_ok(f"http://127.0.0.1:{port}/ready", procs,
                check=lambda b: len(json.loads(b).get("workers", [])) >= 2)
        return f"http://127.0.0.1:{port}"
    if target == "vllm-pd":
        router = shutil_which("vllm-router")
        ports = {}
        for role, core in (("prefill", 0), ("decode", 1)):
            ports[role] = free_port()
            kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
            procs.start(f"vllm-{role}", vllm_cmd(args.vllm_python, folder, ports[role], max_len,
                                                  ["--kv-transfer-config", json.dumps(kv)]),
                        {**vllm_env, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
                         "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
        for role in ports:
            wait_ok(f"http://127.0.0.1:{ports[role]}/health", procs)
        port = free_port()
        procs.start("vllm-router", [router, "--vllm-pd-disaggregation",
                                    "--prefill", f"http://127.0.0.1:{ports['prefill']}",
                                    "--decode", f"http://127.0.0.1:{ports['decode']}",
                                    "--host", "127.0.0.1", "--port", str(port)])
        wait_ok(f"http://127.0.0.1:{port}/health", procs)
        return f"http://127.0.0.1:{port}"
    raise ValueError(f"unknown target {target!r}")


def shutil_which(name: str) -> str:
    import shutil

    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError(f"{name} is not installed (make install puts it in .venv)")
    return found


def median(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None
