"""The two CPU kernels a decode step spends its time in, each against the alternative we dropped.

    .venv/bin/python bench/cpu_ops.py [--threads 2]

- linear: every matmul of one SmolLM2-135M step (30 layers of qkv/o/gate_up/down plus the LM
  head, distinct weights so they stream from memory as in the model), `F.linear` (MKL) against
  the same weights prepacked by oneDNN (engine/linear.py), for 1..256 rows.
- gather: one layer's decode K/V gather over the paged cache, advanced indexing against
  `index_select` over whole blocks (engine/attention.py), and the SDPA call that follows.
- attention: one decode step's attention over the decode rows' kept keys and values (30 layers
  of them, so they stream from memory as in the model), CPU SDPA (`enable_gqa`) against
  `engine.attention.decode_attention` (one matmul per KV head).

`--sections` picks some (`--out`, relative to bench/results, names the file).

Prints JSON and writes bench/results/cpu_ops.json; ratios are within one run (the machine is noisy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from engine.linear import PackedLinear  # noqa: E402

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads / 3 KV heads of 64, vocab 49152, 30 layers.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
NUM_LAYERS, VOCAB, HIDDEN = 30, 49152, 576
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def timed(fn, repeats: int) -> float:
    """Best-of-3 mean milliseconds per call."""
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - t) / repeats)
    return best * 1e3


@torch.inference_mode()
def bench_linear(rows_list: list[int]) -> list[dict]:
    weights = ([torch.randn(*s) for _ in range(NUM_LAYERS) for s in SHAPES]
               + [torch.randn(VOCAB, HIDDEN)])
    packed = [PackedLinear(w, None) for w in weights]
    out = []
    for rows in rows_list:
        x = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}
        t_mkl = timed(lambda x=x: [F.linear(x[w.shape[1]], w) for w in weights], 5)
        t_packed = timed(lambda x=x: [p(x[p.in_features]) for p in packed], 5)
        out.append({"rows": rows, "f_linear_ms": round(t_mkl, 2),
                    "onednn_packed_ms": round(t_packed, 2), "speedup": round(t_mkl / t_packed, 2)})
        print(out[-1], file=sys.stderr, flush=True)
    return out


@torch.inference_mode()
def bench_gather(cases: list[tuple[int, int]]) -> list[dict]:
    num_blocks = 4096
    cache = torch.randn(num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    layer_k = cache[:, 7][:, 0]  # [num_blocks, bs, kvh, d], strided like the engine's view
    out = []
    for num_seqs, context in cases:
        max_blocks = -(-context // BLOCK_SIZE)
        tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in range(num_seqs)])
        flat = tables.view(-1)
        lens = torch.full((num_seqs,), context)
        mask = (torch.arange(max_blocks * BLOCK_SIZE)[None, :] < lens[:, None])[:, None, None, :]
        q = torch.randn(num_seqs, NUM_HEADS, 1, HEAD_DIM)
        k = torch.index_select(layer_k, 0, flat).view(num_seqs, -1, NUM_KV_HEADS,
                                                      HEAD_DIM).transpose(1, 2)
        t_index = timed(lambda tables=tables: layer_k[tables], 20)
        t_select = timed(lambda flat=flat: torch.index_select(layer_k, 0, flat), 20)
        t_sdpa = timed(lambda q=q, k=k, mask=mask: F.scaled_dot_product_attention(
            q, k, k, attn_mask=mask, enable_gqa=True), 20)
        out.append({"num_seqs": num_seqs, "context": context,
                    "advanced_index_ms": round(t_index, 3), "index_select_ms": round(t_select, 3),
                    "speedup": round(t_index / t_select, 2), "sdpa_ms": round(t_sdpa, 3)})
        print(out[-1], file=sys.stderr, flush=True)
    return out


@torch.inference_mode()
def bench_attention(cases: list[tuple[int, int]]) -> list[dict]:
    from engine.attention import decode_attention

    out = []
    for num_seqs, context in cases:
        shape = (num_seqs, NUM_KV_HEADS, context, HEAD_DIM)
        layers = [(torch.randn(shape), torch.randn(shape)) for _ in range(NUM_LAYERS)]
        q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM)
        mask = torch.zeros(num_seqs, 1, 1, context)
        mask[:, ..., context - context // 4 :] = float("-inf")  # rows shorter than the longest
        scale, q_sdpa = HEAD_DIM**-0.5, q.unsqueeze(2)

        def sdpa(layers=layers, q=q_sdpa, mask=mask, scale=scale) -> list:
            return [F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=True) for k, v in layers]

        def ours(layers=layers, q=q, mask=mask, scale=scale) -> list:
            return [decode_attention(q, k, v, mask, scale) for k, v in layers]

        t_sdpa, t_ours = timed(sdpa, 5), timed(ours, 5)
        kv_bytes = 2 * NUM_LAYERS * num_seqs * NUM_KV_HEADS * context * HEAD_DIM * 4
        out.append({"num_seqs": num_seqs, "context": context, "sdpa_ms": round(t_sdpa, 3),
                    "decode_attention_ms": round(t_ours, 3), "speedup": round(t_sdpa / t_ours, 2),
                    "kv_gb_per_s": round(kv_bytes / t_ours / 1e6, 1)})
        print(out[-1], file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,64,256")
    ap.add_argument("--sections", default="linear,gather,attention")
    ap.add_argument("--out", default="cpu_ops.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sections = args.sections.split(",")
    result = {"threads": args.threads, "torch": torch.__version__}
    if "linear" in sections:
        result["linear_one_step"] = bench_linear([int(r) for r in args.rows.split(",")])
    if "gather" in sections:
        result["decode_gather_one_layer"] = bench_gather([(1, 200), (4, 200), (4, 1000),
                                                          (16, 1000)])
    if "attention" in sections:
        result["decode_attention_one_step"] = bench_attention([(4, 256), (4, 512), (16, 512)])
    print(json.dumps(result, indent=2))
    write_result(ROOT / "bench" / "results" / args.out, result)


if __name__ == "__main__":
    main()
