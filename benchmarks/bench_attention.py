"""``merge_attn_states`` on a CUDA GPU: correctness at the benchmark shapes, then GB/s by CUDA-graph
replay against the copy ceiling and the peers (torch.compile of the reference, FlashInfer's
``cascade.merge_state``), then host µs per eager call at one token. ``--sweep`` also times the Triton
kernel's tile/warp alternatives.

FlashInfer's LSE is base 2: its inputs are our LSEs times log2(e), converted once outside the timed
region (an engine built on FlashInfer keeps base-2 LSEs throughout), and its output LSE is divided
back for the correctness check.

    python benchmarks/bench_attention.py --out docs/benchmarks/attention.json
"""

import argparse
import itertools
import math
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_kernels  # noqa: E402,F401  (registers the ops)
from benchmarks import cases, harness  # noqa: E402
from torch_kernels import dispatch  # noqa: E402
from torch_kernels.families.attention import reference as reference  # noqa: E402
from torch_kernels.families.attention import triton as triton_attention  # noqa: E402
from torch_kernels.families.attention.ops import merge_inputs  # noqa: E402
from torch_kernels.testing import assert_close  # noqa: E402

try:
    import flashinfer
    import flashinfer.cascade
except Exception as e:  # reported in the results
    flashinfer, FLASHINFER_ERROR = None, repr(e)

LOG2E = 1.0 / math.log(2.0)
# (tokens, heads, head_size): the README shape (Llama-3-8B's query heads), and DeepSeek MLA's
# 128 heads of 512 (latent attention merges) at fewer tokens.
LARGE = [(8192, 32, 128), (1024, 128, 512)]


def _inputs(T, H, D):
    return merge_inputs(T, H, D, "cuda")


def impls(args) -> dict:
    compiled = torch.compile(reference.merge_attn_states)
    op = torch.ops.deepinfer.merge_attn_states.default
    out = {
        "deepinfer op": lambda: op(*args),
        "triton launcher": lambda: triton_attention.merge_attn_states(*args),
        "torch.compile(reference)": lambda: compiled(*args),
    }
    if flashinfer is not None:
        from torch_kernels.families.attention.flashinfer import merge_attn_states_refuses

        # a launch FlashInfer cannot make leaves a sticky CUDA error behind: ask its limits first
        refused = merge_attn_states_refuses(*args)
        v_a, lse_a, v_b, lse_b = args
        lse_a2, lse_b2 = lse_a * LOG2E, lse_b * LOG2E  # base 2, converted outside the timed call
        out["flashinfer (base-2 LSE)"] = (f"not run: {refused}" if refused else
                                          lambda: flashinfer.cascade.merge_state(v_a, lse_a2, v_b, lse_b2))
    return out


def bench_large(ceiling: float) -> list:
    rows = []
    for T, H, D in LARGE:
        args = _inputs(T, H, D)
        want_v, want_lse = reference.merge_attn_states(*args)
        for name, fn in impls(args).items():
            if isinstance(fn, str):  # FlashInfer's MergeState runs one (D / vec, H) thread block per token
                rows.append({"shape": f"{T}x{H}x{D}", "impl": name, "us": fn})
                continue
            v, lse = fn()
            if name.startswith("flashinfer"):
                lse = lse / LOG2E
            assert_close(v, want_v, msg=f"{name} {T}x{H}x{D}: v")
            # FlashInfer's exp2/log2 are approximate instructions: its LSE only to fp16's tolerance
            assert_close(lse, want_lse, torch.float16 if name.startswith("flashinfer") else torch.float32,
                         msg=f"{name} {T}x{H}x{D}: lse")
            us = harness.graph_us(fn)
            gbps = cases.nbytes("merge_attn_states", args) / us / 1e3
            rows.append({"shape": f"{T}x{H}x{D}", "impl": name, "us": us, "GB/s": gbps, "of copy": gbps / ceiling})
    return rows


def bench_sweep(ceiling: float) -> list:
    """The Triton kernel under other (heads per program, elements per thread) choices."""
    rows = []
    for T, H, D in LARGE:
        args = _inputs(T, H, D)
        want_v, want_lse = reference.merge_attn_states(*args)
        out, out_lse = torch.empty_like(want_v), torch.empty_like(want_lse)
        seen = set()
        for tile, per_thread, flat in itertools.product((256, 512, 1024, 2048, 4096), (4, 8, 16), (True, False)):
            config = replace(triton_attention.TritonMergeConfig.for_shape(H, D, tile, per_thread), flat=flat)
            if config in seen:
                continue
            seen.add(config)
            out.zero_()
            fn = lambda: triton_attention.launch(*args, out, out_lse, config)  # noqa: E731
            fn()
            assert_close(out, want_v, msg=f"sweep {config}")
            us = harness.graph_us(fn)
            gbps = cases.nbytes("merge_attn_states", args) / us / 1e3
            tile_size = config.block_h * config.block_d
            rows.append({"shape": f"{T}x{H}x{D}", "BLOCK_H x BLOCK_D": f"{config.block_h}x{config.block_d}",
                         "warps": config.num_warps, "per thread": tile_size // (32 * config.num_warps),
                         "grid": "flat" if config.flat else "3-D", "us": us, "GB/s": gbps, "of copy": gbps / ceiling,
                         "default": config == triton_attention.TritonMergeConfig.for_shape(H, D)})
    return rows


def bench_host() -> list:
    args = _inputs(1, 32, 128)
    op = torch.ops.deepinfer.merge_attn_states.default
    cases = {
        "torch.empty_like": lambda: torch.empty_like(args[0]),
        "triton launcher (direct)": lambda: triton_attention.merge_attn_states(*args),
        "torch.ops.deepinfer.merge_attn_states": lambda: op(*args),
    }
    if flashinfer is not None:
        cases["flashinfer.cascade.merge_state"] = lambda: flashinfer.cascade.merge_state(*args)
    return harness.host_rows(cases, "torch.ops.deepinfer.merge_attn_states", "merge_attn_states 1x32x128 device time (graph replay)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--sweep", action="store_true", help="also time the Triton kernel's tile/warp choices")
    args = parser.parse_args()
    torch.manual_seed(0)
    chain, _ = dispatch.plan("merge_attn_states")
    ceiling = harness.copy_ceiling_gbps()
    large = bench_large(ceiling)
    sweep = bench_sweep(ceiling) if args.sweep else []
    host = bench_host()
    result = {**harness.header(), "copy_ceiling_GBps": ceiling, "cuda_key_serves": [k.backend.value for k in chain],
              "flashinfer": None if flashinfer else FLASHINFER_ERROR, "large_bf16": large, "sweep_bf16": sweep,
              "host_1x32x128_bf16": host}
    if args.out:
        harness.write_json(args.out, result)
    print(f"\n{result['gpu']}  torch {result['versions']['torch']}  copy ceiling {ceiling:.0f} GB/s  "
          f"CUDA key: {' > '.join(result['cuda_key_serves'])}\n")
    if sweep:
        print(harness.markdown(sweep, ["shape", "BLOCK_H x BLOCK_D", "warps", "per thread", "grid", "us", "GB/s", "of copy",
                                       "default"]))
        print()
    print(harness.markdown(host, ["case", "mode", "host us"]))
    print()
    print(harness.markdown(large, ["shape", "impl", "us", "GB/s", "of copy"]))


if __name__ == "__main__":
    main()
