"""TileLang gated activations: ``(T, 2d) -> (T, d)``, ``out = act(x[:, :d]) * x[:, d:]`` with ``act`` one
of silu, gelu (erf) and gelu (tanh), computed in fp32 as the reference (``families/activation/reference.py``)
writes them (the bf16 tanh GELU's tanh by the hardware's approximation: :data:`_TANH_APPROX`), and
rounded once to the input's dtype. The launch knobs are an :class:`ActivationConfig`, part of the compile
key; :meth:`ActivationConfig.for_shape` picks them.

Shapes: ``input`` ``(T, 2d)`` row view (last dim contiguous, any row stride that is a multiple of the
vector); the output is ``(T, d)``, contiguous. One kernel per (d, dtype, activation, outputs a
thread); the token count is a runtime value (``T.dynamic``), so a batch-size change never compiles
again.

A streaming kernel: each block of ``ActivationConfig.threads`` threads writes one tile of outputs (``BM`` rows of
``BN`` columns, ``BM > 1`` only when a row is shorter than the tile), every thread 8 of them in 16-byte
accesses (two in fp32) of the gate, the up half ``d`` columns to its right, and the output; the erf
GELU's many-token kernel 16 (:data:`_WIDE_PER_THREAD`). Blocks are numbered column tile fastest on one
grid axis (2^31 - 1 blocks), so consecutive blocks stream consecutive memory, as the Triton kernel and
Inductor's pointwise grid do.

Data pointers not 16-byte aligned, or row strides that are not a multiple of the vector, are rare: the
launcher then runs the kernel on an aligned copy, with the same result.

``silu_and_mul_fp8_quant`` is a row kernel of ``backends/tilelang_fp8.py`` computing silu_and_mul's
expression under its config, rounded to the dtype, then quantised (static, per token: the whole row in
one block, per group): bit for bit ``silu_and_mul`` then ``scaled_fp8_quant`` or
``per_token_group_quant_fp8``.
"""

from dataclasses import dataclass, replace
from typing import Iterator, Optional

import tilelang.language as T
import torch
from torch import Tensor

from ... import fp8 as _fp8_core, outputs
from ...backends import tilelang_fp8 as _fp8, tilelang_jit as _jit
from ...backends.host_outputs import fp8_outputs
from ...spec import HostKernels

_NAME = "act_and_mul"
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
# Design notes and the measurements behind each constant: docs/design/activation.md (H200, bf16).
# The erf GELU from 32 tokens at 16 a thread: 4058 against 3839 GB/s at 16384x2*7168 (one token loses).
_WIDE_PER_THREAD = 16
_WIDE_MIN_TOKENS = 32
_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
# Activation -> dtypes taking tanh by tanh.approx.f32 (one SFU op, not two): 3.83 against 4.50 µs at
# 512x2*7168; bf16 only: its error is 0.159 of bf16's tolerance, and fp16's and fp32's are tighter.
_TANH_APPROX = {"gelu_tanh": ("bfloat16",)}
_TANH_APPROX_SOURCE = """
__device__ __forceinline__ float tk_tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""
# The input's loads take no L2 hint: evict_first lost at every shape (4123 against 4315 GB/s, 16384x2*7168).
# Silu and the tanh GELU take the row loop for calls moving 0.5-0.75 of the L2 in 3-4 rows an SM (a block of
# 256 threads a row): input in L2, 512x2*11008 5.92 against 7.47 µs, 512x2*14336 8.11 against 9.17
# (FlashInfer 6.00, 8.35); from DRAM 2-5% behind. It lost at 640x2*14336, 512x2*18432 and 384x2*14336.
_ROW_LOOP_L2 = (0.5, 0.75)
_ROW_LOOP_ROWS_PER_SM = (3, 4)
_ROW_LOOP_ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ActivationConfig(_jit.LaunchConfig):
    """How an activation kernel is launched; :meth:`for_shape` is what the launchers use."""

    # 1024 outputs a block of 4 warps, 8 a thread in 16-byte vectors: the Triton tile, 4363 GB/s at 8192x2*14336.
    threads: int = 128
    per_thread: int = 8
    # tanh by tanh.approx.f32 (silu or the tanh GELU; see _TANH_APPROX)
    tanh_approx: bool = False
    # __expf and an approximate reciprocal, as Triton lowers them: silu 1.33 against 1.68 µs at one token.
    fast_math: bool = True
    # a block per BM rows looping over the column tiles (FlashInfer's grid), not a block per tile
    row_loop: bool = False
    # let the next kernel launch once the block's outputs are written (FlashInfer's place for it)
    trigger_at_end: bool = False

    @classmethod
    def for_shape(cls, dtype: str, act: str, tokens: int, row_loop: bool = False) -> "ActivationConfig":
        """The launchers' configuration for ``tokens`` rows of ``dtype`` (a name) under ``act``;
        ``row_loop``: the token count lies in :func:`row_loop_tokens`' range."""
        config = cls(per_thread=_per_thread(act, tokens), tanh_approx=dtype in _TANH_APPROX.get(act, ()))
        # FlashInfer's launch: a row a block of 256 threads, the next kernel let in as the block ends
        return replace(config, row_loop=True, threads=256, early_trigger=False, trigger_at_end=True) if row_loop else config


