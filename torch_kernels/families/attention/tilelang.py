"""TileLang ``merge_attn_states``: ``v = v_a * wa + v_b * wb`` with ``wa = exp(lse_a - m) / s``,
``wb = exp(lse_b - m) / s``, ``s = exp(lse_a - m) + exp(lse_b - m)``, ``m = max(lse_a, lse_b)``, and
``lse = m + log(s)`` (natural log), per token and head, in fp32 (the reference is
``families/attention/reference.py``).

Shapes: ``v_a``, ``v_b`` ``(T, H, D)`` fp16/bf16/fp32, head dimension contiguous, token and head strides
free; ``lse_a``, ``lse_b`` ``(T, H)`` fp32, any strides. Returns contiguous ``(T, H, D)`` in the dtype of
``v_a`` and ``(T, H)`` fp32.

One kernel per (heads, head size, dtype, aligned partials); the token count and every stride are
runtime values. Each thread merges ``E`` consecutive values of one head (16 bf16: two 16-byte loads
of each partial and two 16-byte stores, 64 bytes in flight), ``D / E`` consecutive threads a head;
(token, head, lane) triples are numbered flat, so any head size fills the blocks. Every lane computes its head's weights (two
4-byte LSE loads, cached across the lanes) and the first lane writes the merged LSE. Empty partials
(LSE ``-inf``, or FlashAttention-2's ``+inf``) as the reference: the other partial's values come
back exactly, never NaN; both empty gives ``v_a`` and ``-inf``. Partials whose strides or start
are not multiples of the vector are read value by value by a second kernel of the same shape.
"""

from dataclasses import dataclass
from typing import Iterator, Optional

import tilelang.language as T
import torch
from torch import Tensor

from ... import outputs
from ...backends import tilelang_jit as _jit
from ...spec import HostKernels

_NAME = "merge_attn_states"
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass(frozen=True)
class MergeConfig(_jit.LaunchConfig):
    """How a merge kernel is launched; :meth:`for_shape` is what the launcher uses."""

    # Values a thread merges (at most): 16 puts two 16-byte vectors of each bf16 partial in flight
    # (4287 GB/s at 16384x32x128, 4 a thread 3245; docs/design/attention.md).
    per_thread: int = 16
    threads: int = 256


_DEFAULT = MergeConfig.for_shape()
_INF = float("inf")
# (token, head, lane) threads per launch: the flat thread index is a 32-bit integer.
_MAX_THREADS = 2**31 - 1 - _DEFAULT.threads
# The partials' loads take no L2 hint: evict_first lost (3957 against 4317 GB/s at 16384x32x128).


def _per_thread(head_size: int, config: MergeConfig = _DEFAULT) -> int:
    """Values per thread: the largest power of two up to ``config.per_thread`` dividing the head size."""
    return min(config.per_thread, head_size & -head_size)


def _vec(head_size: int, dtype: str, config: MergeConfig = _DEFAULT) -> int:
    """Values per access: 16 bytes, or what the head size allows."""
    return min(_per_thread(head_size, config), _jit.lanes(dtype))


