"""The house plan (docs/architecture.md), checked from the source: which package may import
which, no import cycle between any two modules, and the size limits."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "engine", "kv_transfer", "worker", "prefill_worker", "decode_worker",
            "router", "sim", "loadgen", "tandem", "vllm_bridge")
# Folders of scripts run as `python bench/x.py`: their folder is on sys.path, so a sibling is
# imported by its bare name (`from clusters import ...` means bench/clusters.py). They put the
# repository first on sys.path, so a bare name that is one of our packages means the package
# (`from engine import LLM` in bench/engine_gpu.py is engine/, not bench/engine.py).
SCRIPT_DIRS = ("bench",)


def _sources(root: Path, tops: tuple[str, ...]) -> dict[str, Path]:
    """module name -> file, for every package and script of ours under `root` (tests excluded)."""
    out = {}
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


SOURCES = _sources(ROOT, (*PACKAGES, *SCRIPT_DIRS))


def _is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:` (never true at run time)."""
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(path: Path, module: str, runtime_only: bool) -> set[str]:
    """Modules `path` (the module `module`) imports, as absolute names, lazy imports inside
    functions included. `runtime_only` leaves out the body of `if TYPE_CHECKING:` (never
    executed); its `else:` runs and counts."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if runtime_only and isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: `from . import x`, `from ..a import b`
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*up, base] if base else up)
                found.add(base)
                found.update(f"{base}.{a.name}" for a in child.names)
            visit(child)

    visit(tree)
    return found


def _ours(name: str, importer: str, sources: dict[str, Path]) -> str | None:
    """The module of ours that `name` (imported by `importer`) refers to: a module, or a name
    inside one; a bare name a script imports that is none of our packages means its sibling
    script. None if not ours."""
    candidates = [name]
    top = importer.split(".")[0]
    if top in SCRIPT_DIRS:
        candidates.append(f"{top}.{name}")
    for candidate in candidates:
        while candidate:
            if candidate in sources:
                return candidate
            candidate = candidate.rpartition(".")[0]
    return None


def _package(module: str) -> str:
    return module.split(".")[0]


def _violations(rule) -> list[str]:
    bad = []
    for module, path in SOURCES.items():
        for imported in sorted(_imports(path, module, runtime_only=False)):
            problem = rule(module, imported)
            if problem:
                bad.append(f"{module} imports {imported}: {problem}")
    return bad


def _import_graph(sources: dict[str, Path]) -> dict[str, list[str]]:
    """module -> the modules of ours it imports at run time (lazily or not)."""
    return {m: sorted({o for i in _imports(p, m, runtime_only=True)
                       if (o := _ours(i, m, sources)) and o != m})
            for m, p in sources.items()}


def _cycles(graph: dict[str, list[str]]) -> list[str]:
    """Every import cycle the depth-first walk meets, as `a -> b -> a`. A package's
    `__init__` that imports its own submodules counts like any module: a submodule importing
    its package back closes a cycle that runs at import time."""
    cycles = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in graph.get(m, []):
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                dfs(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    return cycles


def test_only_entry_points_tests_and_bench_import_tandem():
    assert _violations(lambda m, i: "tandem/ stands above every package"
                       if _package(i) == "tandem" and _package(m) not in ("tandem", "bench") else None) == []


def test_common_imports_no_other_package_of_ours():
    assert _violations(lambda m, i: "common/ is the ground floor"
                       if _package(m) == "common" and _ours(i, m, SOURCES) and _package(i) != "common"
                       else None) == []


def test_router_imports_no_torch_engine_or_worker():
    banned = ("torch", "engine", "worker", "prefill_worker", "decode_worker", "kv_transfer")
    assert _violations(lambda m, i: "the router image has no torch"
                       if _package(m) == "router" and _package(i) in banned else None) == []


def test_the_vllm_bridge_imports_only_common():
    # It runs beside vLLM in the router's image (no torch), and no router internals: it writes
    # the Redis schema of common/ as any worker does.
    assert _violations(lambda m, i: "vllm_bridge/ stands on common/ alone"
                       if _package(m) == "vllm_bridge" and _ours(i, m, SOURCES)
                       and _package(i) not in ("vllm_bridge", "common") else None) == []
    assert _violations(lambda m, i: "the router image has no torch"
                       if _package(m) == "vllm_bridge" and _package(i) == "torch" else None) == []


def test_bench_never_imports_tests():
    assert _violations(lambda m, i: "shared helpers live in tandem/"
                       if _package(m) == "bench" and _package(i) == "tests" else None) == []


def test_no_import_cycle_between_any_two_modules():
    cycles = _cycles(_import_graph(SOURCES))
    assert cycles == [], "\n".join(cycles)


def test_the_cycle_check_sees_lazy_relative_and_script_imports_but_not_type_checking(tmp_path):
    """The checker itself, on a made-up tree: each kind of import that runs closes a cycle;
    an import under `if TYPE_CHECKING:` does not."""
    files = {
        "pkg/__init__.py": "",
        "pkg/lazy_a.py": "def f():\n    from pkg.lazy_b import g\n",  # inside a function
        "pkg/lazy_b.py": "from pkg import lazy_a\n",
        "pkg/typed_c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                          "    from pkg.typed_d import X\nelse:\n    X = None\n",
        "pkg/typed_d.py": "from pkg.typed_c import X\n",
        "pkg/not_typed_e.py": "from typing import TYPE_CHECKING\nif not TYPE_CHECKING:\n"
                              "    from pkg.not_typed_f import Z\n",
        "pkg/not_typed_f.py": "import pkg.not_typed_e\n",
        "pkg/else_g.py": "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n"
                         "    from pkg.else_h import W\n",
        "pkg/else_h.py": "from pkg.else_g import V\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/rel_m.py": "from .rel_n import q\n",
        "pkg/sub/rel_n.py": "from ..sub import rel_m\n",
        "pkg/init_p/__init__.py": "from pkg.init_p.child import C\n",
        "pkg/init_p/child.py": "from pkg.init_p import D\n",
        "bench/script_x.py": "from script_y import Z\n",
        "bench/script_y.py": "def g():\n    import script_x\n",
        "bench/alone.py": "import json\nfrom pkg.typed_d import X\n",
        # A script named like a package: `pkg` in bench/shadow.py is the package, not bench/pkg.py.
        "bench/pkg.py": "import shadow\n",
        "bench/shadow.py": "from pkg.typed_d import X\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    sources = _sources(tmp_path, ("pkg", "bench"))
    found = {frozenset(c.split(" -> ")) for c in _cycles(_import_graph(sources))}
    assert found == {
        frozenset({"pkg.lazy_a", "pkg.lazy_b"}),
        frozenset({"pkg.not_typed_e", "pkg.not_typed_f"}),
        frozenset({"pkg.else_g", "pkg.else_h"}),
        frozenset({"pkg.sub.rel_m", "pkg.sub.rel_n"}),
        frozenset({"pkg.init_p", "pkg.init_p.child"}),
        frozenset({"bench.script_x", "bench.script_y"}),
    }


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_module_at_most_300_lines(module):
    num_lines = len(SOURCES[module].read_text().splitlines())
    assert num_lines <= 300, f"{module} has {num_lines} lines"


def test_create_app_functions_are_short():
    for module, path in SOURCES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "create_app":
                assert node.end_lineno - node.lineno + 1 < 60, module
