"""The norm family on a CUDA GPU: correctness at the benchmark shapes, then GB/s by CUDA-graph
replay against the copy ceiling and the peers, then host µs per eager call at 1x4096.

    python benchmarks/bench_norm.py --out docs/benchmarks/norm.json
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_kernels  # noqa: E402
from benchmarks import cases, harness  # noqa: E402
from torch_kernels import dispatch  # noqa: E402
from torch_kernels.families.norm import reference as reference  # noqa: E402
from torch_kernels.families.norm import triton as triton_norm  # noqa: E402
from torch_kernels.testing import assert_close  # noqa: E402

try:
    import flashinfer
except Exception as e:  # reported in the results
    flashinfer, FLASHINFER_ERROR = None, repr(e)

EPS = 1e-6
LARGE = [(16384, 8192), (8192, 7168)]


def rmsnorm_impls(n: int):
    compiled = torch.compile(reference.rmsnorm)
    impls = {
        "deepinfer op": lambda x, w: torch.ops.deepinfer.rmsnorm.default(x, w, EPS),
        "triton launcher": lambda x, w: triton_norm.rmsnorm(x, w, EPS),
        "torch.compile(reference)": lambda x, w: compiled(x, w, EPS),
        "F.rms_norm": lambda x, w: F.rms_norm(x, (n,), w, EPS),
    }
    if flashinfer is not None:
        impls["flashinfer"] = lambda x, w: flashinfer.norm.rmsnorm(x, w, EPS)
    return impls


def fused_impls():
    compiled = torch.compile(reference.fused_add_rmsnorm)
    impls = {
        "deepinfer op": lambda x, r, w: torch.ops.deepinfer.fused_add_rmsnorm.default(x, r, w, EPS),
        "triton launcher": lambda x, r, w: triton_norm.fused_add_rmsnorm(x, r, w, EPS),
        "torch.compile(reference)": lambda x, r, w: compiled(x, r, w, EPS),
    }
    if flashinfer is not None:
        impls["flashinfer"] = lambda x, r, w: flashinfer.norm.fused_add_rmsnorm(x, r, w, EPS)
    return impls


def bench_large(ceiling: float) -> list:
    rows = []
    for t, n in LARGE:
        x = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        want = reference.rmsnorm(x, w, EPS)
        for name, fn in rmsnorm_impls(n).items():
            assert_close(fn(x, w), want, msg=f"rmsnorm {name} {t}x{n}")
            us = harness.graph_us(lambda: fn(x, w))
            gbps = cases.nbytes("rmsnorm", (x, w, EPS)) / us / 1e3
            rows.append({"op": "rmsnorm", "shape": f"{t}x{n}", "impl": name, "us": us, "GB/s": gbps,
                         "of copy": gbps / ceiling})
        r = torch.randn_like(x)
        want_x, want_r = x.clone(), r.clone()
        reference.fused_add_rmsnorm(want_x, want_r, w, EPS)
        for name, fn in fused_impls().items():
            xa, ra = x.clone(), r.clone()
            fn(xa, ra, w)
            assert_close(ra, want_r, msg=f"fused_add_rmsnorm {name} residual")
            assert_close(xa, want_x, msg=f"fused_add_rmsnorm {name} output")
            us = harness.graph_us(lambda: fn(xa, ra, w))
            gbps = cases.nbytes("fused_add_rmsnorm", (xa, ra, w, EPS)) / us / 1e3
            rows.append({"op": "fused_add_rmsnorm", "shape": f"{t}x{n}", "impl": name, "us": us, "GB/s": gbps,
                         "of copy": gbps / ceiling})
    return rows


def bench_host() -> list:
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    op = torch.ops.deepinfer.rmsnorm.default
    cases = {
        "torch.empty_like": lambda: torch.empty_like(x),
        "F.rms_norm": lambda: F.rms_norm(x, (4096,), w, EPS),
        "triton launcher (direct)": lambda: triton_norm.rmsnorm(x, w, EPS),
        "torch.ops.deepinfer.rmsnorm": lambda: op(x, w, EPS),
        "torch_kernels.rmsnorm (wrapper)": lambda: torch_kernels.rmsnorm(x, w, EPS),
    }
    if flashinfer is not None:
        cases["flashinfer.norm.rmsnorm"] = lambda: flashinfer.norm.rmsnorm(x, w, EPS)
    rows = [{"case": name, "host us": us, "mode": "grad enabled"} for name, us in harness.host_us_interleaved(cases).items()]
    with torch.inference_mode():
        rows += [{"case": name, "host us": us, "mode": "inference_mode"} for name, us in harness.host_us_interleaved(cases).items()]
    rows.append({"case": "rmsnorm 1x4096 device time (graph replay)", "host us": harness.graph_us(cases["torch.ops.deepinfer.rmsnorm"]),
                 "mode": "device us"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()
    torch.manual_seed(0)
    chain, _ = dispatch.plan("rmsnorm")
    ceiling = harness.copy_ceiling_gbps()
    large = bench_large(ceiling)
    host = bench_host()
    result = {**harness.header(), "copy_ceiling_GBps": ceiling, "cuda_key_serves": [k.backend.value for k in chain],
              "flashinfer": None if flashinfer else FLASHINFER_ERROR, "large_bf16": large, "host_1x4096_bf16": host}
    if args.out:
        harness.write_json(args.out, result)
    print(f"\n{result['gpu']}  torch {result['versions']['torch']}  copy ceiling {ceiling:.0f} GB/s  "
          f"CUDA key: {' > '.join(result['cuda_key_serves'])}\n")
    print(harness.markdown(large, ["op", "shape", "impl", "us", "GB/s", "of copy"]))
    print()
    print(harness.markdown(host, ["case", "mode", "host us"]))


if __name__ == "__main__":
    main()
