"""Every result file a bench script writes names the commit, machine, command and time behind it
(issue 40): it is written by bench/provenance.write_result, never by a JSON dump of its own."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# JSON a bench script may write itself, as (script, a piece of the writing call's source); None:
# the whole script. Each entry must still match a write (a stale one fails too).
NOT_RESULTS = {
    # Golden test data for tests/vllm_bridge, read back byte for byte.
    ("capture_vllm_events.py", None),
    # The cost profile that sim.profile.load reads back: it refuses any key but CostProfile's, so
    # its provenance goes into the `.measurements.json` beside it.
    ("sim_profile.py", "profile.to_json()"),
    # A measuring child's answer to its parent, in a temporary folder: the parent's result has it.
    ("kv_transfer.py", "bench_combo("),
    # write_result itself.
    ("provenance.py", '"provenance": provenance()'),
}
WRITES = ("write_text", "write_bytes", "write", "writelines")
STREAMS = ("stdin", "stdout", "stderr")  # a pipe to a process, or the console: not a file


def _is_dump(node: ast.AST, name: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == name and isinstance(node.func.value, ast.Name)
            and node.func.value.id in ("json", "orjson"))


def _has_dumps(node: ast.AST, dumped: set[str]) -> bool:
    return any(_is_dump(n, "dumps") or (isinstance(n, ast.Name) and n.id in dumped)
               for n in ast.walk(node))


def json_writes(source: str) -> list[str]:
    """The calls in `source` that write JSON to a file themselves: `json.dump(...)`, and a
    `.write_text(...)` (or a file's `.write`) of `json.dumps(...)`, directly or through a name
    bound to it (`text = json.dumps(r); out.write_text(text + "\\n")`)."""
    tree = ast.parse(source)
    dumped = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.AnnAssign)
              and n.value is not None and _has_dumps(n.value, set())
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
              if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if _is_dump(node, "dump"):
            found.append(node)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in WRITES
              and not (isinstance(node.func.value, ast.Attribute)
                       and node.func.value.attr in STREAMS)
              and any(_has_dumps(a, dumped) for a in [*node.args, *node.keywords])):
            found.append(node)
    return [ast.get_source_segment(source, n) for n in found]


def _allowed(script: str, call: str) -> bool:
    return any(s == script and (piece is None or piece in call) for s, piece in NOT_RESULTS)


def test_no_bench_script_writes_a_json_result_without_provenance():
    bad = [f"bench/{p.name}: {call}" for p in sorted(BENCH.glob("*.py"))
           for call in json_writes(p.read_text()) if not _allowed(p.name, call)]
    assert bad == [], "write it with bench/provenance.write_result:\n" + "\n".join(bad)


def test_every_exception_still_names_a_write():
    for script, piece in NOT_RESULTS:
        calls = json_writes((BENCH / script).read_text())
        assert any(piece is None or piece in c for c in calls), (script, piece)


def test_the_scripts_that_wrote_results_write_them_with_provenance():
    expected = {"abuse", "attack", "backlog", "conditional", "cpu_ops", "demo_speed", "disagg",
                "engine", "engine_gpu", "gpu_pd", "grammar", "index", "kv_kernels", "kv_transfer",
                "network", "policies", "rolling_restart", "router_overhead", "serving",
                "serving_mixed", "sim_profile", "vllm_routing", "wire_parse", "engine_regression",
                "kv_tiers", "sim_tiers", "fork", "gpu_decode", "gpu_tiers",
                "kv_tier_loads", "drain", "skewed", "sim_pulls", "autoscale_burst"}
    calling = {p.stem for p in BENCH.glob("*.py")
               if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                      and n.func.id == "write_result" for n in ast.walk(ast.parse(p.read_text())))}
    assert expected <= calling, sorted(expected - calling)


@pytest.mark.parametrize("source, num_found", [
    ("import json\njson.dump(r, open(p, 'w'))\n", 1),
    ("import json\nPath(p).write_text(json.dumps(r, indent=2) + '\\n')\n", 1),
    ("import json\ntext = json.dumps(r)\nprint(text)\nout.write_text(text + '\\n')\n", 1),
    ("import orjson\nwith open(p, 'wb') as f:\n    f.write(orjson.dumps(r))\n", 1),
    ("import json\nwrite_result(p, r)\nprint(json.dumps(r, indent=2))\n", 0),
    ("import json\nproc.stdin.write(json.dumps(r) + '\\n')\n", 0),  # a pipe, not a file
    ("import json\nsys.stderr.write(json.dumps(r))\n", 0),
    ("md = markdown(rows)\n(RESULTS / 'serving.md').write_text(md)\n", 0),
])
def test_the_check_sees_each_way_of_writing_json(source, num_found):
    assert len(json_writes(source)) == num_found


def test_write_result_puts_provenance_first_and_keeps_the_keys(tmp_path):
    from bench.provenance import write_result

    result = {"model": "m", "runs": [{"ok": 3}], "ratios": {"a_over_b": 1.5}}
    path = write_result(tmp_path / "new" / "folder" / "x.json", result)
    assert path == tmp_path / "new" / "folder" / "x.json"
    data = json.loads(path.read_text())
    assert list(data) == ["provenance", "model", "runs", "ratios"]
    assert {k: data[k] for k in result} == result
    prov = data["provenance"]
    assert re.fullmatch(r"[0-9a-f]{40}", prov["commit"])  # this checkout is a git repository
    assert isinstance(prov["dirty"], bool)
    assert prov["command"].startswith(Path(sys.executable).name)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", prov["time_utc"])
    assert set(prov["machine"]) == {"cpu", "cores", "memory_gib", "gpu", "load_average"}
    assert prov["machine"]["cores"] >= 1
    with pytest.raises(ValueError):
        write_result(tmp_path / "y.json", {"provenance": "made up"})
    assert not (tmp_path / "y.json").exists()
