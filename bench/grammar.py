"""Grammar engines for structured outputs on our vocabulary (SmolLM2's 49,152 tokens): llguidance
(what Tandem uses, engine/structured_output.py) against xgrammar, in the same run.

    .venv/bin/pip install --no-deps xgrammar apache-tvm-ffi   # bench only, never CI
    .venv/bin/python bench/grammar.py [--repeats 5]

For three JSON schemas (a small object, an array of six objects, a `tool_choice: required` schema
over two tools) it measures the compile time (cold: a fresh compiler each time, up to a matcher's
first mask, since llguidance compiles lazily) and the time of one next-token mask along a valid
answer (the answer's own tokens are consumed one by one, a mask computed before each), then Tandem's
engine decoding a batch of 8 with and without a schema. Medians of `--repeats`; JSON to
bench/results/grammar.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string"}}}
PEOPLE = {"type": "object", "required": ["people"], "additionalProperties": False,
          "properties": {"people": {"type": "array", "minItems": 6, "maxItems": 6,
                                    "items": PERSON}}}
TOOLS = {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "required": ["name", "parameters"], "additionalProperties": False,
     "properties": {"name": {"const": "get_weather"}, "parameters": {
         "type": "object", "required": ["city", "unit"], "additionalProperties": False,
         "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "object", "required": ["name", "parameters"], "additionalProperties": False,
     "properties": {"name": {"const": "add"}, "parameters": {
         "type": "object", "required": ["a", "b"], "additionalProperties": False,
         "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]}}
PERSON_ANSWER = {"name": "Ada Lovelace", "age": 36, "city": "London"}
CASES = {
    "person": (PERSON, PERSON_ANSWER),
    "six_people": (PEOPLE, {"people": [PERSON_ANSWER] * 6}),
    "tool_required": (TOOLS, [{"name": "get_weather",
                               "parameters": {"city": "Paris", "unit": "celsius"}}]),
}


def llguidance_engine(folder: Path, vocab: int):
    import llguidance
    import numpy as np

    tok = llguidance.LLTokenizer(str(folder / "tokenizer.json"), n_vocab=vocab)

    def compile_(schema: dict):
        # llguidance compiles lazily: the matcher's construction and its first mask build the
        # lexer, so both count as compiling (a fresh matcher is what each request gets).
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False, "item_separator": ", ",
                                          "key_separator": ": "})
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        m.compute_bitmask()
        return grammar

    def run(grammar, tokens: list[int]) -> list[float]:
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            mask = np.frombuffer(m.compute_bitmask(), dtype=np.int32)
            times.append(time.perf_counter() - t0)
            assert mask[t // 32] >> (t % 32) & 1, "the answer left the grammar"
            m.consume_token(t)
        return times

    return compile_, run


def xgrammar_engine(folder: Path, vocab: int):
    import transformers
    import xgrammar

    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)

    def compile_(schema: dict):
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                separators=(", ", ": "))
        m = xgrammar.GrammarMatcher(compiled)  # and its first mask, as for llguidance
        m.fill_next_token_bitmask(xgrammar.allocate_token_bitmask(1, vocab))
        return compiled

    def run(compiled, tokens: list[int]) -> list[float]:
        m = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t0)
            assert int(bitmask[0, t // 32]) >> (t % 32) & 1, "the answer left the grammar"
            m.accept_token(t)
        return times

    return compile_, run


def engine_overhead(repeats: int, batch: int = 8, max_tokens: int = 48) -> dict:
    """Tandem's engine on SmolLM2, a batch of `batch` requests decoding `max_tokens` tokens each
    (ignore_eos), unconstrained and under PEOPLE's schema, alternating; medians of tokens/s."""
    from common.protocol import StructuredOutput
    from engine import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", num_blocks=512, block_size=16, num_threads=2)
    prompts = [f"List six people as JSON ({i})." for i in range(batch)]
    constraint = StructuredOutput(kind="json", spec=json.dumps(PEOPLE))
    rates: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for _ in range(repeats):
        for name, structured in (("unconstrained", None), ("json_schema", constraint)):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                    structured=structured)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    med = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    return {"batch": batch, "max_tokens": max_tokens, "tokens_per_s": med,
            "constrained_over_unconstrained": round(med["json_schema"] / med["unconstrained"], 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar.json"))
    args = ap.parse_args()
    from tokenizers import Tokenizer

    from engine.model_store import SMOLLM2_ID, model_dir

    folder = model_dir(SMOLLM2_ID)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    engines = {"llguidance": llguidance_engine(folder, vocab)}
    try:
        engines["xgrammar"] = xgrammar_engine(folder, vocab)
    except ImportError as e:
        print(f"xgrammar not installed ({e}); measuring llguidance alone", file=sys.stderr)
    out: dict = {"vocab_size": vocab, "repeats": args.repeats, "cases": {}}
    for case, (schema, answer) in CASES.items():
        text = json.dumps(answer, separators=(", ", ": "))
        tokens = tok.encode(text, add_special_tokens=False).ids
        row: dict = {"answer_tokens": len(tokens)}
        for name, (compile_, run) in engines.items():
            compile_s, mask_s = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                grammar = compile_(schema)
                compile_s.append(time.perf_counter() - t0)
                mask_s.extend(run(grammar, tokens))
            mask_s.sort()
            row[name] = {"compile_ms": round(statistics.median(compile_s) * 1e3, 3),
                         "mask_p50_us": round(mask_s[len(mask_s) // 2] * 1e6, 1),
                         "mask_p99_us": round(mask_s[int(len(mask_s) * 0.99)] * 1e6, 1),
                         "mask_mean_us": round(statistics.fmean(mask_s) * 1e6, 1)}
        if "xgrammar" in row:
            row["xgrammar_over_llguidance"] = {
                k: round(row["xgrammar"][k] / row["llguidance"][k], 2)
                   if row["llguidance"][k] else None
                for k in ("compile_ms", "mask_p50_us", "mask_mean_us")}
        out["cases"][case] = row
        print(json.dumps({case: row}), flush=True)
    out["engine"] = engine_overhead(args.repeats)
    print(json.dumps({"engine": out["engine"]}), flush=True)
    write_result(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
