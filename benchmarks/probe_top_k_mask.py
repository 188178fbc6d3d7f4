"""Which route serves ``top_k_mask_logits`` at which k, and what each costs beside FlashInfer, on the GPU host.

    python benchmarks/probe_top_k_mask.py --out results/probe_top_k_mask.json

bf16 logits (``randn * 3``), rows x vocab x k, timed by CUDA-graph replay: the Triton op as it routes
(the slices' bounds where they finish a row, the radix route for the rest), its slice kernel at 4
warps, the radix route alone, and ``flashinfer.sampling.top_k_mask_logits`` when installed. Each result is checked against the
reference before it is timed (FlashInfer's labelled where it keeps other ties).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_kernels.bench import harness  # noqa: E402
from torch_kernels.families.sampling import reference  # noqa: E402
from torch_kernels.families.sampling.triton import logits as triton_logits  # noqa: E402

SHAPES = ((1, 128256), (32, 128256), (256, 32000), (256, 128256), (512, 128256), (256, 256000))
TOP_K = (50, 200, 1000)


def radix_only(x, k):
    """The op with the bound route switched off: every row by radix select."""
    most = triton_logits._MASK_MAX_SLICES
    triton_logits._MASK_MAX_SLICES = 0
    try:
        return triton_logits.top_k_mask_logits(x, None, k)
    finally:
        triton_logits._MASK_MAX_SLICES = most


def slice_warps(x, k, warps):
    """The op with the bound route's slice kernel at ``warps`` warps."""
    default = triton_logits._MASK_WARPS
    triton_logits._MASK_WARPS = warps
    try:
        return triton_logits.top_k_mask_logits(x, None, k)
    finally:
        triton_logits._MASK_WARPS = default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    fs = harness.optional_module("flashinfer.sampling")
    ceiling = harness.copy_ceiling_gbps()
    rows = []
    torch.manual_seed(0)
    for b, v in SHAPES:
        x = torch.randn(b, v, device="cuda").mul_(3).to(torch.bfloat16)
        for k in TOP_K:
            want = reference.top_k_mask_logits(x, None, k)
            calls = {"triton (as routed)": lambda x=x, k=k: triton_logits.top_k_mask_logits(x, None, k),
                     "triton, slice kernel 4 warps": lambda x=x, k=k: slice_warps(x, k, 4),
                     "triton, radix route only": lambda x=x, k=k: radix_only(x, k)}
            if fs is not None:
                calls["FlashInfer"] = lambda x=x, k=k: fs.top_k_mask_logits(x, k)
            for name, fn in list(calls.items()):
                if not torch.equal(fn(), want):  # FlashInfer keeps ties at the k-th value differently
                    if name != "FlashInfer":
                        raise SystemExit(f"{name} differs from the reference at {b}x{v} k={k}")
                    calls["FlashInfer (other ties)"] = calls.pop(name)
            rows += harness.bandwidth_rows("top_k_mask_logits", f"{b}x{v} k={k}", calls, 2 * x.numel() * 2, ceiling,
                                           3)
    harness.write_bandwidth_rows(args.out, ceiling, rows, ["op", "shape", "impl", "us", "GB/s", "of copy"])


if __name__ == "__main__":
    main()
