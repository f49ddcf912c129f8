import numpy as np
import pytest
import torch

from engine.sampler import Sampler, counter_uniforms
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq(params: SamplingParams, outputs=(), name="r") -> Sequence:
    s = Sequence(name, [1, 2, 3], params)
    s.output_token_ids = list(outputs)
    if params.seed is not None:
        s.generator = torch.Generator().manual_seed(params.seed)
    return s


def logits(rows=1, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    lg = logits(3)
    ids, _ = Sampler()(lg, [seq(SamplingParams(temperature=0)) for _ in range(3)])
    assert ids == lg.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    lg = logits(1)
    p = SamplingParams(temperature=3.0, seed=1234)
    a = [Sampler(seed=0)(lg, [seq(p)])[0][0] for _ in range(1)]
    s1 = seq(p)
    run1 = [Sampler(seed=0)(lg, [s1])[0][0] for _ in range(20)]
    s2 = seq(p)
    other = seq(SamplingParams(temperature=3.0))
    both = torch.cat([lg, logits(1, seed=5)])
    run2 = [Sampler(seed=99)(both, [s2, other])[0][0] for _ in range(20)]
    assert run1 == run2 and run1[0] == a[0]
    assert len(set(run1)) > 1  # it is really sampling


def test_top_k_one_and_tiny_top_p_are_greedy():
    lg = logits(2)
    want = lg.argmax(-1).tolist()
    for p in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6),
              SamplingParams(temperature=1.0, min_p=1.0)):
        for _ in range(5):
            assert Sampler()(lg, [seq(p), seq(p)])[0] == want


def test_top_k_restricts_support():
    lg = logits(1, vocab=100)
    allowed = set(lg[0].topk(5).indices.tolist())
    s = seq(SamplingParams(temperature=5.0, top_k=5, seed=0))
    got = {Sampler()(lg, [s])[0][0] for _ in range(200)}
    assert got <= allowed and len(got) > 1


def test_top_p_restricts_support_to_nucleus():
    lg = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    s = seq(SamplingParams(temperature=1.0, top_p=0.8, seed=3))
    got = {Sampler()(lg, [s])[0][0] for _ in range(300)}
    assert got == {0, 1}


def test_min_p_drops_unlikely_tokens():
    lg = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    s = seq(SamplingParams(temperature=1.0, min_p=0.4, seed=3))
    got = {Sampler()(lg, [s])[0][0] for _ in range(300)}
    assert got == {0, 1}


def test_penalties_push_away_from_seen_tokens():
    lg = torch.tensor([[2.0, 1.9, 0.0]])
    greedy_plain = Sampler()(lg, [seq(SamplingParams(temperature=0), outputs=[0])])[0]
    assert greedy_plain == [0]
    assert Sampler()(lg, [seq(SamplingParams(temperature=0, presence_penalty=0.5), [0])])[0] == [1]
    assert Sampler()(lg, [seq(SamplingParams(temperature=0, frequency_penalty=0.05),
                              [0, 0, 0])])[0] == [1]
    # Negative penalties encourage repetition.
    assert Sampler()(lg, [seq(SamplingParams(temperature=0, presence_penalty=-1.0), [1])])[0] == [1]


def test_logprobs_are_normalised_with_top_n():
    lg = logits(1)
    ids, lps = Sampler()(lg, [seq(SamplingParams(temperature=0, logprobs=3))])
    lp = lps[0]
    ref = torch.log_softmax(lg[0], -1)
    assert lp.token_id == ids[0] and abs(lp.logprob - float(ref[ids[0]])) < 1e-6
    assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
    assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.1}, "top_p"),
     ({"top_k": 0}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"max_tokens": 0}, "max_tokens"),
     ({"presence_penalty": 2.5}, "presence_penalty"),
     ({"frequency_penalty": -3}, "frequency_penalty"), ({"logprobs": 21}, "logprobs"),
     ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids")],
)
def test_bad_params_raise_clear_errors(kwargs, field):
    with pytest.raises(ValueError, match=f"invalid sampling parameter {field}"):
        SamplingParams(**kwargs)


def test_single_stop_string_is_listified_and_options_roundtrip():
    p = SamplingParams(stop="END", seed=3, temperature=0.5)
    assert p.stop == ["END"]
    assert SamplingParams.from_options(p.to_options()) == p


