"""The histogram route (``V > Config.cap``, top-p, top-k keeping the whole row: all of
``top_p_renorm_probs``; sampling rows with ``top_k <= 0`` or ``>= V`` only with
``Config.hist_with_top_k``): the full-pass route's searches are one program reading the row once a
round (~340 µs a row on the H200), so four small launches find the top-p threshold's bracket in
parallel, exactly:

1. ``_hist_prepass_kernel`` (grid ``(B, hist_slices)``): each slice's largest pattern, which fixes the
   row's fixed point (``e_max``: the masses below need it, and a per-slice fixed point would not sum
   exactly); the slice's fp32 mass at or above ``hist_levels`` exponent boundaries
   ``hist_level_octaves`` apart (aligned alike in every slice); zeroes the row's histogram. One read.
2. ``_hist_kernel`` (same grid): from the levels, a fine window ``[A, Z)`` of patterns where the
   threshold surely lies (fp32 sums with a proven slack; usually one 2-octave level); the exact
   fixed-point mass (int64) and count per fine bucket of the window (``hist_buckets - 2`` of them, by
   relaxed atomics: integer sums, exact in any order), and of the two lumps below and above it (one
   atomic a slice): ~5-10K atomics a row for a softmax of randn * 3 at p = 0.9, where bucketing all 32
   octaves took two a value and was atomic-throughput bound. Thresholds below the levels' reach
   (p = 0.99 on randn * 3, p = 1) get a window from 0 and that cost.
3. ``_hist_bracket_kernel`` (grid ``(B,)``): scans a row's buckets for the one where the top-p test
   turns (a prefix sum): ``lo`` failing and ``hi`` passing, with the exact masses and counts above
   them, the invariants of the full-pass route's search. The window only decides which bucket that
   is, so exactness never depends on the fp32 levels.
4. ``_bracket_compact_kernel`` (grid ``(B, hist_slices)``): when the bracket holds at most ``cap``
   values (~5 at p = 0.9 for a softmax of randn * 3 at V = 128256: buckets of 1/512 octave), each slice
   appends its own to the row's buffer (slots from an atomic counter; the order does not matter to
   sums and counts).

The filter kernel then ends the search in registers (``_hist_row``: ``_top_p_in_registers`` over the
bracket's ``2^sh`` patterns, 14 bisection steps for a 2-octave window), or, when the bracket is larger
(ties, flat rows, a threshold among many tiny values), goes on with the exact full-pass search inside
it. Sampling leaves the row's threshold, ``e_max`` and target (``draw``) to two more launches on the same
slices: ``_kept_mass_kernel`` sums each slice's kept fixed-point mass, ``_kept_draw_kernel`` finds the
slice that holds the target and scans it alone, where the filter kernel's one program scanned the row
up to the token (58 of 77 µs at one row of 128256, p = 0.9, on the H200).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import fixed_point_bits
from ._common import (_fixed, _target, _top_p_in_registers, _top_p_pred, _value_bits, kept_slice_draw, kept_slice_mass,
                      row_value, slice_of_target)
from .candidates import _stride
from .config import Config
from .pivots import _exact_top_p


@triton.jit(do_not_specialize=["top_k_ptr"])
def _hist_prepass_kernel(
    probs_ptr, probs_row_stride,  # (B, V) fp32 rows, last dim contiguous
    top_k_ptr, top_k_stride,  # (B,) int32/int64 (read when HAS_K): the route takes rows that keep all
    hist_max_ptr,  # (B, SLICES) int32 out: each slice's largest pattern; -1 everywhere: not on the route
    hist_level_ptr,  # (B, SLICES, LEVELS + 1) fp32 out: the slice's mass at or above each level boundary, then all of it
    hist_mass_ptr, hist_count_ptr,  # (B, NB) int64 / int32 out: zeroed for the rows on the route
    fill_ptr,  # (B,) int32 out: zeroed (the compaction's slot counter)
    V, L,  # vocabulary size; values a slice: cdiv(V, SLICES)
    HAS_K: tl.constexpr, SLICES: tl.constexpr, SLICE: tl.constexpr,  # SLICE: next power of two >= L
    NB: tl.constexpr, ZERO: tl.constexpr,  # buckets a row; buckets a slice zeroes (cdiv(NB, SLICES), a power of two)
    LEVELS: tl.constexpr, LEVEL_OCT: tl.constexpr,  # level boundaries a slice, octaves between them
    K_ARR: tl.constexpr = True,  # top_k a (B,) tensor, else an int for every row
):
    """Histogram route, launch 1 of 4 (grid ``(B, SLICES)``): the slice's largest pattern, which
    fixes the row's fixed point (``e_max``) for the histogram; the slice's fp32 mass at or above
    ``LEVELS`` exponent boundaries ``LEVEL_OCT`` octaves apart below its largest value (and its whole
    fp32 mass), from which ``_hist_kernel`` places the row's fine window; and the row's histogram
    zeroed, a part by each slice, so that no memset launch is needed.

    The levels cost ``LEVELS`` compares, selects and fp32 adds a value and ``LEVELS`` more block
    reductions (~30 instructions a value at 8 levels, ~250M at 64 rows: ~8 µs of the H200's integer
    and fp32 issue, and 56 registers a thread: 4 programs an SM, 64 KB of loads in flight), under the
    read of the row from HBM that this kernel pays: measured 2.6/5.3/17.1 µs at 1/32/64 rows before
    the levels. The jump at 64 rows is HBM: 33 MB of probs no longer stay in the 50 MB L2 beside the
    previous call's 33 MB of renormalised rows, whose write-back streams out at the same time
    (~66 MB in 17 µs: ~3.9 TB/s), so little is left to gain here.
    Predicted with the levels: ~3.5/6/18 µs."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    on = True
    if HAS_K:
        k = row_value(top_k_ptr, top_k_stride, row, K_ARR, tl.int64)
        on = (k <= 0) | (k >= V)
    cols = s * L + tl.arange(0, SLICE)
    end = tl.where(on, tl.minimum(s * L + L, V), 0)  # (a scalar folded into the bound: see the slice prepass)
    b = _value_bits(probs_ptr + row * probs_row_stride, cols, cols < end)
    mx = tl.max(b, axis=0)
    tl.store(hist_max_ptr + row * SLICES + s, mx)  # -1: off the route (or an empty slice)
    p = tl.where(b > 0, b.to(tl.float32, bitcast=True), 0.0)
    # the levels' top: the exponent (a multiple of LEVEL_OCT) just above the slice's largest; boundaries
    # top - i * LEVEL_OCT, aligned alike in every slice, so that the slices' sums at one boundary add up
    # (written out here and in _fine_window: a helper call costs the interpreter more than the arithmetic)
    top = ((mx >> 23) + LEVEL_OCT) // LEVEL_OCT * LEVEL_OCT
    lv = hist_level_ptr + (row * SLICES + s) * (LEVELS + 1)
    # one level at a time: a [LEVELS, SLICE] select and sum took 92 registers a thread (2 programs an
    # SM), this 1-D form keeps the kernel near its old 32 (8 programs an SM, the loads of 8 in flight)
    for lvl in tl.static_range(LEVELS):
        piv = tl.maximum(top - (lvl + 1) * LEVEL_OCT, 0) << 23
        tl.store(lv + lvl, tl.sum(tl.where(b >= piv, p, 0.0), axis=0))
    tl.store(lv + LEVELS, tl.sum(p, axis=0))
    z = s * ZERO + tl.arange(0, ZERO)
    z_end = tl.where(on, NB, 0)
    tl.store(hist_mass_ptr + row * NB + z, tl.zeros([ZERO], dtype=tl.int64), mask=z < z_end)
    tl.store(hist_count_ptr + row * NB + z, tl.zeros([ZERO], dtype=tl.int32), mask=z < z_end)
    tl.store(fill_ptr + row, 0, mask=s == 0)


