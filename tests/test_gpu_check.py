"""bench/gpu_check.sh and the GPU benchmarks it runs, on CPU: each new bench script end to end in
its tiny mode (the figures are meaningless here, the script's path is not), and the check script
keeping to its time budget, going on past a failed section and merging what ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def read(path: Path) -> dict:
    data = json.loads(path.read_text())
    assert set(data["provenance"]) >= {"commit", "machine", "command", "time_utc"}
    return data


@pytest.mark.slow
def test_decode_rates_by_sampling_mode_run_on_cpu(tmp_path):
    out = tmp_path / "decode.json"
    r = bench("bench/engine.py", "--device", "cpu", "--quick", "--sampling",
              "greedy,unseeded,mixed", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = read(out)["shapes"]["tiny"]
    steps = read(out)["sizes"]["decode_steps"]
    for mode in ("greedy", "unseeded", "mixed"):
        for b in (1, 4):
            assert res[mode][f"decode_tok_s_b{b}"] > 0
            # The overlap is on for sampled batches too (engine/sampler.py's own streams).
            assert res[mode][f"overlapped_steps_b{b}"] == steps, (mode, b)
    assert set(res["ratios"]) == {f"{m}_over_greedy_b{b}" for m in ("unseeded", "mixed")
                                  for b in (1, 4)}
    arrivals = res["mixed_arrivals"]
    assert arrivals["arrivals"] >= 1 and arrivals["tokens"] > 0
    assert 0 < arrivals["overlapped_steps"] < arrivals["steps"]  # each arrival drains it


def test_an_unknown_sampling_mode_is_refused_before_any_model_is_built(tmp_path):
    r = bench("bench/engine.py", "--device", "cpu", "--quick", "--sampling", "greedy,hot",
              "--out", str(tmp_path / "d.json"), timeout=120)
    assert r.returncode != 0 and "unknown sampling mode 'hot'" in r.stderr
    assert not (tmp_path / "d.json").exists()


def test_sampled_modes_are_compared_with_greedy_at_the_same_batch():
    from bench.gpu_decode import against_greedy, row_params

    res = {"greedy": {"decode_tok_s_b1": 100.0, "decode_tok_s_b16": 1000.0},
           "unseeded": {"decode_tok_s_b1": 96.0, "decode_tok_s_b16": 900.0},
           "seeded": {"error": "boom"}}
    assert against_greedy(res, (1, 16)) == {"unseeded_over_greedy_b1": 0.96,
                                            "unseeded_over_greedy_b16": 0.9}
    kinds = [row_params("mixed", i, 8) for i in range(3)]
    assert [p.greedy for p in kinds] == [True, False, False]
    assert kinds[1].seed is not None and kinds[2].seed is None


@pytest.mark.slow
def test_host_tier_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "tiers.json"
    r = bench("bench/gpu_tiers.py", "--device", "cpu", "--smoke", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = read(out)
    copies = res["copies"]
    assert copies["offload"]["blocks_offloaded"] == copies["blocks"] == 8
    assert copies["reload"]["blocks"] == 8 and copies["reload"]["bit_exact"] is True
    for k in ("offload_over_pinned_per_block", "reload_over_pinned_whole"):
        assert copies[k] > 0
    busy, idle = res["itl_offloading"], res["itl_idle"]
    assert busy["offloaded_during_steps"] > 0 and idle["offloaded_during_steps"] == 0
    assert busy["batch_blocks_among_offloaded"] == 0 and busy["steps"] == res["steps"]
    assert set(res["itl_offloading_over_idle"]) == {"p50_ms", "p99_ms", "mean_ms"}


@pytest.mark.slow
def test_pd_pair_warm_medians_run_on_cpu(tmp_path):
    out = tmp_path / "pd.json"
    r = bench("bench/gpu_pd.py", "--device", "cpu", "--shape", "tiny", "--smoke", "--transport",
              "tcp", "--workdir", str(tmp_path / "work"), "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = read(out)
    assert res["all_identical"] and res["passed"]
    warm = res["warm"]
    assert warm["requests"] == warm["ok"] == 4 and warm["pulls"] >= 1
    assert warm["medians"]["pulled"] >= 1 and warm["medians"]["transfer_ms_p50"] > 0
    assert set(warm["medians_by_length"]) == {"40", "12"}
    assert all("client_s" in row and row["status"] == 200 for row in warm["rows"])


def test_pd_medians_take_prefill_and_pull_from_the_requests_that_pulled():
    from bench.gpu_pd import medians

    rows = [{"prefill_s": 0.1, "transfer_s": 0.01, "transfer_bytes": 10, "first_token_s": 0.2,
             "total_s": 0.5},
            {"prefill_s": 0.3, "transfer_s": 0.06, "transfer_bytes": 10, "first_token_s": 0.4,
             "total_s": 0.7},
            {"prefill_s": 0.0, "transfer_s": 0.0, "transfer_bytes": None, "first_token_s": 0.1,
             "total_s": 0.3}]  # prefilled where it was decoded: no pull
    m = medians(rows)
    assert m["requests"] == 3 and m["pulled"] == 2
    assert m["prefill_ms_p50"] == 200.0 and m["transfer_ms_p50"] == 35.0
    assert m["first_token_ms_p50"] == 200.0 and m["total_ms_p50"] == 500.0
    assert m["pull_over_prefill_p50"] == 0.15


def check_script(out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "bench/gpu_check.sh", str(out / "no-wheels"), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable, **env})


@pytest.mark.slow
def test_gpu_check_goes_on_past_a_failed_section_and_merges_what_ran(tmp_path):
    (tmp_path / "tiers.json").write_text("{}")  # an earlier run's: never taken for this one's
    r = check_script(tmp_path, SECTIONS="env,tiers")
    assert r.returncode == 0, r.stdout + r.stderr
    merged = read(tmp_path / "gpu_check.json")
    assert merged["env"]["status"]["rc"] == 0
    assert read(tmp_path / "env.json")["cuda"] is None  # this machine has no GPU
    assert merged["tiers"]["status"]["rc"] not in (0, None)  # --device cuda on a CPU: fails
    assert "result" not in merged["tiers"] and not (tmp_path / "tiers.json").exists()
    assert set(merged) == {"provenance", "budget_s", "seconds", "env", "tiers"}
    assert merged["budget_s"] == 570 and merged["seconds"] < 570
    assert "=== tiers" in (tmp_path / "gpu_check.log").read_text()


def test_gpu_check_gives_every_section_a_limit_from_its_budget():
    text = (ROOT / "bench" / "gpu_check.sh").read_text()
    # Every section the script defines runs under `run NAME "$(left N)"` or a limit from left.
    sections = ["env", "build", "engine", "decode", "kernels", "transfer", "tiers", "pd",
                "pytest"]
    assert f"SECTIONS:-{','.join(sections)}" in text
    for name in sections:
        assert f"run {name} \"$(left " in text or f"run {name} \"$L\"" in text, name
    assert '--junitxml="$OUT_DIR/pytest.xml"' in text
    assert "${PYTEST_PATHS:-tests/engine tests/kv_transfer}" in text


def test_gpu_check_records_sections_skipped_for_the_budget(tmp_path):
    r = check_script(tmp_path, SECTIONS="env,pd", BUDGET_S="40")
    assert r.returncode == 0, r.stdout + r.stderr
    merged = read(tmp_path / "gpu_check.json")
    for name in ("env", "pd"):
        assert merged[name]["status"] == {"rc": None, "seconds": 0, "skipped": "budget"}
    assert "pd: skipped" in r.stdout
