"""The overlapped decode loop (engine/decode_pipeline.py) on CPU: every request's tokens, text,
finish and logprobs equal the synchronous loop's, through greedy, seeded and unseeded sampling,
stops of every kind, aborts and requests arriving mid-run; no block is leaked; the overlap
really ran."""

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams


def prompts(n: int, base: int = 11, vocab: int = 256) -> list[list[int]]:
    return [[(base * (i + 1) * (j + 3)) % vocab for j in range(3 + 5 * i)] for i in range(n)]


def engine_for(folder, overlap: bool, **kw) -> LLMEngine:
    cfg = EngineConfig(str(folder), num_blocks=kw.pop("num_blocks", 256), block_size=4,
                       async_scheduling=overlap, **kw)
    return LLMEngine(cfg)


def drive(engine: LLMEngine, plan: dict[int, list], max_calls: int = 400) -> dict:
    """Run `engine` to the end; `plan[k]`: actions before call k, ("add", id, prompt, params)
    or ("abort", id). Returns each request's final output and the tokens streamed to it."""
    final, streamed, aborted = {}, {}, {}
    calls = 0
    while calls < max_calls and (engine.has_unfinished() or any(k >= calls for k in plan)):
        for action in plan.get(calls, []):
            if action[0] == "add":
                engine.add_request(action[1], action[2], action[3])
            else:
                out = engine.abort_request(action[1])
                if out is not None:
                    aborted[action[1]] = out.token_ids
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.request_id not in final, "a request finished twice"
                final[out.request_id] = out
        calls += 1
    assert not engine.has_unfinished()
    summary = {rid: (o.token_ids, o.text, o.finish_reason, o.stop_reason,
                     [(lp.token_id, round(lp.logprob, 5), [(t, round(v, 5)) for t, v in lp.top])
                      for lp in o.logprobs] if o.logprobs is not None else None)
               for rid, o in final.items()}
    for rid, o in final.items():
        assert streamed.get(rid, []) == o.token_ids  # nothing dropped, nothing twice
    return {"final": summary, "aborted": aborted}


def both(folder, plan: dict[int, list], **kw) -> tuple[dict, dict, LLMEngine]:
    sync_engine = engine_for(folder, False, **kw)
    overlap_engine = engine_for(folder, True, **kw)
    want = drive(sync_engine, plan)
    got = drive(overlap_engine, plan)
    assert sync_engine.pipeline is None
    for e in (sync_engine, overlap_engine):
        assert e.pool.num_free_blocks == e.num_blocks  # every block back
    return want, got, overlap_engine


def top_ids(top: list[tuple[int, float]]) -> set[int]:
    return {t for t, _ in top}


def adds(params_by_id: dict[str, tuple[list[int], SamplingParams]]) -> list:
    return [("add", rid, p, sp) for rid, (p, sp) in params_by_id.items()]


def test_greedy_with_mixed_lengths_and_stop_tokens(tiny_folder):
    ps = prompts(5)
    # A stop token taken from a greedy run stops one request at an unpredictable step.
    probe = engine_for(tiny_folder, False)
    probe.add_request("p", ps[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop_id = drive(probe, {})["final"]["p"][0][7]
    reqs = {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True))
            for i, p in enumerate(ps)}
    reqs["r1"] = (ps[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                        stop_token_ids=[stop_id]))
    reqs["eos"] = (ps[2], SamplingParams(temperature=0, max_tokens=30))  # EOS if it comes
    want, got, engine = both(tiny_folder, {0: adds(reqs)})
    assert got == want
    assert want["final"]["r1"][2] == "stop" and want["final"]["r0"][2] == "length"
    assert engine.pipeline.num_overlapped_steps > 10


def test_seeded_sampling_with_logprobs(tiny_folder):
    ps = prompts(4)
    reqs = {f"s{i}": (p, SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=12,
                                        ignore_eos=True, logprobs=2 if i % 2 else None))
            for i, p in enumerate(ps)}
    reqs["g"] = (ps[0], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=0))
    want, got, engine = both(tiny_folder, {0: adds(reqs)})
    assert got == want
    assert want["final"]["s1"][4] is not None and len(want["final"]["s1"][4]) == 12
    assert engine.pipeline.num_overlapped_steps > 5


