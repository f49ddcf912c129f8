"""The worker kinds the router can route to, by name (`[backend:]role=url` in `--worker`); the
`Backend` Protocol they implement is in router/backend.py.

- `tandem`: Tandem workers (router/tandem_backend.py);
- `vllm`: vLLM OpenAI servers with the NixlConnector (router/vllm_backend.py).
"""

from __future__ import annotations

from router.tandem_backend import TandemBackend
from router.vllm_backend import VLLMBackend

BACKENDS: dict[str, type] = {"tandem": TandemBackend, "vllm": VLLMBackend}
