"""The rotary embedding on a CUDA GPU: correctness at the benchmark shapes, then GB/s by CUDA-graph
replay against the copy ceiling and the peers (torch.compile of the reference, FlashInfer's
``apply_rope_with_cos_sin_cache_inplace``), then host µs per eager call at one token, with and
without the op's check of the positions (a device sync), and optionally a sweep of the Triton
launch parameters.

    python benchmarks/bench_rope.py --out docs/benchmarks/rope.json [--sweep]

Bytes per call: query and key read and written (the rotated dims only; all of them here), the
positions read, and one cache row (``rot_dim`` values) read per token.
"""

import argparse
import itertools
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_kernels  # noqa: E402  (registers the ops)
from benchmarks import cases, harness  # noqa: E402
from torch_kernels import dispatch  # noqa: E402
from torch_kernels.families.rope import reference as reference  # noqa: E402
from torch_kernels.families.rope import triton as triton_rope  # noqa: E402
from torch_kernels.families.rope import ops as rope_op # noqa: E402
from torch_kernels.testing import assert_close  # noqa: E402

try:
    import flashinfer
    import flashinfer.rope
except Exception as e:  # reported in the results
    flashinfer, FLASHINFER_ERROR = None, repr(e)

TOKENS, HQ, HK, HEAD, MAX_POS = 8192, 32, 8, 128, 8192
# (label, is_neox, layout): the shape with separate contiguous q and k; the same with q and k
# as column slices of one fused qkv tensor (strided rows, what vLLM passes); GPT-J pairing.
LARGE = [("neox", True, "2d"), ("neox fused qkv", True, "qkv"), ("gptj", False, "2d")]


def impls():
    compiled = torch.compile(reference.rotary_embedding)
    out = {
        "deepinfer op": torch.ops.deepinfer.rotary_embedding.default,
        "triton launcher": triton_rope.rotary_embedding,
        "torch.compile(reference)": compiled,
    }
    if flashinfer is not None:
        out["flashinfer"] = lambda p, q, k, hs, c, neox: flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(p, q, k, hs, c, is_neox=neox)
    return out


def _args(is_neox: bool, layout: str, tokens: int = TOKENS):
    return rope_op.make_args(tokens, HQ, HK, HEAD, HEAD, is_neox, layout, "cuda", torch.bfloat16,
                             torch.float32, torch.int64, MAX_POS)


def _copy(args):
    positions, q, k, hs, cache, neox = args
    if q._base is None:
        return (positions, q.clone(), k.clone(), hs, cache, neox)
    b = q._base.clone()
    return (positions, b.as_strided(q.size(), q.stride(), q.storage_offset()),
            b.as_strided(k.size(), k.stride(), k.storage_offset()), hs, cache, neox)


def _bytes(args) -> int:
    return cases.nbytes("rotary_embedding", args)


def bench_large(ceiling: float) -> list:
    rows = []
    for label, neox, layout in LARGE:
        args = _args(neox, layout)
        want = _copy(args)
        reference.rotary_embedding(*want)
        for name, fn in impls().items():
            got = _copy(args)
            try:
                fn(*got)
            except Exception as e:  # a peer that cannot take this layout: say so, keep going
                rows.append({"case": label, "impl": name, "note": f"failed: {type(e).__name__}: {str(e)[:80]}"})
                continue
            assert_close(got[1], want[1], msg=f"{label} {name}: query")
            assert_close(got[2], want[2], msg=f"{label} {name}: key")
            us = harness.graph_us(lambda: fn(*got))
            gbps = _bytes(args) / us / 1e3
            rows.append({"case": label, "impl": name, "us": us, "GB/s": gbps, "of copy": gbps / ceiling})
    return rows


