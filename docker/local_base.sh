#!/usr/bin/env bash
# Base images made on this machine, for when no image registry answers (CI, air-gapped hosts):
#   local/debian:bookworm       debootstrap --variant=minbase (the root of the others)
#   local/python:3.11-bookworm  Debian's python3 with venv and pip: docker/Dockerfile's PYTHON_IMAGE
#   local/redis:bookworm        Debian's redis-server: the compose file's REDIS_IMAGE
#   local/prometheus:bookworm   Debian's prometheus: the compose file's PROMETHEUS_IMAGE
# Needs root, debootstrap, a Debian mirror and a running Docker engine. The images are saved to
# one tarball under $TANDEM_DOCKER_CACHE (default /var/cache/tandem-docker) keyed by this script's
# hash: a later run (or a fresh engine) loads them in seconds instead of making them again.
#   bash docker/local_base.sh            # make or load the four images
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
CACHE="${TANDEM_DOCKER_CACHE:-/var/cache/tandem-docker}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
KEY="$(sha256sum "$HERE/local_base.sh" | cut -c1-16)"
LABEL="org.tandem.local-base=$KEY"
IMAGES=(local/debian:bookworm local/python:3.11-bookworm local/redis:bookworm local/prometheus:bookworm)
TARBALL="$CACHE/local-base-$KEY.tar"

log() { echo "[local_base] $*" >&2; }

current() {  # every image present and made by this version of the script
  local image
  for image in "${IMAGES[@]}"; do
    [[ "$(docker image inspect -f '{{index .Config.Labels "org.tandem.local-base"}}' "$image" 2>/dev/null)" == "$KEY" ]] \
      || return 1
  done
}

if current; then
  log "images present (key $KEY)"
  exit 0
fi
if [[ -s "$TARBALL" ]]; then
  log "loading $TARBALL"
  docker load -q -i "$TARBALL" >&2
  current && exit 0
  log "the cached tarball is incomplete; making the images again"
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

log "debootstrap $SUITE from $MIRROR"
debootstrap --variant=minbase "$SUITE" "$WORK/root" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
  || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
cat >"$WORK/root/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
EOF
# What the official Debian images do: no package caches, docs or locales in the layers.
rm -rf "$WORK"/root/var/cache/apt/archives/*.deb "$WORK"/root/var/lib/apt/lists/*
cat >"$WORK/root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Install-Recommends "false";
EOF
# No daemon starts inside an image build (what the official images' policy-rc.d says too).
printf '#!/bin/sh\nexit 101\n' >"$WORK/root/usr/sbin/policy-rc.d"
chmod +x "$WORK/root/usr/sbin/policy-rc.d"
cat >"$WORK/root/etc/dpkg/dpkg.cfg.d/docker-excludes" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/info/*
EOF
tar -C "$WORK/root" -c . | docker import \
  --change "LABEL $LABEL" --change "ENV LANG=C.UTF-8" --change 'CMD ["bash"]' \
  - local/debian:$SUITE >&2
rm -rf "$WORK/root"

# The host's CA bundle, copied in (a read-only mount of /etc/ssl/certs breaks the
# ca-certificates package's own install step): builds behind a TLS-inspecting proxy still verify.
mkdir -p "$WORK/ctx"
cp /etc/ssl/certs/ca-certificates.crt "$WORK/ctx/host-ca.crt"

build() {  # build TAG, Dockerfile on stdin
  log "building $1"
  DOCKER_BUILDKIT=0 docker build -q --network host --label "$LABEL" -t "$1" -f - "$WORK/ctx" >&2
}

build local/python:3.11-bookworm <<'EOF'
FROM local/debian:bookworm
COPY host-ca.crt /usr/local/share/ca-certificates/host-ca.crt
RUN apt-get update \
 && apt-get install -y ca-certificates python3 python3-venv python3-pip python-is-python3 \
 && rm -rf /var/lib/apt/lists/*
CMD ["python3"]
EOF

build local/redis:bookworm <<'EOF'
FROM local/debian:bookworm
RUN apt-get update && apt-get install -y redis-server && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
VOLUME /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
EOF

build local/prometheus:bookworm <<'EOF'
FROM local/debian:bookworm
RUN apt-get update && apt-get install -y prometheus && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
VOLUME /prometheus
WORKDIR /prometheus
USER prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml"]
EOF

mkdir -p "$CACHE"
rm -f "$CACHE"/local-base-*.tar
log "saving to $TARBALL"
docker save -o "$TARBALL.part" "${IMAGES[@]}"
mv "$TARBALL.part" "$TARBALL"
current