def _build(num_heads: int, head_size: int, dtype: str, aligned: bool, config: Optional[MergeConfig] = None):
    config = config or MergeConfig.for_shape()
    THREADS = config.threads
    pdl = _jit.dependent_launch()
    H, D = num_heads, head_size
    E = _per_thread(D, config)
    VEC = _vec(D, dtype, config)
    LANES = D // E
    # Aligned partials load VEC values at a time; the others value by value (a vector at an address
    # off its size faults). The output is a fresh contiguous tensor: always vectors.
    load = T.vectorized if aligned else T.unroll
    Tn = T.dynamic("num_tokens")
    sa_t, sa_h, sb_t, sb_h, la_t, la_h, lb_t, lb_h = T.dynamic("sa_t, sa_h, sb_t, sb_h, la_t, la_h, lb_t, lb_h", "int64")

    @T.prim_func
    def merge(
        v_a: T.StridedTensor((Tn, H, D), (sa_t, sa_h, 1), dtype),  # partial a, read
        lse_a: T.StridedTensor((Tn, H), (la_t, la_h), "float32"),  # its natural-log LSE, read
        v_b: T.StridedTensor((Tn, H, D), (sb_t, sb_h, 1), dtype),  # partial b, read
        lse_b: T.StridedTensor((Tn, H), (lb_t, lb_h), "float32"),
        out: T.Tensor((Tn, H, D), dtype),  # merged values, written, contiguous
        out_lse: T.Tensor((Tn, H), "float32"),  # merged LSE, written, contiguous
    ):
        # Guards by hand, as TileLang's would split the vectors; explicit ld/st.global.v4, as nvcc
        # stored each thread's first 16 output bytes as four 4-byte stores (sm_90 PTX, nvcc 13.0).
        T.annotate_pass_configs({"tl.disable_safe_memory_legalize": True, "tl.enable_lower_ldgstg": True})
        if aligned:
            # Checked by the launcher and the host code; size-1 dims' strides are unused, and the views
            # round strides down to the vector so TileLang proves each head starts on one (see rope.py).
            T.assume(T.Or(Tn <= 1, sa_t % VEC == 0))
            T.assume(T.Or(Tn <= 1, sb_t % VEC == 0))
            if H > 1:
                T.assume(sa_h % VEC == 0)
                T.assume(sb_h % VEC == 0)
        a_ = T.view(v_a, strides=(sa_t // VEC * VEC, sa_h // VEC * VEC, 1) if aligned else (sa_t, sa_h, 1))
        b_ = T.view(v_b, strides=(sb_t // VEC * VEC, sb_h // VEC * VEC, 1) if aligned else (sb_t, sb_h, 1))
        with T.Kernel(T.ceildiv(Tn * (H * LANES), THREADS), threads=THREADS) as block:
            if pdl:  # before any access: see _jit.dependent_launch
                T.pdl_sync()
            # the next kernel may be scheduled now: see _jit.EARLY_TRIGGER
            if _jit.triggers_early(Tn, num_heads * (3 * head_size * _jit.ELEMENT_BYTES[dtype] + 12), config):
                T.pdl_trigger()
            item = block * THREADS + T.get_thread_binding()  # (token, head, lane), flat
            t = T.alloc_var("int32")
            h = T.alloc_var("int32")
            lane = T.alloc_var("int32")
            t = item // (H * LANES)
            h = item // LANES % H
            lane = item % LANES
            va = T.alloc_local((E,), dtype)
            vb = T.alloc_local((E,), dtype)
            if item < Tn * (H * LANES):
                for v in load(E):
                    va[v] = a_[t, h, lane * E + v]
                for v in load(E):
                    vb[v] = b_[t, h, lane * E + v]
                a = T.alloc_var("float32")
                b = T.alloc_var("float32")
                a = lse_a[t, h]
                b = lse_b[t, h]
                a = T.if_then_else(a == T.float32(_INF), T.float32(-_INF), a)  # FA2 marks an empty row +inf
                b = T.if_then_else(b == T.float32(_INF), T.float32(-_INF), b)
                a_empty = a == T.float32(-_INF)
                b_empty = b == T.float32(-_INF)
                m = T.max(a, b)
                ea = T.exp(a - m)  # NaN when both are empty: those heads take the selects below
                eb = T.exp(b - m)
                s = ea + eb
                # The weights first, then the values: v * exp(lse - m) could overflow.
                wa = ea / s
                wb = eb / s
                for v in T.unroll(E):
                    # An empty partial is never read into the result (its values may be NaN): a
                    # select (selp) of fp32 values, exact for the partial that is returned.
                    fa = T.cast(va[v], "float32")
                    fb = T.cast(vb[v], "float32")
                    va[v] = T.cast(T.Select(b_empty, fa, T.Select(a_empty, fb, fa * wa + fb * wb)), dtype)
                for v in T.vectorized(E):
                    out[t, h, lane * E + v] = va[v]
                if lane == 0:
                    out_lse[t, h] = T.if_then_else(b_empty, a, T.if_then_else(a_empty, b, m + T.log(s)))

    return merge


# ----------------------------------------------------------------------------------------------
# Launcher: the reference's signature. Per call after the first: the outputs, an alignment test,
# one dict lookup for the compiled host function (``_jit.entry``), the call.

_build.config_for = MergeConfig.for_shape  # type: ignore[attr-defined]  # what _jit.compiled builds under
_function = _jit.host_functions(_NAME, _build)  # key of _build -> compiled host function
_functions = _function.cache


def merge_attn_states(v_a: Tensor, lse_a: Tensor, v_b: Tensor, lse_b: Tensor, *, out=None):
    if out is None:
        out, out_lse = v_a.new_empty(v_a.shape), lse_a.new_empty(lse_a.shape)  # contiguous, v_a's dtype; fp32
    else:
        given = out
        out = outputs.given(given, 0, v_a.shape, v_a.dtype, v_a.device)
        out_lse = outputs.given(given, 1, lse_a.shape, torch.float32, v_a.device)
    T_, H, D = v_a.shape
    if T_ == 0:
        return out, out_lse
    dtype = _DTYPES[v_a.dtype]
    bits = 0
    for v in (v_a, v_b):
        bits |= (v.stride(0) if T_ > 1 else 0) | (v.stride(1) if H > 1 else 0) | v.data_ptr() // v.element_size()
    fn = _function(H, D, dtype, not bits % _vec(D, dtype))
    per_launch = _MAX_THREADS // (H * (D // _per_thread(D)))
    if T_ <= per_launch:  # every realistic call
        fn(v_a, lse_a, v_b, lse_b, out, out_lse)
    else:
        for t in range(0, T_, per_launch):
            c = slice(t, t + per_launch)
            fn(v_a[c], lse_a[c], v_b[c], lse_b[c], out[c], out_lse[c])
    return out, out_lse


def merge_attn_states_host(v_a: Tensor, lse_a: Tensor, v_b: Tensor, lse_b: Tensor) -> HostKernels:
    """The C++ entry's host: the aligned kernel (partials on its vector: the granules), the outputs shaped
    like ``v_a`` and ``lse_a``, and the tokens one launch takes."""
    _, H, D = v_a.shape
    dtype = _DTYPES[v_a.dtype]
    vec = _vec(D, dtype)
    return HostKernels(((0, _function(H, D, dtype, True)),), (vec, 0, vec, 0),
                       outputs=(("like", v_a.dtype, 0), ("like", torch.float32, 1)),
                       max_tokens=_MAX_THREADS // (H * (D // _per_thread(D))))


def ci_kernels() -> Iterator[tuple]:
    """(name, build, key) of the specialisations CI compiles for sm_90: head size 128 in every
    dtype, MLA's 512, head sizes that are not powers of two (40: 5 threads a head; 80), a head of
    one value (2-byte accesses), and misaligned partials."""
    for heads, head_size, dtype, aligned in (
        (32, 128, "bfloat16", True),  # the benchmark shape
        (32, 128, "float16", True),
        (32, 128, "float32", True),
        (128, 512, "bfloat16", True),
        (8, 64, "bfloat16", True),
        (5, 40, "float16", True),
        (7, 80, "float32", True),
        (1, 1, "bfloat16", True),
        (32, 128, "bfloat16", False),
    ):
        yield _NAME, _build, (heads, head_size, dtype, aligned)
