#!/usr/bin/env bash
# The project's one GPU check: builds the CUDA kernels, runs the GPU tests, the kernel, KV-transfer,
# engine, sampling-mode decode and host-tier benchmarks and a P/D pair behind the router, all on
# one NVIDIA GPU, and writes each section's JSON (with provenance), the GPU tests' junit XML,
# ONE merged JSON (gpu_check.json) and one log (gpu_check.log) into OUT_DIR.
#
#   make gpu-wheels                              # here, with network: fills .whl/
#   bash bench/gpu_check.sh [WHEELS_DIR] [OUT_DIR]   # there, in the repository root
#
# Made for a GPU machine with torch (CUDA), Triton and transformers but no network and none of the
# service packages: they are installed from WHEELS_DIR (default .whl, made by `make gpu-wheels`,
# which also copies SmolLM2's tokenizer into WHEELS_DIR/tokenizer). SECTIONS (environment) picks
# sections, e.g. SECTIONS=engine,pd to rerun two. Each section has its own time limit and a
# failed one does not stop the next; the whole run keeps within BUDGET_S seconds (default 570,
# so that it fits one 600 s call): a section gets at most what the budget has left (less 15 s
# to merge the results), and one left under 30 s is skipped and recorded so. PYTEST_PATHS
# narrows the GPU tests (default: tests/engine tests/kv_transfer). gpu_check.json's
# `provenance` (bench/provenance.py: commit, machine, command, time) takes its commit from
# COMMIT (environment) where the copy here is no git checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
WHL=${1:-.whl}
OUT_DIR=${2:-${OUT:-bench/results/gpu}}
SECTIONS=${SECTIONS:-env,build,engine,decode,kernels,transfer,tiers,pd,pytest}
PY=${PYTHON:-python3}
BUDGET=${BUDGET_S:-570}
COMMAND="SECTIONS=$SECTIONS bash bench/gpu_check.sh $*"
START=$SECONDS
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

# left WANT: WANT seconds, or what the budget has left if less (15 s kept to merge the results).
left() {
  local rest=$((BUDGET - 15 - (SECONDS - START)))
  echo $(($1 < rest ? $1 : rest))
}

# run NAME LIMIT_S CMD...: runs CMD under a time limit, its output into the log, and records
# {rc, seconds} as PARTS/NAME.status.json; a benchmark writes its own OUT_DIR/NAME.json. Each
# section logs to its own file (two may run at once); the logs are joined at the end, and a failed
# section's tail is printed. A limit under 30 s (the budget is spent) skips the section.
run() {
  local name=$1 limit=$2
  shift 2
  want "$name" || return 0
  rm -f "$OUT_DIR/$name.json"  # never a stale result of an earlier run
  [ "$name" != pytest ] || rm -f "$OUT_DIR/pytest.xml"
  if [ "$limit" -lt 30 ]; then
    echo "=== $name: skipped, ${limit}s of the budget left"
    echo "{\"rc\": null, \"seconds\": 0, \"skipped\": \"budget\"}" >"$PARTS/$name.status.json"
    return 0
  fi
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$PARTS/$name.log" 2>&1
  local rc=$?
  echo "{\"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >"$PARTS/$name.status.json"
  echo "=== $name: rc=$rc in $((SECONDS - t0))s"
  [ "$rc" = 0 ] || tail -n 25 "$PARTS/$name.log"
}

run env "$(left 30)" "$PY" - "$OUT_DIR/env.json" <<'EOF'
import subprocess, sys
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
from bench.provenance import write_result
write_result(sys.argv[1], info)
print(info)
EOF

# The kernel build (nvcc, CPU) overlaps the engine benchmarks (which do not use those kernels).
# Every timing section runs alone on the GPU; the GPU tests come last, with what is left.
run build "$(left 150)" "$PY" -m kv_transfer.build --arch 90 &
BUILD_PID=$!

L=$(left 160)
run engine "$L" "$PY" bench/engine.py --device cuda --shapes smollm2-1.7b,llama3-8b \
  --timeout-s $((L - 12)) --out "$OUT_DIR/engine.json"

# Decode rates by sampling mode, the overlap on for all (bench/gpu_decode.py).
L=$(left 80)
run decode "$L" "$PY" bench/engine.py --device cuda --shapes smollm2-1.7b \
  --sampling greedy,seeded,unseeded,mixed,top_p --timeout-s $((L - 10)) \
  --out "$OUT_DIR/decode.json"

wait "$BUILD_PID"

run kernels "$(left 40)" "$PY" bench/kv_kernels.py --device cuda --out "$OUT_DIR/kernels.json"

L=$(left 110)
run transfer "$L" "$PY" bench/kv_transfer.py --device cuda --layouts smollm2,llama3-8b \
  --sizes 1,16,256,4096 --timeout $((L - 20)) --out "$OUT_DIR/transfer.json"

# The host KV tier against plain pinned copies, and decode step times while it offloads.
run tiers "$(left 50)" "$PY" bench/gpu_tiers.py --device cuda --shape smollm2-1.7b \
  --out "$OUT_DIR/tiers.json"

# Correctness one at a time, then warm per-request medians with 4 requests in flight.
run pd "$(left 130)" "$PY" bench/gpu_pd.py --shape smollm2-1.7b --tokenizer "$TOKENIZER" \
  --num-requests 36 --concurrency 4 --warmup 4 --out "$OUT_DIR/pd.json"

# shellcheck disable=SC2086 # PYTEST_PATHS is a list of paths
run pytest "$(left 130)" "$PY" -m pytest -q -m gpu -p no:cacheprovider \
  --continue-on-collection-errors --junitxml="$OUT_DIR/pytest.xml" \
  ${PYTEST_PATHS:-tests/engine tests/kv_transfer}

for f in "$PARTS"/*.log; do
  [ -f "$f" ] && { echo "=== $(basename "$f" .log)"; cat "$f"; } >>"$LOG"
done

# One JSON: what ran where (provenance), each section's status, its results (each with its own
# provenance), and the GPU tests' outcome.
"$PY" - "$PARTS" "$OUT_DIR/gpu_check.json" "$COMMAND" "${COMMIT:-}" "$BUDGET" \
  "$((SECONDS - START))" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path
from bench.provenance import provenance
parts, out = Path(sys.argv[1]), Path(sys.argv[2])
merged = {"provenance": provenance(command=sys.argv[3])}
merged["provenance"]["commit"] = merged["provenance"]["commit"] or sys.argv[4] or None
merged["budget_s"], merged["seconds"] = int(sys.argv[5]), int(sys.argv[6])
for status in sorted(parts.glob("*.status.json")):
    name = status.name.removesuffix(".status.json")
    entry = {"status": json.loads(status.read_text())}
    data = out.parent / f"{name}.json"
    if data.is_file():
        try:
            entry["result"] = json.loads(data.read_text())
        except json.JSONDecodeError as e:
            entry["result_error"] = str(e)
    merged[name] = entry
xml = out.parent / "pytest.xml"
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
print(json.dumps({k: v["status"] for k, v in merged.items()
                  if isinstance(v, dict) and "status" in v}))
EOF
