#!/usr/bin/env bash
# The project's one GPU check: builds the CUDA kernels, runs the GPU tests, the kernel, KV-transfer
# and engine benchmarks and a P/D pair behind the router, all on one NVIDIA GPU, and writes ONE
# JSON (gpu_check.json) plus one log (gpu_check.log) into OUT_DIR.
#
#   make gpu-wheels                              # here, with network: fills .whl/
#   bash bench/gpu_check.sh [WHEELS_DIR] [OUT_DIR]   # there, in the repository root
#
# Made for a GPU machine with torch (CUDA), Triton and transformers but no network and none of the
# service packages: they are installed from WHEELS_DIR (default .whl, made by `make gpu-wheels`,
# which also copies SmolLM2's tokenizer into WHEELS_DIR/tokenizer). Runs in about 6 minutes on
# an H200. SECTIONS (environment) picks sections, e.g. SECTIONS=engine,pd to rerun two;
# each section has its own time limit and a failed one does not stop the next. PYTEST_PATHS
# narrows the GPU tests (default: tests/engine tests/kv_transfer). gpu_check.json's `provenance`
# (bench/provenance.py: commit, machine, command, time) takes its commit from COMMIT (environment)
# where the copy here is no git checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
WHL=${1:-.whl}
OUT_DIR=${2:-${OUT:-bench/results/gpu}}
SECTIONS=${SECTIONS:-env,build,pytest,kernels,transfer,engine,pd}
PY=${PYTHON:-python3}
COMMAND="SECTIONS=$SECTIONS bash bench/gpu_check.sh $*"
mkdir -p "$OUT_DIR"
PARTS=$(mktemp -d)
LOG="$OUT_DIR/gpu_check.log"
: >"$LOG"
export PYTHONUNBUFFERED=1

if [ -d "$WHL" ] && ls "$WHL"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/tandem-site "$WHL"/*.whl >>"$LOG" 2>&1 || echo "wheel install failed" >>"$LOG"
  export PYTHONPATH="/tmp/tandem-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
TOKENIZER="$WHL/tokenizer"

want() { [[ ",$SECTIONS," == *",$1,"* ]]; }

# run NAME LIMIT_S CMD...: runs CMD under a time limit, its output into the log, and records
# {rc, seconds} as PARTS/NAME.status.json; a benchmark writes its own PARTS/NAME.json. Each
# section logs to its own file (two may run at once); the logs are joined at the end, and a failed
# section's tail is printed.
run() {
  local name=$1 limit=$2
  shift 2
  want "$name" || return 0
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$PARTS/$name.log" 2>&1
  local rc=$?
  echo "{\"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >"$PARTS/$name.status.json"
  echo "=== $name: rc=$rc in $((SECONDS - t0))s"
  [ "$rc" = 0 ] || tail -n 25 "$PARTS/$name.log"
}

run env 30 "$PY" - "$PARTS/env.json" <<'EOF'
import json, subprocess, sys
import torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
try:
    import triton
    info["triton"] = triton.__version__
except ImportError:
    info["triton"] = None
try:
    info["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
except (OSError, subprocess.TimeoutExpired) as e:
    info["nvidia_smi"] = repr(e)
for mod in ("nixl_cu13", "fastapi", "pydantic", "redis"):
    try:
        __import__(mod)
        info[mod] = True
    except Exception as e:  # noqa: BLE001
        info[mod] = repr(e)
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(info)
EOF

# The kernel build (nvcc, CPU) overlaps the engine benchmark (which does not use those kernels);
# the GPU tests and the P/D pair (correctness first, their timings coarse) overlap at the end.
run build 150 "$PY" -m kv_transfer.build --arch 90 &
BUILD_PID=$!

run engine 170 "$PY" bench/engine.py --device cuda --shapes smollm2-1.7b,llama3-8b \
  --timeout-s 155 --out "$PARTS/engine.json"

wait "$BUILD_PID"

run kernels 40 "$PY" bench/kv_kernels.py --device cuda --out "$PARTS/kernels.json"

run transfer 130 "$PY" bench/kv_transfer.py --device cuda --layouts smollm2,llama3-8b \
  --sizes 1,16,256,4096 --timeout 110 --out "$PARTS/transfer.json"

run pytest 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors \
  --junitxml="$PARTS/pytest.xml" ${PYTEST_PATHS:-tests/engine tests/kv_transfer} &
PYTEST_PID=$!

run pd 150 "$PY" bench/gpu_pd.py --shape smollm2-1.7b --tokenizer "$TOKENIZER" \
  --out "$PARTS/pd.json"

wait "$PYTEST_PID"

for f in "$PARTS"/*.log; do
  [ -f "$f" ] && { echo "=== $(basename "$f" .log)"; cat "$f"; } >>"$LOG"
done

# One JSON: what ran where (provenance), each section's status, its results (each with its own
# provenance), and the GPU tests' outcome.
"$PY" - "$PARTS" "$OUT_DIR/gpu_check.json" "$COMMAND" "${COMMIT:-}" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path
from bench.provenance import provenance
parts, out = Path(sys.argv[1]), Path(sys.argv[2])
merged = {"provenance": provenance(command=sys.argv[3])}
merged["provenance"]["commit"] = merged["provenance"]["commit"] or sys.argv[4] or None
for status in sorted(parts.glob("*.status.json")):
    name = status.name.removesuffix(".status.json")
    entry = {"status": json.loads(status.read_text())}
    data = parts / f"{name}.json"
    if data.is_file():
        try:
            entry["result"] = json.loads(data.read_text())
        except json.JSONDecodeError as e:
            entry["result_error"] = str(e)
    merged[name] = entry
xml = parts / "pytest.xml"
if xml.is_file():
    cases = []
    for case in ET.parse(xml).iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = tag
                cases.append({"test": f"{case.get('classname')}::{case.get('name')}",
                              "outcome": outcome, "message": (node.get("message") or "")[:500]})
                break
        else:
            cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome})
    merged.setdefault("pytest", {})["cases"] = cases
out.write_text(json.dumps(merged, indent=2))
print(json.dumps({k: v["status"] for k, v in merged.items() if "status" in v}))
EOF
