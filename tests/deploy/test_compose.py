"""The docker-compose demo built and run for real (issue 33): docker/build.sh builds the router
and worker images (on local bases where no registry answers), the compose file brings up Redis,
the router, 2 prefill + 2 decode workers and Prometheus; a chat through the published port gets
the right answer, a decode container killed mid-stream has its stream resumed on the other one,
`docker stop` drains a worker (exit 0, registration gone) while the router keeps serving, and
`down -v` leaves no container, network or volume. Needs a Docker engine and Compose v1 or v2:
`make test-compose` (deselected from `make test`). The tests run in file order on one project."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from common.registry import RedisKeys
from testing.processes import free_port
from tests.deploy.compose_project import ComposeProject, compose_command, docker, engine_problem
from tests.deploy.tools import ROOT

pytestmark = pytest.mark.docker

MODEL = "smollm2-135m-instruct"
WORKERS = ["prefill-1", "prefill-2", "decode-1", "decode-2"]
SERVICES = ["redis", *WORKERS, "router", "prometheus"]  # Grafana: from its registry only
STORY = {"model": MODEL, "prompt": "Once upon a time, in a small village by the sea, there lived",
         "max_tokens": 240, "temperature": 0, "ignore_eos": True}


def worker_id(service: str) -> str:
    return f"{service.split('-')[0]}-{service}-8200"  # role-advertised host-port


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    """Builds both images; returns the variables compose needs for the other services' images."""
    problem = engine_problem()
    if problem:
        pytest.fail(problem)
    log = tmp_path_factory.mktemp("compose") / "build.log"
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(ROOT / "docker" / "build.sh")], capture_output=True, text=True,
                       env={**os.environ, "PYTHON": sys.executable, "BUILD_LOG": str(log)},
                       timeout=3600)
    if r.returncode != 0:
        pytest.fail(f"docker/build.sh failed:\n{r.stderr[-3000:]}\n{log.read_text()[-6000:]}")
    sizes = {t: int(docker("image", "inspect", "-f", "{{.Size}}", f"tandem-{t}:latest").stdout)
             for t in ("router", "worker")}
    print(f"\n[compose] images built in {time.monotonic() - t0:.0f} s; sizes: "
          + ", ".join(f"tandem-{t} {b / 1e6:.0f} MB" for t, b in sizes.items()))
    return dict(line.split("=", 1) for line in r.stdout.split())


@pytest.fixture(scope="module")
def project(images):
    command = compose_command()
    if command is None:
        pytest.fail("neither docker-compose nor the docker compose plugin is installed")
    env = {**os.environ, **images, "TANDEM_INTERNAL_TOKEN": secrets.token_hex(32),
           "TANDEM_PORT": str(free_port()), "PROMETHEUS_PORT": str(free_port()),
           "GRAFANA_PORT": str(free_port())}
    p = ComposeProject(f"tandem-test-{uuid.uuid4().hex[:8]}", env, command)
    t0 = time.monotonic()
    try:
        p.run("up", "-d", "--no-build", *SERVICES, timeout=900)
        p.wait_healthy(SERVICES, timeout=600)
        p.router = httpx.Client(base_url=f"http://127.0.0.1:{env['TANDEM_PORT']}", timeout=120)
        wait_for(lambda: set(ready_workers(p)) == {worker_id(s) for s in WORKERS}, 120,
                 "every worker registered with the router")
        print(f"\n[compose] up and healthy in {time.monotonic() - t0:.0f} s")
        yield p
    finally:
        p.down()


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.5)


def ready_workers(p: ComposeProject) -> list[str]:
    try:
        return p.router.get("/ready").json().get("workers", [])
    except (httpx.HTTPError, ValueError):
        return []


def chat(p: ComposeProject, question: str) -> dict:
    r = p.router.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": question}],
        "max_tokens": 40, "temperature": 0})
    assert r.status_code == 200, r.text[:1000]
    return r.json()


def registered(p: ComposeProject, service: str) -> bool:
    key = RedisKeys("default").worker(worker_id(service))
    out = p.exec("redis", "redis-cli", "exists", key)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "1"


def running_requests(p: ComposeProject, service: str) -> float:
    code = ("import urllib.request as u; print(u.urlopen('http://127.0.0.1:8200/metrics', "
            "timeout=5).read().decode())")
    out = p.exec(service, "python", "-c", code).stdout
    found = re.search(r"^tandem_worker_running_requests (\S+)$", out, flags=re.M)
    return float(found.group(1)) if found else 0.0


class Stream(threading.Thread):
    """One streamed completion, read on a thread: its text, chunks and final `tandem` field."""

    def __init__(self, p: ComposeProject, body: dict) -> None:
        super().__init__(daemon=True)
        self.p, self.body = p, body
        self.pieces: list[str] = []
        self.tandem: dict | None = None
        self.errors: list = []
        self.done = False

    def run(self) -> None:
        try:
            with self.p.router.stream("POST", "/v1/completions",
                                      json={**self.body, "stream": True}) as r:
                if r.status_code != 200:
                    self.errors.append((r.status_code, r.read()[:500]))
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.errors.append(chunk["error"])
                        self.pieces.extend(c.get("text") or "" for c in chunk.get("choices", []))
                        self.tandem = chunk.get("tandem") or self.tandem
        except httpx.HTTPError as e:
            self.errors.append(repr(e))

    def serving_decode(self) -> str:
        """Once a few tokens have arrived: the decode service this stream runs on."""
        wait_for(lambda: len(self.pieces) >= 8 or not self.is_alive(), 120, "the stream under way")
        assert self.is_alive() and not self.errors, self.errors
        for _ in range(10):
            busy = [s for s in ("decode-1", "decode-2") if running_requests(self.p, s) > 0]
            if len(busy) == 1:
                return busy[0]
        pytest.fail(f"no single decode worker runs the stream: {busy}")


