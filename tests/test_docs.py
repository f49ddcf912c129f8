"""The README and the docs site checked against the code: the generated configuration page is
current, the site builds in strict mode with every page in its nav, no page points outside the
repository or names an issue or a date, the contract's field lists, key formats, golden vectors
and metric names are the code's, the OpenAI page names every request field, and the OpenAI-client
snippets run against a live tiny-random cluster."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
MARKDOWN = [ROOT / "README.md", *PAGES]
CONTRACT = DOCS / "contract.md"
PLANS = ("disagg", "decode_local", "colocated")


def _after(page: Path, marker: str) -> str:
    """The text of `page` after `<!-- marker -->`, up to the next blank line after its block."""
    text = page.read_text()
    start = text.index(f"<!-- {marker} -->") + len(f"<!-- {marker} -->")
    rest = text[start:].lstrip("\n")
    if rest.startswith("```"):
        return rest[rest.index("\n") + 1:rest.index("\n```")]
    return rest.split("\n\n")[0]


def _table(page: Path, marker: str) -> list[list[str]]:
    """The rows (cells stripped) of the table right after `<!-- marker -->`, header excluded."""
    lines = [line for line in _after(page, marker).splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def _ticked(cell: str) -> list[str]:
    """The `code` spans of a cell, outside parentheses (which hold examples, not names)."""
    return re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", cell))


# ---- the site ----------------------------------------------------------------------------------


def test_configuration_page_is_current():
    from tandem.config_reference import PAGE, page

    assert PAGE == DOCS / "configuration.md"
    assert PAGE.read_text() == page(), "stale: python -m tandem.config_reference --write"
    text = PAGE.read_text()
    assert "`TANDEM_ROUTER_POLICY`" in text and "`TANDEM_KV_MEMORY_GB`" in text
    assert "### `tandem up`" in text and "`--prefill`" in text


def test_every_flag_on_the_configuration_page_has_a_meaning():
    rows = [line for line in (DOCS / "configuration.md").read_text().splitlines()
            if line.startswith("| `")]
    assert len(rows) > 100
    cells = [row.split("|") for row in rows]  # ["", flag, ..., meaning, ""]
    blank = [c[1].strip() for c in cells if not c[-2].strip()]
    assert not blank, f"flags without a meaning: {blank}"


def test_every_test_the_threat_model_names_exists():
    """docs/SECURITY.md backs each line with a test by name: each name must be a test (or a
    parametrized case of one) in tests/, so a renamed or deleted test cannot leave a claim
    unbacked."""
    named = set(re.findall(r"`(test_\w+)(?:\[[^\]]*\])?`", (DOCS / "SECURITY.md").read_text()))
    assert len(named) > 40
    defined = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        defined |= set(re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), re.M))
    assert not named - defined, f"tests named in SECURITY.md but not defined: {named - defined}"


def test_config_reference_write_reports_a_stale_page(tmp_path):
    from tandem.config_reference import page, write

    stale = tmp_path / "configuration.md"
    stale.write_text("# Configuration\n\nold\n")
    assert write(stale) is True and stale.read_text() == page()
    assert write(stale) is False


def test_nav_lists_every_page_once():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = [next(iter(entry.values())) for entry in nav]
    assert len(listed) == len(set(listed))
    assert sorted(listed) == sorted(str(p.relative_to(DOCS)) for p in PAGES)


def test_docs_site_builds_in_strict_mode(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "contract" / "index.html").is_file()


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_stays_inside_the_repository(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is not a link
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        path = target.split("#")[0]
        if not path:
            continue  # an anchor on the same page (mkdocs checks those)
        resolved = (page.parent / path).resolve()
        if "://" in target or not resolved.is_relative_to(ROOT) or not resolved.exists():
            bad.append(target)
    assert bad == []
    assert "../shared" not in page.read_text() and "DESIGN.md" not in page.read_text()


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_numbers_or_dates_of_runs(page):
    text = page.read_text()
    assert re.findall(r"\bissues?\s*#?\d+", text, re.I) == []
    assert re.findall(r"(?<![\w/{#])#\d+\b", text) == []  # `{prod#11}` is a hash tag, not an issue
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b", text) == []


def test_readme_is_a_landing_page_whose_two_commands_are_the_makefiles():
    readme = (ROOT / "README.md").read_text()
    assert 100 <= len(readme.splitlines()) <= 250
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M))
    commands = re.findall(r"^make ([a-z-]+)", readme, re.M)
    assert commands[:2] == ["demo", "test"] and {"demo", "test"} <= targets
    for page in PAGES:
        assert f"docs/{page.relative_to(DOCS)}" in readme or page.name == "index.md", page.name


# ---- the contract against the code -------------------------------------------------------------


def test_golden_vectors_are_the_tests_and_the_hash_function():
    from common.hashing import BlockHasher, hash_seed
    from tests import golden

    shown: dict = {}
    exec(_after(CONTRACT, "golden-vectors"), shown)  # noqa: S102 - our own page
    names = {k for k in vars(golden) if k.isupper()}
    assert {k for k in shown if k.isupper()} == names
    assert all(shown[k] == getattr(golden, k) for k in names)
    assert hash_seed(shown["SMOLLM2_ID"], 16) == shown["SMOLLM2_SEED"]
    assert hash_seed(shown["SMOLLM2_ID"], 16, "tenant-a") == shown["SMOLLM2_SEED_SALTED"]
    assert hash_seed("tiny-random", 4) == shown["TINY_SEED_BS4"]
    hasher = BlockHasher(shown["SMOLLM2_ID"], 16)
    assert hasher(list(range(40))) == shown["RANGE40_HASHES"]
    assert hasher(shown["CHAT_PROMPT_IDS"]) == shown["CHAT_PROMPT_HASHES"]
    assert hasher(shown["CHAT_PROMPT_IDS"], cache_salt="tenant-b") \
        == shown["CHAT_PROMPT_HASHES_CACHE_SALTED"]
    assert BlockHasher("tiny-random", 4)(shown["EDGE_TOKENS"]) == shown["EDGE_HASHES"]


def test_redis_keys_are_the_codes():
    from common.registry import EVENT_SHARDS, RedisKeys

    keys, wid = RedisKeys("prod"), "decode-10.0.0.5-8300"
    shown = [_ticked(row[0])[0] for row in _table(CONTRACT, "redis-keys")]
    shard = keys.event_shard(wid)
    assert shown[:5] == [keys.worker(wid), *keys.block_sets(wid), keys.events(shard)]
    assert f"shard {shard}" in CONTRACT.read_text() and EVENT_SHARDS == 16
    assert [s.rsplit(":", 1)[0] if "<" in s else s for s in shown[5:]] == [
        f"{keys.prefix}router", f"{keys.prefix}rl:<16 hex digits>"]


def _registration_fields() -> set[str]:
    """What a worker writes into its `worker:{id}` hash, from WorkerState itself."""
    import torch

    from worker.state import WorkerState

    core = SimpleNamespace(num_blocks=8, max_model_len=64, model_digest="0" * 16, folder="/m",
                           block_size=4, hasher=SimpleNamespace(seed=1), vocab_size=32,
                           model_config=SimpleNamespace(vocab_size=32),
                           kv_cache=torch.zeros(8, 2, 2, 4, 1, 8))
    state = SimpleNamespace(core=core, connector=None, started_at=0.0, served_names=["m"],
                            settings=SimpleNamespace(role="decode", url="http://h:1",
                                                     resolved_worker_id="w", locality=""))
    state.model_info = lambda: WorkerState.model_info(state)
    return set(WorkerState.registration_info(state)) | {"load", "events", "signature"}


def test_registration_fields_are_what_a_worker_writes():
    from common.registry import WorkerLoad

    rows = _table(CONTRACT, "registration-fields")
    assert {_ticked(r[0])[0] for r in rows} == _registration_fields()
    load = next(r for r in rows if r[0] == "`load`")
    assert set(_ticked(load[1])) == set(WorkerLoad.model_fields)


def test_stream_entry_fields_and_kinds_are_the_codes():
    from common.block_events import ENTRY_KINDS, StreamEntry

    text = CONTRACT.read_text()
    section = text[text.index("**`events:{ns#shard}`**"):text.index("Streams are trimmed")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]
    tiered = StreamEntry("w", "0" * 16, 0, "stored", (), "host")  # every field: `m` too
    assert [_ticked(r[0])[0] for r in rows] == list(tiered.fields())
    kinds = next(r for r in rows if r[0] == "`k`")
    assert set(_ticked(kinds[1])) == set(ENTRY_KINDS)


def test_wire_models_are_the_codes():
    from common import protocol

    for row in _table(CONTRACT, "wire-models"):
        model = getattr(protocol, _ticked(row[0])[0])
        assert _ticked(row[1]) == list(model.model_fields), row[0]


def test_signed_fields_are_the_codes():
    from kv_transfer.handle import REQUIRED_FIELDS, SIGNED_FIELDS

    assert tuple(_ticked(_after(CONTRACT, "signed-fields"))) == SIGNED_FIELDS
    text = CONTRACT.read_text()
    required = text[text.index("A decode worker pulls only with a handle that has"):]
    assert all(f"`{f}`" in required.split("whose signature")[0] for f in REQUIRED_FIELDS)


def _metrics(build) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name (as exposed) -> (type, label names) of everything `build(registry)` registers."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    build(registry)
    out = {}
    for metric in registry._collector_to_names:
        name = metric._name + ("_total" if metric._type == "counter" else "")
        out[name] = (metric._type, tuple(metric._labelnames))
    return out


def _shown_metrics(marker: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {_ticked(r[0])[0]: (r[1], tuple(_ticked(r[2]))) for r in _table(CONTRACT, marker)}


def test_router_metric_names_are_the_codes():
    from common.background import BackgroundErrors
    from router.fabric import Fabric
    from router.metrics import RouterMetrics
    from router.models import ModelCatalog
    from router.pull_metrics import PullMetrics

    def build(r):
        RouterMetrics(r)
        PullMetrics(r, Fabric())
        ModelCatalog(only=None, tokenizer_path=None, model_dir=ROOT, hash_salt=None, registry=r)
        BackgroundErrors(r)

    assert _shown_metrics("router-metrics") == _metrics(build)


def test_worker_metric_names_are_the_codes():
    from common.background import BackgroundErrors
    from kv_transfer.metrics import TransferMetrics
    from worker.metrics import WorkerMetrics

    def build(r):
        WorkerMetrics(r, "decode", "m")
        TransferMetrics(r)
        BackgroundErrors(r)

    assert _shown_metrics("worker-metrics") == _metrics(build)


def test_background_task_names_are_the_codes():
    found = set()
    for top in ("common", "engine", "kv_transfer", "worker", "prefill_worker",
                "decode_worker", "router"):
        for path in (ROOT / top).rglob("*.py"):
            found |= set(re.findall(r"\.record\(\"([a-z_]+)\"", path.read_text()))
    text = CONTRACT.read_text()
    listed = _ticked(text[text.index("Its `task` label is one of") + len("Its `task` label"):])
    assert set(listed) == found


# ---- the OpenAI page against the request models ------------------------------------------------

OPENAI = DOCS / "openai.md"
# Fields the models take whose values the page calls refused, and such a value.
REFUSED_VALUES = {"echo": True, "priority": 1}


def _openai_rows() -> list[tuple[list[str], str, str]]:
    return [(_ticked(r[0]), r[1], r[2]) for r in _table(OPENAI, "openai-fields")]


def _bodies(endpoint: str) -> dict[str, dict]:
    minimal = {"chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
               "completions": {"model": "m", "prompt": "hi"}}
    return minimal if endpoint == "both" else {endpoint: minimal[endpoint]}


def _models():
    from router.openai_models import ChatCompletionRequest, CompletionRequest

    return {"chat": ChatCompletionRequest, "completions": CompletionRequest}


def _field_names(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def test_openai_page_names_every_request_field():
    named = {(n, e) for names, e, _ in _openai_rows() for n in names}
    for endpoint, model in _models().items():
        for field in _field_names(model):
            assert (field, endpoint) in named or (field, "both") in named, (endpoint, field)


def test_openai_page_is_right_about_what_is_supported_and_what_is_refused():
    from pydantic import ValidationError

    from common.errors import APIError
    from router.openai_models import UNSUPPORTED

    models = _models()
    statuses = {status for _, _, status in _openai_rows()}
    assert statuses == {"supported", "accepted, ignored", "refused"}
    in_model_refused = set()
    for names, endpoint, status in _openai_rows():
        for endpoint_name, body in _bodies(endpoint).items():
            model = models[endpoint_name]
            for name in names:
                if status != "refused":
                    assert name in _field_names(model), (endpoint_name, name)
                    continue
                known = name in _field_names(model)
                if known:
                    in_model_refused.add(name)
                # Refused by validation, or by name as a field Tandem does not serve.
                with pytest.raises((ValidationError, APIError)):
                    model.model_validate({**body, name: REFUSED_VALUES[name] if known else True})
    assert in_model_refused == set(REFUSED_VALUES)
    refused = {n for names, _, status in _openai_rows() if status == "refused" for n in names}
    assert set(UNSUPPORTED) <= refused  # every field refused by name is on the page as refused


# ---- the client snippets against a live cluster ------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_folder, tmp_path_factory):
    from testing.cluster import Router, Worker

    work = tmp_path_factory.mktemp("docs")
    ns = f"docs-{uuid.uuid4().hex[:6]}"
    procs = []
    try:
        procs.append(Worker("prefill", str(tiny_folder), cache_dir=work, namespace=ns))
        procs.append(Worker("decode", str(tiny_folder), cache_dir=work, namespace=ns))
        router = Router(tiny_folder, ns, cache_dir=work)
        procs.append(router)
        router.wait_workers(2)
        yield router, procs[:2]
    finally:
        for p in reversed(procs):
            p.close()


def _snippets() -> list[tuple[str, int, str]]:
    out = []
    for page in MARKDOWN:
        for i, block in enumerate(re.findall(r"<!-- snippet: openai-client "
                                             r"-->\n```python\n(.*?)\n```",
                                             page.read_text(), re.S)):
            out.append((str(page.relative_to(ROOT)), i, block))
    return out


def test_the_docs_have_openai_client_snippets():
    pages = {page for page, _, _ in _snippets()}
    assert {"README.md", "docs/getting-started.md"} <= pages


@pytest.mark.redis
@pytest.mark.parametrize("page,index,code", _snippets(), ids=lambda v: str(v)[:30])
def test_openai_client_snippet_runs(cluster, page, index, code):
    router, _ = cluster
    assert '"http://127.0.0.1:8000/v1"' in code and '"smollm2-135m-instruct"' in code
    code = code.replace('"http://127.0.0.1:8000/v1"', repr(f"{router.url}/v1"))
    code = code.replace('"smollm2-135m-instruct"', repr("tiny-random"))
    printed = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(printed):
        exec(code, scope)  # noqa: S102 - our own docs
    if "out" in scope:
        out = scope["out"]
        assert (out.choices[0].finish_reason in ("stop", "length")
                and out.usage.completion_tokens >= 1)
        assert out.tandem["plan"] in PLANS and f"{out.tandem['plan']} " in printed.getvalue()
    else:
        tokens = re.search(r"\n (\d+) tokens\n$", printed.getvalue())
        assert tokens and 1 <= int(tokens.group(1)) <= 32, printed.getvalue()


@pytest.mark.redis
def test_every_metric_a_live_cluster_exports_is_in_the_contract(cluster):
    router, workers = cluster
    shown = set(_shown_metrics("router-metrics")) | set(_shown_metrics("worker-metrics"))

    def exported(client) -> set[str]:
        text = client.get("/metrics").text
        return {m for m in re.findall(r"^# TYPE (\S+) ", text, re.M)
                if m.startswith(("tandem_", "vllm:")) and not m.endswith("_created")}

    for proc in (router, *workers):
        names = exported(proc.client)
        assert names and names <= shown, names - shown


def test_tandem_field_is_the_codes():
    import json

    from router.openai_format import timing_field
    from router.trace import Trace

    shown = [_ticked(r[0])[0] for r in _table(CONTRACT, "tandem-field")]
    assert shown == list(timing_field(Trace("disagg"), 0.0, expose_workers=True))
    example = json.loads(_after(DOCS / "getting-started.md", "tandem-example"))
    assert set(example) == set(timing_field(Trace("disagg"), 0.0))
