#!/usr/bin/env bash
# Build tandem-router:latest and tandem-worker:latest from docker/Dockerfile, the images the
# compose file runs. Where Docker Hub answers, on the Dockerfile's python:*-slim base. Where it
# does not (CI, air-gapped hosts), on docker/local_base.sh's local bases, with the host network
# (apt and PyPI), and this machine's CPU torch wheel handed to the build in docker/wheels/
# (download.pytorch.org is out of reach too).
# The legacy builder either way: it needs nothing from a registry (BuildKit fetches nothing
# either without a `# syntax=` line, but Docker's newer clients need the buildx plugin for it).
# Prints what compose needs to run the other services on such a host, as KEY=VALUE lines
# (REDIS_IMAGE, PROMETHEUS_IMAGE); nothing where the registry answers.
#   bash docker/build.sh [--offline | --online]      (default: --online when Docker Hub answers)
#   env: PYTHON (a python with pip, for the torch wheel), TORCH_VERSION, BUILD_LOG
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(dirname "$HERE")"
PYTHON="${PYTHON:-python3}"
PUBLIC_BASE="$(sed -n 's/^ARG PYTHON_IMAGE=//p' "$HERE/Dockerfile")"
TORCH_VERSION="${TORCH_VERSION:-$(sed -n 's/^ARG TORCH_VERSION=//p' "$HERE/Dockerfile" | head -1)}"
BUILD_LOG="${BUILD_LOG:-/dev/stderr}"

log() { echo "[build] $*" >&2; }

mode="${1:-}"
if [[ -z "$mode" ]]; then
  if docker image inspect "$PUBLIC_BASE" >/dev/null 2>&1 \
     || timeout 60 docker pull -q "$PUBLIC_BASE" >/dev/null 2>&1; then
    mode=--online
  else
    mode=--offline
  fi
fi

args=(-f "$HERE/Dockerfile")
case "$mode" in
  --online)
    log "base $PUBLIC_BASE" ;;
  --offline)
    log "no registry: local bases, this machine's torch==$TORCH_VERSION"
    bash "$HERE/local_base.sh"
    "$PYTHON" -m pip download -q --no-deps "torch==$TORCH_VERSION" -d "$HERE/wheels" >&2
    args+=(--network host --build-arg PYTHON_IMAGE=local/python:3.11-bookworm
           --build-arg TORCH_INDEX_URL=https://pypi.org/simple) ;;
  *)
    echo "usage: $0 [--offline | --online]" >&2; exit 2 ;;
esac

for target in router worker; do
  log "target $target -> tandem-$target:latest"
  t0=$SECONDS
  DOCKER_BUILDKIT=0 docker build "${args[@]}" --target "$target" -t "tandem-$target:latest" "$ROOT" \
    >>"$BUILD_LOG" 2>&1 || { log "build of $target failed (log: $BUILD_LOG)"; exit 1; }
  log "target $target built in $((SECONDS - t0)) s"
done

if [[ "$mode" == --offline ]]; then
  echo "REDIS_IMAGE=local/redis:bookworm"
  echo "PROMETHEUS_IMAGE=local/prometheus:bookworm"
fi