@triton.jit
def _fine_window(hist_max_ptr, hist_level_ptr, top_p, row,
                 SLICES: tl.constexpr, LEVELS: tl.constexpr, LEVEL_OCT: tl.constexpr, NB: tl.constexpr):
    """``(A, Z, sh, mx)`` of a row: the fine window ``[A, Z)`` of bit patterns where the top-p threshold
    surely lies, and the log2 ``sh`` of the patterns a fine bucket, so that ``NB - 2`` buckets cover it.

    From the prepass's fp32 level sums: at the row's boundary ``i`` (exponent ``top - i * LEVEL_OCT``)
    slice ``s`` contributes 0 when the boundary is above its own top, its sum at its level ``i - d_s``
    when it has one, and between its last level's sum and its whole sum when the boundary is below its
    levels. ``A``: the highest boundary whose mass at or above it (a lower bound) surely fails the top-p
    test, ``Z``: the lowest whose mass (an upper bound) surely passes (no mass at all, or less than the
    limit). "Surely": beyond ``slack = M * 2^-16``, which covers the fp32 sums' rounding (at most ~30
    roundings of 2^-24 each on the way: 16 values a thread, 8 + 3 reduction steps, the slices in fp64),
    the fixed point's (< V units of 2^-(Q-1) of the largest value: < 2^-26 of ``M`` at V = 128256) and
    the fp64 product. A boundary is a bucket edge, so the exact histogram then agrees with these facts;
    but nothing depends on it: where it would not, the exact bracket lands in a lump and the filter
    kernel's exact fallback narrows it. Where no boundary surely fails, ``A = 0``: the window reaches
    down to pattern 0 and holds nearly every value, as the old fixed 32-octave window did. The same integer and fp32 arithmetic in every program
    of the row: every program finds the same window."""
    sl = tl.arange(0, SLICES)
    mxs = tl.load(hist_max_ptr + row * SLICES + sl)
    mx = tl.max(mxs, axis=0)
    top = ((mx >> 23) + LEVEL_OCT) // LEVEL_OCT * LEVEL_OCT  # the row's levels' top (the prepass's, for mx)
    d = top // LEVEL_OCT - ((mxs >> 23) + LEVEL_OCT) // LEVEL_OCT  # >= 0: the slice's levels start d boundaries lower
    i = tl.arange(0, LEVELS) + 1
    own = i[:, None] - d[None, :]  # [LEVELS, SLICES]: the slice's own level index of the row's boundary i
    lv = hist_level_ptr + (row * SLICES + sl) * (LEVELS + 1)
    g_own = tl.load(lv[None, :] + tl.minimum(tl.maximum(own, 1), LEVELS) - 1)
    tot = tl.load(lv + LEVELS)
    # (lower and upper bounds summed together, a and z found together: each reduction is a helper
    # call to Triton's interpreter, which the CPU tests pay in every program)
    low_s = tl.where(own <= 0, 0.0, g_own).to(tl.float64)
    up_s = tl.where(own <= 0, 0.0, tl.where(own <= LEVELS, g_own, tot[None, :])).to(tl.float64)
    g_low, g_up = tl.split(tl.sum(tl.join(low_s, up_s), axis=1))
    m = tl.sum(tot.to(tl.float64), axis=0)
    limit = top_p * m
    slack = m * 1.52587890625e-05  # 2^-16
    fails = (g_low - slack >= limit) & (g_low - slack > 0)  # (non-finite sums: never sure)
    passes = (g_up == 0) | (g_up + slack < limit)
    piv = tl.maximum(top - i * LEVEL_OCT, 0).to(tl.int64) << 23
    top_pattern = top.to(tl.int64) << 23  # above the row's largest value: no mass, passes
    a, neg_z = tl.split(tl.max(tl.join(tl.where(fails, piv, 0), -tl.where(passes, piv, top_pattern)), axis=0))
    z = -neg_z
    bad = z <= a  # (cannot happen with exact sums: then the old full window)
    a = tl.where(bad, 0, a)
    z = tl.where(bad, top_pattern, z)
    # the fewest patterns a bucket (a power of two) for NB - 2 buckets to cover [a, z): sh = bit_length(c - 1)
    # for c = ceil((z - a) / (NB - 2)), from the exponent of c - 1 as an (exact) fp64
    c1 = (z - a + NB - 3) // (NB - 2) - 1
    sh = tl.where(c1 > 0, (c1.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1022, 0)
    return a, z, sh, mx


@triton.jit(do_not_specialize=["top_p_ptr"])
def _hist_kernel(
    probs_ptr, probs_row_stride,  # (B, V) fp32 rows, last dim contiguous
    top_p_ptr, top_p_stride,  # (B,) fp32
    hist_max_ptr, hist_level_ptr,  # (B, SLICES) int32 slice maxima, (B, SLICES, LEVELS + 1) fp32 level sums
    hist_mass_ptr, hist_count_ptr,  # (B, NB) int64 / int32, zeroed: += the slice's fixed-point mass and count
    window_ptr,  # (B, 4) int64 out: A, Z, sh (written by slice 0)
    V, L, q_bits,  # vocabulary size; values a slice; fixed-point bits Q
    SLICES: tl.constexpr, SLICE: tl.constexpr, NB: tl.constexpr,  # buckets a row (NB - 2 fine, 2 lumps)
    LEVELS: tl.constexpr, LEVEL_OCT: tl.constexpr,
    P_ARR: tl.constexpr = True,  # top_p a (B,) tensor, else a float for every row
):
    """Histogram route, launch 2 of 4 (grid ``(B, SLICES)``): the exact fixed-point mass ``q`` (the
    filter kernel's, from the row's ``e_max``) and count of the row's values, by bucket: bucket 0 lumps
    every pattern below ``A``, bucket ``NB - 1`` every pattern ``>= Z``, buckets ``1 .. NB - 2`` split the
    fine window ``[A, Z)`` (``_fine_window``) into ``2^sh`` patterns each. Integer sums: exact in any order.

    Why: the previous version bucketed all 32 octaves below the row's largest value, by two relaxed
    global atomics a value (mass and count): 16M atomics at 64 rows, 23.6/141/239 µs at 1/32/64 rows
    on the H200 (~60 G atomics/s: about the L2's atomic throughput), the whole route's cost. Now only
    the values inside the window take atomics; both lumps and the slice's lowest fine bucket (all of
    it for ties or a flat slice) are summed in registers, one atomic each. At the benchmark's softmax
    of randn * 3 and p = 0.9 the threshold lies ~11.5 octaves below the largest value, the window is
    one 2-octave level (two when the limit is within the slack of a boundary), ~2.6K values an octave
    there: ~10K atomics a row instead of ~256K, ~0.7M at 64 rows (~10 µs of atomic throughput at
    most, overlapping the read, which is from L2). Per value otherwise: the fixed point, the key and
    the three register sums, ~50 instructions (~400M at 64 rows: ~12 µs of issue spread over 132
    SMs; 110 registers a thread, 2 programs an SM, as before). Predicted ~5/8/14 µs at 1/32/64 rows.
    Rows whose threshold lies below the levels (p = 0.99 on randn * 3: 16 octaves down; p = 1: the
    smallest value with mass) get ``A = 0``, nearly every value in the window, and cost what they
    cost before."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    top_p = row_value(top_p_ptr, top_p_stride, row, P_ARR, tl.float64)
    a, z, sh, mx = _fine_window(hist_max_ptr, hist_level_ptr, top_p, row, SLICES, LEVELS, LEVEL_OCT, NB)
    if mx >= 0:  # the row is on the route
        e_max = tl.maximum(mx >> 23, 1)
        w = tl.arange(0, 4)
        tl.store(window_ptr + row * 4 + w, tl.where(w == 0, a, tl.where(w == 1, z, sh)),
                 mask=w < tl.where(s == 0, 3, 0))  # (a scalar folded into the bound)
        cols = s * L + tl.arange(0, SLICE)
        b = _value_bits(probs_ptr + row * probs_row_stride, cols, cols < tl.minimum(s * L + L, V))
        valid = b >= 0
        q = _fixed(b, e_max, q_bits)
        bl = b.to(tl.int64)
        key = tl.where(bl < a, 0, tl.where(bl >= z, NB - 1, 1 + ((bl - a) >> sh))).to(tl.int32)
        mass_row = hist_mass_ptr + row * NB
        count_row = hist_count_ptr + row * NB
        fine = valid & (key > 0) & (key < NB - 1)
        k_min = tl.min(tl.where(fine, key, NB), axis=0)
        # the lumps and the slice's lowest fine bucket by one reduction and one atomic each: exact zeros,
        # the tiny values below the window and a slice of ties would otherwise queue thousands of atomics
        # on one address. (One [SLICE] reduction at a time: a [3, SLICE] int64 one-hot took all 255
        # registers a thread and spilled, against 121 for the version with one part.)
        for part in tl.static_range(3):
            if part == 0:
                sel = valid & (key == 0)
                at = 0
            elif part == 1:
                sel = valid & (key == NB - 1)
                at = NB - 1
            else:
                sel = fine & (key == k_min)
                at = k_min
            cnt = tl.sum(sel.to(tl.int32), axis=0)
            if cnt > 0:
                tl.atomic_add(mass_row + at, tl.sum(tl.where(sel, q, 0), axis=0), sem="relaxed")
                tl.atomic_add(count_row + at, cnt, sem="relaxed")
        rest = fine & (key != k_min)
        tl.atomic_add(mass_row + key, q, mask=rest & (q != 0), sem="relaxed")  # (no mass: no atomic)
        tl.atomic_add(count_row + key, tl.full([SLICE], 1, tl.int32), mask=rest, sem="relaxed")


@triton.jit(do_not_specialize=["top_p_ptr"])
def _hist_bracket_kernel(
    top_p_ptr, top_p_stride,  # (B,) fp32
    hist_max_ptr, hist_mass_ptr, hist_count_ptr,  # the slice maxima and the row's histogram
    window_ptr,  # (B, 4) int64: A, Z, sh from _hist_kernel
    bracket_ptr,  # (B, 8) int64 out: lo, hi, n = values in (lo, hi] (-1: off the route), g_lo, g_hi, c_lo, c_hi, M
    SLICES: tl.constexpr, NB: tl.constexpr,
    P_ARR: tl.constexpr = True,  # top_p a (B,) tensor, else a float for every row
):
    """Histogram route, launch 3 of 4 (grid ``(B,)``, one small program a row): the
    bucket where the top-p threshold lies. With ``S_j`` the mass of buckets ``>= j`` (exact: sums of
    the exact bucket masses), the lower edge of bucket ``j`` minus one has ``S_j`` above it, its upper
    edge ``S_{j+1}``: the first bucket whose upper edge passes the top-p test (``S_{j+1} == 0`` or
    ``< top_p * M``; the top bucket always does) has a lower edge that fails (or it is bucket 0, whose
    ``lo = -1`` fails by the convention of the full-pass route). So ``lo`` fails and ``hi`` passes with
    the exact masses and counts above them: the same invariants as the full-pass route's search.
    Bucket edges: 0 holds ``(-1, A - 1]``, ``j`` in ``1 .. NB - 2`` holds ``[A + (j - 1) 2^sh, A + j 2^sh)``
    cut at ``Z``, ``NB - 1`` holds ``[Z, top of the largest value's octave]``."""
    row = tl.program_id(0).to(tl.int64)
    mx = tl.max(tl.load(hist_max_ptr + row * SLICES + tl.arange(0, SLICES)), axis=0)
    out = bracket_ptr + row * 8
    if mx >= 0:
        a = tl.load(window_ptr + row * 4)
        z = tl.load(window_ptr + row * 4 + 1)
        sh = tl.load(window_ptr + row * 4 + 2)
        j = tl.arange(0, NB)
        m = tl.load(hist_mass_ptr + row * NB + j)
        c = tl.load(hist_count_ptr + row * NB + j)
        total = tl.sum(m, axis=0)
        count = tl.sum(c, axis=0)
        above = total - tl.cumsum(m, axis=0)  # S_{j+1}: the mass above bucket j
        c_above = count - tl.cumsum(c, axis=0)
        limit = row_value(top_p_ptr, top_p_stride, row, P_ARR, tl.float64) * total.to(tl.float64)
        js = tl.min(tl.where(_top_p_pred(above, limit), j, NB - 1), axis=0)
        g_hi = tl.sum(tl.where(j == js, above, 0), axis=0)
        c_hi = tl.sum(tl.where(j == js, c_above, 0), axis=0)
        g_lo = g_hi + tl.sum(tl.where(j == js, m, 0), axis=0)
        c_lo = c_hi + tl.sum(tl.where(j == js, c, 0), axis=0)
        # the bracket (lo, hi] holds the bucket's patterns (n below counts it). A fine bucket past Z is
        # empty and never the first to pass (the one holding Z - 1, or the lump, comes first). A = 0:
        # bucket 0 is empty, (-1, -1]; when it passes (everything does), the threshold -1 keeps every value
        top = ((tl.maximum(mx >> 23, 1) + 1).to(tl.int64) << 23) - 1  # >= every value of the row
        fine_lo = tl.minimum(a + ((js - 1).to(tl.int64) << sh), z) - 1
        fine_hi = tl.minimum(a + (js.to(tl.int64) << sh), z) - 1
        lo = tl.where(js == 0, -1, tl.where(js == NB - 1, z - 1, fine_lo))
        hi = tl.where(js == 0, a - 1, tl.where(js == NB - 1, tl.maximum(z - 1, top), fine_hi))
        tl.store(out, lo)
        tl.store(out + 1, hi)
        tl.store(out + 2, (c_lo - c_hi).to(tl.int64))
        tl.store(out + 3, g_lo)
        tl.store(out + 4, g_hi)
        tl.store(out + 5, c_lo.to(tl.int64))
        tl.store(out + 6, c_hi.to(tl.int64))
        tl.store(out + 7, total)
    else:
        tl.store(out + 2, -1)


@triton.jit
def _bracket_compact_kernel(
    probs_ptr, probs_row_stride,  # (B, V) fp32 rows, last dim contiguous
    bracket_ptr,  # (B, 8) int64 from _hist_bracket_kernel
    buf_bits_ptr,  # (B, CAP) int32 out: the row's values in the bracket, in no particular order
    fill_ptr,  # (B,) int32, zeroed: slots taken so far
    V, L,
    CAP: tl.constexpr, SLICE: tl.constexpr,
):
    """Histogram route, launch 4 of 4 (grid ``(B, SLICES)``): when the row's bracket holds at most
    ``CAP`` values, each slice appends its own to the row's buffer at slots reserved by an atomic on
    the row's counter. Their order varies from run to run, but the filter kernel only sums and counts
    them (the top-p test): its results do not depend on it. A larger bracket: nothing (the filter
    kernel narrows it with full passes)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    n = tl.load(bracket_ptr + row * 8 + 2)
    if (n >= 0) & (n <= CAP):
        lo = tl.load(bracket_ptr + row * 8).to(tl.int32)
        hi = tl.load(bracket_ptr + row * 8 + 1).to(tl.int32)
        cols = s * L + tl.arange(0, SLICE)
        b = _value_bits(probs_ptr + row * probs_row_stride, cols, cols < tl.minimum(s * L + L, V))
        sel = (b > lo) & (b <= hi)
        cnt = tl.sum(sel.to(tl.int32), axis=0)
        if cnt > 0:
            first = tl.atomic_add(fill_ptr + row, cnt, sem="relaxed")
            pos = first + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(buf_bits_ptr + row * CAP + pos, b, mask=sel & (pos < CAP))  # (n <= CAP: all of them)


@triton.jit
def _hist_row(row_ptr, V, q_bits, limit_scale, buf_bits, slots, hist_max_ptr, bracket_ptr, r31, row,
              SAMPLE: tl.constexpr, CAP: tl.constexpr, CHUNK_G: tl.constexpr, NP_MASS: tl.constexpr,
              HIST_SLICES: tl.constexpr, draw_ptr):
    """(threshold pattern, kept mass, e_max) of a row on the histogram route (top-p, top-k keeping
    all): from the bracket of ``_hist_bracket_kernel``, in registers when the compaction ran (at most
    ``CAP`` values in it), else by the exact full-pass search inside the bracket. ``SAMPLE``: ``draw[row]
    = (thr, e_max, target)`` for ``_kept_mass_kernel`` and ``_kept_draw_kernel``."""
    mx = tl.max(tl.load(hist_max_ptr + row * HIST_SLICES + tl.arange(0, HIST_SLICES)), axis=0)
    e_max = tl.maximum(mx >> 23, 1)
    br = bracket_ptr + row * 8
    lo = tl.load(br).to(tl.int32)
    hi = tl.load(br + 1).to(tl.int32)
    n = tl.load(br + 2)
    g_lo = tl.load(br + 3)
    g_hi = tl.load(br + 4)
    limit = limit_scale * tl.load(br + 7).to(tl.float64)
    if n <= CAP:
        vb = tl.load(buf_bits + slots, mask=slots < n, other=-1)
        thr, mass = _top_p_in_registers(vb, _fixed(vb, e_max, q_bits), limit, lo, hi, g_lo, g_hi)
    else:
        c_lo = tl.load(br + 5).to(tl.int32)
        c_hi = tl.load(br + 6).to(tl.int32)
        thr, mass = _exact_top_p(row_ptr, V, lo, hi, g_lo, g_hi, c_lo, c_hi, limit, e_max, q_bits, buf_bits, slots,
                                 CAP, CHUNK_G, NP_MASS)
    if SAMPLE:
        tl.store(draw_ptr + row * 3, thr.to(tl.int64))
        tl.store(draw_ptr + row * 3 + 1, e_max.to(tl.int64))
        tl.store(draw_ptr + row * 3 + 2, _target(r31, mass))
    return thr, mass, e_max


@triton.jit
def _kept_mass_kernel(probs_ptr, probs_row_stride, hist_max_ptr, draw_ptr, mass_ptr, V, L, q_bits,
                      SLICES: tl.constexpr, CHUNK: tl.constexpr):
    """Histogram-route sampling, after the filter kernel (grid ``(B, SLICES)``, the route's slices):
    ``mass[row, j]``, slice ``j``'s fixed-point mass of the patterns ``>= thr`` at ``e_max``, for the
    rows with a ``draw`` (``e_max`` 0: none). Exact integers: the slices sum to the filter's mass."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    e_max = tl.load(draw_ptr + row * 3 + 1).to(tl.int32)
    mass = tl.zeros((), tl.int64)
    if e_max > 0:
        lo = j * L
        mass = kept_slice_mass(probs_ptr + row * probs_row_stride, lo, tl.minimum(lo + L, V),
                               tl.load(hist_max_ptr + row * SLICES + j), tl.load(draw_ptr + row * 3).to(tl.int32),
                               e_max, q_bits, CHUNK)
    tl.store(mass_ptr + row * SLICES + j, mass)


@triton.jit
def _kept_draw_kernel(probs_ptr, probs_row_stride, draw_ptr, mass_ptr, out_ptr, V, L, q_bits,
                      SLICES: tl.constexpr, CHUNK: tl.constexpr):
    """Histogram-route sampling, last (grid ``(B,)``): for a row with a ``draw``, the first token whose
    cumulative kept mass exceeds its target, scanned in the one slice that holds it (0 for a row
    without mass, as the reference); ``out[row]`` as the filter kernel left it otherwise."""
    row = tl.program_id(0).to(tl.int64)
    e_max = tl.load(draw_ptr + row * 3 + 1).to(tl.int32)
    if e_max > 0:
        thr = tl.load(draw_ptr + row * 3).to(tl.int32)
        target = tl.load(draw_ptr + row * 3 + 2)
        row_ptr = probs_ptr + row * probs_row_stride
        jj = tl.arange(0, SLICES)
        js, base = slice_of_target(tl.load(mass_ptr + row * SLICES + jj), jj, SLICES, target)
        # no slice holds it (no mass): js = SLICES, no pass
        tl.store(out_ptr + row, kept_slice_draw(row_ptr, js * L, tl.minimum(js * L + L, V), thr, e_max, q_bits, base,
                                                target, CHUNK))


def _hist_prepasses(probs: Tensor, top_k, top_p, buf_bits: Tensor, config: Config):
    """The histogram route's kernels (module docstring): ``(slice maxima (B, slices) int32, brackets
    (B, 8) int64, fine windows (B, 4) int64: A, Z, sh)``; the filter kernel reads the first two; the
    compacted brackets are in ``buf_bits``."""
    B, V = probs.shape
    slices, nb, levels, level_oct = config.hist_slices, config.hist_buckets, config.hist_levels, config.hist_level_octaves
    slice_len = triton.cdiv(V, slices)
    slice_pow2 = triton.next_power_of_2(slice_len)
    dev = probs.device
    hist_max = torch.empty((B, slices), dtype=torch.int32, device=dev)
    hist_level = torch.empty((B, slices, levels + 1), dtype=torch.float32, device=dev)
    hist_mass = torch.empty((B, nb), dtype=torch.int64, device=dev)
    hist_count = torch.empty((B, nb), dtype=torch.int32, device=dev)
    fill = torch.empty(B, dtype=torch.int32, device=dev)
    window = torch.empty((B, 4), dtype=torch.int64, device=dev)
    bracket = torch.empty((B, 8), dtype=torch.int64, device=dev)
    has_k = top_k is not None
    _hist_prepass_kernel[(B, slices)](
        probs, probs.stride(0), top_k if has_k else fill, _stride(top_k) if has_k else 0,
        hist_max, hist_level, hist_mass, hist_count, fill, V, slice_len,
        HAS_K=has_k, SLICES=slices, SLICE=slice_pow2, NB=nb, ZERO=triton.next_power_of_2(triton.cdiv(nb, slices)),
        LEVELS=levels, LEVEL_OCT=level_oct, K_ARR=not has_k or isinstance(top_k, Tensor), num_warps=config.hist_warps,
    )
    _hist_kernel[(B, slices)](probs, probs.stride(0), top_p, _stride(top_p), hist_max, hist_level, hist_mass,
                              hist_count, window, V, slice_len, fixed_point_bits(V), SLICES=slices, SLICE=slice_pow2,
                              NB=nb, LEVELS=levels, LEVEL_OCT=level_oct, P_ARR=isinstance(top_p, Tensor),
                              num_warps=config.hist_warps, **({"maxnreg": config.hist_maxnreg} if config.hist_maxnreg else {}))
    _hist_bracket_kernel[(B,)](top_p, _stride(top_p), hist_max, hist_mass, hist_count, window, bracket,
                               SLICES=slices, NB=nb, P_ARR=isinstance(top_p, Tensor), num_warps=config.hist_warps)
    _bracket_compact_kernel[(B, slices)](probs, probs.stride(0), bracket, buf_bits, fill, V, slice_len,
                                         CAP=config.cap, SLICE=slice_pow2, num_warps=config.hist_warps)
    return hist_max, bracket, window
