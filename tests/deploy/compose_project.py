"""One docker-compose project of docker/docker-compose.yml, for the tests: up, a service's
container, health, exec, stop, kill, down, and what a project left behind. Works with Compose v1
(`docker-compose` 1.29, Debian's) and v2 (`docker compose`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass

import httpx

from tests.deploy.tools import ROOT

COMPOSE_FILE = ROOT / "docker" / "docker-compose.yml"
PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"


def compose_command() -> list[str] | None:
    """`docker-compose` where installed, else the `docker compose` plugin, else None."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                 capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return None


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} exited {r.returncode}: {r.stderr[-2000:]}")
    return r


def engine_problem() -> str | None:
    """Why no Docker engine can be used here, or None."""
    if shutil.which("docker") is None:
        return "no docker client (apt-get install docker.io)"
    r = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return f"no Docker engine answers (start dockerd): {r.stderr.strip()[-300:]}"
    return None


@dataclass
class ComposeProject:
    name: str
    env: dict[str, str]
    command: list[str]
    router: httpx.Client | None = None  # the router's published port, once it is up

    def run(self, *args: str, timeout: float = 600,
            check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([*self.command, "-p", self.name, "-f", str(COMPOSE_FILE), *args],
                           env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"compose {' '.join(args)} exited {r.returncode}: "
                               f"{(r.stdout + r.stderr)[-3000:]}")
        return r

    def container(self, service: str) -> str:
        """The id of the service's one container, running or not."""
        ids = docker("ps", "-aq", "--filter", f"label={PROJECT_LABEL}={self.name}",
                     "--filter", f"label={SERVICE_LABEL}={service}").stdout.split()
        if len(ids) != 1:
            raise RuntimeError(f"{service}: {len(ids)} containers")
        return ids[0]

    def inspect(self, service: str) -> dict:
        return json.loads(docker("inspect", self.container(service)).stdout)[0]

    def health(self, service: str) -> str:
        """healthy / starting / unhealthy; running or exited for a container without a check."""
        state = self.inspect(service)["State"]
        return state["Health"]["Status"] if state.get("Health") else state["Status"]

    def wait_healthy(self, services: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = {s: self.health(s) for s in services}
            if all(v in ("healthy", "running") for v in states.values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not healthy within {timeout:.0f} s: "
                                   f"{states}\n{self.logs(tail=30)}")
            time.sleep(2)

    def exec(self, service: str, *cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return docker("exec", self.container(service), *cmd, timeout=timeout, check=False)

    def logs(self, service: str | None = None, tail: int = 100) -> str:
        r = self.run("logs", "--no-color", "--tail", str(tail), *([service] if service else []),
                     check=False, timeout=120)
        return r.stdout + r.stderr

    def volumes(self) -> set[str]:
        """Named and anonymous volumes mounted by the project's containers."""
        ids = docker("ps", "-aq", "--filter", f"label={PROJECT_LABEL}={self.name}").stdout.split()
        if not ids:
            return set()
        return {m["Name"] for c in json.loads(docker("inspect", *ids).stdout)
                for m in c["Mounts"] if m["Type"] == "volume"}

    def leftovers(self, volumes: set[str]) -> dict[str, list[str]]:
        """What of the project still exists: containers and networks by label, and those of
        `volumes` that docker still knows."""
        label = f"label={PROJECT_LABEL}={self.name}"
        known = set(docker("volume", "ls", "-q").stdout.split())
        return {"containers": docker("ps", "-aq", "--filter", label).stdout.split(),
                "networks": docker("network", "ls", "-q", "--filter", label).stdout.split(),
                "volumes": sorted(volumes & known)}

    def down(self) -> None:
        self.run("down", "-v", "--remove-orphans", "--timeout", "60", timeout=300, check=False)
