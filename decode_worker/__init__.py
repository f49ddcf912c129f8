"""The decode service: `POST /generate` pulls the blocks it lacks from a prefill worker (or
prefills locally), joins the continuous batch and streams tokens (see `worker/`)."""

from worker.app import create_app as _create_app
from worker.settings import WorkerSettings


def create_app(settings: WorkerSettings, colocated: bool = False):
    return _create_app(settings.model_copy(update={"role": "colocated" if colocated else "decode"}))
