"""Launch-parameter sweeps of TileLang kernels on the GPU host, beside the Triton backend and
FlashInfer's API in the same run: where the constants of ``impl/tilelang/norm.py``
(``_ELEMENTS_PER_THREAD``, ``_THIRTY_TWO_A_THREAD``, ``_BLOCK_THREADS``), ``impl/tilelang/attention.py``
(``_PER_THREAD``, ``_THREADS``) and ``impl/tilelang/rope.py`` (``_BLOCK_THREADS``) come from, and the
GELUs of ``impl/tilelang/activation.py`` against the Triton backend's.

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
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import cases, harness  # noqa: E402
from torch_kernels.impl.tilelang import _jit, activation as tl_act, attention as tl_merge, norm as tl_norm  # noqa: E402
from torch_kernels.impl.tilelang import rope as tl_rope  # noqa: E402
from torch_kernels.impl.torch import activation as ref_act, attention as ref_merge, norm as ref_norm  # noqa: E402
from torch_kernels.impl.torch import rope as ref_rope  # noqa: E402
from torch_kernels.impl.triton import activation as tr_act, attention as tr_merge, norm as tr_norm  # noqa: E402
from torch_kernels.impl.triton import rope as tr_rope  # noqa: E402

NORM_SHAPES = ((1, 4096), (1, 8192), (32, 8192), (16384, 8192), (16384, 7168), (4096, 4096))
# label -> the module constants it patches. The sweep of 2026-11-29 (elements a thread 8/16/32 x block
# threads 128/512/1024 at 16384x8192, 16384x7168, 4096x4096, 8192x4096) set _THIRTY_TWO_A_THREAD; this
# one times the weight prefetch against the same layouts without it.
NORM_VARIANTS = {"tilelang": {}, "tilelang, no weight prefetch": {"_PREFETCH_WEIGHT": False}}
MERGE_TOKENS = (4096, 8192, 16384)
MERGE_VARIANTS = tuple(itertools.product((4, 8, 16), (128, 256, 512)))  # (values a thread, block threads)
ROPE_TOKENS = (4096, 16384)
ROPE_VARIANTS = (64, 128, 256, 512)  # block threads
ACT_SHAPES = ((16384, 8192), (4096, 4096), (8192, 14336))  # (tokens, d)


def _row(op: str, shape: str, label: str, nbytes: int, us: float, ceiling: float) -> dict:
    row = {"op": op, "shape": shape, "impl": label, "us": us, "GB/s": nbytes / us / 1e3, "of copy": nbytes / us / 1e3 / ceiling}
    print(row, flush=True)
    return row


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

    keys = {(n, fused, label) for (_, n), fused, label in itertools.product(NORM_SHAPES, (False, True), NORM_VARIANTS)}
    prims = {k: _patched(tl_norm, NORM_VARIANTS[k[2]], tl_norm._build, k[0], "bfloat16", "bfloat16", k[1], False)
             for k in keys}
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
        impls = {label: fns[(n, fused, label)] for label in NORM_VARIANTS}
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
            rows.append(_row(op, f"{tokens}x{n}", label, nbytes, harness.replay_us(call), ceiling))
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
            rows.append(_row("merge_attn_states", f"{tokens}x{heads}x{head_size}", label, nbytes, harness.replay_us(call), ceiling))
    return rows


def rope_rows(ceiling: float) -> list:
    key = (32, 8, 128, 128, True, "bfloat16", "float32", "int64", 2, True)  # cases' rope shape, aligned
    prims = {bt: _patched(tl_rope, {"_BLOCK_THREADS": bt}, tl_rope._build, *key) for bt in ROPE_VARIANTS}
    fns = _compile_all(prims)
    rows = []
    for tokens in ROPE_TOKENS:
        args = cases.build("rotary_embedding", tokens, None, cases.PROFILES["gpu"], "cuda", torch.bfloat16)
        positions, q, k, hs, cache, neox = args
        want_q, want_k = q.clone(), k.clone()
        ref_rope.rotary_embedding(positions, want_q, want_k, hs, cache, neox)
        nbytes = cases.nbytes("rotary_embedding", args)
        peer = cases.flashinfer_api("rotary_embedding", args)
        impls = {f"tilelang block {bt}": (lambda fn: lambda p, q_, k_: fn(p, q_, k_, cache))(fns[bt]) for bt in ROPE_VARIANTS}
        impls["triton backend"] = lambda p, q_, k_: tr_rope.rotary_embedding(p, q_, k_, hs, cache, neox)
        impls["flashinfer api"] = lambda p, q_, k_: peer.fn(p, q_, k_, hs, cache, neox)
        for label, fn in impls.items():
            qq, kk = q.clone(), k.clone()
            fn(positions, qq, kk)
            torch.testing.assert_close(qq, want_q, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(kk, want_k, atol=2e-2, rtol=2e-2)
            rows.append(_row("rotary_embedding", f"{tokens}x(32+8)x128", label, nbytes,
                             harness.replay_us(lambda: fn(positions, qq, kk)), ceiling))
    return rows


def act_rows(ceiling: float) -> list:
    import flashinfer.activation

    prims = {(d, act): tl_act._build(d, "bfloat16", act) for (_, d) in ACT_SHAPES for act in ("gelu", "gelu_tanh")}
    fns = _compile_all(prims)
    rows = []
    for (tokens, d), act in itertools.product(ACT_SHAPES, ("gelu", "gelu_tanh")):
        x = torch.randn(tokens, 2 * d, device="cuda", dtype=torch.bfloat16) * 2
        want = ref_act.gelu_and_mul(x, "none" if act == "gelu" else "tanh")
        nbytes = x.numel() * 2 * 3 // 2
        out = torch.empty(tokens, d, device="cuda", dtype=torch.bfloat16)
        fi = flashinfer.activation.gelu_and_mul if act == "gelu" else flashinfer.activation.gelu_tanh_and_mul
        impls = {"tilelang": lambda: (fns[(d, act)](x, out), out)[1],
                 "triton backend": lambda: tr_act.act_and_mul(x, act),
                 "flashinfer api": lambda: fi(x)}
        for label, fn in impls.items():
            torch.testing.assert_close(fn(), want, atol=2e-2, rtol=2e-2)
            rows.append(_row(f"{act}_and_mul", f"{tokens}x2*{d}", label, nbytes, harness.replay_us(fn), ceiling))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--only", default="norm,merge,rope,act", help="comma list of norm, merge, rope, act")
    args = parser.parse_args()
    torch.manual_seed(0)
    ceiling = harness.copy_ceiling_gbps()
    rows = []
    for name, sweep in (("merge", merge_rows), ("norm", norm_rows), ("rope", rope_rows), ("act", act_rows)):
        if name in args.only.split(","):
            try:
                rows += sweep(ceiling)
            except Exception:  # noqa: BLE001  (the other sweeps still run; the traceback is the result)
                traceback.print_exc()
                rows.append({"op": name, "status": "failed: see the log"})
    if args.out:
        harness.write_json(args.out, {**harness.header(), "copy GB/s": ceiling, "rows": rows})
    print(f"\ncopy ceiling {ceiling:.0f} GB/s\n")
    print(harness.markdown(rows, ["op", "shape", "impl", "us", "GB/s", "of copy", "status"]))


if __name__ == "__main__":
    main()
