"""The prefill service: `POST /prefill` computes a prompt's uncached blocks, samples the first
token and exports the blocks under a lease (see `worker/` for the shared machinery)."""

from worker.app import create_app as _create_app
from worker.settings import WorkerSettings


def create_app(settings: WorkerSettings):
    return _create_app(settings.model_copy(update={"role": "prefill"}))
