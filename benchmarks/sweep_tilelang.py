"""Launch-parameter sweeps of TileLang kernels on a CUDA GPU, beside the Triton backend and
FlashInfer's API in the same run: where the launch configurations of ``families/norm/tilelang.py``
(``NormConfig``), ``families/attention/tilelang.py`` (``MergeConfig``), ``families/rope/tilelang.py``
(``RopeConfig``), ``families/activation/tilelang.py`` (``ActivationConfig``) and their early trigger
(``_jit.LaunchConfig``) come from, and of the FP8 row kernels' tilings (``backends/tilelang_fp8.py``:
``--only fp8norm,fp8rms,fp8rows``); ``--only tanh`` measures the error of the activations' tanh.approx form.

    python benchmarks/sweep_tilelang.py --out results/sweep.json

Each variant is the launcher's configuration (``for_shape``) with some fields replaced, compiled (nvcc
in parallel threads), checked against the reference on random bf16 inputs, then timed by CUDA-graph
replay, every implementation of a shape in 5 interleaved rounds (the median kept); GB/s = bytes read +
written over device time, against a device-to-device copy measured in the same run. What the sweeps
decided, and the variants tried before these: ``docs/design/<family>.md`` and
``docs/design/tilelang.md``.
"""

import argparse
import concurrent.futures
import dataclasses
import itertools
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import cases, harness  # noqa: E402
from torch_kernels.testing import TOLERANCES  # noqa: E402
from torch_kernels.backends import tilelang_jit as _jit  # noqa: E402
from torch_kernels.families.activation import tilelang as tl_act  # noqa: E402
from torch_kernels.families.attention import tilelang as tl_merge  # noqa: E402
from torch_kernels.families.norm import tilelang as tl_norm  # noqa: E402
from torch_kernels.families.rope import tilelang as tl_rope  # noqa: E402
from torch_kernels.families.activation import reference as ref_act  # noqa: E402
from torch_kernels.families.attention import reference as ref_merge  # noqa: E402
from torch_kernels.families.norm import reference as ref_norm  # noqa: E402
from torch_kernels.families.rope import reference as ref_rope  # noqa: E402
from torch_kernels.families.activation import triton as tr_act  # noqa: E402
from torch_kernels.families.attention import triton as tr_merge  # noqa: E402
from torch_kernels.families.attention.ops import merge_inputs  # noqa: E402
from torch_kernels.families.norm import triton as tr_norm  # noqa: E402
from torch_kernels.families.norm.ops import BENCH_EPS as EPS  # noqa: E402
from torch_kernels.families.rope import triton as tr_rope  # noqa: E402

ROUNDS = 5  # interleaved timing rounds, the median kept
NORM_SHAPES = tuple((t, n) for n in (4096, 8192) for t in (1, 128, 512, 1024, 4096))
NORM_OPS = ("rmsnorm", "fused_add_rmsnorm")
# label -> the config fields it replaces ("streamed": the many-token kernel, norm._build_streamed); the
# early trigger's variants (docs/design/tilelang.md).
NORM_VARIANTS = {"tilelang, one pass": {}, "tilelang, no early trigger": {"early_trigger": False},
                 "tilelang, always early trigger": {"no_trigger_bytes": (0, 0)}}
MERGE_TOKENS = (1, 256, 512, 4096)
MERGE_VARIANTS = {"tilelang": {}, "tilelang, no early trigger": {"early_trigger": False},  # label -> config fields
                  "tilelang, always early trigger": {"no_trigger_bytes": (0, 0)}}
ROPE_TOKENS = (1, 256, 512, 4096)
ROPE_VARIANTS = {"tilelang": {}, "tilelang, no early trigger": {"early_trigger": False},
                 "tilelang, always early trigger": {"no_trigger_bytes": (0, 0)}}
FP8_NORM_SHAPES = ((4096, 4096), (4096, 7168), (16384, 7168), (16384, 8192))  # (tokens, hidden)
# label -> the config fields of fused_add_rmsnorm(_fp8_quant)'s kernels it replaces ("streamed": the
# many-token kernel at every token count, False: the one-pass kernel); docs/design/fp8.md.
FP8_NORM_VARIANTS = {"tilelang": {}, "tilelang, no min blocks": {"epilogue_min_blocks": 1},
                     "tilelang, one pass": {"streamed": False}, "tilelang, streamed": {"streamed": True},
                     "tilelang, streamed 448 threads": {"streamed": True, "streamed_threads": 448}}
