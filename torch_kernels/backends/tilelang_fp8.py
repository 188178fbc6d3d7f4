"""The FP8 epilogue of the TileLang kernels: ``torch_kernels/fp8.py``'s numerics as TIR expressions, and
the quantising tail of a row kernel (the scales, their maxima reduced across a block's threads, ``q`` and
the scales stored), shared by ``scaled_fp8_quant``, ``per_token_group_quant_fp8`` and the norms and the
activation with an epilogue.

Every value is exact once the epilogue's inputs are, whichever thread holds which value, which is what
makes a fused op equal its unfused pair bit for bit: the max of the magnitudes taken on their bits as
integers (a NaN, whose bits exceed an infinity's, propagates; ``fmaxf`` would drop it), a dynamic
per-tensor or per-token scale ``amax * fp32(1/448)`` (the reference's product), a group's
``__fdiv_rn(amax, 448)`` (``per_token_group_quant_fp8``'s correctly rounded quotient), ``1 / scale`` by
``__frcp_rn``, and the hardware ``cvt.rn.satfinite.e4m3x2.f32``, which is
``clamp(y, -448, 448).to(float8_e4m3fn)`` bit for bit (round to nearest even; NaN stays NaN).

A row kernel's threads hold their values as a :class:`Tile` says; :class:`Quantizer` is the tail for one
tile and one :class:`Epilogue`, and :func:`plan` the tiling of the standalone row kernels
(``scaled_fp8_quant``, ``silu_and_mul_fp8_quant``). No family is imported here.
"""

from dataclasses import dataclass
from typing import Any, Callable

import tilelang.language as T

from ..fp8 import FP8_MAX, GROUP_EPS, INV_FP8_MAX, MIN_SCALE
from . import tilelang_jit as _jit

F32 = "float32"
FP8 = "float8_e4m3fn"
MODES = ("static", "tensor", "token", "group")
#: bits of an fp32 infinity: a positive finite value's bits lie in (0, INF_BITS)
INF_BITS = 0x7F800000