def reference_text(p: ComposeProject, body: dict) -> str:
    r = p.router.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text[:1000]
    return r.json()["choices"][0]["text"]


def test_the_internal_token_is_required(images):
    command = compose_command()
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_INTERNAL_TOKEN"}
    r = subprocess.run([*command, "-f", str(ROOT / "docker" / "docker-compose.yml"), "config"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "set TANDEM_INTERNAL_TOKEN" in r.stdout + r.stderr
    # The image has no token of its own: a worker on a container address refuses to start.
    r = docker("run", "--rm", "tandem-worker:latest", "decode", "--host", "0.0.0.0",
               "--port", "8200", "--cache-dir", "/", timeout=300, check=False)
    assert r.returncode == 2 and "without an internal token" in r.stderr, r.stderr[-2000:]


def test_the_images_run_as_non_root_healthy_and_the_router_has_no_torch(project):
    for service in [*WORKERS, "router"]:
        info = project.inspect(service)
        assert info["Config"]["User"] == "tandem" and info["State"]["Health"]["Status"] == "healthy"
        assert project.exec(service, "id", "-u").stdout.strip() == "10001"
    probe = "import importlib.util as u; print(u.find_spec('torch') is None)"
    assert project.exec("router", "python", "-c", probe).stdout.strip() == "True"
    # The workers' torch is the CPU build (pip took no CUDA wheel).
    probe = "import torch; print(torch.__version__, torch.version.cuda)"
    version, cuda = project.exec("decode-1", "python", "-c", probe, timeout=120).stdout.split()
    assert version.endswith("+cpu") and cuda == "None", (version, cuda)


def test_a_chat_through_the_published_port_gets_the_right_answer(project):
    assert MODEL in [m["id"] for m in project.router.get("/v1/models").json()["data"]]
    out = chat(project, "What is the capital of France?")
    assert "Paris" in out["choices"][0]["message"]["content"], out
    assert out["usage"]["completion_tokens"] > 0 and out["tandem"]["resumed"] == 0


def test_prometheus_scrapes_every_tandem_service(project):
    prometheus = httpx.Client(base_url=f"http://127.0.0.1:{project.env['PROMETHEUS_PORT']}",
                              timeout=30)
    want = {"router:8000", *(f"{s}:8200" for s in WORKERS)}

    def all_up() -> bool:
        targets = prometheus.get("/api/v1/targets").json()["data"]["activeTargets"]
        return {t["labels"]["instance"] for t in targets if t["health"] == "up"} == want

    wait_for(all_up, 60, "every target scraped")


def test_a_decode_container_killed_mid_stream_resumes_on_the_other(project):
    want = reference_text(project, STORY)
    stream = Stream(project, STORY)
    stream.start()
    victim = stream.serving_decode()
    docker("kill", project.container(victim))
    stream.join(240)
    assert not stream.is_alive() and stream.done and not stream.errors, stream.errors
    # Resumed once, so on the one other decode worker, with no token lost or repeated.
    assert stream.tandem["resumed"] == 1, stream.tandem
    assert "".join(stream.pieces) == want
    # Bring it back for the next test (a killed container's restart policy does not apply).
    if project.inspect(victim)["State"]["Status"] != "running":
        docker("start", project.container(victim))
    project.wait_healthy([victim], timeout=300)
    wait_for(lambda: worker_id(victim) in ready_workers(project), 60, f"{victim} registered again")


def test_docker_stop_drains_a_worker_and_the_router_keeps_serving(project):
    body = {**STORY, "max_tokens": 120}
    want = reference_text(project, body)
    stream = Stream(project, body)
    stream.start()
    victim = stream.serving_decode()
    stop = threading.Thread(target=docker, args=("stop", "-t", "40", project.container(victim)),
                            kwargs={"timeout": 120})
    stop.start()
    wait_for(lambda: not registered(project, victim), 10, f"{victim}'s registration deleted")
    stop.join(120)
    stream.join(120)
    state = project.inspect(victim)["State"]
    assert state["Status"] == "exited" and state["ExitCode"] == 0, state
    # The stream in flight finished on the drained worker or resumed elsewhere: all of it.
    assert stream.done and not stream.errors and "".join(stream.pieces) == want, stream.errors
    assert "Traceback" not in project.logs(victim)
    assert worker_id(victim) not in ready_workers(project)
    # An idle prefill worker drains the same way; the router answers on what is left.
    docker("stop", "-t", "40", project.container("prefill-2"), timeout=120)
    assert (project.inspect("prefill-2")["State"]["ExitCode"] == 0
            and not registered(project, "prefill-2"))
    assert ("Paris"
            in chat(project, "What is the capital of France?")["choices"][0]["message"]["content"])


def test_down_leaves_no_container_network_or_volume(project):
    volumes = project.volumes()
    assert volumes  # Redis and Prometheus declare theirs: there is something to remove
    assert project.leftovers(volumes)["networks"]
    project.down()
    assert project.leftovers(volumes) == {"containers": [], "networks": [], "volumes": []}