# rmsnorm_fp8_quant beside rmsnorm under the same NormConfig (they share it: the fused op must return the
# unfused pair's bits), label -> the fields it replaces ("streamed": that kernel at every token count).
FP8_RMS_SHAPES = ((4096, 4096), (16384, 4096), (4096, 7168), (16384, 7168), (4096, 8192))
FP8_RMS_VARIANTS = {"tilelang": {}, "tilelang, one pass": {"streamed": False}, "tilelang, streamed": {"streamed": True},
                    "tilelang, streamed 512 threads": {"streamed": True, "streamed_threads": 512},
                    "tilelang, 8 a thread": {"elements_per_thread": 8},
                    "tilelang, 32 a thread": {"elements_per_thread": 32},
                    "tilelang, no early trigger": {"early_trigger": False}}
# silu_and_mul_fp8_quant and scaled_fp8_quant per token: label -> the tiling of tilelang_fp8.plan (a power
# of two of threads, or whole warps of ``vectors`` up to ``warp_lanes`` threads); a label whose tiling is
# another's at a width is timed once.
FP8_ROW_SHAPES = tuple((t, d) for d in (4096, 5120, 7168, 8192, 14336, 18432) for t in (1, 32, 512, 4096, 16384))
FP8_ROW_VARIANTS = {"tilelang, power of two": {"warp_lanes": 0}, "tilelang, warps of 2": {"warp_lanes": 1024},
                    "tilelang, warps of 1": {"warp_lanes": 1024, "vectors": 1},
                    "tilelang, warps of 4": {"warp_lanes": 1024, "vectors": 4}}
ACT_SHAPES = tuple((t, d) for d in (4096, 7168, 8192) for t in (1, 32, 512, 1024, 2048, 4096, 16384))  # (tokens, d)
ACT_KINDS = ("silu", "gelu_tanh")
# label -> config fields (else the launcher's, ActivationConfig.for_shape): the tanh forms, blocks and
# outputs a thread of docs/design/activation.md.
ACT_VARIANTS = {"tilelang": {}, "tilelang, sigmoid form": {"tanh_approx": False},
                "tilelang, tanh.approx": {"tanh_approx": True},
                "tilelang, 1024 threads": {"threads": 1024}, "tilelang, 16 a thread": {"per_thread": 16},
                "tilelang, no early trigger": {"early_trigger": False}}
