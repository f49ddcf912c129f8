"""bench/engine_goals.py: issue 31's goals judged from the GPU bench's figures."""

from bench.engine_goals import goals, summary


def test_goals_are_met_unmet_or_missing_from_the_figures():
    shapes = {
        "smollm2-1.7b": {
            "graphs": {"decode_tok_s_b1": 640.0, "step_ms_b1": 1.56, "decode_tok_s_b64": 12000.0},
            "profile_graphs": {"gpu_busy": 0.95},
            "fidelity": {"greedy_match_graphs_vs_sdpa": True,
                         "graphs_vs_sdpa": {"within_bf16_tolerance": False}},
        },
    }
    rows = {r["figure"]: r for r in goals(shapes)}
    assert all(r["shape"] == "smollm2-1.7b" for r in rows.values())  # no 8B row: not measured
    assert rows["graphs.decode_tok_s_b1"]["met"] is True
    assert rows["graphs.step_ms_b1"]["met"] is True
    assert rows["graphs.decode_tok_s_b64"]["met"] is False
    assert rows["profile_graphs.gpu_busy"]["met"] is True
    assert rows["prefill.prefill_tok_s_8x2048"]["met"] is None  # the figure is missing
    assert rows["fidelity.graphs_vs_sdpa.within_bf16_tolerance"]["met"] is False
    assert rows["graphs.decode_tok_s_b64"]["measured"] == 12000.0


def test_summary_takes_each_modes_headline_figures():
    res = {"graphs": {"decode_tok_s_b1": 600.0, "step_ms_b1": 1.6, "replay_ms_b1": 1.2,
                      "generate_tok_s_b1": 580.0, "seconds": 3.0},
           "profile_graphs": {"kernels_per_step": 243.0, "gpu_busy": 0.9, "graph_replay_ms": None}}
    got = summary(res)
    assert got == {"graphs.decode_tok_s_b1": 600.0, "graphs.step_ms_b1": 1.6,
                   "graphs.replay_ms_b1": 1.2, "graphs.profile.kernels_per_step": 243.0,
                   "graphs.profile.gpu_busy": 0.9}


def test_summary_leaves_out_missing_figures_and_shows_errors():
    res = {"graphs": {"decode_tok_s_b64": 21000.0, "overlapped_steps_b64": 32,
                      "replay_ms_b64": 2.7},
           "graphs_sync": {"decode_tok_s_b64": 19000.0, "overlapped_steps_b64": 0},
           "eager": {"decode_tok_s_b64": 8000.0, "replay_ms_b64": None},
           "profile_graphs": {"gpu_busy": 0.93, "overlapped_steps": 16, "steps": 16},
           "profile_eager": {"error": "RuntimeError('boom')", "seconds": 0.1}}
    got = summary(res)
    assert got == {"graphs.decode_tok_s_b64": 21000.0, "graphs.overlapped_steps_b64": 32,
                   "graphs.replay_ms_b64": 2.7, "graphs_sync.decode_tok_s_b64": 19000.0,
                   "graphs_sync.overlapped_steps_b64": 0, "eager.decode_tok_s_b64": 8000.0,
                   "graphs.profile.gpu_busy": 0.93, "graphs.profile.overlapped_steps": 16,
                   "eager.profile.error": "RuntimeError('boom')"}
    assert None not in got.values()
