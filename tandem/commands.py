"""What each `tandem` subcommand does (the parser is tandem/cli.py, the settings each builds from
its flags tandem/settings.py). Each imports its package lazily, so `tandem router` never pulls in
torch."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from tandem.settings import (
    bridge_settings,
    cache_dir,
    local_cluster,
    router_settings,
    worker_settings,
)

HEADER_TIMEOUT_S = 10.0  # workers: a connection's request head must arrive within this


def _engine_config(args: argparse.Namespace):
    return worker_settings(args).engine_config()


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from engine.model_store import convert_gguf, download_hf, model_dir, prepare_smollm2

    t0 = time.monotonic()
    given = Path(args.out) if args.out else None
    if args.hf_repo:
        name = args.hf_repo.rstrip("/").rsplit("/", 1)[-1].lower()
        out = download_hf(args.hf_repo, given or model_dir(name, cache_dir(args.cache_dir)),
                          args.revision, args.tokenizer_only)
    elif args.gguf:
        gguf = Path(args.gguf)
        out = convert_gguf(gguf, given or model_dir(gguf.stem.lower(), cache_dir(args.cache_dir)),
                           args.force)
    else:
        out = prepare_smollm2(given, cache_dir(args.cache_dir), args.force)
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
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed)
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


def cmd_worker(args: argparse.Namespace) -> int:
    import uvicorn

    from tandem.server import BindError, DrainingServer, bind, run, timed_http_protocol
    from worker.app import InsecureConfig

    settings = worker_settings(args)
    try:
        sock = bind(settings.host, settings.port, settings.send_buffer_bytes)
    except BindError as e:
        print(f"tandem {settings.role}: {e}", file=sys.stderr)
        return 2
    try:
        if settings.role == "prefill":
            import prefill_worker

            app = prefill_worker.create_app(settings)
        else:
            import decode_worker

            app = decode_worker.create_app(settings, colocated=settings.role == "colocated")
    except InsecureConfig as e:
        print(f"tandem {settings.role}: {e}", file=sys.stderr)
        return 2
    state = app.state.worker
    # After the drain, what is still streaming gets a moment, then is cut (the router resumes it).
    server = DrainingServer(uvicorn.Config(app, host=settings.host, port=settings.port,
                                           log_level="warning", timeout_graceful_shutdown=2,
                                           proxy_headers=False,  # only routers call workers
                                           http=timed_http_protocol(HEADER_TIMEOUT_S, 0)),
                            drain=lambda: state.drain(settings.drain_timeout_s))
    state.request_shutdown = lambda: setattr(server, "should_exit", True)
    run(server, [sock])
    # A worker whose engine died exits non-zero, so its supervisor starts a fresh one.
    return state.exit_code or 0


def cmd_bench(args: argparse.Namespace) -> int:
    from loadgen.bench import main as bench_main

    return bench_main(args)


def cmd_router(args: argparse.Namespace) -> int:
    import uvicorn

    from router.app import create_app
    from router.open_streams import END_GRACE_S
    from tandem.server import BindError, DrainingServer, bind, run, timed_http_protocol

    settings = router_settings(args)
    try:
        sock = bind(settings.host, settings.port, settings.send_buffer_bytes)
    except BindError as e:
        print(f"tandem router: {e}", file=sys.stderr)
        return 2
    app = create_app(settings)
    # The router's drain is uvicorn's own: stop listening, let in-flight requests finish; the
    # streams still open at --drain-timeout-s end with an error event (router/open_streams.py),
    # which uvicorn gives END_GRACE_S to go out before it cancels what is left.
    server = DrainingServer(
        uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                       http=timed_http_protocol(settings.header_timeout_s),
                       # X-Forwarded-For only from the proxies listed (uvicorn trusts loopback's
                       # by default: any local client could then pick its own identity).
                       proxy_headers=bool(settings.forwarded_allow_ips),
                       forwarded_allow_ips=settings.forwarded_allow_ips or None,
                       timeout_graceful_shutdown=settings.drain_timeout_s + END_GRACE_S),
        drain=app.state.gateway.drain)
    run(server, [sock])
    return 0


def cmd_vllm_bridge(args: argparse.Namespace) -> int:
    import asyncio

    from vllm_bridge.allocator import unmap_large_buffers
    from vllm_bridge.bridge import Bridge

    bridge = Bridge(bridge_settings(args))
    unmap_large_buffers()  # event batches of MiBs: freed, they leave the process

    async def serve() -> None:
        # SIGTERM and SIGINT stop it the same way: the registration and block set are deleted
        # on the way out (Bridge.run), so routers drop the server at once.
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await bridge.run()
        except asyncio.CancelledError:
            pass

    asyncio.run(serve())
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    cluster = local_cluster(args)
    # SIGTERM (kill, systemd, a container stop) and SIGHUP (the terminal closed) stop the cluster
    # like Ctrl-C does: every child drains and deregisters (Cluster.down).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    try:
        url = cluster.up()
        print("[tandem] press Ctrl-C to stop", flush=True)
        tick = None
        if args.autoscale:
            from tandem.autoscaler import LocalAutoscaler, read_router

            bounds = {pool: (getattr(args, f"min_{pool}"), getattr(args, f"max_{pool}"))
                      for pool in ("prefill", "decode")}
            tick = LocalAutoscaler(cluster, bounds, read_router(url)).tick
        name = cluster.supervise(tick=tick)
        print(f"[tandem] {name} exited; shutting down", flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.down()


def cmd_demo(args: argparse.Namespace) -> int:
    from tandem.chat import chat

    # The demo shows where each leg ran: its router names the workers (--expose-worker-ids is
    # on by default for demo, off for up).
    cluster = local_cluster(args)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    try:
        url = cluster.up()
        question = "What is the capital of France? Answer in one sentence."
        messages = [{"role": "system", "content": "You are a concise assistant."},
                    {"role": "user", "content": question}]
        out = chat(url, args.model, messages, api_key=args.api_key[0] if args.api_key else None)
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
