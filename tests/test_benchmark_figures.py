"""The published figures are traceable: every table in docs/benchmarks.md either names the result
files behind it (committed under bench/results/, each with its provenance) and every plain
number in the table is found in them, or says plainly that no result file was kept. The README's
speed claims name files that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"
UNTRACED = "No result file was kept"
_RESULT_REF = re.compile(r"bench/results/([\w.\-]+\.json)")
# A plain figure: digits with an optional decimal part and thousands commas, not a ratio (×),
# a share (%), a range or a word; derived ratios are checked through the figures they come from.
_NUMBER = re.compile(r"(?<![\w.×/+\-])(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?![\w.×%/])")


def _tables(text: str) -> list[tuple[int, str, list[str]]]:
    """(line number, the prose since the previous table or heading, the table's body rows)."""
    out, prose, rows, start = [], [], [], 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("|"):
            if not rows:
                start = n
            rows.append(line)
            continue
        if rows:
            out.append((start, "\n".join(prose), rows[2:]))  # skip the header and the rule
            rows, prose = [], []
        if line.startswith("#"):
            prose = []
        prose.append(line)
    if rows:
        out.append((start, "\n".join(prose), rows[2:]))
    return out


def _leaves(node) -> list[float]:
    if isinstance(node, bool):
        return []
    if isinstance(node, int | float):
        return [float(node)]
    if isinstance(node, dict):
        return [v for child in node.values() for v in _leaves(child)]
    if isinstance(node, list):
        return [v for child in node for v in _leaves(child)]
    return []


def _figures(row: str) -> list[tuple[float, int]]:
    """(value, decimals) of each plain figure in a row's cells, the first cell (the row's name)
    left out."""
    cells = [c.strip() for c in row.strip().strip("|").split("|")][1:]
    out = []
    for cell in cells:
        for whole, frac in _NUMBER.findall(cell.replace("**", "")):
            out.append((float(whole.replace(",", "") + ("." + frac if frac else "")), len(frac)))
    return out


def _found(value: float, decimals: int, leaves: list[float]) -> bool:
    # A figure shown with d decimals matches a recorded value that rounds to it (a half-way
    # value may round either way in the doc's formatting).
    tolerance = 0.5 * 10 ** -decimals + 1e-9
    return any(abs(v - value) <= tolerance for v in leaves)


TABLES = _tables(BENCHMARKS.read_text())


def test_the_parser_sees_every_table():
    assert len(TABLES) == BENCHMARKS.read_text().count("\n|---")
    assert _figures("| a | 1,234 | 41.8 | 1.22× | +2.1% | 4bd1a96 |") == [(1234.0, 0), (41.8, 1)]


@pytest.mark.parametrize("line,prose,rows", TABLES, ids=[f"line{t[0]}" for t in TABLES])
def test_each_table_names_its_result_files_or_says_none_was_kept(line, prose, rows):
    if UNTRACED in prose:
        return  # said plainly beside the table
    names = _RESULT_REF.findall(prose)
    assert names, (f"docs/benchmarks.md line {line}: a table with neither a bench/results/ file "
                   f"before it nor the words {UNTRACED!r}")
    leaves = []
    for name in names:
        path = RESULTS / name
        assert path.is_file(), f"line {line}: {path} is not committed"
        result = json.loads(path.read_text())
        provenance = result.get("provenance") or {}
        assert re.fullmatch(r"[0-9a-f]{40}", provenance.get("commit", "")), (
            f"{name}: no provenance naming a commit")
        leaves += _leaves(result)
    missing = [(row.split("|")[1].strip(), value) for row in rows
               for value, decimals in _figures(row) if not _found(value, decimals, leaves)]
    assert not missing, f"docs/benchmarks.md line {line}: figures not in {names}: {missing}"


def test_the_readme_names_result_files_that_exist():
    names = _RESULT_REF.findall((ROOT / "README.md").read_text())
    assert names, "the README's speed claims name no result file"
    for name in names:
        assert (RESULTS / name).is_file(), name


def test_a_figure_not_in_its_file_is_caught(tmp_path):
    leaves = _leaves({"a": {"ttft_ms": 1957.3, "itl": [41.84]}, "ok": True})
    assert _found(1957, 0, leaves) and _found(41.8, 1, leaves)
    assert not _found(1958, 0, leaves) and not _found(41.9, 1, leaves)
    assert not _found(1.0, 0, leaves)  # a boolean is not a figure
