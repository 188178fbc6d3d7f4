"""What every route of the sampling kernels shares: a value's sanitised bit pattern, its fixed-point
mass, the Philox stream, the top-p test, the searches in registers, and the compaction of a bracket of
patterns into the row's buffer."""

import triton
import triton.language as tl

from ..reference import ONE_EXPONENT as _ONE

#: the exponent field of 1.0, at or above which ``sampling_from_probs``' masses sit
ONE_EXPONENT = tl.constexpr(_ONE)


@triton.jit
def row_value(arg, stride, row, PER_ROW: tl.constexpr, DTYPE: tl.constexpr):
    """``arg[row * stride]`` of a per-row tensor, or ``arg`` itself where one scalar serves every row
    (the schemas' ``maybe_<x>_arr`` / ``<x>_val``: a scalar reaches the kernel as an argument, no
    tensor made of it), as ``DTYPE``. Kernels list such arguments in ``do_not_specialize``: a 1 would
    be a constant."""
    if PER_ROW:
        value = tl.load(arg + row * stride).to(DTYPE)
    else:
        value = tl.cast(arg, DTYPE)
    return value


@triton.jit
def row_top_k(top_k_ptr, top_k_stride, row, V, K_ARR: tl.constexpr):
    """The row's top-k as an int32 in ``[1, V]``: ``<= 0`` or ``>= V`` keeps the whole row (``V``)."""
    k64 = row_value(top_k_ptr, top_k_stride, row, K_ARR, tl.int64)
    return tl.where((k64 > 0) & (k64 < V), k64, V).to(tl.int32)


@triton.jit
def _value_bits(row_ptr, cols, mask):
    """int32 bit patterns of the sanitised values (NaN/negative -> 0, +inf -> FLT_MAX); -1 where masked."""
    p = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # fp16/bf16: exact
    p = tl.where(p > 0, tl.minimum(p, 3.4028234663852886e38), 0.0)
    return tl.where(mask, p.to(tl.int32, bitcast=True), -1)


@triton.jit
def _slice_max_bits(row_ptr, lo, hi, CHUNK: tl.constexpr):
    """The largest sanitised pattern (``_value_bits``) of columns ``[lo, hi)`` of a row, -1 for none."""
    offs = tl.arange(0, CHUNK)
    mx = tl.full((), -1, tl.int32)
    for start in range(lo, hi, CHUNK):
        cols = start + offs
        mx = tl.maximum(mx, tl.max(_value_bits(row_ptr, cols, cols < hi), axis=0))
    return mx


@triton.jit
def _row_max_bits(row_ptr, V, CHUNK: tl.constexpr):
    """The largest sanitised pattern (``_value_bits``) of a row of ``V`` values, -1 for an empty row."""
    return _slice_max_bits(row_ptr, 0, V, CHUNK)


@triton.jit
def slices_max_bits(mx_ptr, row, S, BLOCK_S: tl.constexpr):
    """The row's largest pattern from its ``S`` slices' (``mx[row, :S]``, -1 for none)."""
    jj = tl.arange(0, BLOCK_S)
    return tl.max(tl.load(mx_ptr + row * S + jj, mask=jj < S, other=-1), axis=0)


@triton.jit
def slice_of_target(masses, jj, S, target):
    """``(js, base)``: the first of the ``S`` slices (``masses`` at ``jj``, int64, 0 past ``S``) whose
    cumulative mass exceeds ``target``, ``S`` if none, and the mass of the slices before it."""
    cum = tl.cumsum(masses, axis=0)
    js = tl.min(tl.where((cum > target) & (jj < S), jj, S), axis=0)
    return js, tl.sum(tl.where(jj < js, masses, 0), axis=0)


@triton.jit
def _fixed(bits, e_max, q_bits):
    """int64 ``floor(p * 2^s)``: the row's largest value (exponent field ``e_max``) maps to
    ``[2^(q_bits-1), 2^q_bits)``; 0 for bits <= 0 (zero or masked)."""
    exp = bits >> 23
    m = ((bits & 0x7FFFFF) | tl.where(exp > 0, 0x800000, 0)).to(tl.int64)
    shift = tl.maximum(exp, 1) - e_max + (q_bits - 24)
    left = m << tl.maximum(shift, 0).to(tl.int64)
    right = m >> tl.minimum(tl.maximum(-shift, 0), 31).to(tl.int64)
    return tl.where(bits > 0, tl.where(shift >= 0, left, right), 0)