@pytest.mark.parametrize("seeded", [False, True])
def test_sampling_frequencies_follow_the_distribution(seeded):
    # Inverse-CDF sampling: each token's share of 8000 draws is within 3% of its probability,
    # in batches of 4 rows, and a token of probability zero (here: outside top_k) never appears.
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    lg = torch.log(probs).clamp(min=-1e9).expand(4, -1).clone()
    lg[:, 4] = lg[:, 3] - 0.1  # almost as likely as token 3, but top_k=4 excludes it
    p = SamplingParams(temperature=1.0, top_k=4, seed=7 if seeded else None)
    sampler = Sampler(seed=1)
    seqs = [seq(p, name=f"r{i}") for i in range(4)]
    counts = torch.zeros(5)
    for _ in range(2000):
        for s, t in zip(seqs, sampler(lg, seqs)[0], strict=True):
            counts[t] += 1
            s.output_token_ids.append(t)  # the next draw of each stream
    freq = counts / counts.sum()
    assert counts[4] == 0
    assert (freq - probs).abs().max() < 0.03, freq


def test_skip_replays_a_seeded_stream_from_any_point():
    # The decode worker continues a seeded request after the prefill worker's tokens.
    lg = logits(1)
    p = SamplingParams(temperature=2.0, seed=42)
    full = seq(p)
    whole = [Sampler()(lg, [full])[0][0] for _ in range(12)]
    resumed = seq(p, outputs=whole[:5])
    Sampler.skip(resumed.generator, 5)
    assert [Sampler()(lg, [resumed])[0][0] for _ in range(7)] == whole[5:]


def test_seeded_draws_are_the_seeds_torch_stream_in_order():
    # Seeded requests sample exactly as before per-request streams without a seed existed: draw
    # n is the n-th torch.rand of a generator seeded with the request's seed (P/D and resume
    # replay it with Sampler.skip), whatever the batch or the engine's seed.
    lg = logits(1, vocab=64)
    p = SamplingParams(temperature=1.5, seed=2024)
    probs = torch.softmax(lg / 1.5, dim=-1)
    cdf = probs.cumsum(-1)
    gen = torch.Generator().manual_seed(2024)
    want = [int(torch.searchsorted(cdf, torch.rand(1, 1, generator=gen) * cdf[:, -1:],
                                   right=True).clamp(max=63)) for _ in range(10)]
    s = seq(p)
    other = seq(SamplingParams(temperature=1.0), name="other")
    both = torch.cat([lg, logits(1, vocab=64, seed=9)])
    got = []
    for _ in range(10):
        got.append(Sampler(seed=5)(both, [s, other])[0][0])
        other.output_token_ids.append(0)
    assert got == want and len(set(got)) > 1


def test_unseeded_draws_do_not_depend_on_the_batch():
    # A request without a seed draws from its own stream (engine seed, request id, output
    # position): alone, in a batch of five at any row, beside seeded and greedy rows, or with
    # its neighbours changing every step, its tokens are the same.
    vocab = 64
    lg_a = logits(1, vocab=vocab, seed=1)
    p = SamplingParams(temperature=2.0, top_p=0.95)

    def run(batch_of, steps=16):
        a = seq(p, name="a")
        out = []
        for step in range(steps):
            others = batch_of(step)
            rows = [a, *others]
            order = list(range(len(rows)))
            if step % 2:
                order.reverse()  # a at the last row every other step
            lg = torch.cat([lg_a, *[logits(1, vocab=vocab, seed=10 + i)
                                    for i in range(len(others))]])
            ids, _ = Sampler(seed=3)(lg[order], [rows[i] for i in order])
            out.append(ids[order.index(0)])
            a.output_token_ids.append(out[-1])
        return out

    alone = run(lambda step: [])
    crowd = run(lambda step: [seq(p, name=f"o{step}-{i}") for i in range(4)])
    mixed = run(lambda step: [seq(SamplingParams(temperature=1.0, seed=step), name="s"),
                              seq(SamplingParams(temperature=0), name="g"),
                              seq(p, name=f"u{step}")][: 1 + step % 3])
    assert alone == crowd == mixed
    assert len(set(alone)) > 3  # it is really sampling