@dataclass(frozen=True)
class Epilogue:
    """What a quantising tail computes (part of a kernel's compile key):

    * ``static``: ``q = x * (1 / scale)`` with the scale read from the device (NaN ``q`` where it is not
      positive and finite), the scale copied to the output;
    * ``tensor``: the same with ``scale = max(amax * fp32(1/448), MIN_SCALE)`` of a max given as the bits
      of a device value (the second kernel of a dynamic per-tensor quant);
    * ``token``: one scale a row, ``max(min(amax, ub) * fp32(1/448), MIN_SCALE)`` (``ub``: ``scale_ub``
      given);
    * ``group``: one scale per ``group_size`` values, ``max(amax, GROUP_EPS) / 448`` (``ue8m0``: its
      power-of-two ceiling), as ``per_token_group_quant_fp8`` with eps ``1e-10``.
    """

    mode: str
    group_size: int = 0
    ue8m0: bool = False
    ub: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"epilogue mode {self.mode!r} is not one of {MODES}")
        if (self.mode == "group") != (self.group_size > 0) or self.ue8m0 and self.mode != "group":
            raise ValueError(f"epilogue {self!r}: group_size and ue8m0 are for group scales only")
        if self.ub and self.mode != "token":
            raise ValueError(f"epilogue {self!r}: a bound applies to per-token scales only")

    @classmethod
    def of(cls, scale: Any, group_size: int, ue8m0: bool = False) -> "Epilogue":
        """The epilogue of a fused op's quant arguments (``scale`` a tensor or None, ``group_size`` -1 per token)."""
        if scale is not None:
            return cls("static")
        return cls("token") if group_size <= 0 else cls("group", group_size, bool(ue8m0))

    def __str__(self) -> str:  # the compile trace's key: static, tensor, token, token_ub, g128, g128_ue8m0
        if self.mode == "group":
            return f"g{self.group_size}" + ("_ue8m0" if self.ue8m0 else "")
        return self.mode + ("_ub" if self.ub else "")

    @property
    def reduces(self) -> bool:
        """Whether the scales depend on the values (a max is reduced)."""
        return self.mode in ("token", "group")

    @property
    def takes_scale(self) -> bool:
        """Whether the kernel reads a one-value fp32 tensor: the static scale, the max's bits, the bound."""
        return self.mode in ("static", "tensor") or self.ub

    def scale_bytes(self, n: int) -> int:
        """Bytes of scales a row of ``n`` values writes (0 for one scale a tensor)."""
        return 4 * (n // self.group_size if self.mode == "group" else self.mode == "token")


# ----------------------------------------------------------------------------------------------
# The numerics, as TIR expressions of fp32 values


def abs_bits(x: Any) -> Any:
    """The bits of ``|x|`` as an int32, ordered as the magnitudes (a NaN's above an infinity's)."""
    return T.reinterpret(x, "int32") & 0x7FFFFFFF


def _nan_min(a: Any, b: Any) -> Any:
    """``torch.minimum``: NaN if either is."""
    return T.if_then_else(T.isnan(a), a, T.if_then_else(T.isnan(b), b, T.min(a, b)))


def token_max(amax_bits: Any, ub: Any = None) -> Any:
    """``min(amax, ub)`` (``torch.minimum``: NaN if either is) of ``amax`` given by its bits."""
    amax = T.reinterpret(amax_bits, F32)
    return amax if ub is None else _nan_min(amax, ub)


def floor_scale(scale: Any) -> Any:
    """``max(scale, MIN_SCALE)``, a NaN kept (``clamp(min=)``; ``fmaxf`` would drop it)."""
    return T.if_then_else(T.isnan(scale), scale, T.max(scale, T.float32(MIN_SCALE)))


def group_scale(amax: Any) -> Any:
    """A group's ``amax / 448`` correctly rounded (``__fdiv_rn``)."""
    return T.ieee_fdiv(amax, T.float32(FP8_MAX))


def dynamic_scale(amax: Any) -> Any:
    """A per-token or per-tensor ``amax * fp32(1/448)``: the reference's product (what torch computes
    for ``amax / 448.0`` on CUDA), before the floor."""
    return amax * T.float32(INV_FP8_MAX)


def pow2_ceil(scale: Any) -> Any:
    """The power-of-two ceiling of a non-negative fp32 ``scale`` from its bits (UE8M0); NaN stays
    (unsigned: a NaN's bits plus the mantissa mask would overflow int32)."""
    up = T.reinterpret((T.reinterpret(scale, "uint32") + T.uint32(0x7FFFFF)) & T.uint32(INF_BITS), F32)
    return T.if_then_else(T.isnan(scale), scale, up)


def static_inverse(scale: Any) -> Any:
    """``1 / scale`` (IEEE), NaN where the scale is not positive and finite (tested on its bits: the
    negative ones, -0 and the NaNs of either sign fall outside ``(0, INF_BITS)``)."""
    bits = T.reinterpret(scale, "int32")
    nan = T.reinterpret(T.int32(0x7FC00000), F32)
    return T.if_then_else(T.And(bits > 0, bits < INF_BITS), T.ieee_frcp(scale), nan)


def _masked_bits(y: Any, ok: Any) -> Any:
    """:func:`abs_bits` of a stored value as an fp32, 0 where ``ok`` is false (a Python True: no test);
    a bf16's from its own bits (an fp32's upper half), so the fp32 values need not be kept."""
    if str(y.dtype) == "bfloat16":
        bits = T.shift_left(T.cast(T.reinterpret(y, "uint16"), "int32") & 0x7FFF, 16)
    else:
        bits = abs_bits(T.cast(y, F32))
    return bits if ok is True else T.if_then_else(ok, bits, 0)


def to_fp8(y: Any) -> Any:
    """``clamp(y, -448, 448).to(float8_e4m3fn)``: TileLang lowers the cast to ``cvt.rn.satfinite``."""
    return T.cast(y, FP8)


def eps_bits(eps: float = GROUP_EPS) -> int:
    """The bits of the fp32 group eps, where a group's max starts (the floor ``max(amax, eps)``)."""
    import struct

    return struct.unpack("<i", struct.pack("<f", eps))[0]


# ----------------------------------------------------------------------------------------------
# A row kernel's values and its tail


@dataclass(frozen=True)
class Tile:
    """How a row kernel's block holds its values: thread ``t`` works on row ``t // lanes`` of the
    block's ``rows``, on ``nv`` vectors of ``vec`` values, vector ``k`` at column ``(k * lanes + t %
    lanes) * vec`` of the span of ``width`` columns the block covers (a warp's lanes on consecutive
    vectors)."""

    vec: int
    lanes: int  # a power of two, or whole warps where a block holds one row
    nv: int
    rows: int = 1

    @property
    def threads(self) -> int:
        return self.lanes * self.rows

    @property
    def width(self) -> int:
        return self.nv * self.lanes * self.vec

    def column(self, k: Any, lane: Any) -> Any:
        """The first column of vector ``k`` of the thread at ``lane``, within the span."""
        return (k * self.lanes + lane) * self.vec


class Quantizer:
    """The quantising tail of a :class:`Tile` under an :class:`Epilogue`, for rows of ``n`` values.

    Its values (``yv``: a thread's ``(nv, vec)`` local buffer, rounded to the op's dtype) are grouped in
    *slots* that share a scale: one for ``static``/``tensor``/``token``; per group: a vector's ``vec /
    group_size`` groups, or one per vector whose group spans ``group_size / vec`` lanes, or one per
    ``group_size / (lanes * vec)`` vectors spanning every lane of the row. A ``token`` (or group) scale
    whose row (group) is wider than the span (``chunks`` spans) takes two passes: :meth:`fold` per span,
    then the scales, then the values again (the kernel recomputes them) for :meth:`store`.

    The macros are built once per instance: ``quantize(yv, live, row, row_ok, col0, Q, S, Sin, first)``
    (one span: fold, reduce, scales, store), or ``start(m)``, ``fold(yv, live, m)``, ``scales(m, inv,
    row, row_ok, col0, S, Sin, first)`` and ``store(yv, live, row, col0, inv, Q)``. ``live(k)``: whether
    vector ``k`` lies in the tensor (a Python True where the tiling proves it); ``row_ok``: whether the
    thread's row exists; ``first``: whether this is the grid's first thread (it copies a one-scale
    output); ``S``: the scales (``(1,)``, ``(T,)`` per token, ``(T, G)`` per group); ``Sin``: the
    one-value input (:attr:`Epilogue.takes_scale`), best loaded into a local buffer at the kernel's
    start (its latency then hides under the rows' loads), or None.
    """

    def __init__(self, tile: Tile, epi: Epilogue, n: int, chunks: int = 1):
        self.tile, self.epi, self.n, self.chunks = tile, epi, n, chunks
        vec, lanes, nv = tile.vec, tile.lanes, tile.nv
        g = epi.group_size
        if epi.mode == "group" and chunks == 1 and g <= vec:
            sub = vec // g
            slots, slot_lanes = nv * sub, 1

            def slot(k, v):
                return k * sub + v // g
        elif epi.mode == "group" and chunks == 1 and g <= lanes * vec:
            slots, slot_lanes = nv, g // vec

            def slot(k, v):
                return k
        elif epi.mode == "group" and chunks == 1 and g < tile.width:
            span = g // (lanes * vec)
            if nv % span:
                raise ValueError(f"{tile}: {nv} vectors a thread do not hold whole groups of {g}")
            slots, slot_lanes = nv // span, lanes

            def slot(k, v):
                return k // span
        else:  # one scale over the span(s): static, tensor, token, or a group as wide as the span or wider
            if epi.mode == "group" and g != tile.width * chunks:
                raise ValueError(f"{tile} x {chunks}: a group of {g} must fill the spans")
            slots, slot_lanes = 1, (lanes if epi.reduces else 1)

            def slot(k, v):
                return 0
        self.slots, self.slot_lanes, self.slot = slots, slot_lanes, slot
        L = slot_lanes
        WARPS = max(tile.threads // 32, 1)
        per_vector_slot = epi.mode == "group" and chunks == 1 and g < vec
        start_bits = eps_bits() if epi.mode == "group" else 0

        @T.macro
        def start(m):
            for s in T.unroll(slots):
                m[s] = start_bits

        @T.macro
        def fold(yv, live, m):
            for k in T.unroll(nv):
                for v in T.unroll(vec):
                    m[slot(k, v)] = T.max(m[slot(k, v)], _masked_bits(yv[k, v], live(k)))

        @T.macro
        def reduce(m):
            # shfl.xor within the lanes of a slot (redux.sync over a whole warp), then across warps
            # through shared memory: one barrier for every slot
            if L >= 32:
                for s in T.unroll(slots):
                    m[s] = T.warp_reduce_max(m[s])
            elif L > 1:
                for s in T.unroll(slots):
                    for o in T.unroll(L.bit_length() - 1):
                        m[s] = T.max(m[s], T.shfl_xor(m[s], 1 << o))
            if L > 32:
                red = T.alloc_shared((slots, WARPS), "int32")
                tid = T.get_thread_binding()
                for s in T.unroll(slots):
                    if tid % 32 == 0:
                        red[s, tid // 32] = m[s]
                T.sync_threads()
                for s in T.unroll(slots):
                    for w in T.unroll(L // 32):
                        m[s] = T.max(m[s], red[s, tid // 32 // (L // 32) * (L // 32) + w])

        @T.macro
        def scales(m, inv, row, row_ok, col0, S, Sin, first):
            tid = T.get_thread_binding()
            lane = tid % lanes
            sc = T.alloc_local((slots,), F32)
            if epi.mode == "static":
                sc[0] = Sin[0]
                inv[0] = static_inverse(sc[0])
            elif epi.mode == "tensor":
                sc[0] = dynamic_scale(Sin[0])  # the max, its bits seen as fp32
                sc[0] = floor_scale(sc[0])
                inv[0] = T.ieee_frcp(sc[0])
            else:
                for s in T.unroll(slots):
                    if epi.mode == "token":  # max(min(amax, ub) * fp32(1/448), MIN_SCALE)
                        sc[s] = dynamic_scale(token_max(m[s], Sin[0] if epi.ub else None))
                        sc[s] = floor_scale(sc[s])
                    else:  # max(amax, eps) / 448: m started at eps's bits
                        sc[s] = group_scale(T.reinterpret(m[s], F32))
                        if epi.ue8m0:
                            sc[s] = pow2_ceil(sc[s])
                    inv[s] = T.ieee_frcp(sc[s])
            if not epi.reduces:
                if first:
                    S[0] = sc[0]
            elif epi.mode == "token":
                if row_ok:
                    if lane == 0:
                        S[row] = sc[0]
            elif per_vector_slot:
                if row_ok:
                    for s in T.unroll(slots):
                        if col0 + tile.column(s // (vec // g), lane) + s % (vec // g) * g < n:
                            S[row, (col0 + tile.column(s // (vec // g), lane)) // g + s % (vec // g)] = sc[s]
            else:  # the slot's first vector, on its group's first lane
                if row_ok:
                    if lane % L == 0:
                        for s in T.unroll(slots):
                            if col0 + tile.column(s * nv // slots, lane) < n:
                                S[row, (col0 + tile.column(s * nv // slots, lane)) // g] = sc[s]

        @T.macro
        def store(yv, live, row, col0, inv, Q):
            tid = T.get_thread_binding()
            lane = tid % lanes
            qv = T.alloc_local((nv, vec), FP8)
            for k in T.unroll(nv):
                if live(k):
                    if per_vector_slot:
                        for v in T.unroll(vec):
                            qv[k, v] = to_fp8(T.cast(yv[k, v], F32) * inv[slot(k, v)])
                    else:
                        for v in T.vectorized(vec):
                            qv[k, v] = to_fp8(T.cast(yv[k, v], F32) * inv[slot(k, 0)])
                    for v in T.vectorized(vec):
                        Q[row, col0 + tile.column(k, lane) + v] = qv[k, v]

        @T.macro
        def quantize(yv, live, row, row_ok, col0, Q, S, Sin, first):
            inv = T.alloc_local((slots,), F32)
            m = T.alloc_local((slots,), "int32")
            if epi.reduces:
                start(m)
                fold(yv, live, m)
                reduce(m)
            scales(m, inv, row, row_ok, col0, S, Sin, first)
            store(yv, live, row, col0, inv, Q)

        self.start, self.fold, self.reduce, self.scales, self.store, self.quantize = (
            start, fold, reduce, scales, store, quantize)


# ----------------------------------------------------------------------------------------------
# Tiling of the standalone row kernels


#: threads a block of the row kernels (short rows share one, several rows to it)
BLOCK_THREADS = 128
#: threads a row at most
MAX_LANES = 1024
#: a thread's values held in registers, in bytes of the op's dtype: 64 bf16 or 32 fp32 (32 registers)
MAX_THREAD_BYTES = 128


@dataclass(frozen=True)
class Plan:
    """A row kernel's launch: the :class:`Tile` of a block, ``col_tiles`` blocks along a row (each a
    span of ``tile.width`` columns, or of ``chunks`` spans walked twice where one scale covers more)."""

    tile: Tile
    col_tiles: int
    chunks: int = 1

    @property
    def segment(self) -> int:
        """Columns one block covers."""
        return self.tile.width * self.chunks


def _pow2_at_most(x: int) -> int:
    return 1 << max(x, 1).bit_length() - 1


def plan(n: int, dtype: str, epi: Epilogue, vectors: int = 2, block_threads: int = BLOCK_THREADS,
         warp_lanes: int = 0) -> Plan:
    """The tiling of a row kernel over rows of ``n`` values of ``dtype`` under ``epi``, about ``vectors``
    vectors a thread. Values without a row-wide scale tile the row in spans of ``block_threads`` threads
    (short rows several to a block; a group wider than a span takes more lanes, then more vectors, then
    two passes); a per-token scale takes the whole row in one block, tiled exactly where a power of two
    of threads allows (7168 bf16: 128 threads of 7 vectors, not 512 over 8192 columns), in two passes
    where a thread would hold more than :data:`MAX_THREAD_BYTES` at 1024 threads; or, where a power of two
    of threads would hold more than ``vectors`` vectors a thread, in whole warps of ``vectors`` that tile
    it exactly, up to ``warp_lanes`` threads (7168 bf16 at 512: 448 threads of 2)."""
    vec = _jit.vector_width(n, dtype)
    nvec = n // vec
    max_nv = max(1, MAX_THREAD_BYTES // (vec * _jit.ELEMENT_BYTES[dtype]))
    if epi.mode == "token":
        lanes = min(MAX_LANES, _pow2_at_most(-(-nvec // vectors)))
        exact = lanes
        while nvec % exact and exact > 1 and -(-nvec // (exact // 2)) <= max_nv:
            exact //= 2
        if nvec % exact == 0:
            lanes = exact
        nv, chunks = -(-nvec // lanes), 1
        if nv > vectors and nvec % (32 * vectors) == 0 and block_threads <= nvec // vectors <= warp_lanes:
            return Plan(Tile(vec, nvec // vectors, vectors), 1)
        if nv > max_nv:  # two passes over spans of at most max_nv vectors a thread
            chunks = -(-nv // max_nv)
            nv = -(-nv // chunks)
        return Plan(Tile(vec, lanes, nv, max(1, block_threads // lanes)), 1, chunks)
    span = min(1 << (nvec - 1).bit_length(), block_threads * vectors)  # vectors a block's row covers
    nv = min(vectors, span)
    lanes = span // nv
    if epi.mode == "group" and span * vec < epi.group_size:
        g = epi.group_size // vec  # vectors a group
        lanes = min(MAX_LANES, g // nv)
        nv = min(max(nv, g // lanes), max_nv)
        width = lanes * nv * vec
        if width < epi.group_size:  # two passes over each group
            return Plan(Tile(vec, lanes, nv, 1), n // epi.group_size, epi.group_size // width)
        return Plan(Tile(vec, lanes, nv, 1), n // width, 1)
    tile = Tile(vec, lanes, nv, max(1, block_threads // lanes))
    return Plan(tile, -(-n // tile.width), 1)


def live_vector(plan_: Plan, n: int, num_tokens: Any, row: Any, col0: Any, lane: Any) -> Callable[[Any], Any]:
    """``live(k)`` of a row kernel: vector ``k`` inside a ``(num_tokens, n)`` tensor (a Python True where
    the tiling proves it)."""
    tile = plan_.tile
    rows_ok = True if tile.rows == 1 else row < num_tokens  # one row a block: its row exists
    cols_ok = n % plan_.segment == 0

    def live(k: Any) -> Any:
        if cols_ok:
            return rows_ok
        ok = col0 + tile.column(k, lane) < n
        return ok if rows_ok is True else T.And(rows_ok, ok)
    return live


def bytes_per_token(n_in: int, n_out: int, dtype: str, epi: Epilogue) -> int:
    """Bytes a row moves: ``n_in`` values of ``dtype`` read, ``n_out`` fp8 and the scales written."""
    return n_in * _jit.ELEMENT_BYTES[dtype] + n_out + epi.scale_bytes(n_out)



def row_kernel(name: str, n: int, in_cols: int, dtype: str, epi: Epilogue, plan_: Plan, produce: Any,
               config: Any, moved: int) -> Any:
    """The prim_func ``name(X, Q, S[, Sin])`` of a standalone row kernel: ``X`` ``(T, in_cols)`` rows of
    ``dtype`` (last dim contiguous, row stride a multiple of the vector from two rows on: the launchers
    copy other rows), ``Q`` ``(T, n)`` fp8 contiguous, ``S`` the scales (``(1,)``, ``(T,)`` per token,
    ``(T, n / group_size)`` through its strides per group), ``Sin`` the one-value input where
    :attr:`Epilogue.takes_scale`. ``produce(X, yv, live, row, col0)`` (a macro) fills the thread's
    ``yv`` ``(nv, vec)`` with its outputs at the tile's columns from ``col0``, rounded to ``dtype``
    (vectors with ``live(k)`` false may be left as they are). ``config``: the family's
    :class:`tilelang_jit.LaunchConfig`; ``moved``: bytes a row moves (the early trigger's window)."""
    pdl = _jit.dependent_launch()
    tile = plan_.tile
    VEC, LANES, NV, BM = tile.vec, tile.lanes, tile.nv, tile.rows
    COL_TILES, CHUNKS, SPAN = plan_.col_tiles, plan_.chunks, tile.width
    quant = Quantizer(tile, epi, n, CHUNKS)
    # a row's values wait in registers for its scale: two blocks an SM, so that one loads while the
    # other reduces (silu 14336 bf16 per token: 146 registers a thread, one block of 256, without)
    MIN_BLOCKS = 2 if epi.mode == "token" and tile.threads <= 512 else 1
    Tn = T.dynamic("num_tokens")
    sx = T.dynamic("x_row_stride", "int64")
    if epi.mode == "group":
        s_t, s_g = T.dynamic("s_token_stride, s_group_stride", "int64")
        S_type = T.StridedTensor((Tn, n // epi.group_size), (s_t, s_g), F32)
    else:
        S_type = T.Tensor((Tn,) if epi.mode == "token" else (1,), F32)

    @T.macro
    def body(X, Q, S, Sin):
        # rows start on a vector from two rows on (the host code checks it); the view's stride, rounded
        # down to the vector, moves no address and lets TileLang prove 16-byte accesses
        T.assume(T.Or(Tn <= 1, sx % VEC == 0))
        Xa = T.view(X, strides=(sx // VEC * VEC, 1))
        with T.Kernel(T.ceildiv(Tn, BM) * COL_TILES, threads=tile.threads) as block:
            if MIN_BLOCKS > 1:
                T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            if pdl:  # before any access: see tilelang_jit.dependent_launch
                T.pdl_sync()
            if _jit.triggers_early(Tn, moved, config):  # see tilelang_jit.EARLY_TRIGGER
                T.pdl_trigger()
            tid = T.get_thread_binding()
            row = block // COL_TILES * BM + tid // LANES
            col0 = block % COL_TILES * (SPAN * CHUNKS)
            first = T.And(block == 0, tid == 0)
            row_ok = True if BM == 1 else row < Tn
            yv = T.alloc_local((NV, VEC), dtype)
            sv = T.alloc_local((1,), F32)  # the one-value input, loaded first: its latency under the rows'
            if epi.takes_scale:
                sv[0] = Sin[0]
            if CHUNKS == 1:
                live = live_vector(plan_, n, Tn, row, col0, tid % LANES)
                produce(Xa, yv, live, row, col0)
                quant.quantize(yv, live, row, row_ok, col0, Q, S, sv, first)
            else:  # one scale over more than the registers hold: its max first, then the values again
                m = T.alloc_local((1,), "int32")
                inv = T.alloc_local((1,), F32)
                quant.start(m)
                for c in T.serial(CHUNKS):
                    produce(Xa, yv, live_vector(plan_, n, Tn, row, col0 + c * SPAN, tid % LANES), row, col0 + c * SPAN)
                    quant.fold(yv, live_vector(plan_, n, Tn, row, col0 + c * SPAN, tid % LANES), m)
                quant.reduce(m)
                quant.scales(m, inv, row, row_ok, col0, S, sv, first)
                for c in T.serial(CHUNKS):
                    produce(Xa, yv, live_vector(plan_, n, Tn, row, col0 + c * SPAN, tid % LANES), row, col0 + c * SPAN)
                    quant.store(yv, live_vector(plan_, n, Tn, row, col0 + c * SPAN, tid % LANES), row,
                                col0 + c * SPAN, inv, Q)

    if epi.takes_scale:
        @T.prim_func
        def fp8_rows(
            X: T.StridedTensor((Tn, in_cols), (sx, 1), dtype),  # input rows, read
            Q: T.Tensor((Tn, n), FP8),  # written, contiguous
            S: S_type,  # the scales, written
            Sin: T.Tensor((1,), F32),  # the static scale, the max's bits (as fp32), or the bound; read
        ):
            body(X, Q, S, Sin)
    else:
        @T.prim_func
        def fp8_rows(
            X: T.StridedTensor((Tn, in_cols), (sx, 1), dtype),  # input rows, read
            Q: T.Tensor((Tn, n), FP8),  # written, contiguous
            S: S_type,  # the scales, written
        ):
            body(X, Q, S, None)
    return fp8_rows.with_attr("global_symbol", name)