# The middle sizes (chunked prefill, batched decode), L2 warm or cold (--cold-l2): the grids and tiles tried there.
MID_ACT_SHAPES = tuple((t, d) for d in (4096, 7168, 8192, 14336, 18432) for t in (128, 256, 512, 1024, 2048))
MID_ACT_KINDS = ("silu", "gelu_tanh", "gelu")
MID_ACT_VARIANTS = {"tilelang": {}, "tilelang, end trigger": {"early_trigger": False, "trigger_at_end": True},
                    "tilelang, row loop, 256 threads": {"row_loop": True, "threads": 256},
                    "tilelang, row loop, 256 threads, no trigger": {"row_loop": True, "threads": 256, "early_trigger": False},
                    "tilelang, row loop, 256 threads, end trigger": {"row_loop": True, "threads": 256, "early_trigger": False,
                                                                      "trigger_at_end": True},
                    "tilelang, row loop, 128 threads, end trigger": {"row_loop": True, "threads": 128, "early_trigger": False,
                                                                      "trigger_at_end": True},
                    "tilelang, row loop, 512 threads, end trigger": {"row_loop": True, "threads": 512, "early_trigger": False,
                                                                      "trigger_at_end": True}}


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

    keys = set(itertools.product({n for _, n in NORM_SHAPES}, NORM_OPS, NORM_VARIANTS))

    def prim(n, op, label):
        fields = {k: v for k, v in NORM_VARIANTS[label].items() if k != "streamed"}
        config = dataclasses.replace(tl_norm.NormConfig.for_shape(n, "bfloat16", "fused" in op), **fields)
        return tl_norm._build(n, "bfloat16", "bfloat16", "fused" in op, op.startswith("gemma"),
                              NORM_VARIANTS[label].get("streamed", False), config=config)
    prims = {(n, op, label): prim(n, op, label) for n, op, label in keys}
    fns = _compile_all(prims)
    rows = []
    for (tokens, n), op in itertools.product(NORM_SHAPES, NORM_OPS):
        fused = "fused" in op
        args = cases.build(op, tokens, n, cases.PROFILES["gpu"], "cuda", torch.bfloat16)
        x, r, w = args[:3] if fused else (args[0], args[0], args[1])  # r: read by the fused ops only
        nbytes = cases.nbytes(op, args)
        if fused:
            want_x, want_r = x.clone(), r.clone()
            getattr(ref_norm, op)(want_x, want_r, w, EPS)
        else:
            want = getattr(ref_norm, op)(x, w, EPS)
        impls = {label: fns[(n, op, label)] for label in NORM_VARIANTS}
        impls["triton backend"] = getattr(tr_norm, op)
        impls["flashinfer api"] = getattr(flashinfer.norm, op)
        calls = {}
        for label, fn in impls.items():
            if isinstance(fn, str):
                rows.append({"op": op, "shape": f"{tokens}x{n}", "impl": label, "status": fn})
                continue
            xx, rr = x.clone(), r.clone()
            out = torch.empty_like(x)
            kernel = label.startswith("tilelang")  # a compiled host function: outputs are arguments
            if fused:
                call = lambda fn=fn: fn(xx, rr, w, EPS)  # noqa: E731
                call()
                torch.testing.assert_close(xx, want_x, atol=2e-2, rtol=2e-2)
                torch.testing.assert_close(rr, want_r, atol=2e-2, rtol=2e-2)
            else:
                call = (lambda fn=fn: fn(xx, w, out, EPS)) if kernel else (lambda fn=fn: fn(xx, w, EPS))
                got = call()
                torch.testing.assert_close(out if kernel else got, want, atol=2e-2, rtol=2e-2)
            calls[label] = call
        rows += harness.bandwidth_rows(op, f"{tokens}x{n}", calls, nbytes, ceiling, ROUNDS)
    return rows


