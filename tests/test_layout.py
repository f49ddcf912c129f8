"""The house plan (docs/ARCHITECTURE.md), checked from the source: which package may import
which, no import cycles between modules, and the size limits."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "engine", "kv_transfer", "worker", "prefill_worker", "decode_worker",
            "router", "sim", "loadgen", "tandem")
SCRIPT_DIRS = ("bench",)


def _sources() -> dict[str, Path]:
    """module name -> file, for every package and script of ours (tests excluded)."""
    out = {}
    for top in (*PACKAGES, *SCRIPT_DIRS):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


SOURCES = _sources()


def _imports(path: Path, runtime_only: bool) -> set[str]:
    """Modules `path` imports (absolute names), lazy imports inside functions included.
    `runtime_only` leaves out those under `if TYPE_CHECKING:` (never executed)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if runtime_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.add(child.module)
                found.update(f"{child.module}.{a.name}" for a in child.names)
            visit(child)

    visit(tree)
    return found


def _ours(name: str) -> str | None:
    """The module of ours that `name` refers to (a module, or a name inside one), or None."""
    while name:
        if name in SOURCES:
            return name
        name = name.rpartition(".")[0]
    return None


def _package(module: str) -> str:
    return module.split(".")[0]


def _violations(rule) -> list[str]:
    bad = []
    for module, path in SOURCES.items():
        for imported in sorted(_imports(path, runtime_only=False)):
            problem = rule(module, imported)
            if problem:
                bad.append(f"{module} imports {imported}: {problem}")
    return bad


def test_only_entry_points_tests_and_bench_import_tandem():
    assert _violations(lambda m, i: "tandem/ stands above every package"
                       if _package(i) == "tandem" and _package(m) not in ("tandem", "bench") else None) == []


def test_common_imports_no_other_package_of_ours():
    assert _violations(lambda m, i: "common/ is the ground floor"
                       if _package(m) == "common" and _ours(i) and _package(i) != "common" else None) == []


def test_router_imports_no_torch_engine_or_worker():
    banned = ("torch", "engine", "worker", "prefill_worker", "decode_worker", "kv_transfer")
    assert _violations(lambda m, i: "the router image has no torch"
                       if _package(m) == "router" and _package(i) in banned else None) == []


def test_bench_never_imports_tests():
    assert _violations(lambda m, i: "shared helpers live in tandem/"
                       if _package(m) == "bench" and _package(i) == "tests" else None) == []


def test_no_import_cycles_between_modules():
    graph = {m: sorted({o for i in _imports(p, runtime_only=True) if (o := _ours(i)) and o != m})
             for m, p in SOURCES.items()}
    cycles = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in graph.get(m, []):
            # A package's __init__ importing its own submodules is not a cycle of two modules.
            if n.startswith(m + "."):
                continue
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                dfs(n)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            dfs(m)
    assert cycles == [], "\n".join(cycles)


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_module_at_most_300_lines(module):
    num_lines = len(SOURCES[module].read_text().splitlines())
    assert num_lines <= 300, f"{module} has {num_lines} lines"


def test_create_app_functions_are_short():
    for module, path in SOURCES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "create_app":
                assert node.end_lineno - node.lineno + 1 < 60, module
