"""Launches of the Triton ``qk_rmsnorm_rope`` kernel, on the GPU host, all in one run: where
``TritonQKNormRopeConfig``'s warps, heads a warp and rotation come from.

    python benchmarks/sweep_triton_qk.py --out results/sweep_triton_qk.json

A head's sum of squares must be reduced in rmsnorm's row layout (4 bf16 a lane at head 128, one warp a
head), which caps what one head puts in flight a lane; the variants give a warp several heads (so a lane
several loads) and rotate the rounded pairs in registers rather than loading them again. Each variant is
first checked bit for bit against Triton's rmsnorm then Triton's rotary embedding (bf16/fp16/fp32, neox
and GPT-J, full and partial rotary, 1/33/4096 tokens), then timed by CUDA-graph replay at Qwen3-8B's
shapes (32 + 8 heads of 128, fused qkv views) against a copy measured in the same run. The results and
what they decided: ``docs/design/rope.md``.
"""

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_kernels.bench import harness  # noqa: E402
from torch_kernels.families.norm import triton as tr_norm  # noqa: E402
from torch_kernels.families.rope import ops as rope  # noqa: E402
from torch_kernels.families.rope import triton as tr_rope  # noqa: E402

HQ, HK, HS, MAX_POS = rope.BENCH_SIZES["gpu"]
TOKENS = (1, 32, 256, 1024, 4096, 16384)
#: label -> (warps, heads a warp, one tile a program, pairs rotated in registers); None: the launcher's own
VARIANTS = {
    "default": None,
    "8 warps x 1 head, pairs loaded again": (8, 1, False, False),
    "8 warps x 1 head": (8, 1, False, True),
    "4 warps x 2 heads, pairs loaded again": (4, 2, False, False),
    "2 warps x 4 heads": (2, 4, False, True),
    "4 warps x 4 heads": (4, 4, False, True),
    "2 warps x 4 heads, a tile a program": (2, 4, True, True),
}


def config(variant, tokens: int, args):
    """The launch of ``variant`` for ``args`` (``None``: the launcher's own)."""
    if variant is None:
        return None
    warps, per_warp, one_tile, in_regs = variant
    _, q, k, qw, kw, _, hs, cache, _ = args
    heads = q.shape[-1] // hs + (0 if k is None else k.shape[-1] // hs)
    base = tr_rope.TritonQKNormRopeConfig._pick(
        heads, hs, cache.shape[1] // 2, q.element_size(), qw.element_size(),
        (kw if kw is not None else qw).element_size(), heads if one_tile else
        (-(-tr_rope._MIN_PROGRAMS // tokens) if tokens < tr_rope._MIN_PROGRAMS else 1), warps, per_warp)
    return dataclasses.replace(base, in_regs=in_regs)


def exact(variant) -> str:
    """'' if the variant is its unfused pair bit for bit on every checked case, else the first miss."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for tokens in (1, 33, 4096):
            for rot, neox in ((HS, True), (HS, False), (HS // 2, True)):
                args = rope.make_qk_args(tokens, HQ, HK, HS, rot, neox, "qkv", "cuda", dtype, max_position=MAX_POS)
                base = args[1]._base.clone()
                want_q = base.as_strided(args[1].size(), args[1].stride(), args[1].storage_offset())
                want_k = base.as_strided(args[2].size(), args[2].stride(), args[2].storage_offset())
                rope.unfused(args[0], want_q, want_k, *args[3:], rmsnorm=tr_norm.rmsnorm,
                             rotary=tr_rope.rotary_embedding)
                tr_rope.qk_rmsnorm_rope(*args, config=config(variant, tokens, args))
                if not torch.equal(args[1]._base, base):
                    return f"{dtype} T{tokens} rot{rot} {'neox' if neox else 'gptj'}"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ceiling = harness.copy_ceiling_gbps()
    misses = {label: exact(v) for label, v in VARIANTS.items()}
    print({k: v or "exact" for k, v in misses.items()}, flush=True)
    rows = []
    for tokens in TOKENS:
        a = rope.make_qk_args(tokens, HQ, HK, HS, HS, True, "qkv", "cuda", torch.bfloat16, max_position=MAX_POS)
        nbytes = rope._qk_bench_nbytes(a)
        calls = {label + ("" if not misses[label] else " (not exact)"):
                 (lambda c=config(v, tokens, a): tr_rope.qk_rmsnorm_rope(*a, config=c))
                 for label, v in VARIANTS.items()}
        for fn in calls.values():
            fn()
        rows += harness.bandwidth_rows("qk_rmsnorm_rope", f"{tokens}x({HQ}+{HK})x{HS}", calls, nbytes, ceiling, 3)
    harness.write_bandwidth_rows(args.out, ceiling, rows, ["shape", "impl", "us", "GB/s", "of copy"], exact=misses)


if __name__ == "__main__":
    main()