def test_stop_strings_and_max_model_len(tiny_folder):
    ps = prompts(3)
    probe = engine_for(tiny_folder, False)
    probe.add_request("p", ps[2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    text = drive(probe, {})["final"]["p"][1]
    stop = next(text[i:i + 2] for i in range(6, len(text) - 2) if text[i:i + 2].isprintable())
    reqs = {"stop": (ps[2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                           stop=[stop])),
            "long": (ps[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)),
            "mid": (ps[1], SamplingParams(temperature=0, max_tokens=17, ignore_eos=True))}
    want, got, engine = both(tiny_folder, {0: adds(reqs)}, max_model_len=40)
    assert got == want
    assert want["final"]["stop"][2] == "stop" and want["final"]["stop"][3] == stop
    assert want["final"]["long"][2] == "length" and len(ps[0]) + len(want["final"]["long"][0]) == 40
    assert engine.pipeline.num_overlapped_steps > 5


def test_aborts_and_mixed_arrivals(tiny_folder):
    ps = prompts(6)
    g = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=25, ignore_eos=True)
    plan = {0: [("add", "a", ps[0], g), ("add", "b", ps[1], seeded), ("add", "c", ps[2], g)],
            4: [("abort", "b")],
            7: [("add", "d", ps[3], g)],
            9: [("add", "e", ps[4], seeded), ("abort", "c")],
            15: [("add", "f", ps[5], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))]}
    want, got, engine = both(tiny_folder, plan)
    assert got["final"] == want["final"]
    # An abort answers with the tokens read so far: the step in flight is not counted.
    assert got["aborted"] == want["aborted"] and set(want["aborted"]) == {"b", "c"}
    assert engine.pipeline.num_drains >= 3  # each arrival drained the overlap
    assert engine.pipeline.num_overlapped_steps > 10


def test_unoverlappable_batches_run_synchronously(tiny_folder):
    """Penalties and min_tokens keep the synchronous loop (their sampling needs the previous
    token on the host)."""
    ps = prompts(3)
    reqs = {"pen": (ps[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                          frequency_penalty=0.5)),
            "min": (ps[1], SamplingParams(temperature=0, max_tokens=8, min_tokens=8))}
    want, got, engine = both(tiny_folder, {0: adds(reqs)})
    assert got == want and engine.pipeline.num_overlapped_steps == 0
    engine.add_request("pen-sampled", ps[2], SamplingParams(temperature=1.0, max_tokens=6,
                                                            ignore_eos=True, presence_penalty=1))
    drive(engine, {})
    assert engine.pipeline.num_overlapped_steps == 0


def test_unseeded_sampling_overlaps_and_equals_sync(tiny_folder):
    """Sampling without a seed overlaps too (each request draws from its own stream), through
    stop tokens, aborts, arrivals and logprobs; tokens equal the synchronous loop's, although
    the overlapped loop samples rows that are dropped afterwards (stopped or aborted)."""
    ps = prompts(6)
    free = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=22, ignore_eos=True)

    def first(u1: SamplingParams) -> list:
        return [("add", "u0", ps[0], free), ("add", "u1", ps[1], u1),
                ("add", "u2", ps[2], SamplingParams(temperature=0.7, top_k=20, max_tokens=18,
                                                    ignore_eos=True, logprobs=2)),
                ("add", "s", ps[3], SamplingParams(temperature=0.8, seed=11, max_tokens=16,
                                                   ignore_eos=True)),
                ("add", "g", ps[4], SamplingParams(temperature=0, max_tokens=14,
                                                   ignore_eos=True))]

    # Unseeded draws are a function of the engine's seed, the request and the order in which
    # requests first sample: a run of the same arrivals gives the stop token a place.
    probe = engine_for(tiny_folder, False)
    u1 = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    stop_id = drive(probe, {0: first(u1)})["final"]["u1"][0][6]
    u1 = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id])
    plan = {0: first(u1), 5: [("abort", "u0")], 9: [("add", "late", ps[5], free)]}
    want, got, engine = both(tiny_folder, plan)
    # Logprobs within float noise: a dropped row still in flight changes the batch's shape,
    # and with it the last bits of a matmul.
    lp_want, lp_got = want["final"]["u2"][4], got["final"]["u2"][4]
    assert [(t, top_ids(top)) for t, _, top in lp_got] == [(t, top_ids(top))
                                                          for t, _, top in lp_want]
    assert max(abs(a[1] - b[1]) for a, b in zip(lp_want, lp_got, strict=True)) < 1e-4
    for res in (want, got):
        res["final"]["u2"] = res["final"]["u2"][:4]
    assert got == want
    assert want["final"]["u1"][2] == "stop" and len(want["final"]["u1"][0]) <= 7
    assert set(want["aborted"]) == {"u0"} and len(lp_want) == 18
    assert len(set(want["final"]["late"][0])) > 3  # sampled, not stuck on one token
    assert engine.pipeline.num_overlapped_steps > 10
    # Only unseeded rows: every steady step overlaps.
    engine.add_request("alone", ps[0], free)
    before = engine.pipeline.num_overlapped_steps
    drive(engine, {})
    assert engine.pipeline.num_overlapped_steps - before >= 18


def test_preemption_under_overlap(tiny_folder):
    """Too few blocks: the overlap hands over to the scheduler, which preempts as usual."""
    ps = prompts(4)
    reqs = {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            for i, p in enumerate(ps)}
    want, got, engine = both(tiny_folder, {0: adds(reqs)}, num_blocks=24)
    assert got == want
    assert engine.scheduler.num_preemptions > 0 and engine.pipeline.num_overlapped_steps > 0


