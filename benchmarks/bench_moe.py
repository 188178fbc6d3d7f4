"""The MoE routers on a CUDA GPU: correctness at the benchmark shapes, then µs by CUDA-graph replay
(and GB/s against the copy ceiling) beside the peers in the same run: torch.compile of the reference
and the eager reference. ``--sweep`` also times the Triton kernel's tokens-per-program x warps
alternatives against the launcher's heuristic.

Shapes: ``topk_softmax`` 8192 tokens x 256 experts, top 8, renormalised, fp32 and bf16 logits
(target: under 15 µs; torch.compile of the reference measured 124 µs on an H200);
``grouped_topk`` DeepSeek-V3: 8192 x 256, 8 groups, keep 4, top 8, sigmoid + fp32 bias, scaling 2.5.

No FlashInfer peer: its DeepSeek-V3 router (``fused_moe.fused_topk_deepseek``) builds a JIT module
(``dsv3_fused_routing``, several minutes to build on first use), which timed the benchmark out.
Without ``--sweep`` the run takes
well under 90 s (one torch.compile per op and dtype, 4 cases x 4 timed implementations).

Random logits put some rows on near ties (two keys within fp32 rounding), which two correct
implementations may order differently: the checks compare ids exactly on the other rows
(``near_ties``) and report how many there were.

    python benchmarks/bench_moe.py --out docs/benchmarks/moe.json [--sweep]
"""

import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_kernels  # noqa: E402,F401  (registers the ops)
from benchmarks import harness  # noqa: E402
from benchmarks.cases import nbytes  # noqa: E402
from torch_kernels import dispatch  # noqa: E402
from torch_kernels.families.moe import reference as reference  # noqa: E402
from torch_kernels.families.moe import triton as triton_moe  # noqa: E402
from torch_kernels.families.moe.ops import compare_routing, near_ties  # noqa: E402

TOKENS, EXPERTS, TOPK = 8192, 256, 8
GROUPS, TOPK_GROUP, SCALE = 8, 4, 2.5


def cases():
    """(name, op, args) per benchmark case; the logits dtype is in the name."""
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(TOKENS, EXPERTS, device="cuda", dtype=dtype) * 2
        name = str(dtype).replace("torch.", "")
        out.append((f"topk_softmax {name}", "topk_softmax", (x, TOPK, True)))
        # fp32, as DeepSeek-V3 keeps it, but representable in bf16: FlashInfer takes the bias in
        # the logits' dtype, and the same bias makes the same choices
        bias = (torch.randn(EXPERTS, device="cuda") * 0.1).to(torch.bfloat16).float()
        out.append((f"grouped_topk {name}", "grouped_topk", (x, TOPK, True, GROUPS, TOPK_GROUP, "sigmoid", bias, SCALE)))
    return out


def impls(op, args) -> dict:
    ref = getattr(reference, op)
    compiled = torch.compile(ref)  # one dynamo cache per function: a dtype change recompiles once
    overload = getattr(torch.ops.deepinfer, op).default
    return {
        "deepinfer op": lambda: overload(*args),
        "triton launcher": lambda: getattr(triton_moe, op)(*args),
        "torch.compile(reference)": lambda: compiled(*args),
        "eager reference": lambda: ref(*args),
    }


def bench(ceiling: float) -> list:
    rows = []
    for name, op, args in cases():
        want = getattr(reference, op)(*args)
        skip = near_ties(op, args)
        for impl, fn in impls(op, args).items():
            t0 = time.perf_counter()
            compare_routing(list(fn()), list(want), args[0].dtype, skip)
            us = harness.graph_us(fn)
            gbps = nbytes(op, args) / us / 1e3
            rows.append({"case": name, "impl": impl, "near-tie rows": int(skip.sum()), "matches": "yes",
                         "us": us, "GB/s": gbps, "of copy": gbps / ceiling,
                         "s to check and time": round(time.perf_counter() - t0, 1)})
    return rows


def sweep() -> list:
    """Every (tokens per program, warps) for each case, beside the heuristic's pick."""
    rows = []
    for name, op, args in cases():
        x = args[0]
        groups = args[3] if op == "grouped_topk" else 1
        auto = triton_moe.TritonMoeConfig.for_shape(x.shape[1], groups, x.element_size())
        route = (lambda a: (a[0], a[1], a[2], 1, 1, True, None, 1.0)) if op == "topk_softmax" else \
            (lambda a: (a[0], a[1], a[2], a[3], a[4], a[5] == "softmax", a[6], a[7]))
        want = getattr(reference, op)(*args)
        skip = near_ties(op, args)
        for block_r, warps in itertools.product((1, 2, 4, 8, 16, 32), (1, 2, 4, 8)):
            config = triton_moe.TritonMoeConfig(block_r, warps)
            fn = lambda: triton_moe._route(*route(args), config=config)  # noqa: E731
            try:
                compare_routing(list(fn()), list(want), x.dtype, skip)
                us = harness.graph_us(fn)
            except Exception as e:  # noqa: BLE001  (out of resources: reported)
                us = repr(e)[:60]
            rows.append({"case": name, "tokens/program": block_r, "warps": warps, "us": us,
                         "heuristic": "<-" if config == auto else ""})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--sweep", action="store_true", help="also time the Triton kernel's launch alternatives")
    args = parser.parse_args()
    torch.manual_seed(0)
    start = time.perf_counter()
    ceiling = harness.copy_ceiling_gbps()
    rows = bench(ceiling)
    swept = sweep() if args.sweep else None
    result = {**harness.header(), "copy_ceiling_GBps": ceiling,
              "cuda_key_serves": {op: [k.backend.value for k in dispatch.plan(op)[0]] for op in ("topk_softmax", "grouped_topk")},
              "flashinfer": "not run: fused_topk_deepseek needs a JIT build not in the host's cache",
              "shapes": f"{TOKENS}x{EXPERTS} top-{TOPK}; grouped: {GROUPS} groups, keep {TOPK_GROUP}, sigmoid + bias, x{SCALE}",
              "routing": rows, "sweep": swept}
    if args.out:
        harness.write_json(args.out, result)
    print(f"\n{result['gpu']}  torch {result['versions']['torch']}  copy ceiling {ceiling:.0f} GB/s  "
          f"CUDA key: {result['cuda_key_serves']}\n")
    if swept:
        print(harness.markdown(swept, ["case", "tokens/program", "warps", "us", "heuristic"]))
        print()
    print(harness.markdown(rows, ["case", "impl", "us", "GB/s", "of copy", "matches", "near-tie rows"]))
    print(f"\n{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