# A slice's fixed-point mass summed in fp64: each value is an fp64 integer below 2^44 and the sums of such
# non-negative integers are exact while they stay below 2^53, which a total below 2^52 proves; a slice
# past it sums again in int64. 34.8 against 55.3 µs at 256 x 128256 (sampling_from_probs' slice pass,
# H200; a plain read 31.5): the int64 shifts and selects of _fixed set the pass's time, not its reads.
F64_EXACT = tl.constexpr(4503599627370496.0)  # 2^52
MASS_CHUNK = 1024  # values a step of the fp64 mass passes at 4 warps: 34.8 against 49.2 µs at 2048 (as above)


@triton.jit
def _fixed_f64(bits, e_max, q_bits):
    """``_fixed`` as an fp64 integer, ``floor(p * 2^s)``: exact for a value at or below the exponent
    field ``e_max`` (below ``2^q_bits``, a product by a power of two, floored); 0 for bits <= 0."""
    p = tl.maximum(bits, 0).to(tl.float32, bitcast=True).to(tl.float64)
    scale = ((q_bits - 1 - e_max + 127 + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # 2^s
    return tl.floor(p * scale)


@triton.jit
def f64_mass(acc):
    """``(the int64 sum of the fp64 integer masses acc, whether it may be inexact)``: exact below 2^52
    (``F64_EXACT``); past it the caller sums again in int64."""
    total = tl.sum(acc, axis=0)
    return total.to(tl.int64), total >= F64_EXACT


@triton.jit
def kept_slice_mass(row_ptr, lo, hi, slice_max, thr, e_max, q_bits, CHUNK: tl.constexpr):
    """The int64 fixed-point mass (at ``e_max``, the row's largest exponent field) of the patterns
    ``>= thr`` in columns ``[lo, hi)`` of a row whose values there reach ``slice_max`` at most: 0
    without a read where ``slice_max < thr``, summed in fp64 (``F64_EXACT``)."""
    offs = tl.arange(0, CHUNK)
    end = tl.where(slice_max >= thr, hi, lo)
    acc = tl.zeros((CHUNK,), tl.float64)
    for start in range(lo, end, CHUNK):
        cols = start + offs
        b = _value_bits(row_ptr, cols, cols < hi)
        acc += tl.where(b >= thr, _fixed_f64(b, e_max, q_bits), 0.0)
    mass, inexact = f64_mass(acc)
    if inexact:
        acc64 = tl.zeros((CHUNK,), tl.int64)
        for start in range(lo, end, CHUNK):
            cols = start + offs
            b = _value_bits(row_ptr, cols, cols < hi)
            acc64 += tl.where(b >= thr, _fixed(b, e_max, q_bits), 0)
        mass = tl.sum(acc64, axis=0)
    return mass


@triton.jit
def kept_slice_draw(row_ptr, lo, hi, thr, e_max, q_bits, base, target, CHUNK: tl.constexpr):
    """The first column of ``[lo, hi)`` where the cumulative fixed-point mass (at ``e_max``) of the
    patterns ``>= thr``, from ``base``, exceeds ``target``; 0 where none does (a row without mass: the
    reference's token). The scan stops reading at the chunk that holds it."""
    token = tl.full((), 2147483647, tl.int32)
    offs = tl.arange(0, CHUNK)
    for start in range(lo, hi, CHUNK):
        if token == 2147483647:
            cols = start + offs
            b = _value_bits(row_ptr, cols, cols < hi)
            cum = base + tl.cumsum(tl.where(b >= thr, _fixed(b, e_max, q_bits), 0), axis=0)
            token = tl.min(tl.where(cum > target, cols, 2147483647), axis=0)
            base = tl.max(cum, axis=0)
    return tl.where(token == 2147483647, 0, token)


@triton.jit
def exponent_from_one(mx):
    """The exponent field ``sampling_from_probs``' masses sit at for a row whose largest pattern is ``mx``:
    the larger of its and 1.0's (``reference.ONE_EXPONENT``)."""
    return tl.maximum(mx >> 23, ONE_EXPONENT)


@triton.jit
def philox_w01(seed, offset, row, c3):
    """Words 0 and 1 of Philox4x32-10, counter ``(row, offset_lo, offset_hi, c3)`` (uint32 ``c3``), key
    ``(seed_lo, seed_hi)``. Written out (not ``tl.randint``) so the stream cannot change with the Triton
    version."""
    c0 = row.to(tl.uint32)
    c1 = (offset & 0xFFFFFFFF).to(tl.uint32)
    c2 = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(10):
        _c0, _c2 = c0, c2
        c0 = tl.umulhi(_c2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(_c0, 0xD2511F53) ^ c3 ^ k1
        c1 = _c2 * 0xCD9E8D57
        c3 = _c0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1


@triton.jit
def _random_bits31(seed_ptr, offset_ptr, row, PER_ROW: tl.constexpr = False):
    """31 random bits: word 0 of Philox4x32-10 with counter (row, offset_lo, offset_hi, 0), key (seed_lo, seed_hi);
    ``PER_ROW``: the row's own seed and offset (``(B,)`` tensors) and row word 0, its draw alone."""
    seed, offset, c0 = rng_row(seed_ptr, offset_ptr, row, PER_ROW)
    c0, _ = philox_w01(seed, offset, c0, row.to(tl.uint32) * 0)
    return (c0 >> 1).to(tl.int64)


@triton.jit
def rng_row(seed_ptr, offset_ptr, row, PER_ROW: tl.constexpr):
    """``(seed, offset, counter row word)`` of a row (``reference.rng_rows``)."""
    if PER_ROW:
        seed = tl.load(seed_ptr + row)
        offset = tl.load(offset_ptr + row)
        c0 = row * 0
    else:
        seed = tl.load(seed_ptr)
        offset = tl.load(offset_ptr)
        c0 = row
    return seed, offset, c0


def rng_tensors(seed, offset, rows: int):
    """``(seed, offset, per_row)`` for the kernels: one-element tensors as they are, or, where either
    holds one value a row, both as contiguous ``(rows,)`` (a broadcast one expanded on the device)."""
    if seed.numel() == 1 and offset.numel() == 1:
        return seed, offset, False
    return seed.reshape(-1).expand(rows).contiguous(), offset.reshape(-1).expand(rows).contiguous(), True


@triton.jit
def _target(r31, mass):
    """``floor(r31 * mass / 2^31)`` exactly, for mass < 2^62."""
    return r31 * (mass >> 31) + ((r31 * (mass & 0x7FFFFFFF)) >> 31)


@triton.jit
def _top_p_pred(g, limit):
    """The top-p test of a value whose larger survivors have mass ``g``: kept iff this is true."""
    return (g == 0) | (g.to(tl.float64) < limit)


# Bisection, one block-wide reduction a step: four pivots a step made _filter_kernel slower (9.4 -> 11.9 µs).
@triton.jit
def _kth_in_registers(vb, k, lo, hi, c_above):
    """The largest pattern in ``[lo, hi)`` with ``count(vb >= it) + c_above >= k`` (bisection; ``lo``
    qualifies). ``vb``: the candidate patterns (-1 in unused slots), ``c_above``: values >= hi not in ``vb``."""
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        c = tl.sum((vb >= mid).to(tl.int32), axis=0) + c_above
        lo = tl.where(c >= k, mid, lo)
        hi = tl.where(c >= k, hi, mid)
    return lo


@triton.jit
def _top_p_in_registers(vb, q, limit, lo, hi, g_lo, g_above):
    """The smallest pattern in ``(lo, hi]`` that passes the top-p test (``lo`` fails, ``hi`` passes),
    and the mass above the pattern just below it (the kept mass). ``vb``/``q``: the patterns in
    ``(lo, hi]`` and their masses; ``g_lo``/``g_above``: the mass above ``lo``/``hi``."""
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        g = tl.sum(tl.where(vb > mid, q, 0), axis=0) + g_above
        ok = _top_p_pred(g, limit)
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid)
        g_lo = tl.where(ok, g_lo, g)
    return hi, g_lo


@triton.jit
def _compact(row_ptr, V, lo, hi, dst, CHUNK_G: tl.constexpr, CAP: tl.constexpr):
    """Store the row's patterns ``lo < b <= hi`` at ``dst`` in index order (the caller has counted at
    most ``CAP``); returns how many."""
    offs = tl.arange(0, CHUNK_G)
    n = 0
    for start in range(0, V, CHUNK_G):
        cols = start + offs
        b = _value_bits(row_ptr, cols, cols < V)
        sel = (b > lo) & (b <= hi)
        cnt = tl.sum(sel.to(tl.int32), axis=0)
        if cnt > 0:
            pos = n + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(dst + pos, b, mask=sel & (pos < CAP))
            n += cnt
    tl.debug_barrier()
    return tl.minimum(n, CAP)
