"""How much of the paged KV-cache write's distance to the copy ceiling is its slot pattern, on the GPU host.

    python benchmarks/probe_kv_slots.py --out results/probe_kv_slots.json

``reshape_and_cache_flash`` and ``rotary_embedding_and_cache`` (Triton, TileLang) at Qwen3-8B's 8 kv heads of
128, block size 16, timed by CUDA-graph replay with the suite's slots (a random permutation of twice the
tokens' slots: every token's 2 KB lands in its own random place) and with the slots a prefill gets (the
tokens of a block contiguous, blocks in random order), against a copy measured in the same run.
"""

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_kernels.bench import harness  # noqa: E402
from torch_kernels.families.kv_cache import ops as kv  # noqa: E402

TOKENS = (4096, 16384)


def prefill_slots(slots, block_size: int):
    """The same cache, each block's tokens contiguous, the blocks in random order."""
    tokens = slots.numel()
    blocks = torch.randperm(2 * (-(-tokens // block_size)), device=slots.device)[: -(-tokens // block_size)]
    return (blocks[:, None] * block_size + torch.arange(block_size, device=slots.device)).flatten()[:tokens]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--backends", default="triton,tilelang")
    args = parser.parse_args()
    ceiling = harness.copy_ceiling_gbps()
    mods = {}
    for b in args.backends.split(","):
        try:
            mods[b] = importlib.import_module(f"torch_kernels.families.kv_cache.{b}")
        except Exception as e:  # noqa: BLE001  (reported)
            print(f"{b}: not importable: {e}")
    rows = []
    for tokens in TOKENS:
        for op, make, nbytes_of, slot_at in (
                ("reshape_and_cache_flash", kv._bench_args, kv._bench_nbytes, 4),
                ("rotary_embedding_and_cache", kv._rope_bench_args, kv._rope_bench_nbytes, 9)):
            a = make(tokens, None, "gpu", "cuda", torch.bfloat16)
            block_size = a[slot_at - 2].shape[1]
            b = a[:slot_at] + (prefill_slots(a[slot_at], block_size),) + a[slot_at + 1:]
            calls = {}
            for name, m in mods.items():
                fn = getattr(m, op)
                calls[f"{name}, random slots"] = lambda fn=fn, a=a: fn(*a)
                calls[f"{name}, prefill slots"] = lambda fn=fn, b=b: fn(*b)
            if "triton" in mods:
                cfg = mods["triton"].TritonCacheConfig if op == "reshape_and_cache_flash" else \
                    mods["triton"].TritonRopeCacheConfig
                fn = getattr(mods["triton"], op)
                for bh, warps in ((8, 2), (8, 8), (4, 2), (16, 4), (16, 8), (2, 1)):
                    calls[f"triton {bh} heads {warps} warps"] = lambda fn=fn, a=a, c=cfg(bh, warps): fn(*a, config=c)
            k, v = a[:2] if op == "reshape_and_cache_flash" else a[2:4]
            kd, vd = torch.empty(k.shape, dtype=k.dtype, device=k.device), torch.empty(v.shape, dtype=v.dtype,
                                                                                       device=v.device)
            calls["copy of key and value (torch)"] = lambda k=k, v=v, kd=kd, vd=vd: (kd.copy_(k), vd.copy_(v))
            for fn in calls.values():
                fn()
            rows += harness.bandwidth_rows(op, f"{tokens} tokens", calls, nbytes_of(a), ceiling, 3)
    harness.write_bandwidth_rows(args.out, ceiling, rows, ["op", "shape", "impl", "us", "GB/s", "of copy"])


if __name__ == "__main__":
    main()
