"""Each command's settings, from its flags (those given), then the environment, then the
defaults: the worker's, the router's and the vLLM bridge's, and the local cluster that `tandem up`
and `tandem demo` start. Each imports its package lazily, as the commands do (tandem/commands.py).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tandem.flags import given


def cache_dir(value: str | None) -> Path:
    # The edge is the one place the environment is read.
    return Path(value or os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")


def worker_settings(args: argparse.Namespace):
    """The worker's settings: the flags given, then TANDEM_* variables, then the defaults; the
    role is the subcommand's (`tandem chat` builds only the engine from them)."""
    from worker.settings import WorkerSettings

    kwargs = given(args, WorkerSettings)
    kwargs.setdefault("cache_dir", cache_dir(None))
    if args.command in ("prefill", "decode", "colocated"):
        kwargs["role"] = args.command
    return WorkerSettings(**kwargs)


def router_settings(args: argparse.Namespace):
    """The router's settings: the flags given, then TANDEM_ROUTER_* variables, then the
    defaults; TANDEM_INTERNAL_TOKEN as for the workers."""
    from router.settings import RouterSettings

    kwargs = given(args, RouterSettings)
    kwargs.setdefault("cache_dir", cache_dir(None))
    # The workers read TANDEM_INTERNAL_TOKEN themselves; the router's prefix is TANDEM_ROUTER_.
    if "internal_token" not in kwargs and os.environ.get("TANDEM_INTERNAL_TOKEN"):
        kwargs["internal_token"] = os.environ["TANDEM_INTERNAL_TOKEN"]
    return RouterSettings(**kwargs)


def bridge_settings(args: argparse.Namespace):
    """The vLLM bridge's settings: the flags given, then TANDEM_BRIDGE_* variables, then the
    defaults; TANDEM_INTERNAL_TOKEN as for the workers."""
    from vllm_bridge.settings import BridgeSettings

    kwargs = given(args, BridgeSettings)
    if "internal_token" not in kwargs and os.environ.get("TANDEM_INTERNAL_TOKEN"):
        kwargs["internal_token"] = os.environ["TANDEM_INTERNAL_TOKEN"]
    return BridgeSettings(**kwargs)


def local_cluster(args: argparse.Namespace):
    """The local cluster of `tandem up` or `tandem demo` (tandem/launcher.py), not started yet:
    its router's flags from the command's, TANDEM_INTERNAL_TOKEN as for the workers."""
    from tandem.launcher import Cluster

    router_args = ["--policy", args.policy] if args.policy else []
    if args.chat_template:
        router_args += ["--chat-template", str(Path(args.chat_template).resolve())]
    if args.expose_worker_ids:
        router_args.append("--expose-worker-ids")
    if getattr(args, "autoscale", False):  # `tandem up` only
        if args.no_redis:
            raise SystemExit("[tandem] --autoscale needs Redis: workers started later register "
                             "there")
        # The planner's bounds are the launcher's; local workers start in seconds.
        router_args += [f"--planner-{b}-{pool}={getattr(args, f'{b}_{pool}')}"
                        for pool in ("prefill", "decode") for b in ("min", "max")]
        router_args.append("--planner-startup-s=20")
    return Cluster(model=args.model, cache_dir=cache_dir(args.cache_dir), port=args.port,
                   num_prefill=args.prefill, num_decode=args.decode,
                   redis_url=None if args.no_redis else args.redis_url,
                   redis_cluster=args.redis_cluster, num_blocks=args.num_blocks,
                   threads=args.threads, namespace=args.namespace,
                   host_kv_gb=args.host_kv_gb, disk_kv_gb=args.disk_kv_gb,
                   disk_kv_dir=Path(args.disk_kv_dir).resolve() if args.disk_kv_dir else None,
                   drain_timeout_s=args.drain_timeout_s,
                   internal_token=os.environ.get("TANDEM_INTERNAL_TOKEN") or None,
                   extra_worker_args=["--enable-fault-injection"]
                                     if args.enable_fault_injection else [],
                   extra_router_args=router_args, api_keys=list(args.api_key))
