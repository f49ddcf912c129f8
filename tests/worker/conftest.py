import uuid

import pytest


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("workers")


@pytest.fixture(scope="module")
def namespace():
    return f"test-{uuid.uuid4().hex[:8]}"
