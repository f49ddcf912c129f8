"""Register and stack use of Triton kernels built for an H200 (sm_90) on a machine without a GPU:
Triton's own ptxas compiles them and the cuobjdump Triton bundles reads each cubin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Runs after the caller's code, which defines SPECS: a list of
# (label, kernel, constexprs, num_warps, {arg name: Triton type}, extra compile options).
# An argument missing from the types is a bf16 pointer if its name ends in _ptr, else an i32.
_COMPILE = """
import json, os, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
report = {}
for label, fn, consts, warps, types, options in SPECS:
    sig = {a: "constexpr" if a in consts else types.get(a, "*bf16" if a.endswith("_ptr")
           else "i32") for a in fn.arg_names}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, **options})
    path = f"{sys.argv[1]}/{label}.cubin"
    open(path, "wb").write(compiled.asm["cubin"])
    usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", path],
                           capture_output=True, text=True, check=True).stdout
    line = next(x for x in usage.splitlines() if "REG:" in x)
    report[label] = {k: int(v) for k, v in (f.split(":") for f in line.split()[:2])}
print(json.dumps(report))
"""


def register_use(specs_code: str, out_dir: Path) -> dict[str, dict[str, int]]:
    """{label: {"REG": registers, "STACK": bytes of stack}} for each kernel `specs_code`'s SPECS
    names, compiled in a fresh interpreter (not under TRITON_INTERPRET, with its own cache)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out_dir / "cache")
    done = subprocess.run([sys.executable, "-c", specs_code + _COMPILE, str(out_dir)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
