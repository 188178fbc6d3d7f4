"""The full-pass route (no top-k or a large one, or ties that overflow the candidate buffer): each
threshold is found by a multi-pivot search over the bit pattern, one read of the row (from L2 at
64 x 128256 fp32, 33 MB) per round of pivots, until the bracket left holds at most ``Config.cap``
values; those are compacted into the buffer (one more read) and the search ends in registers. The
top-p search narrows its bracket with fp32 sums first (``_coarse_top_p``), then exactly
(``_exact_top_p``, with which the histogram route ends too). Sampling then scans the row in index order
and stops at the chunk holding the token (``_sample_scan``)."""

import triton
import triton.language as tl

from ._common import _compact, _fixed, _kth_in_registers, _target, _top_p_in_registers, _top_p_pred, \
    _value_bits


@triton.jit
def _coarse_top_p(row_ptr, V, lo, hi, c_lo, c_hi, mass, limit, e_max, q_bits,
                  CAP: tl.constexpr, CHUNK_G: tl.constexpr, NP_FLOAT: tl.constexpr):
    """Narrow the top-p bracket (``lo`` fails, ``hi`` passes, ``c_*``: counts above them) with fp32
    sums instead of the exact fixed point: a pass costs a compare and an fp32 add per value and pivot,
    reduced once per pass, against an int64 conversion, select and reduction per chunk for the exact
    search (1076 µs for top-p alone at 64 x 128256 on the H200). A pivot moves a bracket end only when
    its fp32 mass is farther from the limit than the sums' error bound ``slack``, so both ends stay
    exact facts; a pass where no pivot is decisive stops the search and the exact one goes on.

    ``slack``: each slot adds one value per chunk (``V / CHUNK_G`` additions), then ``CHUNK_G`` slots
    are summed: at most ``(V / CHUNK_G + CHUNK_G)`` units of 2^-24 of the mass, plus the fixed point's
    own rounding (< 2^-25 of the mass, see the reference); 64 more units for the f64 scaling."""
    offs_g = tl.arange(0, CHUNK_G)
    to_p = ((e_max - 126 - q_bits + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # 2^-s: fixed point -> p
    limit_p = limit * to_p
    slack = mass.to(tl.float64) * to_p * ((V // CHUNK_G + CHUNK_G + 64).to(tl.float64) * 5.9604644775390625e-08)
    jf = tl.arange(0, NP_FLOAT).to(tl.int64) + 1
    go = 1
    while (go == 1) & (hi - lo > 1) & (c_lo - c_hi > CAP):
        piv = lo + ((hi - lo).to(tl.int64) * jf // (NP_FLOAT + 1)).to(tl.int32)
        g_acc = tl.zeros([CHUNK_G, NP_FLOAT], dtype=tl.float32)
        c_acc = tl.zeros([CHUNK_G, NP_FLOAT], dtype=tl.int32)
        for start in range(0, V, CHUNK_G):
            cols = start + offs_g
            b = _value_bits(row_ptr, cols, cols < V)  # -1 where masked: never above a pivot (>= lo >= -1)
            above = b[:, None] > piv[None, :]
            g_acc += tl.where(above, b.to(tl.float32, bitcast=True)[:, None], 0.0)
            c_acc += above.to(tl.int32)
        g = tl.sum(g_acc, axis=0).to(tl.float64)
        c = tl.sum(c_acc, axis=0)
        surely_passes = (c == 0) | (g + slack < limit_p)
        surely_fails = (c > 0) & (g - slack >= limit_p)
        new_lo = tl.max(tl.where(surely_fails, piv, lo), axis=0)
        new_hi = tl.min(tl.where(surely_passes, piv, hi), axis=0)
        c_lo = tl.min(tl.where(surely_fails, c, c_lo), axis=0)
        c_hi = tl.max(tl.where(surely_passes, c, c_hi), axis=0)
        go = tl.where((new_lo != lo) | (new_hi != hi), 1, 0)
        lo = new_lo
        hi = new_hi
    return lo, hi, c_lo, c_hi


@triton.jit
def _full_pass_route(row_ptr, V, k, tau, mx, e_max, q_bits, limit_scale, joint_mass, buf_bits, slots, r31, row,
                     HAS_P: tl.constexpr, SAMPLE: tl.constexpr, CAP: tl.constexpr, CHUNK_G: tl.constexpr,
                     NP_COUNT: tl.constexpr, NP_MASS: tl.constexpr, NP_FLOAT: tl.constexpr):
    """(threshold pattern, kept mass, sampled token) of a row whose top-k survivors may not fit in the
    buffer: multi-pivot searches over the row (``tau``: a lower bound of ``t_k``)."""
    token = tl.full([], 0, tl.int32)
    # ---- full-pass route: multi-pivot searches over the row until the bracket of candidate
    # patterns holds at most CAP values, then those are compacted into the buffer and the search
    # ends in registers -------------------------------------------------------------------------
    offs_g = tl.arange(0, CHUNK_G)
    thr = 0
    if k < V:
        # t_k: the largest pattern with k values >= it. c_lo = count(>= lo) >= k > c_hi = count(>= hi)
        lo = tau
        hi = mx + 1
        c_lo = V  # an upper bound until a pivot measures it
        c_hi = 0
        jc = tl.arange(0, NP_COUNT).to(tl.int64) + 1
        while (hi - lo > 1) & (c_lo - c_hi > CAP):
            piv = lo + ((hi - lo).to(tl.int64) * jc // (NP_COUNT + 1)).to(tl.int32)
            counts = tl.zeros([NP_COUNT], dtype=tl.int32)
            for start in range(0, V, CHUNK_G):
                cols = start + offs_g
                b = _value_bits(row_ptr, cols, cols < V)
                counts += tl.sum((b[:, None] >= piv[None, :]).to(tl.int32), axis=0)
            ok = counts >= k
            # counts fall as the pivot rises: the largest passing pivot has the least count
            lo = tl.max(tl.where(ok, piv, lo), axis=0)
            c_lo = tl.min(tl.where(ok, counts, c_lo), axis=0)
            hi = tl.min(tl.where(ok, hi, piv), axis=0)
            c_hi = tl.max(tl.where(ok, c_hi, counts), axis=0)
        if hi - lo > 1:
            nb = _compact(row_ptr, V, lo, hi - 1, buf_bits, CHUNK_G, CAP)
            vb = tl.load(buf_bits + slots, mask=slots < nb, other=-1)
            lo = _kth_in_registers(vb, k, lo, hi, c_hi)
        thr = lo
    # per-slot sums, reduced once after the pass: a block-wide reduction per chunk waits on barriers
    mass_acc = tl.zeros([CHUNK_G], dtype=tl.int64)
    kept_acc = tl.zeros([CHUNK_G], dtype=tl.int32)
    for start in range(0, V, CHUNK_G):
        cols = start + offs_g
        b = _value_bits(row_ptr, cols, cols < V)
        mass_acc += tl.where(b >= thr, _fixed(b, e_max, q_bits), 0)
        kept_acc += (b >= thr).to(tl.int32)
    mass = tl.sum(mass_acc, axis=0)
    kept = tl.sum(kept_acc, axis=0)
    if HAS_P:
        limit = limit_scale * tl.where(joint_mass >= 0, joint_mass, mass).to(tl.float64)  # joint: the row's mass
        # lo fails the top-p test, hi passes; g_*/c_*: mass and count of the values above them
        lo = thr - 1
        hi = mx
        g_lo = mass
        c_lo = kept
        g_hi = tl.zeros([], dtype=tl.int64)
        c_hi = 0
        if (e_max >= 63) & (e_max <= 190):  # 2^-64 <= largest value < 2^64: fp32 sums neither overflow nor underflow
            lo, hi, c_lo, c_hi = _coarse_top_p(row_ptr, V, lo, hi, c_lo, c_hi, mass, limit, e_max, q_bits,
                                               CAP, CHUNK_G, NP_FLOAT)
            g_lo_acc = tl.zeros([CHUNK_G], dtype=tl.int64)
            g_hi_acc = tl.zeros([CHUNK_G], dtype=tl.int64)
            for start in range(0, V, CHUNK_G):  # the exact masses above the bracket's ends
                cols = start + offs_g
                b = _value_bits(row_ptr, cols, cols < V)
                q = _fixed(b, e_max, q_bits)
                g_lo_acc += tl.where(b > lo, q, 0)
                g_hi_acc += tl.where(b > hi, q, 0)
            g_lo = tl.sum(g_lo_acc, axis=0)
            g_hi = tl.sum(g_hi_acc, axis=0)
        thr, mass = _exact_top_p(row_ptr, V, lo, hi, g_lo, g_hi, c_lo, c_hi, limit, e_max, q_bits, buf_bits, slots,
                                 CAP, CHUNK_G, NP_MASS)
    if SAMPLE:
        token = _sample_scan(row_ptr, V, thr, mass, e_max, q_bits, r31, row, CHUNK_G)
    return thr, mass, token


@triton.jit
def _exact_top_p(row_ptr, V, lo, hi, g_lo, g_hi, c_lo, c_hi, limit, e_max, q_bits, buf_bits, slots,
                 CAP: tl.constexpr, CHUNK_G: tl.constexpr, NP_MASS: tl.constexpr):
    """(threshold pattern, kept mass) of the top-p test from a bracket: ``lo`` fails, ``hi`` passes,
    ``g_*``/``c_*``: the exact mass and the count of the row's values above them. Multi-pivot passes
    over the row with exact fixed-point sums until the bracket holds at most ``CAP`` values, which are
    compacted into the buffer; the search ends in registers."""
    offs_g = tl.arange(0, CHUNK_G)
    jm = tl.arange(0, NP_MASS).to(tl.int64) + 1
    while (hi - lo > 1) & (c_lo - c_hi > CAP):
        piv = lo + ((hi - lo).to(tl.int64) * jm // (NP_MASS + 1)).to(tl.int32)
        g = tl.zeros([NP_MASS], dtype=tl.int64)
        c = tl.zeros([NP_MASS], dtype=tl.int32)
        for start in range(0, V, CHUNK_G):
            cols = start + offs_g
            b = _value_bits(row_ptr, cols, cols < V)
            above = b[:, None] > piv[None, :]
            g += tl.sum(tl.where(above, _fixed(b, e_max, q_bits)[:, None], 0), axis=0)
            c += tl.sum(above.to(tl.int32), axis=0)
        ok = _top_p_pred(g, limit)
        # mass and count fall as the pivot rises: the largest failing pivot has the least,
        # the smallest passing one the most
        lo = tl.max(tl.where(ok, lo, piv), axis=0)
        g_lo = tl.min(tl.where(ok, g_lo, g), axis=0)
        c_lo = tl.min(tl.where(ok, c_lo, c), axis=0)
        hi = tl.min(tl.where(ok, piv, hi), axis=0)
        g_hi = tl.max(tl.where(ok, g, g_hi), axis=0)
        c_hi = tl.max(tl.where(ok, c, c_hi), axis=0)
    if hi - lo > 1:
        nb = _compact(row_ptr, V, lo, hi, buf_bits, CHUNK_G, CAP)
        vb = tl.load(buf_bits + slots, mask=slots < nb, other=-1)
        hi, g_lo = _top_p_in_registers(vb, _fixed(vb, e_max, q_bits), limit, lo, hi, g_lo, g_hi)
    return hi, g_lo


@triton.jit
def _sample_scan(row_ptr, V, thr, mass, e_max, q_bits, r31, row, CHUNK_G: tl.constexpr):
    """The sampled token of a row kept at ``bits >= thr`` with kept mass ``mass``: a scan in index
    order that stops reading at the chunk holding the token (0 for a row without mass)."""
    offs_g = tl.arange(0, CHUNK_G)
    token = tl.full([], 0, tl.int32)
    target = _target(r31, mass)
    run = tl.zeros([], dtype=tl.int64)
    found = 0
    for start in range(0, V, CHUNK_G):
        if found == 0:  # stops reading once the token is found
            cols = start + offs_g
            b = _value_bits(row_ptr, cols, cols < V)
            kq = tl.where(b >= thr, _fixed(b, e_max, q_bits), 0)
            total = tl.sum(kq, axis=0)
            if run + total > target:  # the token is in this chunk: the one prefix sum of the scan
                cum = run + tl.cumsum(kq, axis=0)
                token = tl.min(tl.where(cum > target, cols, V), axis=0)
                found = 1
            run += total
    return token
