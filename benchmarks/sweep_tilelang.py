"""Launch-parameter sweeps of the TileLang norm and merge kernels on the GPU host, beside the Triton
backend and FlashInfer's API in the same run: where the constants of ``impl/tilelang/norm.py``
(``_ELEMENTS_PER_THREAD``, ``_THIRTY_TWO_A_THREAD``, ``_BLOCK_THREADS``) and ``impl/tilelang/attention.py`` (``_PER_THREAD``,
``_THREADS``) come from.

    . .gpu-pkgs/setup.sh && python benchmarks/sweep_tilelang.py --out sweep.json

Each variant is built with the module's constants patched, compiled (nvcc in parallel threads), checked
against the reference on random bf16 inputs, then timed by CUDA-graph replay; GB/s = bytes read +
written over device time, against a device-to-device copy measured in the same run.
"""

import argparse
import concurrent.futures
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import cases, harness  # noqa: E402
from torch_kernels.impl.tilelang import _jit, attention as tl_merge, norm as tl_norm  # noqa: E402
from torch_kernels.impl.torch import attention as ref_merge, norm as ref_norm  # noqa: E402
from torch_kernels.impl.triton import attention as tr_merge, norm as tr_norm  # noqa: E402

NORM_SHAPES = ((16384, 8192), (16384, 7168), (4096, 4096), (8192, 4096))
NORM_VARIANTS = tuple(itertools.product((8, 16, 32), (128, 512, 1024)))  # (elements a thread, block threads)
MERGE_TOKENS = (4096, 8192, 16384)
MERGE_VARIANTS = tuple(itertools.product((4, 8, 16), (128, 256, 512)))  # (values a thread, block threads)


def _patched(module, values: dict, build, *key):
    old = {k: getattr(module, k) for k in values}
    try:
        for k, v in values.items():
            setattr(module, k, v)
        return build(*key)
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def _compile_all(funcs: dict) -> dict:
    import tilelang

    def one(item):
        name, prim = item
        try:
            return name, _jit.entry(tilelang.compile(prim, target="cuda", execution_backend=_jit.EXECUTION_BACKEND))
        except Exception as e:  # noqa: BLE001  (reported as the variant's result)
            return name, f"{type(e).__name__}: {e}"[:160]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        return dict(pool.map(one, funcs.items()))


def norm_rows(ceiling: float) -> list:
    import flashinfer.norm

    keys = {(n, fused, ept, bt) for (_, n), fused, (ept, bt) in itertools.product(NORM_SHAPES, (False, True), NORM_VARIANTS)}
    prims = {k: _patched(tl_norm, {"_ELEMENTS_PER_THREAD": k[2], "_BLOCK_THREADS": k[3], "_THIRTY_TWO_A_THREAD": set()}, tl_norm._build,
                         k[0], "bfloat16", "bfloat16", k[1], False) for k in keys}
    fns = _compile_all(prims)
    rows = []
    for (tokens, n), fused in itertools.product(NORM_SHAPES, (False, True)):
        g = torch.Generator(device="cuda").manual_seed(tokens + n)
        x = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16, generator=g)
        r = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
        nbytes = x.numel() * 2 * (4 if fused else 2)
        op = "fused_add_rmsnorm" if fused else "rmsnorm"
        if fused:
            want_x, want_r = x.clone(), r.clone()
            ref_norm.fused_add_rmsnorm(want_x, want_r, w, cases.EPS)
        else:
            want = ref_norm.rmsnorm(x, w, cases.EPS)
        impls = {f"tilelang {ept}/thread, block {bt}": fns[(n, fused, ept, bt)] for ept, bt in NORM_VARIANTS}
        impls["triton backend"] = "triton"
        impls["flashinfer api"] = "flashinfer"
        for label, fn in impls.items():
            if isinstance(fn, str) and fn not in ("triton", "flashinfer"):
                rows.append({"op": op, "shape": f"{tokens}x{n}", "impl": label, "status": fn})
                continue
            xx, rr = x.clone(), r.clone()
            out = torch.empty_like(x)
            if fused:
                call = {"triton": lambda: tr_norm.fused_add_rmsnorm(xx, rr, w, cases.EPS),
                        "flashinfer": lambda: flashinfer.norm.fused_add_rmsnorm(xx, rr, w, cases.EPS)}.get(
                            fn, lambda fn=fn: fn(xx, rr, w, cases.EPS))
                call()
                torch.testing.assert_close(xx, want_x, atol=2e-2, rtol=2e-2)
                torch.testing.assert_close(rr, want_r, atol=2e-2, rtol=2e-2)
            else:
                call = {"triton": lambda: tr_norm.rmsnorm(xx, w, cases.EPS),
                        "flashinfer": lambda: flashinfer.norm.rmsnorm(xx, w, cases.EPS)}.get(
                            fn, lambda fn=fn: fn(xx, w, out, cases.EPS))
                got = call()
                torch.testing.assert_close(out if got is None else got, want, atol=2e-2, rtol=2e-2)
            us = harness.replay_us(call)
            rows.append({"op": op, "shape": f"{tokens}x{n}", "impl": label, "us": us,
                         "GB/s": nbytes / us / 1e3, "of copy": nbytes / us / 1e3 / ceiling})
            print(rows[-1], flush=True)
    return rows