def _fp8_norm_sweep(ceiling: float, fused: bool, shapes, variants: dict) -> list:
    """The norm (``fused_add_rmsnorm`` with ``fused``, else ``rmsnorm``) and its FP8 op (static and
    per-token scales) under each of ``variants`` (label -> the NormConfig fields it replaces;
    ``"streamed"``: that kernel at every token count), the FP8 op checked bit for bit against the
    variant's own norm followed by TileLang's scaled_fp8_quant (they share a config: the fused op must
    return the unfused pair's bits); FlashInfer's static-scale op beside them."""
    import flashinfer.norm

    from torch_kernels.backends import tilelang_fp8 as tl_fp8
    from torch_kernels.families.quant import tilelang as tl_quant

    plain = "fused_add_rmsnorm" if fused else "rmsnorm"
    epilogues = {plain: None, "static": tl_fp8.Epilogue("static"), "token": tl_fp8.Epilogue("token")}

    def prim(tokens, n, mode, label):
        fields = {k: v for k, v in variants[label].items() if k != "streamed"}
        conf = dataclasses.replace(tl_norm.NormConfig.for_shape(n, "bfloat16", fused), **fields)
        streamed = variants[label].get("streamed", tokens >= conf.streamed_from)
        streamed = streamed and tl_norm._streams(n, "bfloat16", "bfloat16", conf)
        return tl_norm._build(n, "bfloat16", "bfloat16", fused, False, streamed, epilogues[mode], config=conf)
    keys = {(tokens, n, mode, label) for tokens, n in shapes for mode in epilogues for label in variants}
    fns = _compile_all({key: prim(*key) for key in keys})

    rows = []
    for (tokens, n), mode in itertools.product(shapes, epilogues):
        op = plain if mode == plain else f"{plain}_fp8_quant ({mode})"
        x = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        w = 1 + 0.1 * torch.randn(n, device="cuda", dtype=torch.bfloat16)
        scale = torch.tensor([0.02], device="cuda") if mode == "static" else None
        io = (3 if fused else 1) * 2 + (2 if mode == plain else 1)  # bytes an element: read, residual, output
        nbytes = tokens * n * io + (tokens * 4 if mode == "token" else 0) + n * 2
        ref_y, ref_r = x.clone(), r.clone()  # the reference's norm (and residual), once a shape
        if fused:
            ref_norm.fused_add_rmsnorm(ref_y, ref_r, w, EPS)
        else:
            ref_y = ref_norm.rmsnorm(x, w, EPS)
        calls = {}
        for label in variants:
            fn, norm = fns[(tokens, n, mode, label)], fns[(tokens, n, plain, label)]
            if isinstance(fn, str) or isinstance(norm, str):
                rows.append({"op": op, "shape": f"{tokens}x{n}", "impl": label, "status": fn if isinstance(fn, str) else norm})
                continue
            y, want_r = (x.clone(), r.clone()) if fused else (torch.empty_like(x), None)
            if fused:
                norm(y, want_r, w, EPS)
                torch.testing.assert_close(want_r, ref_r, atol=2e-2, rtol=2e-2)
            else:
                norm(x, w, y, EPS)
            torch.testing.assert_close(y, ref_y, atol=2e-2, rtol=2e-2)
            if mode == plain:
                if fused:
                    xx, rr = x.clone(), r.clone()
                    calls[label] = lambda fn=fn, xx=xx, rr=rr: fn(xx, rr, w, EPS)  # noqa: E731
                else:
                    out = torch.empty_like(x)
                    calls[label] = lambda fn=fn, out=out: fn(x, w, out, EPS)  # noqa: E731
                continue
            want_q, want_s = tl_quant.scaled_fp8_quant(y, scale, scale is None)
            q = torch.empty(tokens, n, device="cuda", dtype=torch.float8_e4m3fn)
            s = torch.empty(1 if scale is not None else tokens, device="cuda")
            extra = (scale,) if scale is not None else ()
            rr = r.clone()
            call = ((lambda fn=fn, q=q, s=s, rr=rr, extra=extra: fn(x, rr, w, q, s, *extra, EPS)) if fused else  # noqa: E731
                    (lambda fn=fn, q=q, s=s, extra=extra: fn(x, w, q, s, *extra, EPS)))  # noqa: E731
            call()
            same = torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s.view(-1))
            if not same or (fused and not torch.equal(rr, want_r)):
                rows.append({"op": op, "shape": f"{tokens}x{n}", "impl": label, "status": "differs from the unfused pair"})
                continue
            calls[label] = call
        if mode == "static":
            q = torch.empty(tokens, n, device="cuda", dtype=torch.float8_e4m3fn)
            if fused:
                rr = r.clone()
                calls["flashinfer api"] = lambda rr=rr, q=q: flashinfer.norm.fused_add_rmsnorm_quant(q, x, rr, w, scale, EPS)
            else:
                calls["flashinfer api"] = lambda q=q: flashinfer.norm.rmsnorm_quant(q, x, w, scale, EPS)
        rows += harness.bandwidth_rows(op, f"{tokens}x{n}", calls, nbytes, ceiling, ROUNDS)
    return rows


def fp8_norm_rows(ceiling: float) -> list:
    return _fp8_norm_sweep(ceiling, True, FP8_NORM_SHAPES, FP8_NORM_VARIANTS)


def fp8_rms_rows(ceiling: float) -> list:
    return _fp8_norm_sweep(ceiling, False, FP8_RMS_SHAPES, FP8_RMS_VARIANTS)


