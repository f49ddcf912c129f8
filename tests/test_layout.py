"""The house plan (docs/architecture.md), checked from the source: which package may import
which, no import cycle between any two modules, and the size limits."""

from __future__ import annotations

import ast
import fnmatch
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "engine", "kv_transfer", "worker", "prefill_worker", "decode_worker",
            "router", "sim", "loadgen", "tandem", "vllm_bridge", "testing")
# What `pip install` installs: pyproject's package patterns. testing/ (the test harness) is ours
# but not installed: only tests and bench/ may import it.
INSTALL_PATTERNS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "packages"]["find"]["include"]
HARNESS = "testing"
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


def _imports(path: Path, module: str) -> set[str]:
    """Modules `path` (the module `module`) imports, as absolute names: lazy imports inside
    functions and type-only ones (`if TYPE_CHECKING:`) included."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
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
        for imported in sorted(_imports(path, module)):
            problem = rule(module, imported)
            if problem:
                bad.append(f"{module} imports {imported}: {problem}")
    return bad


def _import_graph(sources: dict[str, Path]) -> dict[str, list[str]]:
    """module -> the modules of ours it imports (lazily, for types only, or at import time): a
    circle is one even where part of it runs only under a type checker, since the two modules
    still depend on each other's insides."""
    return {m: sorted({o for i in _imports(p, m)
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
                       if _package(i) == "tandem"
                       and _package(m) not in ("tandem", "bench", HARNESS) else None) == []


def _installed(package: str) -> bool:
    return any(fnmatch.fnmatchcase(package, p) for p in INSTALL_PATTERNS)


def test_the_test_harness_is_ours_but_not_installed():
    """Every package of ours but testing/ is installed; testing/ (its fixed ports, tokens and
    throwaway servers) never reaches a wheel or an image."""
    assert [p for p in PACKAGES if p != HARNESS and not _installed(p)] == []
    assert not _installed(HARNESS)


def test_no_installed_package_imports_the_test_harness():
    assert _violations(lambda m, i: "testing/ is not installed: only tests and bench/ import it"
                       if _package(i) == HARNESS and _installed(_package(m)) else None) == []


def test_common_imports_no_other_package_of_ours():
    assert _violations(lambda m, i: "common/ is the ground floor"
                       if _package(m) == "common" and _ours(i, m, SOURCES)
                       and _package(i) != "common"
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
    assert _violations(lambda m, i: "shared helpers live in testing/"
                       if _package(m) == "bench" and _package(i) == "tests" else None) == []


def test_no_import_cycle_between_any_two_modules():
    cycles = _cycles(_import_graph(SOURCES))
    assert cycles == [], "\n".join(cycles)


def test_the_cycle_check_sees_lazy_relative_script_and_type_only_imports(tmp_path):
    """The checker itself, on a made-up tree: each kind of import closes a cycle, one under
    `if TYPE_CHECKING:` (never run) too."""
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
        frozenset({"pkg.typed_c", "pkg.typed_d"}),
        frozenset({"pkg.not_typed_e", "pkg.not_typed_f"}),
        frozenset({"pkg.else_g", "pkg.else_h"}),
        frozenset({"pkg.sub.rel_m", "pkg.sub.rel_n"}),
        frozenset({"pkg.init_p", "pkg.init_p.child"}),
        frozenset({"bench.script_x", "bench.script_y"}),
    }


def _private_reaches(path: Path, module: str) -> list[str]:
    """`x._name` in `path` where `x` is neither `self` nor `cls` (`self.engine._name` counts)
    nor rooted in a module of another distribution (torch's and triton's private parts are
    theirs to keep)."""
    tree = ast.parse(path.read_text())
    foreign = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            foreign |= {a.asname or a.name.split(".")[0] for a in node.names
                        if not _ours(a.name, module, SOURCES)}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if not _ours(node.module, module, SOURCES):
                foreign |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue  # its own (`self.engine._x` is not)
            root = node.value
            while isinstance(root, ast.Attribute | ast.Call | ast.Subscript):
                root = root.func if isinstance(root, ast.Call) else root.value
            if not (isinstance(root, ast.Name) and root.id in foreign):
                found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    return found


def test_engine_parts_use_each_other_through_public_members():
    """A part of the engine (the overlapped decode loop, request intake, KV imports, ...) is
    given what it needs and calls it through its interface, never another object's `_x`."""
    assert [r for m, p in SOURCES.items() if _package(m) == "engine"
            for r in _private_reaches(p, m)] == []


@pytest.mark.parametrize("module", sorted(SOURCES))
def test_module_at_most_300_lines(module):
    num_lines = len(SOURCES[module].read_text().splitlines())
    assert num_lines <= 300, f"{module} has {num_lines} lines"


def test_ruff_enforces_the_line_length():
    """`make lint` fails a line over 100 columns (E501), so a module near its size limit is split
    by what it does instead of its lines growing; no file is let off it wholesale."""
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    lint = ruff.get("lint", {})
    off = [*lint.get("ignore", []), *lint.get("extend-ignore", []),
           *(code for codes in lint.get("per-file-ignores", {}).values() for code in codes)]
    assert ruff["line-length"] == 100 and "E" in lint["select"]
    assert not [code for code in off if "E501".startswith(code)], off


def test_create_app_functions_are_short():
    for module, path in SOURCES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "create_app":
                assert node.end_lineno - node.lineno + 1 < 60, module