def merge_rows(ceiling: float) -> list:
    heads, head_size = 32, 128
    prims = {(e, t): _patched(tl_merge, {"_PER_THREAD": e, "_THREADS": t}, tl_merge._build,
                              heads, head_size, "bfloat16", True) for e, t in MERGE_VARIANTS}
    fns = _compile_all(prims)
    rows = []
    for tokens in MERGE_TOKENS:
        args = cases.merge_inputs(tokens, heads, head_size, "cuda")
        want = ref_merge.merge_attn_states(*args)
        nbytes = cases.nbytes("merge_attn_states", args)
        peer = cases.flashinfer_api("merge_attn_states", args)
        impls = {f"tilelang {e}/thread, block {t}": fns[(e, t)] for e, t in MERGE_VARIANTS}
        impls["triton backend"] = lambda: tr_merge.merge_attn_states(*args)
        peer_args = peer.prepare(args) if peer.prepare else args
        impls["flashinfer api"] = lambda: peer.fn(*peer_args)
        for label, fn in impls.items():
            if isinstance(fn, str):
                rows.append({"op": "merge_attn_states", "shape": f"{tokens}x{heads}x{head_size}", "impl": label, "status": fn})
                continue
            if label.startswith("tilelang"):
                out, out_lse = torch.empty_like(args[0]), torch.empty_like(args[1])
                call = (lambda fn=fn, out=out, out_lse=out_lse: fn(*args, out, out_lse))
                call()
                got = [out, out_lse]
            else:
                call = fn
                got = list(call())
                if label == "flashinfer api":
                    got = peer.adapt(got)
            torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=1e-3)
            us = harness.replay_us(call)
            rows.append({"op": "merge_attn_states", "shape": f"{tokens}x{heads}x{head_size}", "impl": label, "us": us,
                         "GB/s": nbytes / us / 1e3, "of copy": nbytes / us / 1e3 / ceiling})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--only", default="norm,merge", help="norm, merge or both")
    args = parser.parse_args()
    torch.manual_seed(0)
    ceiling = harness.copy_ceiling_gbps()
    rows = []
    if "merge" in args.only:
        rows += merge_rows(ceiling)
    if "norm" in args.only:
        rows += norm_rows(ceiling)
    if args.out:
        harness.write_json(args.out, {**harness.header(), "copy GB/s": ceiling, "rows": rows})
    print(f"\ncopy ceiling {ceiling:.0f} GB/s\n")
    print(harness.markdown(rows, ["op", "shape", "impl", "us", "GB/s", "of copy", "status"]))


if __name__ == "__main__":
    main()
