"""Where the sampling family's device time goes, kernel by kernel, on a CUDA GPU:

    python benchmarks/profile_sampling.py

For each op at 1, 32 and 64 rows of 128256 (fp32 softmax of randn * 3, top_k = 50, top_p = 0.9, as
bench_sampling.py) the Triton backend runs 20 times under ``torch.profiler`` and every kernel's mean
device µs a call is printed (launch gaps are not kernels: the sum can be below the graph-replay time).
"""

import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_kernels.families.sampling import triton as sampling  # noqa: E402

CALLS = 20


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    for rows in (1, 32, 64):
        g = torch.Generator(device="cuda").manual_seed(rows)
        probs = torch.softmax(torch.randn(rows, 128256, device="cuda", generator=g) * 3, dim=-1)
        top_k = torch.full((rows,), 50, dtype=torch.int32, device="cuda")
        top_p = torch.full((rows,), 0.9, device="cuda")
        seed, offset = torch.tensor([1], device="cuda"), torch.tensor([0], device="cuda")
        calls = {"top_k_renorm_probs": lambda: sampling.top_k_renorm_probs(probs, top_k),
                 "top_p_renorm_probs": lambda: sampling.top_p_renorm_probs(probs, top_p),
                 "sampling": lambda: sampling.top_k_top_p_sampling_from_probs(probs, top_k, top_p, seed, offset)}
        for name, fn in calls.items():
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
            print(f"{name} {rows} rows: kernels {total:.1f} µs a call: {parts}", flush=True)


if __name__ == "__main__":
    main()