_PER_THREAD = ActivationConfig.per_thread


_vec = _jit.vector_width  # over d: the up half starts d elements after the gate


def _tile(d: int, per_thread: int = _PER_THREAD, threads: int = ActivationConfig.threads):
    """``(BM, BN)`` of a block's ``per_thread * threads`` outputs: a row of up to that many columns (a
    power of two, at least one thread's ``per_thread``), rows filling the tile."""
    tile = per_thread * threads
    bn = min(max(1 << (d - 1).bit_length(), per_thread), tile)
    return tile // bn, bn


def _per_thread(act: str, tokens: int) -> int:
    return _WIDE_PER_THREAD if act == "gelu" and tokens >= _WIDE_MIN_TOKENS else _PER_THREAD


_devices: dict = {}  # CUDA device index -> (its L2 cache's bytes, its SM count)


def row_loop_tokens(d: int, dtype: torch.dtype, act: str, device: torch.device) -> range:
    """The token counts whose calls take the row loop on ``device``: those moving :data:`_ROW_LOOP_L2`
    of its L2 in more than 3 and at most 4 rows an SM (:data:`_ROW_LOOP_ROWS_PER_SM`; silu and the tanh
    GELU: empty for the others)."""
    if act not in _ROW_LOOP_ACTIVATIONS:
        return range(0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _devices.get(index)
    if found is None:
        props = torch.cuda.get_device_properties(index)
        found = _devices[index] = (getattr(props, "L2_cache_size", 0) or 0, props.multi_processor_count)
    l2, sms = found
    per_token = 3 * d * _jit.ELEMENT_BYTES[_DTYPES[dtype]]
    (low, high), (fewest, most) = _ROW_LOOP_L2, _ROW_LOOP_ROWS_PER_SM
    start = max(-(-int(low * l2) // per_token), fewest * sms + 1)
    return range(start, max(start, min(int(high * l2) // per_token, most * sms) + 1))


def _erfc_t(g):
    """``t = 1 / (1 + 0.3275911 |g| / sqrt(2))`` of the GELU below, by the approximate reciprocal (as
    Triton's ``1.0 / x``): kept in a register by the kernel, since its five uses would otherwise be five
    instructions (the reciprocal is an ``asm volatile``)."""
    return T.fast_rcp(T.float32(1) + T.float32(0.3275911 * 0.7071067811865476) * T.abs(g))


def _tanh_approx(u):
    """``tanh(u)`` for an fp32 expression, by ``tanh.approx.f32`` (the kernel imports
    :data:`_TANH_APPROX_SOURCE`)."""
    return T.call_extern("float32", "tk_tanh_approx", u)


def _activate(g, act: str, t=None, tanh_approx: bool = False, fast_math: bool = True):
    """``act(g)`` for an fp32 expression ``g``: silu as ATen's CUDA kernel computes it (with
    ``fast_math``, by ``__expf`` and ``fast_rcp`` as Triton's ``tl.exp`` and division), the GELUs in the
    Triton backend's forms (``triton/activation.py``: ``_activate``, which says why each is exact
    enough); ``t``: :func:`_erfc_t` of ``g`` (erf GELU); ``tanh_approx``: silu or the tanh GELU as
    ``h + h * tanh(u)`` with one ``tanh.approx.f32`` (:data:`_TANH_APPROX`). Not CUDA's ``erff``/``tanhf``,
    which branch on the argument: 3686 and 3949 against silu's 4345 GB/s at 16384x2*8192."""
    f = T.float32
    if tanh_approx:  # h = g / 2; silu's u = h, the tanh GELU's sqrt(2/pi) (g + 0.044715 g^3)
        h = f(0.5) * g
        u = h if act == "silu" else g * (f(0.7978845608028654) + f(0.7978845608028654 * 0.044715) * g * g)
        return h + h * _tanh_approx(u)
    if act == "silu":
        if fast_math:
            return g * T.fast_rcp(f(1) + T.__exp(-g))
        return g / (f(1) + T.exp(-g))
    if act == "gelu":
        # 1 + erf(g / sqrt(2)) from erfc(z) ~ t * P(t) * exp(-z^2), z = |g| / sqrt(2) (Abramowitz &
        # Stegun 7.1.26: within 2.1e-7 absolute of the exact GELU): 2 - erfc for g >= 0, erfc (no
        # cancellation) below; erfc appears once, so the generated code has no branch to repeat it in
        z = T.abs(g) * f(0.7071067811865476)
        erfc = t * (f(0.254829592) + t * (f(-0.284496736) + t * (f(1.421413741) + t * (f(-1.453152027) + t * f(1.061405429)))))
        erfc = erfc * T.__exp(-z * z)
        pos = g >= f(0)
        return f(0.5) * g * (T.if_then_else(pos, f(2), f(0)) + T.if_then_else(pos, f(-1), f(1)) * erfc)
    # 0.5 * (1 + tanh(u)) == sigmoid(2u): g * sigmoid(2 * sqrt(2/pi) * (g + 0.044715 g^3))
    if fast_math:
        return g * T.fast_rcp(f(1) + T.__exp(f(-1.5957691216057308) * (g + f(0.044715) * g * g * g)))
    return g / (f(1) + T.exp(f(-1.5957691216057308) * (g + f(0.044715) * g * g * g)))


def _build(d: int, dtype: str, act: str, per_thread: int = _PER_THREAD, row_loop: bool = False,
           config: Optional[ActivationConfig] = None):
    """The kernel of ``per_thread`` outputs a thread under ``config`` (default :meth:`ActivationConfig.for_shape`
    with ``row_loop``, whose ``per_thread`` gives way to the argument)."""
    config = config or _config_for(d, dtype, act, per_thread, row_loop)
    per_thread, THREADS = config.per_thread, config.threads
    pdl = _jit.dependent_launch()
    VEC = _vec(d, dtype)
    NV = per_thread // VEC  # vectors a thread
    BM, BN = _tile(d, per_thread, THREADS)
    TR = BN // per_thread  # threads a row
    COL_TILES = -(-d // BN)
    f32 = "float32"
    num_tokens = T.dynamic("num_tokens")
    x_stride = T.dynamic("x_row_stride", "int64")

    live = _jit.in_bounds(num_tokens, BM, d, BN)  # of the output
    tanh_approx = config.tanh_approx
    if tanh_approx and act == "gelu":
        raise ValueError("activation: the erf GELU has no tanh form")

    @T.macro
    def one_tile(X, O, gate, up, t, row, col):
        """The thread's outputs of the tile whose first vector is at (row, col)."""
        for k in T.unroll(NV):  # every load issued before the first use
            if live(row, col + k * TR * VEC):
                for v in T.vectorized(VEC):
                    gate[k, v] = X[row, col + k * TR * VEC + v]
                for v in T.vectorized(VEC):
                    up[k, v] = X[row, d + col + k * TR * VEC + v]
        for k in T.unroll(NV):
            if live(row, col + k * TR * VEC):
                for v in T.unroll(VEC):
                    if act == "gelu":
                        t[0] = _erfc_t(T.cast(gate[k, v], f32))
                    gate[k, v] = T.cast(_activate(T.cast(gate[k, v], f32), act, t[0], tanh_approx, config.fast_math)
                                        * T.cast(up[k, v], f32), dtype)
                for v in T.vectorized(VEC):
                    O[row, col + k * TR * VEC + v] = gate[k, v]

    @T.prim_func
    def act_and_mul(
        X: T.StridedTensor((num_tokens, 2 * d), (x_stride, 1), dtype),  # gate then up half per row, read
        O: T.Tensor((num_tokens, d), dtype),  # output rows, contiguous; written
    ):
        # Row strides are multiples of VEC from two rows on (the launcher ensures it, the host code checks);
        # the view rounds the stride down to VEC, moving no address, so TileLang proves 16-byte row starts.
        T.assume(T.Or(num_tokens <= 1, x_stride % VEC == 0))
        Xa = T.view(X, strides=(x_stride // VEC * VEC, 1))
        with T.Kernel(T.ceildiv(num_tokens, BM) * (1 if config.row_loop else COL_TILES), threads=THREADS) as block:
            if tanh_approx:
                T.import_source(_TANH_APPROX_SOURCE)
            if pdl:  # before any access: see _jit.dependent_launch
                T.pdl_sync()
            # the next kernel may be scheduled now: see _jit.EARLY_TRIGGER
            if _jit.triggers_early(num_tokens, 3 * d * _jit.ELEMENT_BYTES[dtype], config):
                T.pdl_trigger()
            # Thread t: row t // TR, vectors at columns (t % TR + k * TR) * VEC, so a warp's lanes touch
            # consecutive vectors; explicit register loops, as TileLang does not widen a loop calling erf.
            tid = T.get_thread_binding()
            gate = T.alloc_local((NV, VEC), dtype)
            up = T.alloc_local((NV, VEC), dtype)
            t = T.alloc_local((1,), f32)  # the erf GELU's _erfc_t
            if config.row_loop:  # the block's rows, tile after tile
                for tile in T.serial(COL_TILES):
                    one_tile(Xa, O, gate, up, t, block * BM + tid // TR, tile * BN + tid % TR * VEC)
            else:
                one_tile(Xa, O, gate, up, t, block // COL_TILES * BM + tid // TR, block % COL_TILES * BN + tid % TR * VEC)
            if pdl and config.trigger_at_end:
                T.pdl_trigger()

    return act_and_mul


def _config_for(d: int, dtype: str, act: str, per_thread: int = _PER_THREAD, row_loop: bool = False) -> ActivationConfig:
    """The launcher's config of the kernel of this key (``for_shape`` at a token count taking ``per_thread``)."""
    return replace(ActivationConfig.for_shape(dtype, act, 1, row_loop), per_thread=per_thread)


_build.config_for = _config_for  # type: ignore[attr-defined]  # what _jit.compiled builds under


# ----------------------------------------------------------------------------------------------
# Launchers: the reference's signatures. Per call, after the first: one dict lookup for the
# compiled host function (its vector width beside it), an alignment test, and the call.

_functions: dict = {}  # (d, dtype, activation, outputs a thread, row loop) -> (host function, vector width)


def _function(d: int, dtype: torch.dtype, act: str, tokens: int = 1, row_loop: bool = False):
    """``(host function, vector width)`` for ``tokens`` rows under :meth:`ActivationConfig.for_shape`."""
    key = (d, dtype, act, _per_thread(act, tokens), row_loop)
    found = _functions.get(key)
    if found is None:
        config = ActivationConfig.for_shape(_DTYPES[dtype], act, tokens, row_loop)
        kernel = _jit.compiled(_NAME, _build, d, _DTYPES[dtype], act, config.per_thread, row_loop, config=config)
        found = _functions[key] = (_jit.entry(kernel), _vec(d, _DTYPES[dtype]))
    return found


def host_functions(input: Tensor, act: str):
    """The compiled host functions ``act_and_mul`` calls for rows like ``input``'s, each with the token
    count from which it serves: what the C++ entry (``fast_path.py``) calls for the plain calls
    (contiguous, aligned) it serves: the tiles, from :data:`_WIDE_MIN_TOKENS` tokens the erf GELU's wide
    ones, and over :func:`row_loop_tokens` the row loop."""
    d = input.shape[-1] // 2
    rows = row_loop_tokens(d, input.dtype, act, input.device)
    starts = {0, _WIDE_MIN_TOKENS if act == "gelu" else 0} | ({rows.start, rows.stop} if rows else set())
    return tuple((t, _function(d, input.dtype, act, t, t in rows)[0]) for t in sorted(starts))


# The C++ entry's host providers (the manifest's HostCall).
def silu_and_mul_host(input: Tensor):
    return host_functions(input, "silu")


def gelu_and_mul_host(input: Tensor, approximate: str = "none"):
    return host_functions(input, "gelu_tanh" if approximate == "tanh" else "gelu")


def gelu_tanh_and_mul_host(input: Tensor):
    return host_functions(input, "gelu_tanh")


def act_and_mul(input: Tensor, act: str, out=None) -> Tensor:
    d = input.shape[-1] // 2
    x = input if input.dim() == 2 else input.reshape(-1, 2 * d)
    if out is None:
        y = x.new_empty((x.shape[0], d))  # contiguous; half the host time of torch.empty(shape, dtype=, device=)
    else:
        y = outputs.given(out, 0, (*input.shape[:-1], d), input.dtype, input.device).view(x.shape[0], d)
    if x.shape[0]:
        fn, vec = _function(d, x.dtype, act, x.shape[0], x.shape[0] in row_loop_tokens(d, x.dtype, act, x.device))
        if x.data_ptr() & 15 or x.stride(0) % vec:  # rare: a view at an odd offset; a fresh copy is aligned
            x = x.clone(memory_format=torch.contiguous_format)
        fn(x, y)
    return y if input.dim() == 2 else y.view(*input.shape[:-1], d)


def silu_and_mul(input: Tensor, *, out=None) -> Tensor:
    return act_and_mul(input, "silu", out)


def gelu_and_mul(input: Tensor, approximate: str = "none", *, out=None) -> Tensor:
    return act_and_mul(input, "gelu_tanh" if approximate == "tanh" else "gelu", out)


def gelu_tanh_and_mul(input: Tensor, *, out=None) -> Tensor:
    return act_and_mul(input, "gelu_tanh", out)


# ----------------------------------------------------------------------------------------------
# silu_and_mul_fp8_quant: a row kernel of tilelang_fp8 whose values are silu_and_mul's, computed by the
# expression its kernel computes under its config (so they are its output bits), rounded to the dtype,
# then quantised by the shared epilogue (scaled_fp8_quant's or per_token_group_quant_fp8's numerics).

_QUANT_NAME = "silu_and_mul_fp8_quant"


@dataclass(frozen=True)
class ActivationQuantConfig(_jit.LaunchConfig):
    """How ``silu_and_mul_fp8_quant`` is launched: ``vectors`` 16-byte output vectors a thread in blocks
    of ``threads`` (static and group scales: the plain kernel's 1024-output tiles); a per-token row in
    one block, about ``token_vectors`` a thread."""

    vectors: int = 1
    token_vectors: int = 2
    threads: int = 128
    # per token, whole warps of ``token_vectors`` up to this many threads (tilelang_fp8.plan): 7168 bf16 on
    # 448 of 2 (48 registers), 193 against 207 µs at 16384 tokens on 128 of 7 (148); 896 of 2 lost 4%
    warp_lanes: int = 512

    def plan(self, d: int, dtype: str, epi: "_fp8.Epilogue") -> "_fp8.Plan":
        return _fp8.plan(d, dtype, epi, self.token_vectors if epi.mode == "token" else self.vectors, self.threads,
                         self.warp_lanes)


def _build_quant(d: int, dtype: str, epi: "_fp8.Epilogue", config: Optional[ActivationQuantConfig] = None):
    """``q = fp8(silu(x[:, :d]) * x[:, d:])`` under ``epi``: ``fn(X, Q, S[, Sin])``."""
    config = config or ActivationQuantConfig()
    act = ActivationConfig.for_shape(dtype, "silu", 1)  # the plain kernel's formula flags
    p = config.plan(d, dtype, epi)
    tile = p.tile
    f32 = "float32"

    @T.macro
    def produce(X, yv, live, row, col0):
        lane = T.get_thread_binding() % tile.lanes
        up = T.alloc_local((tile.nv, tile.vec), dtype)
        for k in T.unroll(tile.nv):  # every load issued before the first use
            if live(k):
                for v in T.vectorized(tile.vec):
                    yv[k, v] = X[row, col0 + tile.column(k, lane) + v]
                for v in T.vectorized(tile.vec):
                    up[k, v] = X[row, d + col0 + tile.column(k, lane) + v]
        for k in T.unroll(tile.nv):
            if live(k):
                for v in T.unroll(tile.vec):
                    yv[k, v] = T.cast(_activate(T.cast(yv[k, v], f32), "silu", None, act.tanh_approx, act.fast_math)
                                      * T.cast(up[k, v], f32), dtype)

    moved = _fp8.bytes_per_token(2 * d, d, dtype, epi)
    return _fp8.row_kernel(_QUANT_NAME, d, 2 * d, dtype, epi, p, produce, config, moved)


_build_quant.config_for = lambda *key: ActivationQuantConfig()  # type: ignore[attr-defined]
_quant_function = _jit.host_functions(_QUANT_NAME, _build_quant)  # (d, dtype, epilogue) -> host function


def silu_and_mul_fp8_quant(input: Tensor, scale: Optional[Tensor] = None, group_size: int = -1,
                           column_major_scales: bool = False, scale_ue8m0: bool = False, *, out=None):
    d = input.shape[-1] // 2
    q, s = _fp8_core.empty_outputs(input, d, scale, group_size, column_major_scales, out=out)
    x = input if input.dim() == 2 else input.reshape(-1, 2 * d)
    if x.shape[0] == 0:
        if scale is not None:
            s.copy_(scale.reshape(1))
        return q, s
    dtype = _DTYPES[input.dtype]
    vec = _vec(d, dtype)
    if ((x.stride(0) if x.shape[0] > 1 else 0) | x.data_ptr() // x.element_size()) % vec:
        x = x.clone(memory_format=torch.contiguous_format)  # rare: rows off the vector
    epi = _fp8.Epilogue.of(scale, group_size, scale_ue8m0)
    fn = _quant_function(d, dtype, epi)
    q2 = q.view(-1, d)
    if scale is not None:
        fn(x, q2, s, scale.reshape(1))
    elif epi.mode == "token":
        fn(x, q2, s.view(-1))
    else:
        fn(x, q2, s.view(-1, d // group_size))
    return q, s


def silu_and_mul_fp8_quant_host(input: Tensor, scale: Optional[Tensor] = None, group_size: int = -1,
                                column_major_scales: bool = False, scale_ue8m0: bool = False) -> HostKernels:
    """The C++ entry's host: the kernel silu_and_mul_fp8_quant calls, q and the scales' layout."""
    d = input.shape[-1] // 2
    fn = _quant_function(d, _DTYPES[input.dtype], _fp8.Epilogue.of(scale, group_size, scale_ue8m0))
    return HostKernels(((0, fn),), outputs=fp8_outputs(d, scale is not None, group_size, column_major_scales))


def ci_kernels() -> Iterator[tuple]:
    """(name, build, key) of the specialisations CI compiles for sm_90: every activation, every dtype,
    and each tiling: whole column tiles (14336 = 14 x 1024), a masked last column tile (4864), rows
    shorter than the tile (several a block, 200: masked), and an odd ``d`` (scalar accesses); the erf
    GELU's 16 a thread and the row loop too."""
    for d, dtype, act, per_thread, row_loop in (
        (14336, "bfloat16", "silu", _PER_THREAD, False),  # the benchmark shape
        (14336, "bfloat16", "gelu", _WIDE_PER_THREAD, False),
        (4864, "float16", "gelu_tanh", _PER_THREAD, False),
        (14336, "bfloat16", "gelu_tanh", _PER_THREAD, False),  # tanh.approx
        (200, "float32", "silu", _PER_THREAD, False),
        (257, "bfloat16", "gelu", _PER_THREAD, False),
        (4864, "float32", "gelu", _WIDE_PER_THREAD, False),
        (14336, "bfloat16", "silu", _PER_THREAD, True),  # the row loop: whole tiles (14336 = 7 x 2048)
        (4864, "float16", "gelu_tanh", _PER_THREAD, True),  # and a masked last one
    ):
        yield _NAME, _build, (d, dtype, act, per_thread, row_loop)


def ci_fp8_kernels() -> Iterator[tuple]:
    """(name, build, key) of ``silu_and_mul_fp8_quant``'s kernels CI compiles for sm_90: each mode and
    dtype, a row tiled exactly (14336 = 256 threads x 7 vectors; 7168 by whole warps, 448 x 2), groups
    narrower than a vector (4 of a vector of 8), an odd ``d``, a per-token row in two passes and a group
    as wide (65536 fp32)."""
    E = _fp8.Epilogue
    for d, dtype, epi in ((14336, "bfloat16", E("token")),  # the benchmark shape
                          (7168, "bfloat16", E("token")),
                          (14336, "bfloat16", E("group", 128)), (14336, "bfloat16", E("static")),
                          (384, "float16", E("group", 128, True)), (24, "bfloat16", E("group", 4, True)),
                          (7, "float32", E("token")), (65536, "float32", E("token")),
                          (65536, "float32", E("group", 65536))):
        yield _QUANT_NAME, _build_quant, (d, dtype, epi)