def bench_host() -> list:
    """Host µs per eager call at one token (a decode step), where launch and checks dominate."""
    args = _args(True, "qkv", tokens=1)
    op = torch.ops.deepinfer.rotary_embedding.default
    cases = {
        "triton launcher (direct)": lambda: triton_rope.rotary_embedding(*args),
        "torch.ops.deepinfer.rotary_embedding": lambda: op(*args),
    }
    if flashinfer is not None:
        cases["flashinfer apply_rope_with_cos_sin_cache_inplace"] = lambda: flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
            args[0], args[1], args[2], HEAD, args[4], is_neox=True)
    rows = []
    with torch.inference_mode():
        for name, fn in cases.items():
            rows.append({"case": name, "positions check": "default (off on CUDA)" if "deepinfer" in name else "-",
                         "host us": harness.host_us(fn)})
        saved = torch_kernels.configure(check_indices=True)
        try:
            rows.append({"case": "torch.ops.deepinfer.rotary_embedding", "positions check": "on (a device sync)",
                         "host us": harness.host_us(cases["torch.ops.deepinfer.rotary_embedding"])})
        finally:
            torch_kernels.configure(saved)
        rows.append({"case": "device time, 1 token (graph replay)", "positions check": "-",
                     "host us": harness.graph_us(cases["torch.ops.deepinfer.rotary_embedding"])})
    return rows


def sweep(ceiling: float) -> list:
    """GB/s of the Triton kernel over its launch parameters, both pairings, at the benchmark shape and
    at 256 tokens."""
    rows = []
    for tokens, is_neox in itertools.product((TOKENS, 256), (True, False)):
        pairing = "neox" if is_neox else "gptj"
        args = _args(is_neox, "2d", tokens)
        want = _copy(args)
        reference.rotary_embedding(*want)
        heuristic = triton_rope.TritonRopeConfig.for_shape(tokens, HQ + HK, HEAD // 2)
        for hpp, bh, nw in itertools.product((8, 16, HQ + HK), (4, 8, 16, 32), (1, 2, 4, 8)):
            if bh > hpp:
                continue
            got = _copy(args)
            config = replace(heuristic, heads_per_program=hpp, block_h=bh, num_warps=nw)
            fn = lambda: triton_rope.launch(*got, config)  # noqa: E731
            fn()
            assert_close(got[1], want[1], msg=f"sweep {pairing} {hpp} {bh} {nw}")
            us = harness.graph_us(fn)
            rows.append({"tokens": tokens, "pairing": pairing, "heads/program": hpp, "BLOCK_H": bh, "warps": nw, "us": us,
                         "GB/s": _bytes(args) / us / 1e3, "of copy": _bytes(args) / us / 1e3 / ceiling})
        print(f"heuristic at {tokens} tokens ({pairing}): heads/program {heuristic.heads_per_program}, "
              f"BLOCK_H {heuristic.block_h}, warps {heuristic.num_warps}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--sweep", action="store_true", help="also sweep the Triton launch parameters")
    args = parser.parse_args()
    torch.manual_seed(0)
    chain, _ = dispatch.plan("rotary_embedding")
    ceiling = harness.copy_ceiling_gbps()
    large = bench_large(ceiling)
    host = bench_host()
    swept = sweep(ceiling) if args.sweep else []
    result = {**harness.header(), "copy_ceiling_GBps": ceiling, "cuda_key_serves": [k.backend.value for k in chain],
              "flashinfer": None if flashinfer else FLASHINFER_ERROR,
              "shape": f"{TOKENS} tokens, {HQ}+{HK} heads x {HEAD}, bf16, cache fp32 {MAX_POS}x{HEAD}, int64 positions",
              "large_bf16": large, "host_1_token_bf16": host, "sweep": swept}
    if args.out:
        harness.write_json(args.out, result)
    print(f"\n{result['gpu']}  torch {result['versions']['torch']}  copy ceiling {ceiling:.0f} GB/s  "
          f"CUDA key: {' > '.join(result['cuda_key_serves'])}\n{result['shape']}\n")
    if swept:
        best = [r for t, pr in itertools.product((TOKENS, 256), ("neox", "gptj"))
                for r in sorted((r for r in swept if r["tokens"] == t and r["pairing"] == pr), key=lambda r: r["us"])[:6]]
        print(harness.markdown(best, ["tokens", "pairing", "heads/program", "BLOCK_H", "warps", "us", "GB/s", "of copy"]))
        print()
    print(harness.markdown(host, ["case", "positions check", "host us"]))
    print()
    print(harness.markdown(large, ["case", "impl", "us", "GB/s", "of copy", "note"]))


if __name__ == "__main__":
    main()