def fp8_row_rows(ceiling: float) -> list:
    """silu_and_mul_fp8_quant and scaled_fp8_quant per token under each of FP8_ROW_VARIANTS, checked bit
    for bit against TileLang's silu_and_mul followed by its scaled_fp8_quant (its shipped plan)."""
    from torch_kernels.backends import tilelang_fp8 as tl_fp8
    from torch_kernels.families.quant import tilelang as tl_quant

    token = tl_fp8.Epilogue("token")

    def config(op, label):
        fields = dict(FP8_ROW_VARIANTS[label])
        if op == "silu":
            return tl_act.ActivationQuantConfig(token_vectors=fields.pop("vectors", 2), **fields)
        return tl_quant.ScaledConfig(**fields)

    def prim(d, op, label):
        if op == "silu":
            return tl_act._build_quant(d, "bfloat16", token, config(op, label))
        return tl_quant._build_scaled(d, "bfloat16", token, config(op, label))
    keys = {(d, op, label) for d in {d for _, d in FP8_ROW_SHAPES} for op in ("silu", "scaled") for label in FP8_ROW_VARIANTS}
    plans = {key: config(key[1], key[2]).plan(key[0], "bfloat16", token) if key[1] == "silu"
             else tl_quant._scaled_plan(key[0], "bfloat16", token, config(key[1], key[2])) for key in keys}
    # a variant whose plan is another's compiles once, under the first label
    first = {}
    for key in sorted(keys):
        first.setdefault((key[0], key[1], plans[key]), key)
    fns = _compile_all({key: prim(*key) for key in set(first.values())})

    rows = []
    for (tokens, d), op in itertools.product(FP8_ROW_SHAPES, ("silu", "scaled")):
        name = "silu_and_mul_fp8_quant (token)" if op == "silu" else "scaled_fp8_quant (token)"
        cols = 2 * d if op == "silu" else d
        x = torch.randn(tokens, cols, device="cuda", dtype=torch.bfloat16)
        y = tl_act.silu_and_mul(x) if op == "silu" else x
        want_q, want_s = tl_quant.scaled_fp8_quant(y, None, True)
        nbytes = tokens * (cols * 2 + d + 4)
        calls, seen = {}, set()
        for label in FP8_ROW_VARIANTS:
            key = first[(d, op, plans[(d, op, label)])]
            tile = plans[key].tile
            impl = f"{label} ({tile.lanes}x{tile.nv})"
            if key in seen:
                continue
            seen.add(key)
            fn = fns[key]
            if isinstance(fn, str):
                rows.append({"op": name, "shape": f"{tokens}x{d}", "impl": impl, "status": fn})
                continue
            q = torch.empty(tokens, d, device="cuda", dtype=torch.float8_e4m3fn)
            s = torch.empty(tokens, device="cuda")
            call = lambda fn=fn, q=q, s=s: fn(x, q, s)  # noqa: E731
            call()
            if not (torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s.view(-1))):
                rows.append({"op": name, "shape": f"{tokens}x{d}", "impl": impl, "status": "differs from the unfused pair"})
                continue
            calls[impl] = call
        rows += harness.bandwidth_rows(name, f"{tokens}x{d}", calls, nbytes, ceiling, ROUNDS)
    return rows


def merge_rows(ceiling: float) -> list:
    heads, head_size = 32, 128
    key = (heads, head_size, "bfloat16", True)
    prims = {label: tl_merge._build(*key, config=dataclasses.replace(tl_merge.MergeConfig.for_shape(*key), **fields))
             for label, fields in MERGE_VARIANTS.items()}
    fns = _compile_all(prims)
    rows = []
    for tokens in MERGE_TOKENS:
        args = merge_inputs(tokens, heads, head_size, "cuda")
        want = ref_merge.merge_attn_states(*args)
        nbytes = cases.nbytes("merge_attn_states", args)
        peer = cases.flashinfer_api("merge_attn_states", args)
        impls = {label: fns[label] for label in MERGE_VARIANTS}
        impls["triton backend"] = lambda: tr_merge.merge_attn_states(*args)
        peer_args = peer.prepare(args) if peer.prepare else args
        impls["flashinfer api"] = lambda: peer.fn(*peer_args)
        calls = {}
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
            calls[label] = call
        rows += harness.bandwidth_rows("merge_attn_states", f"{tokens}x{heads}x{head_size}", calls, nbytes, ceiling, ROUNDS)
    return rows


