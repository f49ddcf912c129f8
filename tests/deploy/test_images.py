"""The images' recipes: the CUDA worker target compiles the KV kernels (the same build command
runs here with nvcc, compile-only) and puts them where the loader looks; compose's GPU profile
reserves a GPU per worker and runs that image; its vLLM profile runs each vLLM server beside a
bridge that reads its KV events."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from kv_transfer.build import nvcc_path
from kv_transfer.kernels import LIB_NAME
from tests.deploy.tools import ROOT

DOCKERFILE = ROOT / "docker" / "Dockerfile"


def stages() -> dict[str, str]:
    """Stage name -> its text (from its FROM line to the next)."""
    text = DOCKERFILE.read_text()
    parts = re.split(r"^(?=FROM )", text, flags=re.M)
    out = {}
    for part in parts[1:]:
        name = re.match(r"FROM \S+ AS (\S+)", part)
        if name:
            out[name.group(1)] = part
    return out


def test_the_cuda_worker_ships_the_kernels_where_the_loader_looks():
    s = stages()
    assert {"kernels", "worker-cuda-build", "worker-cuda", "worker"} <= set(s)
    # The legacy builder (docker-compose v1's builds) builds every stage before its target:
    # the CPU images must not need the CUDA devel image or torch's CUDA wheels.
    order = list(s)
    cuda = min(order.index(n) for n in ("kernels", "worker-cuda-build", "worker-cuda"))
    assert order.index("router") < cuda and order.index("worker") < cuda
    copy = re.search(r"COPY --from=kernels (\S+) (\S+)", s["worker-cuda"])
    assert copy and copy.group(2).endswith(f"/site-packages/kv_transfer/_lib/{LIB_NAME}")
    assert "whl/cu1" in s["worker-cuda-build"] and '".[worker]"' in s["worker-cuda-build"]
    run = re.search(r"^RUN (python3 -m kv_transfer\.build .*)$", s["kernels"], flags=re.M)
    assert run and copy.group(1) in run.group(1)


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
def test_the_kernels_stage_command_compiles_here_for_sm80_and_sm90(tmp_path):
    run = re.search(r"^RUN python3 -m (kv_transfer\.build .*)$", stages()["kernels"], flags=re.M)
    args = shlex.split(run.group(1))
    out = tmp_path / LIB_NAME
    args[args.index("--out") + 1] = str(out)
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.stat().st_size > 0
    binary = out.read_bytes()  # the fat binary names the architectures it carries code for
    assert b"sm_80" in binary and b"sm_90" in binary


def test_compose_gpu_profile_reserves_a_gpu_per_worker_and_runs_the_cuda_image():
    from tandem.cli import build_parser

    compose = yaml.safe_load((ROOT / "docker" / "docker-compose.yml").read_text())
    gpu = {n: s for n, s in compose["services"].items() if "gpu" in s.get("profiles", [])}
    assert {"prefill-gpu", "decode-gpu"} <= set(gpu)
    for name, svc in gpu.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        image = re.fullmatch(r"\$\{TANDEM_WORKER_CUDA_IMAGE:-(\S+)\}", svc["image"])  # a default
        assert (svc["build"]["target"] == "worker-cuda" and image
                and image.group(1).endswith("latest-cuda"))
        args = build_parser().parse_args(svc["command"])
        assert args.device == "cuda" and args.advertise_host == name
    # No service falls back to a default token.
    for svc in compose["services"].values():
        token = (svc.get("environment") or {}).get("TANDEM_INTERNAL_TOKEN")
        assert token is None or token.startswith("${TANDEM_INTERNAL_TOKEN:?")


def test_compose_vllm_profile_pairs_each_vllm_server_with_a_bridge_on_its_event_sockets():
    from tandem.cli import build_parser
    from tandem.flags import given
    from vllm_bridge.settings import BridgeSettings

    compose = yaml.safe_load((ROOT / "docker" / "docker-compose.yml").read_text())
    services = compose["services"]
    vllm = {n: s for n, s in services.items() if "vllm" in s.get("profiles", [])}
    assert set(vllm) == {"vllm-setup", "vllm-1", "vllm-1-bridge", "vllm-2", "vllm-2-bridge"}
    assert not {"vllm-setup", "vllm-1", "vllm-2"} & {n for n, s in services.items()
                                                     if "gpu" in s.get("profiles", [])}
    for name in ("vllm-1", "vllm-2"):
        server, bridge = services[name], services[f"{name}-bridge"]
        devices = server["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
        cmd = server["command"]
        cfg = json.loads(cmd[cmd.index("--kv-events-config") + 1])
        assert cfg["enable_kv_cache_events"] is True and cfg["endpoint"].startswith("ipc://")
        assert cfg["replay_endpoint"].startswith("ipc://")
        parsed = build_parser().parse_args(bridge["entrypoint"][1:] + bridge["command"])
        s = BridgeSettings(**given(parsed, BridgeSettings))
        assert (s.events_endpoint, s.replay_endpoint, s.topic) == (
            cfg["endpoint"], cfg["replay_endpoint"], cfg["topic"])
        assert s.vllm_url == f"http://{name}:{cmd[cmd.index('--port') + 1]}"
        assert s.resolved_worker_id == name and s.redis_url == "redis://redis:6379/0"
        # The sockets' volume: the two share it, no other service mounts it.
        sockets = f"{name}-kv:/run/tandem-kv"
        assert sockets in server["volumes"] and sockets in bridge["volumes"]
        assert [n for n, svc in services.items() if any(v.startswith(f"{name}-kv:")
                                                         for v in svc.get("volumes", []))] == [
            "vllm-setup", name, f"{name}-bridge"]
        # The model's digest: the bridge reads the very folder vLLM serves.
        folder = cmd[cmd.index("--model") + 1]
        assert str(s.model_folder) == folder and "vllm-models:/models:ro" in bridge["volumes"]
        assert server["user"] == "10001:10001"  # the bridge's user owns the sockets vLLM makes
        assert server["environment"]["VLLM_API_KEY"].startswith("${TANDEM_INTERNAL_TOKEN:?")
        assert bridge["environment"]["TANDEM_BRIDGE_VLLM_API_KEY"].startswith(
            "${TANDEM_INTERNAL_TOKEN:?")
