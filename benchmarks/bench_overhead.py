"""Where the host time of one eager ``torch.ops.deepinfer.rmsnorm`` call goes, layer by layer
(1x4096 bf16 on CUDA): allocation, the launcher, validation, the slot, the dispatcher, autograd.

    . .gpu-pkgs/setup.sh && python benchmarks/bench_overhead.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_kernels  # noqa: E402,F401
from benchmarks import harness  # noqa: E402
from torch_kernels import dispatch, ops  # noqa: E402
from torch_kernels.impl.triton import norm as triton_norm  # noqa: E402

EPS = 1e-6


def layers() -> list:
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    op = torch.ops.deepinfer.rmsnorm.default
    validate = ops.BY_NAME["rmsnorm"].validate
    slot = dispatch.slot("rmsnorm")
    op(x, w, EPS)  # resolve the slot
    bare = torch.library.Library("deepinfer_bench", "DEF")
    bare.define("rmsnorm(Tensor input, Tensor weight, float eps) -> Tensor")
    bare.impl("rmsnorm", triton_norm.rmsnorm, "CUDA")
    bare_op = torch.ops.deepinfer_bench.rmsnorm.default
    cases = [
        ("torch.empty_like", lambda: torch.empty_like(x)),
        ("validate only", lambda: validate(x, w, EPS)),
        ("triton launcher (direct)", lambda: triton_norm.rmsnorm(x, w, EPS)),
        ("slot.call (selection, no validation)", lambda: slot.call(x, w, EPS)),
        ("bare Library op over the launcher", lambda: bare_op(x, w, EPS)),
        ("torch.ops.deepinfer.rmsnorm", lambda: op(x, w, EPS)),
    ]
    rows = []
    for mode, ctx in (("grad enabled", torch.enable_grad), ("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        with ctx():
            times = harness.host_us_interleaved(dict(cases))
        launcher = times["triton launcher (direct)"]
        rows += [{"case": name, "mode": mode, "host us": us, "over launcher": us - launcher} for name, us in times.items()]
    return rows


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="JSON file for the results")
    rows = layers()
    if parser.parse_args().out:
        harness.write_json(parser.parse_args().out, {**harness.header(), "host_1x4096_bf16": rows})
    print(harness.markdown(rows, ["case", "mode", "host us", "over launcher"]))
