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

    record = logging.LogRecord("tandem.x", logging.WARNING, __file__, 1, "pull failed (%s)",
                               ("boom",), None)
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
    from tandem.settings import router_settings, worker_settings

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


@pytest.mark.parametrize("command,cls_name",
                         [("router", "RouterSettings"), ("decode", "WorkerSettings")])
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
        argv = ([command, flag_name(name)]
                + ([] if kind is bool else [choices[0] if choices else _sample(field, kind)]))
        got = given(parser.parse_args(argv), cls)
        assert list(got) == [name]
        settings = cls(**got)
        assert getattr(settings, name) == (True if kind is bool else got[name]), name


def test_a_settings_class_keeps_its_own_fields_first():
    """The SLO planner's fields live in a base the router's settings mix in, and pydantic puts a
    base's fields first: --help and the reference still list the router's own first, each field
    once."""
    from router.planner_settings import PlannerSettings
    from router.settings import RouterSettings
    from tandem.flags import fields_in_order

    names = list(fields_in_order(RouterSettings))
    assert sorted(names) == sorted(RouterSettings.model_fields)
    planner = list(PlannerSettings.model_fields)
    assert names[:2] == ["host", "port"] and names[-len(planner):] == planner
    assert list(RouterSettings.model_fields)[:len(planner)] == planner  # what it undoes


def test_old_flag_spellings_and_global_flags_after_the_subcommand():
    from tandem.cli import build_parser
    from tandem.settings import router_settings, worker_settings

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


def _string_bound_to_a_token(tree) -> list[str]:
    """Non-empty string literals given to a name, attribute, keyword or parameter called
    `token`, `*_token` or `token_*` (any case): a credential written in code."""
    import ast
    import re

    is_token = re.compile(r"(^|_)token($|_)", re.IGNORECASE).search

    def name_of(target) -> str | None:
        return target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)

    found = []
    for node in ast.walk(tree):
        pairs = []
        if isinstance(node, ast.Assign):
            pairs = [(name_of(t), node.value) for t in node.targets]
        elif isinstance(node, ast.AnnAssign):
            pairs = [(name_of(node.target), node.value)]
        elif isinstance(node, ast.keyword):
            pairs = [(node.arg, node.value)]
        elif isinstance(node, ast.arguments):
            positional = node.posonlyargs + node.args
            pairs = list(zip([a.arg for a in positional[len(positional) - len(node.defaults):]],
                             node.defaults, strict=True))
            pairs += [(a.arg, d) for a, d in zip(node.kwonlyargs, node.kw_defaults, strict=True)]
        found += [f"{name} = {value.value!r}" for name, value in pairs
                  if name and is_token(name) and isinstance(value, ast.Constant)
                  and isinstance(value.value, str) and value.value]
    return found


def test_the_wheel_carries_no_test_harness_and_no_fixed_token(tmp_path):
    """The wheel built from this checkout (every package of ours copied, testing/ included):
    the installed packages and nothing else, no module of testing/, and no string given to a
    token anywhere in its code (the harness's token was once the constant
    "internal-test-token" inside the installed `tandem` package)."""
    import ast
    import shutil
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ours = sorted(p.name for p in ROOT.iterdir()
                  if (p / "__init__.py").is_file() and p.name != "tests")
    for name in ours:
        shutil.copytree(ROOT / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "_lib"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(tmp_path / "out"), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "out").glob("tandem-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        fixed = {n: bad for n in names if n.endswith(".py")
                 if (bad := _string_bound_to_a_token(ast.parse(z.read(n))))}
    assert fixed == {}
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert "testing" in ours and "tandem" in tops
    assert tops == set(ours) - {"testing"}


def test_the_token_check_sees_each_way_of_writing_one():
    """The checker above, on made-up code: each binding of a literal to a token is found; an
    empty default, a generated token and other names are not."""
    import ast

    code = '''
TOKEN = "t1"
internal_token: str = "t2"
class A:
    def __init__(self, token="t3", *, api_token="t4"):
        self.token = "t5"
connect(internal_token="t6")
none = ""
tokenizer_source = "x"
max_tokens = "8"
TOKEN_OK = secrets.token_urlsafe(24)
def f(token=None, other_token=""): pass
'''
    found = _string_bound_to_a_token(ast.parse(code))
    assert sorted(v.split("'")[1] for v in found) == ["t1", "t2", "t3", "t4", "t5", "t6"]
