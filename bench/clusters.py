"""One fresh local cluster (Redis namespace, workers, router) per benchmark arm, driven by
`tandem bench`'s runner; shared by bench/policies.py and bench/disagg.py."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadgen.bench import run  # noqa: E402
from testing.cluster import Router, Worker  # noqa: E402 - the same process helpers as the tests


def run_on_cluster(name: str, roles: list[str], model: str, workload_name: str, sessions,
                   work: Path, *, policy: str = "kv_aware", num_blocks: int = 2048,
                   worker_args: list[str] | None = None, concurrency: int = 4,
                   router_env: dict[str, str] | None = None) -> dict:
    """Starts `roles` workers and a router, runs `sessions`, stops everything; the bench summary."""
    from engine.model_store import resolve_model

    folder = resolve_model(model)
    ns = f"bench-{name}-{uuid.uuid4().hex[:6]}"
    workers = [Worker(role, str(folder), cache_dir=work, namespace=ns, num_blocks=num_blocks,
                      extra=worker_args) for role in roles]
    router = Router(folder, ns, cache_dir=work, policy=policy, env=router_env)
    try:
        router.wait_workers(len(roles))
        return run(f"{router.url}/v1", folder.name, workload_name, len(sessions),
                   concurrency=concurrency, sessions=sessions,
                   out_dir=ROOT / "bench" / "results", name=name)
    finally:
        router.close()
        for w in workers:
            w.close()
