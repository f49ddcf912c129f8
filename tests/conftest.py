import os
from pathlib import Path

import pytest


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


def pytest_collection_modifyitems(config, items):
    # The files marked slow first: with a file per test process, the longest start at once
    # instead of becoming the run's tail.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; the CPU twin of this test runs instead")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
