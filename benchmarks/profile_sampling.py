"""Where the sampling family's device time goes, kernel by kernel, on a CUDA GPU:

    python benchmarks/profile_sampling.py [--ops top_k_mask_logits,sampling_from_probs] [--shapes 32x128256,256x32000]

Each op's Triton backend runs 20 times under ``torch.profiler`` at each shape (rows x vocabulary; a
softmax of randn * 3 logits: fp32 probabilities, bf16 logits; top_k = 50, top_p = 0.9, min_p = 0.1, as
the suite) and every kernel's mean device µs a call is printed (launch gaps are not kernels: the sum
can be below the graph-replay time).
"""

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_kernels.families.sampling import triton as sampling  # noqa: E402

CALLS = 20
SHAPES = "1x128256,32x128256,64x128256"
OPS = "top_k_renorm_probs,top_p_renorm_probs,top_k_top_p_sampling_from_probs"


def _calls(rows: int, vocab: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 3
    probs = torch.softmax(logits, dim=-1)
    top_k = torch.full((rows,), 50, dtype=torch.int32, device="cuda")
    top_p = torch.full((rows,), 0.9, device="cuda")
    seed, offset = torch.tensor([1], device="cuda"), torch.tensor([0], device="cuda")
    bf16 = logits.bfloat16()
    return {"top_k_renorm_probs": lambda: sampling.top_k_renorm_probs(probs, top_k),
            "top_p_renorm_probs": lambda: sampling.top_p_renorm_probs(probs, top_p),
            "top_k_top_p_sampling_from_probs":
                lambda: sampling.top_k_top_p_sampling_from_probs(probs, top_k, top_p, seed, offset),
            "top_p_sampling_from_probs":
                lambda: sampling.top_k_top_p_sampling_from_probs(probs, None, top_p, seed, offset, top_k_val=0),
            "top_k_mask_logits": lambda: sampling.top_k_mask_logits(bf16, None, 50),
            "sampling_from_probs": lambda: sampling.sampling_from_probs(probs, seed, offset),
            "sampling_from_logits": lambda: sampling.sampling_from_logits(bf16, seed, offset),
            "min_p_sampling_from_probs": lambda: sampling.min_p_sampling_from_probs(probs, None, 0.1, seed, offset)}


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=OPS)
    parser.add_argument("--shapes", default=SHAPES)
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        rows, vocab = (int(n) for n in shape.split("x"))
        calls = _calls(rows, vocab)
        for name in args.ops.split(","):
            fn = calls[name]
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    fn()
                torch.cuda.synchronize()
            per_kernel = collections.defaultdict(float)
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    per_kernel[event.name] += event.device_time / CALLS
            total = sum(per_kernel.values())
            parts = ", ".join(f"{k[:40]} {v:.1f}" for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1]))
            print(f"{name} {shape}: kernels {total:.1f} µs a call: {parts}", flush=True)


if __name__ == "__main__":
    main()
