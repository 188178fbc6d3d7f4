"""The paged-cache decoder layer (examples/paged_decoder_layer.py, Llama-3-8B shapes; with ``--qk-norm``
also Qwen3's per-head QK-norm) beside the cacheless layer (examples/decoder_layer.py), ours and plain
torch, compiled.

    python benchmarks/bench_paged_layer.py --output docs/benchmarks/paged_layer.json
    python benchmarks/bench_paged_layer.py --device cpu --tiny      # a smoke test of the script, seconds

Rows, per token count (one sequence's prefill, its blocks a random choice of a cache of twice as many
blocks as it needs, block size 16): ``no cache, ours`` / ``no cache, plain`` (the cacheless layer), and
``paged fused`` / ``paged unfused`` / ``paged plain`` (each writes the sequence's keys and values into
the paged cache once and reads them back for SDPA), each with and without QK-norm where asked. On CUDA
each row is compiled (``fullgraph``, static shapes), checked, then timed: ``graph us``, device µs of
one call replayed from a CUDA graph (every row's graph in interleaved rounds), ``call us`` µs per call
between CUDA events, the host included; ``x plain`` is the matching plain row's µs over this row's. On
the CPU the rows run eagerly (``call us``: wall clock), which says nothing of a GPU. Before timing,
``= paged unfused`` records whether a paged row returns what the unfused one returns, bit for bit
(outputs and caches).
"""

import argparse
import dataclasses
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import decoder_layer  # noqa: E402
import paged_decoder_layer as paged  # noqa: E402
from benchmarks import harness  # noqa: E402

NO_CACHE = {"no cache, ours": True, "no cache, plain": False}  # row -> DecoderLayer's ``ours``
PAGED = {"paged fused": "fused", "paged unfused": "unfused", "paged plain": "plain"}


def _rows_at(cfg, tokens: int, qk_norm: bool, device: str, dtype, compiled: bool, rounds: int) -> list:
    num_blocks = 2 * -(-tokens // paged.BLOCK_SIZE)
    positions, hidden, slot_mapping = paged.paged_inputs(cfg, tokens, num_blocks, device, dtype, seed=1000 + tokens)
    calls, results = {}, {}
    layers = {} if qk_norm else {row: decoder_layer.DecoderLayer(cfg, ours, device, dtype) for row, ours in NO_CACHE.items()}
    for row, layer in layers.items():
        fn = torch.compile(layer, fullgraph=True, dynamic=False) if compiled else layer
        calls[row] = lambda fn=fn: fn(positions, hidden)
    for row, variant in PAGED.items():
        layer = paged.PagedDecoderLayer(cfg, variant, device, dtype, qk_norm=qk_norm)
        caches = layer.new_caches(num_blocks, torch.Generator().manual_seed(7))
        fn = torch.compile(layer, fullgraph=True, dynamic=False) if compiled else layer
        calls[row] = lambda fn=fn, caches=caches: fn(positions, hidden, *caches, slot_mapping)
        results[row] = caches
    out = {row: {"tokens": tokens, "row": row, "qk_norm": qk_norm} for row in calls}
    for row, call in calls.items():  # the first call compiles; every row is checked before any is timed
        got = call()
        if row in results:
            results[row] = (*got, *results[row])
    for row in PAGED:
        out[row]["= paged unfused"] = all(torch.equal(a, b) for a, b in zip(results[row], results["paged unfused"]))
    if device == "cuda":
        graph_us, failed = harness.replay_us_interleaved(calls, rounds=rounds)
        for row, call in calls.items():
            out[row]["graph us"] = graph_us.get(row)
            if row in failed:
                out[row]["error"] = f"{type(failed[row]).__name__}: {failed[row]}"[:300]
            out[row]["call us"] = harness.events_us(call)
    else:
        for row, call in calls.items():
            out[row]["call us"] = harness.wall_us(call, min_s=1e-3, repeat=3)
    for row, r in out.items():
        plain = out.get("paged plain" if row.startswith("paged") else "no cache, plain")
        for col in ("graph", "call"):
            us, ref = r.get(f"{col} us"), plain.get(f"{col} us") if plain else None
            r[f"{col} x plain"] = ref / us if us and ref else None
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}, flush=True)
    return list(out.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small layer (hidden 64) instead of Llama-3-8B's")
    p.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,32,2048; on the CPU 1,7)")
    p.add_argument("--qk-norm", default="both", choices=("off", "on", "both"), help="Qwen3's QK-norm in the paged rows")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the graph replays")
    p.add_argument("--output", default=None, help="JSON file for the results (docs/benchmarks/paged_layer.json)")
    a = p.parse_args(argv)
    cfg = paged.TINY if a.tiny else paged.LLAMA_8B
    tokens = [int(t) for t in (a.tokens or ("1,32,2048" if a.device == "cuda" else "1,7")).split(",")]
    dtype = torch.bfloat16
    settings = {"off": (False,), "on": (True,), "both": (False, True)}[a.qk_norm]
    torch.manual_seed(0)
    rows = []
    with torch._dynamo.config.patch(recompile_limit=64), torch.inference_mode():
        for t in tokens:
            for qk_norm in settings:
                rows += _rows_at(cfg, t, qk_norm, a.device, dtype, a.device == "cuda", a.rounds)
    header = harness.header() if a.device == "cuda" else {"gpu": None, "versions": harness.versions()}
    result = {**header, "device": a.device, "config": dataclasses.asdict(cfg),
              "block_size": paged.BLOCK_SIZE, "rows": rows}
    if a.output:
        harness.write_json(a.output, result)
    print(f"\n{result['gpu'] or a.device}  torch {result['versions']['torch']}\n")
    print(harness.markdown(rows, ["tokens", "qk_norm", "row", "graph us", "graph x plain", "call us", "call x plain",
                                  "= paged unfused", "error"]))
    return int(any("error" in row for row in rows))


if __name__ == "__main__":
    raise SystemExit(main())
