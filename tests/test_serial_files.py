"""`make test`'s serial phase collects only the files that spell `mark.serial` (Makefile
SERIAL_FILES); tests/conftest.py refuses a serial test in any other file, so none is silently
left out of both phases."""

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import check_serial_files

ROOT = Path(__file__).resolve().parents[1]


def item(path: Path, serial: bool) -> SimpleNamespace:
    return SimpleNamespace(path=path, get_closest_marker=lambda name: serial or None)


def test_a_serial_test_in_a_file_that_does_not_spell_the_mark_is_refused(tmp_path):
    marked, unmarked = tmp_path / "test_a.py", tmp_path / "test_b.py"
    marked.write_text("pytestmark = pytest.mark.serial\n")
    unmarked.write_text("pytestmark = SERIAL\n")
    check_serial_files([item(marked, True), item(unmarked, False)])
    with pytest.raises(pytest.UsageError, match="test_b.py"):
        check_serial_files([item(marked, True), item(unmarked, True)])


def test_the_makefile_lists_every_file_with_a_serial_mark():
    listed = subprocess.run(["make", "-s", "--no-print-directory", "-f", "Makefile",
                             "print-serial-files"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    spelled = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                     if "mark.serial" in p.read_text() and p.name != Path(__file__).name)
    assert sorted(set(listed) - {str(Path(__file__).relative_to(ROOT))}) == spelled
    assert "tests/security/test_round_three.py" in listed
