"""TileLang ``per_token_group_quant_fp8``: per group of ``group_size`` consecutive values of a row,
``scale = max(max|x|, eps) / 448`` (``scale_ue8m0``: its power-of-two ceiling) and
``q = clamp(x / scale, -448, 448)`` as float8_e4m3fn (the reference is ``families/quant/reference.py``).

Shapes: ``input (..., H)`` fp16/bf16/fp32, last dimension contiguous, rows of any stride; ``q (..., H)``
contiguous; ``scales (..., H/group_size)`` fp32, row-major or column-major (DeepGEMM's, storage
``(H/group_size, T)``: the kernel writes through the scale tensor's strides, so one kernel serves both).

One kernel per (group size, dtype, UE8M0, division mode, aligned rows); token count, hidden size and
strides are runtime values. Each thread owns ``E`` consecutive values of one group (16, or
``group_size / 32`` for groups wider than 512; 16 bf16 are two 16-byte loads and one 16-byte fp8
store), and the ``group_size / E`` consecutive lanes of a warp that share a group combine their maxima
with ``shfl.xor``. The (row, group) pairs are numbered flat, so every thread has work whatever the
hidden size (one 32-bit division per thread finds its row). Rows whose stride or start is not a
multiple of the 16-byte vector are read value by value by a second kernel of the same shape.

Numerics as the Triton kernel's (``docs/design/quant.md``): the group max on the magnitudes' bits as
integers (a NaN propagates); ``scale = __fdiv_rn(amax, 448)``, bit-equal to the reference's;
``q = x * __frcp_rn(scale)``, one fp8 step at most from ``x / scale`` (each value divided below
``eps = 2**-100``, where the reciprocal could overflow); the hardware ``cvt.rn.satfinite.e4m3x2.f32``,
which is ``clamp(y, -448, 448).to(float8_e4m3fn)`` bit for bit.

``scaled_fp8_quant`` is a row kernel of ``backends/tilelang_fp8.py``, whose numerics (these, with a dynamic
scale ``max(amax * fp32(1/448), 1 / (448 * 512))`` as the reference takes it) the norms and the activation
that end in a quantisation share: static, per token (the whole row in one block) with or without
``scale_ub``, and per tensor in two kernels with no host sync (the max of the magnitudes' bits by one
``atomicMax`` a block into a zeroed int32, then the quantisation reading it); each bit for bit the
reference's. Rows off the vector are copied first (rare).
"""

from dataclasses import dataclass
from typing import Iterator, Optional

import tilelang.language as T
import torch
from torch import Tensor

from .reference import empty_outputs

from ... import fp8 as _fp8_core
from ...backends import tilelang_fp8 as _fp8, tilelang_jit as _jit
from ...backends.rows import rows
from ...backends.host_outputs import fp8_outputs
from ...spec import HostKernels

_NAME = "per_token_group_quant_fp8"
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass(frozen=True)
class QuantConfig(_jit.LaunchConfig):
    """How a quantisation kernel is launched; :meth:`for_shape` is what the launcher uses."""

    # 16 values a thread: one 16-byte fp8 store, 32 bytes of bf16 in flight; groups over 512 take
    # group_size / 32, so a group's lanes stay in one warp (docs/design/quant.md).
    per_thread: int = 16
    threads: int = 256


_DEFAULT = QuantConfig.for_shape()
# Below this eps the reciprocal of the scale may overflow: divide every value instead.
_EXACT_DIV_EPS = 2.0 ** -100
# (row, group) pairs per launch: the flat pair index is a 32-bit integer.
_MAX_PAIRS = 2**31 - 1 - _DEFAULT.threads