def rope_rows(ceiling: float) -> list:
    key = (32, 8, 128, 128, True, "bfloat16", "float32", "int64", 2, True)  # cases' rope shape, aligned
    prims = {label: tl_rope._build(*key, config=dataclasses.replace(tl_rope.RopeConfig.for_shape(*key), **fields))
             for label, fields in ROPE_VARIANTS.items()}
    fns = _compile_all(prims)
    rows = []
    for tokens in ROPE_TOKENS:
        args = cases.build("rotary_embedding", tokens, None, cases.PROFILES["gpu"], "cuda", torch.bfloat16)
        positions, q, k, hs, cache, neox = args
        want_q, want_k = q.clone(), k.clone()
        ref_rope.rotary_embedding(positions, want_q, want_k, hs, cache, neox)
        nbytes = cases.nbytes("rotary_embedding", args)
        peer = cases.flashinfer_api("rotary_embedding", args)
        impls = {label: (lambda fn: lambda p, q_, k_: fn(p, q_, k_, cache))(fns[label]) for label in ROPE_VARIANTS}
        impls["triton backend"] = lambda p, q_, k_: tr_rope.rotary_embedding(p, q_, k_, hs, cache, neox)
        impls["flashinfer api"] = lambda p, q_, k_: peer.fn(p, q_, k_, hs, cache, neox)
        calls = {}
        for label, fn in impls.items():
            qq, kk = q.clone(), k.clone()
            fn(positions, qq, kk)
            torch.testing.assert_close(qq, want_q, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(kk, want_k, atol=2e-2, rtol=2e-2)
            calls[label] = (lambda fn, qq, kk: lambda: fn(positions, qq, kk))(fn, qq, kk)
        rows += harness.bandwidth_rows("rotary_embedding", f"{tokens}x(32+8)x128", calls, nbytes, ceiling, ROUNDS)
    return rows


def _exact(act: str, x):
    """``act(x[:, :d]) * x[:, d:]`` in fp64; the tanh GELU as ``g * sigmoid(2u)``, since its reference
    form's ``1 + tanh(u)`` cancels to 0 in the tail (g <= -4.3 in bf16's range) even in fp64."""
    x = x.double()
    d = x.shape[-1] // 2
    g, up = x[:, :d], x[:, d:]
    if act == "gelu_tanh":
        return g * torch.sigmoid(1.5957691216057308 * (g + 0.044715 * g ** 3)) * up
    return (ref_act.silu_and_mul(x) if act == "silu" else ref_act.gelu_and_mul(x, "none"))


def _of_tolerance(got, exact) -> float:
    """The largest error of ``got`` against the fp64 ``exact``, as a fraction of the test tolerance of
    ``got``'s dtype (atol + rtol |exact|, ``torch_kernels.testing.TOLERANCES``): at most 1 passes."""
    atol, rtol = TOLERANCES[got.dtype]
    return ((got.double() - exact).abs() / (atol + rtol * exact.abs())).max().item()


def tanh_rows(ceiling: float) -> list:
    """The error of the activations' two forms (``ActivationConfig.tanh_approx``: tanh.approx, or the sigmoid
    by ex2 and rcp) at every bf16 gate value of size 2^-8 to 16, up half 1: the largest error over |g| (the
    rounding to bf16 is relative to the output's own size), the largest in ulps of the output (the rounding
    alone: half an ulp) and where it occurs, how many outputs are more than an ulp off, and the largest as
    a fraction of the bf16 test tolerance."""
    g = torch.arange(0x3B80, 0x4181, dtype=torch.int16).view(torch.bfloat16).to("cuda")  # 2^-8 .. 16
    g = torch.cat([g, -g])
    d = g.numel() // 8 * 8
    x = torch.cat([g[:d], torch.ones(d, device="cuda", dtype=torch.bfloat16)]).view(1, 2 * d)
    rows = []
    for act in ("silu", "gelu_tanh"):
        exact = _exact(act, x)
        base = tl_act.ActivationConfig.for_shape("bfloat16", act, 1)
        forms = {"tanh.approx": True, "sigmoid form": False}
        fns = _compile_all({label: tl_act._build(d, "bfloat16", act, config=dataclasses.replace(base, tanh_approx=on))
                            for label, on in forms.items()})
        for label, fn in [("reference", None), *fns.items()]:
            if isinstance(fn, str):
                rows.append({"op": f"{act}_and_mul", "impl": label, "status": fn})
                continue
            got = ref_act.silu_and_mul(x) if act == "silu" else ref_act.gelu_tanh_and_mul(x)
            if fn is not None:
                got = torch.empty_like(got)
                fn(x, got)
            err = (got.double() - exact).abs()[0]
            ulps = err / torch.exp2(torch.floor(torch.log2(exact.abs()[0])) - 7)  # bf16: 8 significant bits
            worst = int(ulps.argmax())
            rows.append({"op": f"{act}_and_mul", "shape": f"1x2*{d}, 2^-8 <= |g| <= 16", "impl": label,
                         "max err / |g|": (err / g[:d].double().abs()).max().item(), "max ulp": ulps.max().item(),
                         "at g": g[worst].item(), "over 1 ulp": int((ulps > 1).sum()),
                         "of tol": _of_tolerance(got, exact)})
            print(rows[-1], flush=True)
    return rows


def act_rows(ceiling: float, flush=None, shapes=ACT_SHAPES, acts=ACT_KINDS, variants=ACT_VARIANTS) -> list:
    import flashinfer.activation

    def config(label, act, tokens):
        return dataclasses.replace(tl_act.ActivationConfig.for_shape("bfloat16", act, tokens), **variants[label])

    configs = {(tokens, d, act, label): config(label, act, tokens)
               for (tokens, d) in shapes for act in acts for label in variants}
    prims = {(d, act, c): tl_act._build(d, "bfloat16", act, config=c) for (_, d, act, _), c in configs.items()}
    fns = _compile_all(prims)
    fns = {k: fns[(k[1], k[2], c)] for k, c in configs.items()}
    rows = []
    for (tokens, d), act in itertools.product(shapes, acts):
        x = torch.randn(tokens, 2 * d, device="cuda", dtype=torch.bfloat16) * 2
        want = ref_act.silu_and_mul(x) if act == "silu" else ref_act.gelu_and_mul(x, "tanh" if act == "gelu_tanh" else "none")
        exact = _exact(act, x)
        errors = {"reference": _of_tolerance(want, exact)}  # the bf16 rounding alone
        nbytes = x.numel() * 2 * 3 // 2
        out = torch.empty(tokens, d, device="cuda", dtype=torch.bfloat16)
        impls = {label: (lambda fn=fns[(tokens, d, act, label)]: (fn(x, out), out)[1]) for label in variants}
        impls["triton backend"] = lambda: tr_act.act_and_mul(x, act)
        fi = getattr(flashinfer.activation, f"{act}_and_mul")
        impls["flashinfer api"] = lambda: fi(x)
        calls = {}
        for label, fn in impls.items():
            if isinstance(fns.get((tokens, d, act, label)), str):
                rows.append({"op": f"{act}_and_mul", "shape": f"{tokens}x2*{d}", "impl": label,
                             "status": fns[(tokens, d, act, label)]})
                continue
            got = fn()
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            errors[label] = _of_tolerance(got, exact)
            calls[label] = fn
        rows += [dict(r, **{"of tol": errors.get(r["impl"])})
                 for r in harness.bandwidth_rows(f"{act}_and_mul", f"{tokens}x2*{d}", calls, nbytes, ceiling, ROUNDS, flush)]
    return rows


def mid_act_rows(ceiling: float, flush=None) -> list:
    return act_rows(ceiling, flush, MID_ACT_SHAPES, MID_ACT_KINDS, MID_ACT_VARIANTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--only", default="norm,fp8norm,merge,rope,act,tanh",
                        help="comma list of norm, fp8norm, fp8rms, fp8rows, merge, rope, act, midact, tanh")
    parser.add_argument("--cold-l2", action="store_true", help="midact: flush L2 before every timed call")
    args = parser.parse_args()
    torch.manual_seed(0)
    ceiling = harness.copy_ceiling_gbps()
    flush = harness.l2_flush() if args.cold_l2 else None
    rows = []
    for name, sweep in (("merge", merge_rows), ("norm", norm_rows), ("fp8norm", fp8_norm_rows), ("fp8rms", fp8_rms_rows),
                        ("fp8rows", fp8_row_rows), ("rope", rope_rows), ("act", act_rows),
                        ("midact", lambda c: mid_act_rows(c, flush)), ("tanh", tanh_rows)):
        if name in args.only.split(","):
            try:
                rows += sweep(ceiling)
            except Exception:  # noqa: BLE001  (the other sweeps still run; the traceback is the result)
                traceback.print_exc()
                rows.append({"op": name, "status": "failed: see the log"})
    if args.out:
        harness.write_json(args.out, {**harness.header(), "copy GB/s": ceiling, "rows": rows})
    print(f"\ncopy ceiling {ceiling:.0f} GB/s\n")
    print(harness.markdown(rows, ["op", "shape", "impl", "us", "GB/s", "of copy", "of tol", "max err / |g|", "max ulp",
                                  "at g", "over 1 ulp", "status"]))


if __name__ == "__main__":
    main()
