"""``per_token_group_quant_fp8`` on a CUDA GPU: correctness at the benchmark shapes (the op's
``compare``), then GB/s by CUDA-graph replay against the copy ceiling and the peers, then host µs per
eager call at 1x7168. ``--sweep`` also times the Triton kernel's tile / warps / division variants.

    python benchmarks/bench_quant.py --sweep --out docs/benchmarks/quant.json

Bytes per call: read 2 B per bf16 element, write 1 B per fp8 element and 4 B per group scale.
Peers: torch.compile of the reference (3383 GB/s at 8192x7168 g128 on an H200). FlashInfer
0.7.4 has no per-token-group FP8 quantisation; vLLM and sglang are not peers here.
"""

import argparse
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_kernels  # noqa: E402,F401
from benchmarks import cases, harness  # noqa: E402
from torch_kernels import dispatch, ops  # noqa: E402
from torch_kernels.families.quant import reference as reference  # noqa: E402
from torch_kernels.families.quant import triton as triton_quant  # noqa: E402

OP = "per_token_group_quant_fp8"
EPS = 1e-10
# (tokens, hidden, group_size, column_major_scales, scale_ue8m0): DeepSeek-V3's hidden size 7168.
LARGE = [(8192, 7168, 128, False, False), (8192, 7168, 128, True, False), (8192, 7168, 128, True, True),
         (16384, 7168, 64, False, False)]
SWEEP_TILES = (2048, 4096, 8192, 16384)
SWEEP_WARPS = (2, 4, 8, 16)
compare = ops.BY_NAME[OP].compare


def _bytes(t: int, h: int, g: int) -> int:
    return cases.nbytes(OP, (torch.empty(t, h, dtype=torch.bfloat16, device="meta"), g))


def impls():
    compiled = torch.compile(reference.per_token_group_quant_fp8)
    return {
        "deepinfer op": lambda x, g, cm, ue: torch.ops.deepinfer.per_token_group_quant_fp8.default(x, g, EPS, cm, ue),
        "triton launcher": lambda x, g, cm, ue: triton_quant.per_token_group_quant_fp8(x, g, EPS, cm, ue),
        "torch.compile(reference)": lambda x, g, cm, ue: compiled(x, g, EPS, cm, ue),
        "eager reference": lambda x, g, cm, ue: reference.per_token_group_quant_fp8(x, g, EPS, cm, ue),
    }


def bench_large(ceiling: float) -> list:
    rows = []
    candidates = impls()
    for t, h, g, cm, ue in LARGE:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16) * 4
        want = reference.per_token_group_quant_fp8(x, g, EPS, cm, ue)
        shape = f"{t}x{h} g{g}{' colmajor' if cm else ''}{' ue8m0' if ue else ''}"
        for name, fn in candidates.items():
            compare(list(fn(x, g, cm, ue)), list(want))
            us = harness.graph_us(lambda: fn(x, g, cm, ue))
            gbps = _bytes(t, h, g) / us / 1e3
            rows.append({"shape": shape, "impl": name, "us": us, "GB/s": gbps, "of copy": gbps / ceiling})
    return rows


def sweep(ceiling: float) -> list:
    """The Triton kernel alone at 8192x7168 g128 bf16: elements per program x warps with row-major
    scales, multiplying by 1/scale (the default); then the best of those with column-major scales,
    with a div_rn per element instead, and with the fp32 emulation of the fp8 rounding (the
    interpreter's path, which the GPU replaces by cvt.rn.satfinite: what that saves)."""
    t, h, g = 8192, 7168, 128
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16) * 4

    def run(tile, warps, cm, exact, emulate=False):
        q, s = reference.empty_outputs(x, g, cm)
        config = replace(triton_quant.TritonQuantConfig.for_shape(t, h // g, g, tile), num_warps=warps)

        def fn():
            triton_quant.launch(x, q, s, g, EPS, False, config, exact_div=exact, emulate_cast=emulate)
        fn()
        compare([q, s], list(reference.per_token_group_quant_fp8(x, g, EPS, cm, False)))
        us = harness.graph_us(fn)
        gbps = _bytes(t, h, g) / us / 1e3
        return {"layout": "colmajor" if cm else "rowmajor", "division": "div_rn" if exact else "x*(1/s)",
                "fp8 rounding": "fp32 emulation" if emulate else "cvt",
                "tile": tile, "BLOCK_M x BLOCK_G": f"{config.block_m}x{config.block_g}", "warps": warps, "us": us,
                "GB/s": gbps,
                "of copy": gbps / ceiling}

    rows = [run(tile, warps, False, False) for tile in SWEEP_TILES for warps in SWEEP_WARPS
            if 128 <= tile // warps <= 4096]  # 4 to 128 elements a thread
    best = max(rows, key=lambda r: r["GB/s"])
    rows.append(run(best["tile"], best["warps"], True, False))
    rows.append(run(best["tile"], best["warps"], False, True))
    rows.append(run(best["tile"], best["warps"], False, False, True))
    return rows


def bench_host() -> list:
    x = torch.randn(1, 7168, device="cuda", dtype=torch.bfloat16)
    op = torch.ops.deepinfer.per_token_group_quant_fp8.default
    cases = {
        "torch.empty_like": lambda: torch.empty_like(x),
        "triton launcher (direct)": lambda: triton_quant.per_token_group_quant_fp8(x, 128, EPS),
        "torch.ops.deepinfer op": lambda: op(x, 128, EPS, False, False),
    }
    rows = [{"case": name, "host us": harness.host_us(fn)} for name, fn in cases.items()]
    rows.append({"case": "1x7168 device time (graph replay)", "host us": harness.graph_us(cases["torch.ops.deepinfer op"])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--sweep", action="store_true", help="also sweep the Triton kernel's launch parameters")
    args = parser.parse_args()
    torch.manual_seed(0)
    chain, _ = dispatch.plan(OP)
    ceiling = harness.copy_ceiling_gbps()
    large = bench_large(ceiling)
    swept = sweep(ceiling) if args.sweep else []
    host = bench_host()
    result = {**harness.header(), "copy_ceiling_GBps": ceiling, "cuda_key_serves": [k.backend.value for k in chain],
              "large_bf16": large, "sweep_8192x7168_g128": swept, "host_1x7168_bf16": host}
    if args.out:
        harness.write_json(args.out, result)
    print(f"\n{result['gpu']}  torch {result['versions']['torch']}  copy ceiling {ceiling:.0f} GB/s  "
          f"CUDA key: {' > '.join(result['cuda_key_serves'])}\n")
    if swept:
        print(harness.markdown(sorted(swept, key=lambda r: -r["GB/s"]),
                               ["layout", "division", "fp8 rounding", "tile", "BLOCK_M x BLOCK_G", "warps", "us", "GB/s", "of copy"]))
        print()
    print(harness.markdown(host, ["case", "host us"]))
    print()
    print(harness.markdown(large, ["shape", "impl", "us", "GB/s", "of copy"]))


if __name__ == "__main__":
    main()
