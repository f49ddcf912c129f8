"""Building the model draws no random weights it would throw away: parameters are made on the
meta device and then loaded (engine/weights.py). A random init there imports torch._dynamo, and
the meta device's `to_empty` sympy and torch.fx: together more than a second of every worker's
start on two cores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_building_and_running_the_engine_imports_neither_dynamo_nor_sympy(tiny_folder):
    code = ("import sys\n"
            "from engine import LLM\n"
            "from engine.sampling_params import SamplingParams\n"
            f"llm = LLM({str(tiny_folder)!r}, num_blocks=64, block_size=4)\n"
            "params = SamplingParams(max_tokens=4, ignore_eos=True)\n"
            "out = llm.generate(['hello there', 'abc'], params)\n"
            "assert len(out[0].token_ids) == 4, out\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sympy' or m.startswith(\n"
            "    ('torch._dynamo', 'torch.fx.experimental.symbolic_shapes'))))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout
