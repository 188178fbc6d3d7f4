"""The Triton RMSNorm kernel against the structure Inductor generates for the reference, on the GPU
host, all in one run: where ``families/norm/triton.py``'s pass structure and cache hints come from.

    python benchmarks/sweep_triton_norm.py --out results/sweep_triton_norm.json

Inductor's kernel for the reference reads the row twice (chunks of 2048 or the whole row, 16 warps):
first with ``evict_last``, so the second read (``evict_first``) comes from L2, and the weight with
``evict_last`` (``probe_inductor.py`` shows it). Each variant below is that kernel with one choice
changed, checked against the reference, then timed by CUDA-graph replay against a copy measured in the
same run. The results and what they decided: ``docs/design/norm.md``.
"""

import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import cases, harness  # noqa: E402
from torch_kernels.families.norm import reference as ref_norm  # noqa: E402
from torch_kernels.families.norm import triton as tr_norm  # noqa: E402
from torch_kernels.families.norm.ops import BENCH_EPS as EPS  # noqa: E402

SHAPES = ((32, 8192), (4096, 4096), (16384, 4096), (16384, 7168), (16384, 8192))


@triton.jit
def _variant(x_ptr, res_ptr, out_ptr, w_ptr, N, eps,
             BLOCK: tl.constexpr, TWO_PASS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
             X1: tl.constexpr, X2: tl.constexpr, W: tl.constexpr, PDL: tl.constexpr, RELOAD: tl.constexpr):
    """Rows of ``N`` (contiguous); ``X1``/``X2``/``W``: eviction policies of the first read of the row,
    its second read (TWO_PASS, or RELOAD: one pass without residual reading the row again to
    normalise it) and the weight ("" for none); ``PDL``: launched as a programmatic dependent launch,
    so it first waits for the previous kernel on the stream."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    x_row, res_row, out_row = x_ptr + row * N, res_ptr + row * N, out_ptr + row * N
    cols = tl.arange(0, BLOCK)
    if TWO_PASS:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            m = start + cols < N
            x = tl.load(x_row + start + cols, mask=m, other=0.0, eviction_policy=X1).to(tl.float32)
            if HAS_RESIDUAL:
                x += tl.load(res_row + start + cols, mask=m, other=0.0, eviction_policy=X1).to(tl.float32)
                tl.store(res_row + start + cols, x.to(res_ptr.dtype.element_ty), mask=m)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
        for start in range(0, N, BLOCK):
            m = start + cols < N
            if HAS_RESIDUAL:
                x = tl.load(res_row + start + cols, mask=m, other=0.0, eviction_policy=X2).to(tl.float32)
            else:
                x = tl.load(x_row + start + cols, mask=m, other=0.0, eviction_policy=X2).to(tl.float32)
            w = tl.load(w_ptr + start + cols, mask=m, other=0.0, eviction_policy=W).to(tl.float32)
            tl.store(out_row + start + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=m)
    else:
        m = cols < N
        x = tl.load(x_row + cols, mask=m, other=0.0, eviction_policy=X1).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(res_row + cols, mask=m, other=0.0, eviction_policy=X1).to(tl.float32)
            tl.store(res_row + cols, x.to(res_ptr.dtype.element_ty), mask=m)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0, eviction_policy=W).to(tl.float32)
        if RELOAD:
            x = tl.load(x_row + cols, mask=m, other=0.0, eviction_policy=X2).to(tl.float32)
        tl.store(out_row + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=m)


def _variants(n: int, fused: bool) -> dict:
    """label -> (BLOCK, TWO_PASS, X1, X2, W, num_warps, PDL, num_stages, RELOAD): the backend's one
    pass and its many-token structure (the fused ops in 4096-value chunks; rmsnorm read twice, as
    Inductor's kernel for the reference). The variants timed before (hints, PDL, chunk sizes, stages)
    are in this file's git history."""
    row = triton.next_power_of_2(n)
    warps = tr_norm.TritonNormConfig.for_shape(1, n, fused).num_warps  # the backend's one-pass warps
    if fused:
        return {
            "one pass": (row, False, "", "", "", warps, False, 3, False),
            "two pass 4096 (backend from 4096 tokens)": (4096, True, "evict_last", "evict_first", "evict_last", 16,
                                                         False, 3, False),
        }
    return {
        "one pass": (row, False, "", "", "evict_last", warps, False, 3, False),
        "one pass, read twice (backend from 4096 tokens)": (row, False, "evict_last", "evict_first", "evict_last",
                                                            warps, False, 3, True),
        "read twice, 1 stage": (row, False, "evict_last", "evict_first", "evict_last", warps, False, 1, True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ceiling = harness.copy_ceiling_gbps()
    rows = []
    for (tokens, n), fused in itertools.product(SHAPES, (False, True)):
        op = "fused_add_rmsnorm" if fused else "rmsnorm"
        args = cases.build(op, tokens, n, cases.PROFILES["gpu"], "cuda", torch.bfloat16)
        x, r, w = args[:3] if fused else (args[0], args[0], args[1])  # r: read by the fused op only
        nbytes = cases.nbytes(op, args)
        if fused:
            want = [x.clone(), r.clone()]
            ref_norm.fused_add_rmsnorm(*want, w, EPS)
        else:
            want = [ref_norm.rmsnorm(x, w, EPS)]
        for label, (block, two, x1, x2, wp, warps, pdl, stages, reload) in _variants(n, fused).items():
            xx, rr, out = x.clone(), r.clone(), torch.empty_like(x)
            dst = xx if fused else out

            def call(block=block, two=two, x1=x1, x2=x2, wp=wp, warps=warps, pdl=pdl, stages=stages, reload=reload,
                     xx=xx, rr=rr, dst=dst):
                _variant[(tokens,)](xx, rr, dst, w, n, EPS, BLOCK=block, TWO_PASS=two, HAS_RESIDUAL=fused,
                                    X1=x1, X2=x2, W=wp, PDL=pdl, RELOAD=reload, num_warps=warps, num_stages=stages,
                                    launch_pdl=pdl)
            call()
            got = [xx, rr] if fused else [out]
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
            us = harness.replay_us(call)
            row = {"op": op, "shape": f"{tokens}x{n}", "impl": label, "us": us, "GB/s": nbytes / us / 1e3,
                   "of copy": nbytes / us / 1e3 / ceiling}
            print(row, flush=True)
            rows.append(row)
    harness.write_bandwidth_rows(args.out, ceiling, rows, ["op", "shape", "impl", "us", "GB/s", "of copy"])


if __name__ == "__main__":
    main()
