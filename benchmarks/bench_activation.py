"""The gated activations on a CUDA GPU: correctness at the benchmark shapes, then GB/s by CUDA-graph
replay against the copy ceiling and the peers (torch.compile of the reference, FlashInfer), then host
µs per eager call at one token. ``--sweep`` also times the Triton kernel's tile/warp alternatives.

    python benchmarks/bench_activation.py --out docs/benchmarks/activation.json
"""

import argparse
import itertools
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_kernels  # noqa: E402,F401  (registers the ops)
from benchmarks import cases, harness  # noqa: E402
from torch_kernels import dispatch  # noqa: E402
from torch_kernels.families.activation import reference as reference  # noqa: E402
from torch_kernels.families.activation import triton as triton_activation  # noqa: E402
from torch_kernels.testing import assert_close  # noqa: E402

try:
    import flashinfer
    import flashinfer.activation
except Exception as e:  # reported in the results
    flashinfer, FLASHINFER_ERROR = None, repr(e)

# (tokens, d): Llama-3-8B's MLP (the README figure), and Llama-3.2-3B's at half the tokens, to see the
# heuristics hold below the largest size.
LARGE = [(8192, 14336), (4096, 8192)]
# (our op, approximate or None, FlashInfer's function name)
OPS = [("silu_and_mul", None, "silu_and_mul"), ("gelu_and_mul", "none", "gelu_and_mul"),
       ("gelu_tanh_and_mul", None, "gelu_tanh_and_mul")]


def _args(x, approximate):
    return (x,) if approximate is None else (x, approximate)


def impls(op: str, approximate, fi_name: str) -> dict:
    compiled = torch.compile(getattr(reference, op))
    overload = getattr(torch.ops.deepinfer, op).default
    launcher = getattr(triton_activation, op)
    out = {
        "deepinfer op": lambda x: overload(*_args(x, approximate)),
        "triton launcher": lambda x: launcher(*_args(x, approximate)),
        "torch.compile(reference)": lambda x: compiled(*_args(x, approximate)),
    }
    if flashinfer is not None:
        fi = getattr(flashinfer.activation, fi_name)
        out["flashinfer"] = lambda x: fi(x)
    return out


def _bytes(t: int, d: int) -> int:
    return cases.nbytes("silu_and_mul", (torch.empty(t, 2 * d, dtype=torch.bfloat16, device="meta"),))


def bench_large(ceiling: float) -> list:
    rows = []
    for t, d in LARGE:
        x = torch.randn(t, 2 * d, device="cuda", dtype=torch.bfloat16) * 2
        for op, approximate, fi_name in OPS:
            want = getattr(reference, op)(*_args(x, approximate))
            for name, fn in impls(op, approximate, fi_name).items():
                assert_close(fn(x), want, msg=f"{op} {name} {t}x2*{d}")
                us = harness.graph_us(lambda: fn(x))
                gbps = _bytes(t, d) / us / 1e3
                rows.append({"op": op, "shape": f"{t}x2*{d}", "impl": name, "us": us, "GB/s": gbps,
                             "of copy": gbps / ceiling})
    return rows


def bench_sweep(ceiling: float) -> list:
    """The Triton kernel under other (tile, elements per thread) choices, silu at the large shapes."""
    rows = []
    for t, d in LARGE:
        x = torch.randn(t, 2 * d, device="cuda", dtype=torch.bfloat16)
        want = reference.silu_and_mul(x)
        out = torch.empty_like(want)
        seen = set()
        for tile, per_thread, flat in itertools.product((512, 1024, 2048, 4096, 8192), (4, 8, 16), (True, False)):
            config = replace(triton_activation.TritonActivationConfig.for_shape(d, tile, per_thread), flat=flat)
            if config in seen:
                continue
            seen.add(config)
            out.zero_()
            fn = lambda: triton_activation.launch(x, out, "silu", config)  # noqa: E731
            fn()
            assert_close(out, want, msg=f"sweep {config}")
            us = harness.graph_us(fn)
            gbps = _bytes(t, d) / us / 1e3
            tile_size = config.block_m * config.block_n
            rows.append({"shape": f"{t}x2*{d}", "BLOCK_M x BLOCK_N": f"{config.block_m}x{config.block_n}",
                         "warps": config.num_warps, "per thread": tile_size // (32 * config.num_warps),
                         "grid": "flat" if config.flat else "2-D", "us": us, "GB/s": gbps, "of copy": gbps / ceiling,
                         "default": config == triton_activation.TritonActivationConfig.for_shape(d)})
    return rows


def bench_host() -> list:
    x = torch.randn(1, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    op = torch.ops.deepinfer.silu_and_mul.default
    cases = {
        "torch.empty_like": lambda: torch.empty_like(x),
        "triton launcher (direct)": lambda: triton_activation.silu_and_mul(x),
        "torch.ops.deepinfer.silu_and_mul": lambda: op(x),
    }
    if flashinfer is not None:
        cases["flashinfer.activation.silu_and_mul"] = lambda: flashinfer.activation.silu_and_mul(x)
    return harness.host_rows(cases, "torch.ops.deepinfer.silu_and_mul", "silu_and_mul 1x2*14336 device time (graph replay)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--sweep", action="store_true", help="also time the Triton kernel's tile/warp choices")
    args = parser.parse_args()
    torch.manual_seed(0)
    chain, _ = dispatch.plan("silu_and_mul")
    ceiling = harness.copy_ceiling_gbps()
    large = bench_large(ceiling)
    sweep = bench_sweep(ceiling) if args.sweep else []
    host = bench_host()
    result = {**harness.header(), "copy_ceiling_GBps": ceiling, "cuda_key_serves": [k.backend.value for k in chain],
              "flashinfer": None if flashinfer else FLASHINFER_ERROR, "large_bf16": large, "sweep_silu_bf16": sweep,
              "host_1x2x14336_bf16": host}
    if args.out:
        harness.write_json(args.out, result)
    print(f"\n{result['gpu']}  torch {result['versions']['torch']}  copy ceiling {ceiling:.0f} GB/s  "
          f"CUDA key: {' > '.join(result['cuda_key_serves'])}\n")
    if sweep:
        print(harness.markdown(sweep, ["shape", "BLOCK_M x BLOCK_N", "warps", "per thread", "grid", "us", "GB/s", "of copy",
                                       "default"]))
        print()
    print(harness.markdown(host, ["case", "mode", "host us"]))
    print()
    print(harness.markdown(large, ["op", "shape", "impl", "us", "GB/s", "of copy"]))


if __name__ == "__main__":
    main()
