"""Package boundaries and the command line."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_router_and_common_never_import_torch():
    code = ("import sys, router, common, common.hashing, common.protocol, common.cli; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'engine'))))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_cli_chat_runs_offline_engine(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "common.cli", "chat", "--model", "tiny-random", "--cache-dir",
         str(tmp_path), "--num-blocks", "64", "--max-tokens", "5", "--json", "hello"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) == 5 and result["finish_reason"] == "length"
    assert (tmp_path / "models" / "tiny-random" / "config.json").is_file()


def test_cli_reports_unknown_model_clearly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "common.cli", "chat", "--model", "no-such-model", "--cache-dir",
         str(tmp_path), "hi"], cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2 and "unknown model 'no-such-model'" in out.stderr


def test_json_logs_carry_request_ids():
    import logging

    from common.logs import JsonFormatter

    record = logging.LogRecord("tandem.x", logging.WARNING, __file__, 1, "pull failed (%s)", ("boom",), None)
    record.request_id = "req-9"
    entry = json.loads(JsonFormatter().format(record))
    assert entry["msg"] == "pull failed (boom)" and entry["request_id"] == "req-9"
    assert entry["level"] == "warning" and entry["ts"].endswith("Z")


def test_tandem_demo_runs_a_local_cluster_without_redis(tmp_path):
    """`tandem demo` end to end (workers and router as processes); --no-redis takes the
    in-process index path, so this runs wherever the CLI does."""
    out = subprocess.run(
        [sys.executable, "-m", "common.cli", "demo", "--model", "tiny-random", "--cache-dir",
         str(tmp_path), "--no-redis", "--num-blocks", "128", "--port", "0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "assistant> " in out.stdout and "[plan disagg" in out.stdout
    assert "static-prefill-0" in out.stdout and "[tandem] stopped" in out.stdout


def test_flags_win_and_environment_fills_the_rest(monkeypatch, tmp_path):
    from common.cli import _given, _router_kwargs, _worker_kwargs, build_parser
    from router.settings import RouterSettings
    from worker.settings import WorkerSettings

    monkeypatch.setenv("TANDEM_ROUTER_POLICY", "round_robin")
    monkeypatch.setenv("TANDEM_ROUTER_PORT", "9100")
    monkeypatch.setenv("TANDEM_MAX_NUM_SEQS", "7")
    s = RouterSettings(**_given(_router_kwargs, build_parser().parse_args(["router", "--port", "9001"])))
    assert (s.policy, s.port) == ("round_robin", 9001)
    w = WorkerSettings(**_given(_worker_kwargs, build_parser().parse_args(["decode"])))
    assert (w.role, w.max_num_seqs) == ("decode", 7)
    w = WorkerSettings(**_given(_worker_kwargs, build_parser().parse_args(["decode", "--max-num-seqs", "9"])))
    assert w.max_num_seqs == 9


def test_readme_config_reference_is_current(tmp_path):
    from common.config_reference import write_readme

    copy = tmp_path / "README.md"
    copy.write_text((ROOT / "README.md").read_text())
    assert not write_readme(copy), "README config reference is stale: python -m common.config_reference --write"
    assert "TANDEM_ROUTER_POLICY" in copy.read_text()
