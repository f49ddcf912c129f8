"""Rolling-restart soak: a 2P+2D tiny-random cluster behind one router under a streaming load that
checks every answer (testing/streaming_load.py); each round SIGTERMs every worker in turn and
starts it again, by default on a new port (a new worker id, as a rescheduled pod gets). After
every round: the router's RSS, Redis's used memory, the keys of the cluster's namespace, and
the answers so far (failed, lost or repeated tokens must stay at zero).

    .venv/bin/python bench/rolling_restart.py [--rounds 8] [--same-port]

Writes bench/results/rolling_restart.json. Flat memory means the router's RSS after the last
round within a few MiB of the first (`rss_growth_mib`), and a constant key count.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.provenance import write_result  # noqa: E402
from engine.tiny import build_tiny_random  # noqa: E402
from testing.cluster import two_by_two  # noqa: E402
from testing.redis_server import REDIS_URL  # noqa: E402
from testing.streaming_load import StreamingLoad  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--same-port", action="store_true", help="restart on the same port (same id)")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "rolling_restart.json"))
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="tandem-roll-"))
    folder = build_tiny_random(workdir / "models" / "tiny-random")
    ns = f"bench-roll-{uuid.uuid4().hex[:6]}"
    r = redis.Redis.from_url(REDIS_URL)
    rounds = []
    with two_by_two(folder, workdir, ns) as (router, workers):
        load = StreamingLoad(router.url, "tiny-random", num_clients=args.clients).start()
        time.sleep(2.0)
        t0 = time.monotonic()
        for i in range(args.rounds):
            for w in workers:
                status = w.stop(signal.SIGTERM)
                if status != 0:
                    raise RuntimeError(f"{w.worker_id} exited with {status}")
                w.restart(new_port=not args.same_port)
                router.wait_workers(4, timeout=60)
            time.sleep(1.0)  # the router has dropped the departed ids by now
            row = {"round": i + 1, "elapsed_s": round(time.monotonic() - t0, 1),
                   "router_rss_mib": round(rss_mib(router.proc.pid), 1),
                   "redis_used_memory_mib": round(r.info("memory")["used_memory"] / 2**20, 2),
                   "namespace_keys": sum(1 for _ in r.scan_iter(match=f"tandem:{ns}:*")),
                   "router_known_workers": len(router.client.get("/ready").json()["workers"]),
                   "answers_ok": load.num_ok, "failures": len(load.failures),
                   "mismatches": len(load.mismatches)}
            rounds.append(row)
            print(json.dumps(row), flush=True)
        result = load.stop()
    rss = [row["router_rss_mib"] for row in rounds]
    out = {"rounds": rounds, "restarts": args.rounds * len(workers),
           "new_port": not args.same_port, "answers_ok": result["ok"],
           "failures": result["failures"][:20], "mismatches": result["mismatches"][:20],
           "rss_growth_mib": round(rss[-1] - rss[0], 1) if rss else None,
           "rss_growth_last_half_mib": round(rss[-1] - rss[len(rss) // 2], 1) if rss else None}
    write_result(args.out, out)
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=2))
    return 0 if not result["failures"] and not result["mismatches"] else 1


if __name__ == "__main__":
    sys.exit(main())