def _per_thread(group_size: int, config: QuantConfig = _DEFAULT) -> int:
    return max(min(config.per_thread, group_size), group_size // 32)


def _vec(group_size: int, dtype: str, config: QuantConfig = _DEFAULT) -> int:
    """Values per access of the input: 16 bytes, or one group when it is smaller."""
    return min(_per_thread(group_size, config), _jit.lanes(dtype))


def _build(group_size: int, dtype: str, ue8m0: bool, exact_div: bool, aligned: bool, config: Optional[QuantConfig] = None):
    config = config or QuantConfig.for_shape()
    THREADS = config.threads
    pdl = _jit.dependent_launch()
    GS = group_size
    E = _per_thread(GS, config)
    LANES = GS // E  # threads a group: a power of two, at most 32
    VEC = _vec(GS, dtype, config)
    GROUPS_PER_BLOCK = THREADS // LANES
    # Aligned rows load VEC values at a time; the others value by value (a vector at an address off
    # its size faults). q is a fresh contiguous tensor: always one vector of E values.
    load = T.vectorized if aligned else T.unroll
    Tn, H, G = T.dynamic("num_tokens, hidden, groups")
    sx, ss_t, ss_g = T.dynamic("sx, ss_t, ss_g", "int64")

    @T.prim_func
    def quant(
        x: T.StridedTensor((Tn, H), (sx, 1), dtype),  # input rows, read
        q: T.Tensor((Tn, H), "float8_e4m3fn"),  # written, contiguous
        s: T.StridedTensor((Tn, G), (ss_t, ss_g), "float32"),  # scales, written: row- or column-major
        eps: T.float32,  # floor of each group's max, >= 0
    ):
        # The accesses below are guarded by hand (``pair < Tn * G``); TileLang's own guards, which
        # it adds where it cannot prove a row index in range, would split every vector access
        # into 16 checked scalar ones.
        T.annotate_pass_configs({"tl.disable_safe_memory_legalize": True})
        # Checked on the host at every call. A lone row's stride is never used and may be reported
        # as anything (DLPack exports of torch before 2.10 say 1); the view rounds it down to the
        # vector, which lets TileLang prove that every row starts on a vector boundary.
        T.assume(H == G * GS)
        T.assume(H % GS == 0)
        if aligned:
            T.assume(T.Or(Tn <= 1, sx % VEC == 0))
        xa = T.view(x, strides=(sx // VEC * VEC, 1) if aligned else (sx, 1))
        with T.Kernel(T.ceildiv(Tn * G, GROUPS_PER_BLOCK), threads=THREADS) as block:
            if pdl:  # before any access: see _jit.dependent_launch
                T.pdl_sync()
            # the next kernel may be scheduled now: see _jit.EARLY_TRIGGER
            if _jit.triggers_early(Tn, H * (_jit.ELEMENT_BYTES[dtype] + 1) + G * 4, config):
                T.pdl_trigger()
            tid = T.get_thread_binding()
            pair = block * GROUPS_PER_BLOCK + tid // LANES  # (row, group), flat
            # Row and group kept in registers: one 32-bit division per thread (sizes are positive:
            # C's truncating division, not TIR's floor division with its sign tests).
            t = T.alloc_var("int32")
            g = T.alloc_var("int32")
            t = T.truncdiv(pair, G)
            g = pair - t * G
            xf = T.alloc_local((E,), "float32")
            qv = T.alloc_local((E,), "float8_e4m3fn")
            amax_bits = T.alloc_var("int32")
            if pair < Tn * G:
                for v in load(E):
                    xf[v] = T.cast(xa[t, g * GS + tid % LANES * E + v], "float32")
            else:  # no row: still takes part in the shuffles below
                for v in T.unroll(E):
                    xf[v] = T.float32(0)
            amax_bits = T.reinterpret(eps, "int32")  # a negative int for eps = -0.0: never the max
            for v in T.unroll(E):
                amax_bits = T.max(amax_bits, _fp8.abs_bits(xf[v]))
            for k in T.unroll(LANES.bit_length() - 1):
                amax_bits = T.max(amax_bits, T.shfl_xor(amax_bits, 1 << k))
            scale = T.alloc_var("float32")
            scale = _fp8.group_scale(T.reinterpret(amax_bits, "float32"))  # the shared numerics (tilelang_fp8)
            if ue8m0:
                scale = _fp8.pow2_ceil(scale)
            if exact_div:
                for v in T.vectorized(E):
                    qv[v] = _fp8.to_fp8(T.ieee_fdiv(xf[v], scale))
            else:
                inv = T.ieee_frcp(scale)
                for v in T.vectorized(E):
                    qv[v] = _fp8.to_fp8(xf[v] * inv)
            if pair < Tn * G:
                for v in T.vectorized(E):
                    q[t, g * GS + tid % LANES * E + v] = qv[v]
                if tid % LANES == 0:
                    s[t, g] = scale

    return quant


# ----------------------------------------------------------------------------------------------
# Launcher: the reference's signature. Per call after the first: the outputs, an alignment test,
# one dict lookup for the compiled host function (``_jit.entry``), the call.

_build.config_for = QuantConfig.for_shape  # type: ignore[attr-defined]  # what _jit.compiled builds under
_function = _jit.host_functions(_NAME, _build)  # key of _build -> compiled host function
_functions = _function.cache


def per_token_group_quant_fp8(input: Tensor, group_size: int, eps: float = 1e-10,
                              column_major_scales: bool = False, scale_ue8m0: bool = False, *, out=None):
    q, s = empty_outputs(input, group_size, column_major_scales, out)
    if input.dim() == 2:
        x, q2, s2 = input, q, s
    else:  # (T, H) rows: a view unless the leading dims do not collapse; (T, G) views of the outputs,
        # whose leading dims are contiguous in both scale layouts
        H = input.shape[-1]
        x, q2, s2 = input.reshape(-1, H), q.view(-1, H), s.view(-1, H // group_size)
    rows = x.shape[0]
    if rows == 0:
        return q, s
    dtype = _DTYPES[input.dtype]
    aligned = not ((x.stride(0) if rows > 1 else 0) | x.data_ptr() // x.element_size()) % _vec(group_size, dtype)
    fn = _function(group_size, dtype, bool(scale_ue8m0), eps < _EXACT_DIV_EPS, aligned)
    per_launch = _MAX_PAIRS // s2.shape[1]
    if rows <= per_launch:  # every realistic call
        fn(x, q2, s2, eps)
    else:
        for r in range(0, rows, per_launch):
            fn(x[r:r + per_launch], q2[r:r + per_launch], s2[r:r + per_launch], eps)
    return q, s


def per_token_group_quant_fp8_host(input: Tensor, group_size: int, eps: float = 1e-10,
                                   column_major_scales: bool = False, scale_ue8m0: bool = False) -> HostKernels:
    """The C++ entry's host: the kernel the launcher calls for contiguous 16-byte-aligned rows like
    ``input``'s, q and the scales' layout, and the rows one launch may take."""
    H, dtype = input.shape[-1], _DTYPES[input.dtype]
    vec = _vec(group_size, dtype)
    aligned = H % vec == 0 and 16 % (vec * input.element_size()) == 0
    fn = _function(group_size, dtype, bool(scale_ue8m0), eps < _EXACT_DIV_EPS, aligned)
    return HostKernels(((0, fn),), outputs=fp8_outputs(H, False, group_size, column_major_scales),
                       max_tokens=_MAX_PAIRS // (H // group_size))


# ----------------------------------------------------------------------------------------------
# scaled_fp8_quant: one row kernel per (hidden size, dtype, mode) with the shared epilogue
# (backends/tilelang_fp8.py); the dynamic per-tensor scale takes a first kernel, the max of the
# magnitudes' bits by one atomicMax a block into a zeroed int32, read by the second on the device.

_SCALED = "scaled_fp8_quant"
_ABSMAX = "fp8_absmax"


@dataclass(frozen=True)
class ScaledConfig(_jit.LaunchConfig):
    """How a ``scaled_fp8_quant`` kernel is launched: about ``vectors`` 16-byte vectors a thread, rows
    in blocks of ``threads`` (a per-token row takes one block of up to 1024 threads); the max kernel's
    grid at most ``max_blocks`` blocks (each one atomic)."""

    vectors: int = 2
    threads: int = 128
    max_blocks: int = 1056  # 8 blocks of 128 threads on each of 132 SMs
    # none: whole warps of 2 tied the 128 threads of 7 at 7168 bf16 per token, and lost at one token
    # (1.49 against 1.41 µs, H100); see tilelang_fp8.plan
    warp_lanes: int = 0


def _scaled_plan(n: int, dtype: str, epi, config: ScaledConfig):
    return _fp8.plan(n, dtype, epi, config.vectors, config.threads, config.warp_lanes)


def _build_scaled(n: int, dtype: str, epi, config: Optional[ScaledConfig] = None):
    """``q = fp8(x * inv)`` over rows of ``n`` values under the epilogue ``epi`` (static, tensor or
    token): ``fn(X, Q, S[, Sin])`` (``tilelang_fp8.row_kernel``)."""
    config = config or ScaledConfig()
    p = _scaled_plan(n, dtype, epi, config)
    tile = p.tile

    @T.macro
    def load(X, xv, live, row, col0):
        lane = T.get_thread_binding() % tile.lanes
        for k in T.unroll(tile.nv):
            if live(k):
                for v in T.vectorized(tile.vec):
                    xv[k, v] = X[row, col0 + tile.column(k, lane) + v]

    return _fp8.row_kernel(_SCALED, n, n, dtype, epi, p, load, config, _fp8.bytes_per_token(n, n, dtype, epi))


def _build_absmax(n: int, dtype: str, config: Optional[ScaledConfig] = None):
    """``A[0] = max(A[0], max bits of |x|)`` over rows of ``n`` values: each block folds its tiles
    (a grid of at most ``config.max_blocks``), reduces by redux.sync and shared memory, and makes one
    atomicMax (the bits of non-negative floats order as integers; a NaN's exceed an infinity's)."""
    config = config or ScaledConfig()
    pdl = _jit.dependent_launch()
    p = _scaled_plan(n, dtype, _fp8.Epilogue("static"), config)
    tile = p.tile
    VEC, LANES, NV, BM, COL_TILES, SPAN = tile.vec, tile.lanes, tile.nv, tile.rows, p.col_tiles, tile.width
    THREADS, WARPS = tile.threads, max(tile.threads // 32, 1)
    Tn = T.dynamic("num_tokens")
    sx = T.dynamic("sx", "int64")
    moved = n * _jit.ELEMENT_BYTES[dtype]

    @T.prim_func
    def fp8_absmax(
        X: T.StridedTensor((Tn, n), (sx, 1), dtype),  # input rows, read
        A: T.Tensor((1,), "int32"),  # zeroed by the launcher; receives the max of the magnitudes' bits
    ):
        T.assume(T.Or(Tn <= 1, sx % VEC == 0))
        Xa = T.view(X, strides=(sx // VEC * VEC, 1))
        tiles = T.ceildiv(Tn, BM) * COL_TILES
        with T.Kernel(T.min(tiles, config.max_blocks), threads=THREADS) as block:
            if pdl:
                T.pdl_sync()
            if _jit.triggers_early(Tn, moved, config):
                T.pdl_trigger()
            tid = T.get_thread_binding()
            lane = tid % LANES
            m = T.alloc_var("int32")
            red = T.alloc_shared((WARPS,), "int32")
            xv = T.alloc_local((VEC,), dtype)
            m = 0
            for it in T.serial(T.ceildiv(tiles - block, T.min(tiles, config.max_blocks))):
                t = block + it * T.min(tiles, config.max_blocks)
                row = t // COL_TILES * BM + tid // LANES
                col0 = t % COL_TILES * SPAN
                live = _fp8.live_vector(p, n, Tn, row, col0, lane)
                for k in T.unroll(NV):
                    if live(k):
                        for v in T.vectorized(VEC):
                            xv[v] = Xa[row, col0 + tile.column(k, lane) + v]
                        for v in T.unroll(VEC):
                            m = T.max(m, _fp8.abs_bits(T.cast(xv[v], "float32")))
            m = T.warp_reduce_max(m)
            if WARPS > 1:
                if tid % 32 == 0:
                    red[tid // 32] = m
                T.sync_threads()
                for w in T.unroll(WARPS):
                    m = T.max(m, red[w])
            if tid == 0:
                T.atomic_max(A[0], m)

    return fp8_absmax


_build_scaled.config_for = lambda *key: ScaledConfig()  # type: ignore[attr-defined]
_build_absmax.config_for = lambda *key: ScaledConfig()  # type: ignore[attr-defined]
_scaled_function = _jit.host_functions(_SCALED, _build_scaled)  # (n, dtype, epilogue) -> host function
_absmax_function = _jit.host_functions(_ABSMAX, _build_absmax)  # (n, dtype) -> host function


def scaled_fp8_quant(input: Tensor, scale: Optional[Tensor] = None, per_token: bool = False,
                     scale_ub: Optional[Tensor] = None, *, out=None):
    n = input.shape[-1]
    q, s = _fp8_core.empty_outputs(input, n, scale, _fp8_core.PER_TOKEN, False, per_token, out)
    x = rows(input)
    if x.shape[0] == 0:
        if scale is not None:
            s.copy_(scale.reshape(1))
        elif not per_token:
            s.fill_(_fp8_core.MIN_SCALE)  # the max of nothing is 0
        return q, s
    dtype = _DTYPES[input.dtype]
    if ((x.stride(0) if x.shape[0] > 1 else 0) | x.data_ptr() // x.element_size()) % _jit.vector_width(n, dtype):
        x = x.clone(memory_format=torch.contiguous_format)  # rare: rows off the vector
    q2 = q.view(-1, n)
    if scale is not None:
        _scaled_function(n, dtype, _STATIC)(x, q2, s, scale.reshape(1))
    elif per_token:
        if scale_ub is None:
            _scaled_function(n, dtype, _TOKEN)(x, q2, s.view(-1))
        else:
            _scaled_function(n, dtype, _TOKEN_UB)(x, q2, s.view(-1), scale_ub.reshape(1))
    else:
        amax = torch.zeros(1, dtype=torch.int32, device=x.device)
        _absmax_function(n, dtype)(x, amax)
        _scaled_function(n, dtype, _TENSOR)(x, q2, s, amax.view(torch.float32))
    return q, s


def scaled_fp8_quant_host(input: Tensor, scale: Optional[Tensor] = None, per_token: bool = False,
                          scale_ub: Optional[Tensor] = None):
    """The C++ entry's host: the one row kernel of the static and per-token modes, q and the scales'
    layout; none for the dynamic per-tensor scale (two kernels) or a static scale with a bound."""
    n, dtype = input.shape[-1], _DTYPES[input.dtype]
    if scale is not None:
        epi = _STATIC if scale_ub is None else None
    else:
        epi = (_TOKEN if scale_ub is None else _TOKEN_UB) if per_token else None
    if epi is None:
        return ()
    return HostKernels(((0, _scaled_function(n, dtype, epi)),),
                       outputs=fp8_outputs(n, scale is not None, _fp8_core.PER_TOKEN, False))


_STATIC, _TENSOR = _fp8.Epilogue("static"), _fp8.Epilogue("tensor")
_TOKEN, _TOKEN_UB = _fp8.Epilogue("token"), _fp8.Epilogue("token", ub=True)


def ci_kernels() -> Iterator[tuple]:
    """(name, build, key) of the specialisations CI compiles for sm_90: DeepSeek's group 128 and 64
    in every dtype, UE8M0, the exact-division path (eps < 2**-100), groups narrower than a thread's
    16 values, wider than 512 (group_size / 32 a thread), and misaligned rows. (Column-major scales
    are a stride, not a key.)"""
    for group, dtype, ue8m0, exact, aligned in (
        (128, "bfloat16", False, False, True),  # the benchmark shape
        (128, "bfloat16", True, False, True),
        (128, "float16", False, False, True),
        (128, "float32", False, True, True),
        (64, "bfloat16", False, False, True),
        (64, "float32", True, False, True),
        (8, "bfloat16", False, False, True),
        (1, "float16", True, False, True),
        (4096, "bfloat16", False, False, True),
        (128, "bfloat16", False, False, False),
    ):
        yield _NAME, _build, (group, dtype, ue8m0, exact, aligned)


def ci_fp8_kernels() -> Iterator[tuple]:
    """(name, build, key) of ``scaled_fp8_quant``'s kernels CI compiles for sm_90: each mode (static,
    per token with and without a bound, the per-tensor pair), each dtype, several rows a block (100), a
    hidden size of no vector (5), a per-token row in two passes (65536 fp32)."""
    E = _fp8.Epilogue
    for n, dtype, epi in ((7168, "bfloat16", E("token")),  # the benchmark shape
                          (7168, "bfloat16", E("static")), (4096, "float16", E("tensor")),
                          (100, "float16", E("token", ub=True)), (5, "float32", E("static")),
                          (65536, "float32", E("token"))):
        yield _SCALED, _build_scaled, (n, dtype, epi)
    for n, dtype in ((7168, "bfloat16"), (100, "float32")):
        yield _ABSMAX, _build_absmax, (n, dtype)
