import json
import os
from collections import Counter
from pathlib import Path

import pytest

# Each test file's time in the last recorded run (setup, call and teardown of its tests, in
# seconds): `make test` starts the longest files first, so that none becomes the run's tail.
FILE_DURATIONS = Path(__file__).with_name("file_durations.json")
_recorded: Counter = Counter()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs three test processes on two cores: one OpenMP thread each, and in the
    # workers they start, since oversubscribed OpenMP threads spin against each other (the
    # SmolLM2 file took 3-4x its time alone). Set before anything imports torch.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser):
    parser.addoption("--record-file-durations", action="store_true",
                     help=f"write each test file's time in this run to {FILE_DURATIONS.name} "
                          "(files not run keep theirs)")


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _file_durations() -> dict[str, float]:
    return json.loads(FILE_DURATIONS.read_text()) if FILE_DURATIONS.exists() else {}


def pytest_collection_modifyitems(config, items):
    # The longest files first (a file runs in one test process: --dist loadfile, with xdist's
    # own reordering by test count turned off in the Makefile): longest-first keeps the run's
    # end from waiting on one long file. A file not yet recorded counts as a slow one when it
    # has a test marked slow.
    check_serial_files(items)
    seconds = _file_durations()
    slow = {_file(item.nodeid) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: -seconds.get(_file(item.nodeid),
                                             30.0 if _file(item.nodeid) in slow else 1.0))
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; the CPU twin of this test runs instead")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def check_serial_files(items) -> None:
    # `make test`'s serial phase collects only the files that spell `mark.serial` (Makefile
    # SERIAL_FILES): a test marked serial some other way would never run in either phase.
    files = {str(item.path) for item in items if item.get_closest_marker("serial")}
    missed = sorted(f for f in files if "mark.serial" not in Path(f).read_text())
    if missed:
        raise pytest.UsageError(f"tests marked serial in files that do not spell "
                                f"'mark.serial' (Makefile SERIAL_FILES misses them): {missed}")


def pytest_runtest_logreport(report):
    _recorded[_file(report.nodeid)] += report.duration


def pytest_sessionfinish(session):
    # Under xdist the controller sees every test's reports; its workers do not write.
    config = session.config
    if not config.getoption("--record-file-durations") or hasattr(config, "workerinput"):
        return
    seconds = _file_durations()
    seconds.update({f: round(s, 1) for f, s in _recorded.items()})
    FILE_DURATIONS.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """The model cache `make test` prepares SmolLM2 into (same default as the CLI)."""
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> Path:
    from engine.tiny import build_tiny_random

    return build_tiny_random(tmp_path_factory.mktemp("models") / "tiny-random")


@pytest.fixture(scope="session")
def smollm2_folder(cache_dir) -> Path:
    from engine.model_store import prepare_smollm2

    return prepare_smollm2(cache_dir=cache_dir)


@pytest.fixture(scope="session")
def reference(tiny_folder):
    """The one-process engine on tiny-random: what every served path must reproduce."""
    from engine import LLM

    return LLM(str(tiny_folder), num_blocks=512, block_size=4)