def test_unseeded_streams_are_keyed_by_engine_seed_and_request_and_indexed_by_position():
    lg = logits(1, vocab=200)
    p = SamplingParams(temperature=5.0)

    def stream(engine_seed, rid, given=0, pending=0, n=12):
        s = seq(p, outputs=[0] * given, name=rid)
        sampler, out = Sampler(seed=engine_seed), []
        for _ in range(n):
            out.append(sampler.launch(lg, [s], num_pending=pending).resolve()[0][0])
            s.output_token_ids.append(out[-1])
        return out

    base = stream(0, "req-1")
    assert stream(0, "req-1") == base  # a function of (seed, id, position): nothing else
    assert stream(1, "req-1") != base and stream(0, "req-2") != base
    # Resumed after 5 tokens (or with one token in flight: an overlapped step), the request
    # goes on where its stream was.
    assert stream(0, "req-1", given=5, n=7) == base[5:]
    assert stream(0, "req-1", given=4, pending=1, n=7) == base[5:]
    # An id that comes back to the same engine (a client's X-Request-Id) gets a new stream.
    sampler = Sampler(seed=0)
    again = [seq(p, name="req-1") for _ in range(2)]
    draws = [[sampler.launch(lg, [s], num_pending=i).resolve()[0][0] for i in range(12)]
             for s in again]
    assert draws[0] == base and draws[1] != base


def test_counter_uniforms_are_uniform_and_independent_across_streams():
    n = 200_000
    keys = np.repeat(np.arange(1000, dtype=np.uint64) * np.uint64(7919), n // 1000)
    index = np.tile(np.arange(n // 1000, dtype=np.uint64), 1000)
    u = counter_uniforms(keys, index)
    assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
    hist = np.bincount((u * 20).astype(int), minlength=20) / n
    assert np.abs(hist - 0.05).max() < 0.003  # 20 bins within 6% of their share
    # Neighbouring streams (keys one apart) and neighbouring draws are uncorrelated.
    a = counter_uniforms(np.arange(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64))
    b = counter_uniforms(np.arange(n, dtype=np.uint64) + np.uint64(1),
                         np.zeros(n, dtype=np.uint64))
    c = counter_uniforms(np.arange(n, dtype=np.uint64), np.ones(n, dtype=np.uint64))
    assert abs(np.corrcoef(a[:-1], b[:-1])[0, 1]) < 0.01
    assert abs(np.corrcoef(a, c)[0, 1]) < 0.01
    assert abs(float(a.mean()) - 0.5) < 0.005


def mixed_batch(device: str) -> list[Sequence]:
    """Greedy, seeded, unseeded, top-k/p and logit_bias rows: every kind that overlaps."""
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3),
             SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=8, top_p=0.9),
             SamplingParams(temperature=1.0, logit_bias={5: 2.0}), SamplingParams(temperature=0.5)]
    seqs = [seq(p, name=f"m{i}") for i, p in enumerate(kinds)]
    for s in seqs:
        if s.generator is not None:
            s.generator = torch.Generator(device=device).manual_seed(s.params.seed)
    return seqs


def test_cpu_twin_of_launch_on_cuda():
    """What the GPU test below checks on CUDA, on CPU: a mixed batch's unseeded rows are the
    same tokens whatever the device (their draws come from the host), greedy rows argmax."""
    lg = logits(6, vocab=64, seed=4)
    a, b = mixed_batch("cpu"), mixed_batch("cpu")
    ids_a = Sampler(seed=2).launch(lg, a).resolve()[0]
    ids_b = Sampler(seed=2).launch(lg.clone(), b).resolve()[0]
    assert ids_a == ids_b and ids_a[0] == int(lg[0].argmax())


@pytest.mark.gpu
def test_launch_on_cuda_never_waits_for_the_device():
    """An overlapped step queues the next one before the host reads this one's tokens: sampling
    must not synchronise with the stream (torch's sync debug mode raises on any wait), for every
    kind of row that overlaps. Unseeded and greedy rows pick the CPU sampler's tokens."""
    lg = logits(6, vocab=64, seed=4)
    want = Sampler(seed=2).launch(lg, mixed_batch("cpu")).resolve()[0]
    on_gpu = lg.cuda()
    Sampler(seed=2).launch(on_gpu, mixed_batch("cuda")).resolve()  # first allocations made
    sampler, seqs = Sampler(seed=2), mixed_batch("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = sampler.launch(on_gpu, seqs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got = batch.resolve()[0]
    assert [got[i] for i in (0, 2, 3, 4, 5)] == [want[i] for i in (0, 2, 3, 4, 5)]
