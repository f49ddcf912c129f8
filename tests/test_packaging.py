"""Package boundaries and the command line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_router_and_common_never_import_torch():
    code = ("import sys, router, common, common.hashing, common.protocol, tandem.cli; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'engine'))))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_cli_chat_runs_offline_engine(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "chat", "--model", "tiny-random", "--cache-dir",
         str(tmp_path), "--num-blocks", "64", "--max-tokens", "5", "--json", "hello"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) == 5 and result["finish_reason"] == "length"
    assert (tmp_path / "models" / "tiny-random" / "config.json").is_file()


def test_cli_reports_unknown_model_clearly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "chat", "--model", "no-such-model", "--cache-dir",
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
        [sys.executable, "-m", "tandem.cli", "demo", "--model", "tiny-random", "--cache-dir",
         str(tmp_path), "--no-redis", "--num-blocks", "128", "--port", "0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "assistant> " in out.stdout and "[plan disagg" in out.stdout
    assert "static-prefill-0" in out.stdout and "[tandem] stopped" in out.stdout


def test_flags_win_and_environment_fills_the_rest(monkeypatch):
    from tandem.cli import build_parser
    from tandem.commands import router_settings, worker_settings

    monkeypatch.setenv("TANDEM_ROUTER_POLICY", "round_robin")
    monkeypatch.setenv("TANDEM_ROUTER_PORT", "9100")
    monkeypatch.setenv("TANDEM_MAX_NUM_SEQS", "7")
    parse = build_parser().parse_args
    s = router_settings(parse(["router", "--port", "9001"]))
    assert (s.policy, s.port) == ("round_robin", 9001)
    w = worker_settings(parse(["decode"]))
    assert (w.role, w.max_num_seqs) == ("decode", 7)
    assert worker_settings(parse(["decode", "--max-num-seqs", "9"])).max_num_seqs == 9


SAMPLES = {int: "3", float: "2.5", str: "value", Path: "/tmp/x", list: "http://127.0.0.1:1"}


def _sample(field, kind) -> str:
    """SAMPLES[kind], raised to the field's lower bound where it has one (a socket buffer of
    at least 4096 bytes, say)."""
    value = SAMPLES[kind]
    if kind in (int, float):
        for bound in field.metadata:
            low = getattr(bound, "ge", None)
            if low is None and getattr(bound, "gt", None) is not None:
                low = bound.gt + 1
            if low is not None and float(value) < low:
                value = str(int(low) if kind is int else float(low))
    return value


@pytest.mark.parametrize("command,cls_name", [("router", "RouterSettings"), ("decode", "WorkerSettings")])
def test_every_setting_is_a_flag(command, cls_name):
    """Each field of the settings class has a --name-with-dashes flag whose value reaches the
    settings (the issue: only 17 of 44 router settings had one)."""
    from router.settings import RouterSettings
    from tandem.cli import build_parser
    from tandem.flags import flag_name, flag_type, given
    from worker.settings import WorkerSettings

    cls = {"RouterSettings": RouterSettings, "WorkerSettings": WorkerSettings}[cls_name]
    parser = build_parser()
    for name, field in cls.model_fields.items():
        if name == "role":
            continue  # the subcommand
        kind, choices = flag_type(field.annotation)
        argv = [command, flag_name(name)] + ([] if kind is bool else [choices[0] if choices else _sample(field, kind)])
        got = given(parser.parse_args(argv), cls)
        assert list(got) == [name]
        settings = cls(**got)
        assert getattr(settings, name) == (True if kind is bool else got[name]), name


def test_old_flag_spellings_and_global_flags_after_the_subcommand():
    from tandem.cli import build_parser
    from tandem.commands import router_settings, worker_settings

    parse = build_parser().parse_args
    args = parse(["decode", "--kv-memory", "2", "--heartbeat-ttl", "3", "--no-pack-weights", "-v",
                  "--log-json"])
    w = worker_settings(args)
    assert (w.kv_memory_gb, w.heartbeat_ttl_s, w.pack_weights) == (2.0, 3.0, False)
    assert args.verbose and args.log_json
    args = parse(["-v", "router", "--worker", "decode=http://h:1", "--worker", "prefill=http://h:2",
                  "--api-key", "k", "--tokenizer", "/t", "--prefill-timeout-s", "5"])
    r = router_settings(args)
    assert r.workers == ["decode=http://h:1", "prefill=http://h:2"] and r.api_keys == ["k"]
    assert str(r.tokenizer_path) == "/t" and r.prefill_timeout_s == 5.0 and args.verbose


def test_help_shows_each_settings_description_and_default(capsys):
    from tandem.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--prefill-timeout-s" in text and "longest prefill leg" in text
    assert "(default: 60.0; env TANDEM_ROUTER_PREFILL_TIMEOUT_S)" in text