@pytest.fixture
def triton_engines(tiny_folder, triton_kernels):
    return [engine_for(tiny_folder, overlap, attention_backend="triton", max_num_seqs=8,
                       num_blocks=128, max_model_len=20) for overlap in (False, True)]


def test_overlap_through_the_graph_buckets(tiny_folder, triton_engines):
    """The CPU twin of the GPU path: decode steps through the per-bucket functions, the sampled
    ids copied into the static input buffer on the device."""
    ps = prompts(3)
    reqs = {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True))
            for i, p in enumerate(ps)}
    # Ends at max_model_len (20: 5 blocks of 4): an extra row past it would overflow the table.
    reqs["r2"] = (ps[2], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    results = []
    for engine in triton_engines:
        engine.runner.enable_graphs(capture=False)
        results.append(drive(engine, {0: adds(reqs)}))
        assert engine.pool.num_free_blocks == engine.num_blocks
    assert results[0] == results[1]
    assert (results[0]["final"]["r2"][2] == "length"
            and len(results[0]["final"]["r2"][0]) == 20 - len(ps[2]))
    assert triton_engines[1].pipeline.num_overlapped_steps > 5


def test_overlap_is_on_only_with_cuda_graphs_unless_asked():
    on_gpu = EngineConfig("m", device="cuda")
    assert on_gpu.overlaps_steps
    assert not EngineConfig("m", device="cuda", enforce_eager=True).overlaps_steps
    assert not EngineConfig("m", device="cuda", attention_backend="sdpa").overlaps_steps
    assert not EngineConfig("m").overlaps_steps  # CPU: the synchronous loop
    assert EngineConfig("m", async_scheduling=True).overlaps_steps
    assert not EngineConfig("m", device="cuda", async_scheduling=False).overlaps_steps


@pytest.mark.gpu
def test_overlap_on_gpu_equals_sync(tiny_folder, triton_kernels):
    """The GPU twin: graphs captured, sampled ids copied into the static buffer on the device,
    tokens read through pinned memory after the next step is queued; an unseeded request's
    draws reach the device through pinned memory too."""
    ps = prompts(6)
    probe = engine_for(tiny_folder, False, device="cuda", dtype="float32", max_num_seqs=8)
    probe.add_request("p", ps[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop_id = drive(probe, {})["final"]["p"][0][9]
    g = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plan = {0: [("add", f"g{i}", p, g) for i, p in enumerate(ps[:3])]
            + [("add", "stop", ps[1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                     stop_token_ids=[stop_id])),
               ("add", "seeded", ps[3], SamplingParams(temperature=0.9, seed=5, max_tokens=30,
                                                       ignore_eos=True)),
               ("add", "unseeded", ps[4], SamplingParams(temperature=0.9, max_tokens=30,
                                                         ignore_eos=True))],
            12: [("abort", "g1")],
            20: [("add", "late", ps[5],
                  SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))]}
    want, got, engine = both(tiny_folder, plan, device="cuda", dtype="float32", max_num_seqs=8)
    assert got == want
    assert engine.runner.graphs is not None and engine.pipeline.num_overlapped_steps > 20
    assert want["final"]["stop"][2] == "stop"


def test_an_import_during_overlap_waits_for_the_step_in_flight(tiny_folder):
    """Blocks a stop frees are still written by the step in flight; an import (filled off the
    stream) waits for that step, then the overlap hands over to the synchronous loop."""
    engine = engine_for(tiny_folder, True)
    ps = prompts(3)
    for i, p in enumerate(ps[:2]):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=20,
                                                      ignore_eos=True))
    streamed = {}
    for _ in range(4):
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.pipeline.in_flight is not None
    waited = []
    original = engine.pipeline.in_flight.sampled.wait
    engine.pipeline.in_flight.sampled.wait = lambda: waited.append(1) or original()
    seq, _ = engine.add_imported_request("imp", ps[2], SamplingParams(temperature=0, max_tokens=4,
                                                                      ignore_eos=True))
    assert waited
    engine.finish_import("imp", success=True)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = out.token_ids
    assert set(done) == {"r0", "r1", "imp"} and len(done["imp"]) == 4
    assert all(streamed[rid] == done[rid] for rid in ("r0", "r1"))
    reference = engine_for(tiny_folder, False)
    for i, p in enumerate(ps[:2]):
        reference.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=20,
                                                         ignore_eos=True))
    assert {rid: o[0] for rid, o in drive(reference, {})["final"].items()} == {
        rid: done[rid] for rid in ("r0", "r1")}
    assert engine.pipeline.num_drains >= 1 and engine.pool.num_free_blocks == engine.num_blocks
