"""Triton sampling family: bit-identical to the reference, one program per row after an optional
split prepass.

The semantics (``torch_kernels/impl/torch/sampling.py``) reduce every op to one threshold ``T`` on the
row's fp32 bit patterns (kept: ``bits(p) >= T``) and the kept mass ``M`` in 64-bit fixed point; the
kernel finds ``T`` and ``M`` with integer arithmetic only, so it agrees with the reference exactly,
whatever the summation order. Two routes per row:

* **Candidates** (``0 < top_k <= K_SMALL``, or the whole row fits in ``CAP``): one streaming pass over
  the row collects, in index order, every value ``>= tau`` into a per-row scratch buffer of ``CAP``
  slots, where ``tau`` is a lower bound of the k-th largest value. When a chunk would overflow the
  buffer, ``tau`` is raised to the k-th largest of buffer + chunk (a bisection on the bit pattern in
  registers) and the buffer is compacted. At the end the buffer holds every value ``>= t_k``, and the
  top-k threshold, the top-p threshold (bisection on the fixed-point mass) and the sample (a prefix
  sum) are computed in registers. One read of the row: this is the path of ``top_k=50``. When
  ``V <= CAP`` every row takes it, and the kernel is compiled without the full-pass route (``FITS``).
* **Full passes** (no or large top-k, or ties that overflow the buffer): each threshold is found by
  a multi-pivot search over the bit pattern, one read of the row (from L2 at the benchmark's 33 MB)
  per round of pivots, until the bracket left holds at most ``CAP`` values; those are compacted into
  the buffer (one more read) and the search ends in registers. Then a sampling scan that stops at
  the sampled token (or the renormalised row is written).

**Split prepass** (``V > CAP`` with top-k given): the streaming pass is latency-bound, one program
walking 31 chunks of 4096 at ``V = 128256`` with block-wide reductions and a scan in each (~135 µs a
row on the H200, whatever the batch). So a first kernel (``_slice_candidates_kernel``, grid
``(B, SLICES)``) cuts each row into ``SLICES`` contiguous slices of ``L = cdiv(V, SLICES)`` values
(4008 at 32 slices), each held in registers by its own program, which finds with a multi-pivot count
search a lower bound ``tau_s`` of its slice's k-th largest pattern (0 if the slice has fewer than k
values) and a cover pattern ``cover_s`` (``tau_s``, or ``tau_s + 1`` above a tie too large) such that
at most ``SLICE_CAP = CAP / SLICES`` of its values are ``>= cover_s``; those it writes, in index order,
into its ``SLICE_CAP`` slots of the row's buffer (-1 fills the rest). ``tau = max_s tau_s`` is a lower
bound of the row's ``t_k``; when every ``cover_s <= tau`` the buffer holds every value of the row
``>= tau`` in index order, and the filter kernel goes straight to the register part of the candidate
route (no streaming pass). Otherwise (``k > SLICE_CAP``, ties, or fewer positive values than k) the
row takes the routes above as if there were no prepass.

Exactness does not depend on the launch parameters: ``tests/test_sampling.py`` runs every route with
a 64-slot buffer on rows of 1000 against the reference, with and without the split prepass (4 and 16
slices: 16 and 4 slots a slice).

Arguments arrive validated (``torch_kernels.ops.sampling``): probs ``(B, V)`` fp32 with a contiguous
last dim, ``top_k`` int32/int64 ``(B,)``, ``top_p`` fp32 ``(B,)``, seed and offset int64 one-element
tensors, all on one device.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..torch.sampling import fixed_point_bits


class Config(NamedTuple):
    """Launch parameters (powers of two; ``k_small <= cap``, ``slices <= cap``). Chosen by register
    budget, not yet by measurement (108 registers a thread at 16 warps for sm_90, no spills):
    ``benchmarks/bench_sampling.py --sweep`` times the alternatives on the H200."""
    cap: int = 4096  # candidate buffer slots per row (int32 bits + int32 index)
    chunk: int = 4096  # elements per step of the streaming candidate pass
    k_small: int = 1024  # the candidate route takes 0 < top_k <= k_small
    chunk_g: int = 2048  # elements per step of the full-pass searches
    np_count: int = 16  # pivots per pass of the top-k count search (log2(17) = 4.1 bits a pass)
    np_mass: int = 8  # pivots per pass of the exact top-p mass search (int64 sums: fewer, 3.2 bits a pass)
    np_float: int = 8  # pivots per pass of the fp32 top-p search: [chunk_g, 8] fp32 + int32 accumulators, 64 registers
    num_warps: int = 16  # one program per row: 64 rows fill half the H200's SMs, so wide programs
    # split prepass (V > cap with top-k given; 0 slices: none). cap // slices slots a slice (128): a row
    # can split only when top_k <= min(cap // slices, k_small)
    slices: int = 32  # slices per row: 4008 values a slice at V = 128256, 32 programs for one row
    np_slice: int = 16  # pivots per round of a slice's count search ([16, 4096] compares per round)
    slice_warps: int = 8  # a slice program: 16 values, 16 x 16 compares per thread a round; 80 registers
    # for sm_90 without spills (4 warps: 180, so at most 2 programs an SM; 16 warps: 75)


DEFAULT = Config()



@triton.jit
def _value_bits(row_ptr, cols, mask):
    """int32 bit patterns of the sanitised values (NaN/negative -> 0, +inf -> FLT_MAX); -1 where masked."""
    p = tl.load(row_ptr + cols, mask=mask, other=0.0)
    p = tl.where(p > 0, tl.minimum(p, 3.4028234663852886e38), 0.0)
    return tl.where(mask, p.to(tl.int32, bitcast=True), -1)


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


@triton.jit
def _random_bits31(seed_ptr, offset_ptr, row):
    """31 random bits: Philox4x32-10, counter (row, offset_lo, offset_hi, 0), key (seed_lo, seed_hi).
    Written out (not ``tl.randint``) so the stream cannot change with the Triton version."""
    seed = tl.load(seed_ptr)
    offset = tl.load(offset_ptr)
    c0 = row.to(tl.uint32)
    c1 = (offset & 0xFFFFFFFF).to(tl.uint32)
    c2 = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c3 = c0 * 0
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
    return (c0 >> 1).to(tl.int64)


@triton.jit
def _target(r31, mass):
    """``floor(r31 * mass / 2^31)`` exactly, for mass < 2^62."""
    return r31 * (mass >> 31) + ((r31 * (mass & 0x7FFFFFFF)) >> 31)


@triton.jit
def _top_p_pred(g, limit):
    """The top-p test of a value whose larger survivors have mass ``g``: kept iff this is true."""
    return (g == 0) | (g.to(tl.float64) < limit)


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


@triton.jit
def _candidate_route(buf_bits, buf_idx, slots, n, k, tau, mx, e_max, q_bits, limit_scale, seed_ptr, offset_ptr, row,
                     HAS_P: tl.constexpr, SAMPLE: tl.constexpr, CAP: tl.constexpr):
    """(threshold pattern, kept mass, sampled token) of a row whose buffer holds every value ``>= t_k``
    (the ``n`` slots at ``buf_bits``/``buf_idx``, in index order): everything in registers."""
    # ---- candidate route: everything >= t_k is in the buffer, in index order -----------------
    tl.debug_barrier()
    vb = tl.load(buf_bits + slots, mask=slots < n, other=-1)
    vi = tl.load(buf_idx + slots, mask=slots < n, other=0)
    return _candidates_in_registers(vb, vi, slots, k, tau, mx, e_max, q_bits, limit_scale, seed_ptr, offset_ptr, row,
                                    HAS_P, SAMPLE, CAP)


@triton.jit
def _candidates_in_registers(vb, vi, slots, k, tau, mx, e_max, q_bits, limit_scale, seed_ptr, offset_ptr, row,
                             HAS_P: tl.constexpr, SAMPLE: tl.constexpr, CAP: tl.constexpr):
    """(threshold pattern, kept mass, sampled token) from the candidates ``vb`` (bit patterns) and
    ``vi`` (token ids): every value of the row ``>= tau`` (a lower bound of ``t_k``) is there once, in
    index order along ``slots``; other slots hold patterns below ``tau`` (-1 for none), which no
    threshold, mass or prefix sum below counts."""
    token = tl.full([], 0, tl.int32)
    thr = _kth_in_registers(vb, k, tau, mx + 1, 0)
    q = _fixed(vb, e_max, q_bits)
    mass = tl.sum(tl.where(vb >= thr, q, 0), axis=0)
    if HAS_P:
        # the smallest pattern >= t_k whose larger survivors weigh < top_p * M_k; below t_k
        # "fails" (mass above it: M_k), the largest value passes (nothing above it)
        thr, mass = _top_p_in_registers(vb, q, limit_scale * mass.to(tl.float64), thr - 1, mx, mass, 0)
    if SAMPLE:
        target = _target(_random_bits31(seed_ptr, offset_ptr, row), mass)
        cum = tl.cumsum(tl.where(vb >= thr, q, 0), axis=0)
        first = tl.min(tl.where(cum > target, slots, CAP), axis=0)
        token = tl.max(tl.where(slots == first, vi, 0), axis=0)  # no hit (no mass): 0
    return thr, mass, token


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
def _full_pass_route(row_ptr, V, k, tau, mx, e_max, q_bits, limit_scale, buf_bits, slots, seed_ptr, offset_ptr, row,
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
        limit = limit_scale * mass.to(tl.float64)
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
        thr = hi
        mass = g_lo
    if SAMPLE:
        target = _target(_random_bits31(seed_ptr, offset_ptr, row), mass)
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

    return thr, mass, token


@triton.jit
def _stream_candidates(row_ptr, V, k, buf_bits, buf_idx, offs, slots,
                       CAP: tl.constexpr, CHUNK: tl.constexpr, K_SMALL: tl.constexpr, FITS: tl.constexpr):
    """Pass 1 of a row without a split: ``(tau, n, overflow, mx)``: the row's largest bit pattern ``mx``
    and, unless ``overflow`` (the row takes the full-pass route), the ``n`` values ``>= tau`` (a lower
    bound of ``t_k``) in the buffer, in index order."""
    # ---- pass 1: the row's largest bit pattern; candidates >= tau into the buffer -------------------
    # overflow == 1: the row takes the full-pass route (not a candidate row, or ties beyond CAP).
    overflow = tl.where((k <= K_SMALL) | (V <= CAP), 0, 1)
    tau = 0  # a lower bound of the k-th largest bit pattern
    n = 0  # valid buffer slots
    mxv = tl.full([CHUNK], -1, tl.int32)  # elementwise running max: reduced only when needed
    b_next = _value_bits(row_ptr, offs, offs < V)
    for start in range(0, V, CHUNK):
        # the next chunk is requested before this one is processed: its latency hides behind the work
        b = b_next
        cols = start + offs
        nxt = cols + CHUNK
        b_next = _value_bits(row_ptr, nxt, nxt < V)
        mxv = tl.maximum(mxv, b)
        if overflow == 0:
            sel = b >= tau
            cnt = tl.sum(sel.to(tl.int32), axis=0)
            if not FITS:  # n + cnt <= V <= CAP otherwise
                if n + cnt > CAP:
                    # raise tau to the k-th largest of buffer + chunk (bisection on the bit pattern), compact
                    tl.debug_barrier()
                    vb = tl.load(buf_bits + slots, mask=slots < n, other=-1)
                    vi = tl.load(buf_idx + slots, mask=slots < n, other=0)
                    lo = tau
                    hi = tl.max(mxv, axis=0) + 1
                    while hi - lo > 1:
                        mid = lo + (hi - lo) // 2
                        c = tl.sum((vb >= mid).to(tl.int32), axis=0) + tl.sum((b >= mid).to(tl.int32), axis=0)
                        lo = tl.where(c >= k, mid, lo)
                        hi = tl.where(c >= k, hi, mid)
                    tau = lo
                    keep = vb >= tau
                    nb = tl.sum(keep.to(tl.int32), axis=0)
                    sel = b >= tau
                    cnt = tl.sum(sel.to(tl.int32), axis=0)
                    if nb + cnt > CAP:
                        overflow = 1
                    else:
                        pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
                        tl.debug_barrier()
                        tl.store(buf_bits + pos, vb, mask=keep)
                        tl.store(buf_idx + pos, vi, mask=keep)
                        n = nb
            if (overflow == 0) & (cnt > 0):
                pos = n + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                tl.store(buf_bits + pos, b, mask=sel)
                tl.store(buf_idx + pos, cols, mask=sel)
                n += cnt
    mx = tl.max(mxv, axis=0)  # the row's largest bit pattern
    return tau, n, overflow, mx


@triton.jit
def _unsplit_row(row_ptr, V, k, q_bits, limit_scale, buf_bits, buf_idx, offs, slots, seed_ptr, offset_ptr, row,
                 HAS_P: tl.constexpr, SAMPLE: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
                 K_SMALL: tl.constexpr, CHUNK_G: tl.constexpr, NP_COUNT: tl.constexpr, NP_MASS: tl.constexpr,
                 NP_FLOAT: tl.constexpr, FITS: tl.constexpr):
    """(threshold pattern, kept mass, sampled token, e_max) of a row without a split: pass 1, then the
    candidate route or the full-pass route."""
    tau, n, overflow, mx = _stream_candidates(row_ptr, V, k, buf_bits, buf_idx, offs, slots, CAP, CHUNK, K_SMALL, FITS)
    e_max = tl.maximum(mx >> 23, 1)
    if FITS:
        # the whole row fits in the buffer: the candidate route always suffices. The full-pass route is
        # not even compiled then: with V == 1 (Triton makes it a constant) its search loops are provably
        # never entered, and Triton 3.6's coalescing pass asserts on memory ops in unreachable code.
        thr, mass, token = _candidate_route(buf_bits, buf_idx, slots, n, k, tau, mx, e_max, q_bits, limit_scale,
                                            seed_ptr, offset_ptr, row, HAS_P, SAMPLE, CAP)
    else:
        if overflow == 0:
            thr, mass, token = _candidate_route(buf_bits, buf_idx, slots, n, k, tau, mx, e_max, q_bits, limit_scale,
                                                seed_ptr, offset_ptr, row, HAS_P, SAMPLE, CAP)
        else:
            thr, mass, token = _full_pass_route(row_ptr, V, k, tau, mx, e_max, q_bits, limit_scale, buf_bits, slots,
                                                seed_ptr, offset_ptr, row, HAS_P, SAMPLE, CAP, CHUNK_G,
                                                NP_COUNT, NP_MASS, NP_FLOAT)
    return thr, mass, token, e_max


@triton.jit
def _slice_candidates_kernel(
    probs_ptr, probs_row_stride,  # (B, V) fp32 rows, last dim contiguous
    top_k_ptr, top_k_stride,  # (B,) int32/int64; <= 0 or >= V keeps all
    stats_ptr,  # (B, 4, SLICES) int32 out: per slice tau_s, largest pattern, n_s (-1: no split), cover_s
    cand_bits_ptr, cand_idx_ptr,  # (B, SLICES, SLICE_CAP) int32 out: the filter kernel's (B, CAP) buffers
    V,  # vocabulary size
    L,  # values a slice: cdiv(V, SLICES)
    SLICES: tl.constexpr,  # slices a row (grid axis 1)
    SLICE: tl.constexpr,  # next power of two >= L: a slice in registers
    SLICE_CAP: tl.constexpr,  # candidate slots a slice: CAP // SLICES
    K_SPLIT: tl.constexpr,  # min(SLICE_CAP, K_SMALL): rows with a larger k are not split
    NP: tl.constexpr,  # pivots per round of the count search
):
    """The split prepass of one slice ``[s*L, min((s+1)*L, V))`` of one row (module docstring).

    With ``f(t)`` = the number of the slice's values ``>= t``, it writes ``tau_s`` with ``f(tau_s) >= k``
    (0 when the slice has fewer than k values: no bound at all), the slice's largest pattern, and a
    cover ``cover_s`` with ``n_s = f(cover_s) <= SLICE_CAP``: those values, in index order, into the
    slice's slots, -1 in the slots after them. ``cover_s = tau_s`` unless ties at the slice's k-th
    largest pattern ``t`` exceed ``SLICE_CAP`` (``f(t) > SLICE_CAP``, e.g. hundreds of exact zeros when
    the slice has fewer than k positive values): then ``cover_s = t + 1`` (``f(t + 1) < k``) and the row
    splits only if another slice bounds ``t_k`` above ``t``. ``n_s = -1`` and no candidates: the row's
    k exceeds ``K_SPLIT``, and the slice is not even read."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    row_ptr = probs_ptr + row * probs_row_stride
    stats = stats_ptr + row * (4 * SLICES) + s
    k64 = tl.load(top_k_ptr + row * top_k_stride).to(tl.int64)
    k = tl.where((k64 > 0) & (k64 < V), k64, V).to(tl.int32)
    split = k <= K_SPLIT

    cols = s * L + tl.arange(0, SLICE)
    # the slice ends at min((s+1)*L, V): the last slices may be short or empty. The scalar `split` is
    # folded into the bound (the interpreter rejects a mask of vector & scalar)
    end = tl.where(split, tl.minimum(s * L + L, V), 0)
    b = _value_bits(row_ptr, cols, cols < end)  # -1 outside the slice (and everywhere without a split)
    mx = tl.max(b, axis=0)  # -1: an empty slice

    # multi-pivot count search: f(lo) >= k > f(hi) (f(mx + 1) = 0), until f(lo) <= SLICE_CAP. It starts
    # only when f(0) = the slice's length exceeds SLICE_CAP >= k, so the slice has k values; a slice of
    # at most SLICE_CAP values keeps tau_s = 0 and all its values.
    lo = tl.full([], 0, tl.int32)
    hi = mx + 1
    c_lo = tl.sum((b >= 0).to(tl.int32), axis=0)
    c_hi = tl.full([], 0, tl.int32)
    jp = tl.arange(0, NP).to(tl.int64) + 1
    while (hi - lo > 1) & (c_lo > SLICE_CAP):
        # NP pivots in (lo, hi): the bracket shrinks (NP + 1)-fold a round, 31 bits in <= 8 rounds at 16
        # pivots; but it stops once f(lo) <= SLICE_CAP, not at t: 1.5 rounds on average, 2 at most, for
        # k = 50 and 128 slots on slices of 4008 softmax values (a numpy model of this loop)
        piv = lo + ((hi - lo).to(tl.int64) * jp // (NP + 1)).to(tl.int32)
        # pivots on the leading axis: Triton's default layout spreads the last axis over the threads,
        # so each thread compares its own SLICE / (32 * warps) values (16 at 4096 and 8 warps) with all
        # NP pivots; [SLICE, NP] would replicate SLICE / 2 / warps values in each thread (256)
        counts = tl.sum((b[None, :] >= piv[:, None]).to(tl.int32), axis=1)
        ok = counts >= k
        # counts fall as the pivot rises: the largest passing pivot has the least count
        lo = tl.max(tl.where(ok, piv, lo), axis=0)
        c_lo = tl.min(tl.where(ok, counts, c_lo), axis=0)
        hi = tl.min(tl.where(ok, hi, piv), axis=0)
        c_hi = tl.max(tl.where(ok, c_hi, counts), axis=0)
    # if the search ended at hi = lo + 1 with f(lo) > SLICE_CAP, lo is the slice's k-th largest, tied
    # beyond SLICE_CAP: the values above it (f(hi) < k <= SLICE_CAP) still fit
    fits = c_lo <= SLICE_CAP
    cover = tl.where(fits, lo, hi)
    n = tl.where(fits, c_lo, c_hi)
    tl.store(stats, lo)
    tl.store(stats + SLICES, mx)
    tl.store(stats + 2 * SLICES, tl.where(split, n, -1))
    tl.store(stats + 3 * SLICES, cover)

    sel = b >= cover  # cover >= 0 > -1: never outside the slice; n values, at most SLICE_CAP
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    dst = (row * SLICES + s) * SLICE_CAP
    tl.store(cand_bits_ptr + dst + pos, b, mask=sel)
    tl.store(cand_idx_ptr + dst + pos, cols, mask=sel)
    rest = tl.arange(0, SLICE_CAP)
    tl.store(cand_bits_ptr + dst + rest, tl.full([SLICE_CAP], -1, tl.int32), mask=rest >= tl.where(split, n, SLICE_CAP))


@triton.jit
def _filter_kernel(
    probs_ptr, probs_row_stride,  # (B, V) fp32 rows, last dim contiguous
    top_k_ptr, top_k_stride,  # (B,) int32/int64; <= 0 or >= V keeps all (read when HAS_K)
    top_p_ptr, top_p_stride,  # (B,) fp32 (read when HAS_P)
    seed_ptr, offset_ptr,  # one int64 each (read when SAMPLE)
    out_ptr, out_row_stride,  # SAMPLE: (B,) int32 ids; else (B, V) fp32 renormalised rows
    buf_bits_ptr, buf_idx_ptr,  # (B, CAP) int32 scratch: candidate bit patterns and token ids
    stats_ptr,  # SPLIT: (B, 4, SLICES) int32 from the prepass (tau_s, largest pattern, n_s, cover_s)
    V,  # vocabulary size (elements per row)
    q_bits,  # fixed-point bits Q of the row's largest value (fixed_point_bits(V))
    HAS_K: tl.constexpr,  # apply top-k
    HAS_P: tl.constexpr,  # apply top-p (to the top-k survivors)
    SAMPLE: tl.constexpr,  # write one sampled id per row, else the renormalised row
    CAP: tl.constexpr,  # candidate buffer slots per row
    CHUNK: tl.constexpr,  # elements per step of the streaming pass
    K_SMALL: tl.constexpr,  # the candidate route takes top_k <= K_SMALL
    CHUNK_G: tl.constexpr,  # elements per step of a full pass
    NP_COUNT: tl.constexpr,  # pivots per top-k search pass
    NP_MASS: tl.constexpr,  # pivots per exact top-p search pass
    NP_FLOAT: tl.constexpr,  # pivots per fp32 top-p search pass
    FITS: tl.constexpr,  # V <= CAP: the buffer holds a whole row, the candidate route is the only one
    SPLIT: tl.constexpr,  # the split prepass ran: its rows skip pass 1 (buffers in slice layout)
    SLICES: tl.constexpr,  # slices a row of the prepass (SPLIT)
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = probs_ptr + row * probs_row_stride
    buf_bits = buf_bits_ptr + row * CAP
    buf_idx = buf_idx_ptr + row * CAP
    offs = tl.arange(0, CHUNK)
    slots = tl.arange(0, CAP)

    k = V
    if HAS_K:
        k64 = tl.load(top_k_ptr + row * top_k_stride).to(tl.int64)
        k = tl.where((k64 > 0) & (k64 < V), k64, V).to(tl.int32)

    limit_scale = 0.0
    if HAS_P:
        limit_scale = tl.load(top_p_ptr + row * top_p_stride).to(tl.float64)

    if SPLIT:
        # Why the buffer then holds what the candidate route needs. Each tau_s is 0 or has k values of
        # its slice >= it, so the row has k values >= tau = max_s tau_s: tau <= t_k (also when slices
        # are shorter than k or empty: their tau_s is 0). Slice s wrote ALL its values >= cover_s; where
        # cover_s <= tau for every s, that includes all its values >= tau, so the values >= tau of the
        # row are all in the buffer, in index order (slices are contiguous and in order, and so are
        # the slots); the other slots are below tau or -1. At most SLICES * SLICE_CAP <= CAP of them.
        sl = tl.arange(0, SLICES)
        stats = stats_ptr + row * (4 * SLICES)
        tau = tl.max(tl.load(stats + sl), axis=0)
        n_min = tl.min(tl.load(stats + 2 * SLICES + sl), axis=0)
        cover_max = tl.max(tl.load(stats + 3 * SLICES + sl), axis=0)
        if (n_min >= 0) & (cover_max <= tau) & (k <= K_SMALL):  # (the prepass flags k > K_SMALL already)
            # ---- split row: the prepass wrote the candidates; no streaming pass ---------------------
            mx = tl.max(tl.load(stats + SLICES + sl), axis=0)  # the row's largest bit pattern
            e_max = tl.maximum(mx >> 23, 1)
            vb = tl.load(buf_bits + slots)  # SLICES x SLICE_CAP = CAP slots (powers of two), all written
            vb = tl.where(vb >= tau, vb, -1)  # below tau (a lower cover_s): harmless, but no candidate
            vi = tl.load(buf_idx + slots, mask=vb >= 0, other=0)
            thr, mass, token = _candidates_in_registers(vb, vi, slots, k, tau, mx, e_max, q_bits, limit_scale,
                                                        seed_ptr, offset_ptr, row, HAS_P, SAMPLE, CAP)
        else:
            thr, mass, token, e_max = _unsplit_row(row_ptr, V, k, q_bits, limit_scale, buf_bits, buf_idx, offs,
                                                   slots, seed_ptr, offset_ptr, row, HAS_P, SAMPLE, CAP, CHUNK,
                                                   K_SMALL, CHUNK_G, NP_COUNT, NP_MASS, NP_FLOAT, FITS)
    else:
        thr, mass, token, e_max = _unsplit_row(row_ptr, V, k, q_bits, limit_scale, buf_bits, buf_idx, offs, slots,
                                               seed_ptr, offset_ptr, row, HAS_P, SAMPLE, CAP, CHUNK, K_SMALL,
                                               CHUNK_G, NP_COUNT, NP_MASS, NP_FLOAT, FITS)

    if SAMPLE:
        tl.store(out_ptr + row, token)
    else:
        # ---- renormalised row: p / S, S = sum of the kept values, from the fixed-point mass ---------
        # (exact to 2^-26 relative: each q loses < 1 unit of 2^-(Q-1) of the largest value)
        scale = ((e_max - 126 - q_bits + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # 2^-s
        total = mass.to(tl.float64) * scale
        inv = tl.where(total > 0, 1.0 / tl.maximum(total, 1e-300), 0.0).to(tl.float32)
        out_row = out_ptr + row * out_row_stride
        for start in range(0, V, CHUNK_G):
            cols = start + tl.arange(0, CHUNK_G)
            b = _value_bits(row_ptr, cols, cols < V)
            p = b.to(tl.float32, bitcast=True)
            tl.store(out_row + cols, tl.where(b >= thr, p * inv, 0.0), mask=cols < V)


def _slice_prepass(probs: Tensor, top_k: Tensor, buf_bits: Tensor, buf_idx: Tensor, config: Config) -> Tensor:
    """Run ``_slice_candidates_kernel`` over ``(B, config.slices)``: writes the slices' candidates into
    ``buf_bits``/``buf_idx`` (``(B, cap)``, as ``(B, slices, cap // slices)``) and returns their
    ``(B, 4, slices)`` int32 stats (``tau_s``, largest pattern, ``n_s``, ``cover_s``)."""
    B, V = probs.shape
    slices = config.slices
    slice_len = triton.cdiv(V, slices)
    stats = torch.empty((B, 4, slices), dtype=torch.int32, device=probs.device)
    _slice_candidates_kernel[(B, slices)](
        probs, probs.stride(0), top_k, top_k.stride(0), stats, buf_bits, buf_idx, V, slice_len,
        SLICES=slices, SLICE=triton.next_power_of_2(slice_len), SLICE_CAP=config.cap // slices,
        K_SPLIT=min(config.cap // slices, config.k_small), NP=config.np_slice, num_warps=config.slice_warps,
    )
    return stats


def _launch(probs: Tensor, top_k, top_p, seed, offset, sample: bool, config: Config = DEFAULT) -> Tensor:
    B, V = probs.shape
    if sample:
        out = torch.empty(B, dtype=torch.int32, device=probs.device)
    else:
        out = torch.empty((B, V), dtype=torch.float32, device=probs.device)
    if B == 0:
        return out
    cap = config.cap
    buf_bits = torch.empty((B, cap), dtype=torch.int32, device=probs.device)
    buf_idx = torch.empty((B, cap), dtype=torch.int32, device=probs.device)
    dummy = out  # stands in for the pointers a mode does not read
    # the prepass pays where the streaming pass would walk several chunks; without top-k no row is a
    # candidate row unless it fits
    split = top_k is not None and V > cap and config.slices > 0
    stats = _slice_prepass(probs, top_k, buf_bits, buf_idx, config) if split else dummy
    _filter_kernel[(B,)](
        probs, probs.stride(0),
        top_k if top_k is not None else dummy, top_k.stride(0) if top_k is not None else 0,
        top_p if top_p is not None else dummy, top_p.stride(0) if top_p is not None else 0,
        seed if seed is not None else dummy, offset if offset is not None else dummy,
        out, out.stride(0) if not sample else 1,
        buf_bits, buf_idx, stats,
        V, fixed_point_bits(V),
        HAS_K=top_k is not None, HAS_P=top_p is not None, SAMPLE=sample,
        CAP=cap, CHUNK=config.chunk, K_SMALL=config.k_small, CHUNK_G=config.chunk_g,
        NP_COUNT=config.np_count, NP_MASS=config.np_mass, NP_FLOAT=config.np_float, FITS=V <= cap,
        SPLIT=split, SLICES=config.slices if split else 1,
        num_warps=config.num_warps,
    )
    return out


def top_k_renorm_probs(probs: Tensor, top_k: Tensor) -> Tensor:
    return _launch(probs, top_k, None, None, None, sample=False)


def top_p_renorm_probs(probs: Tensor, top_p: Tensor) -> Tensor:
    return _launch(probs, None, top_p, None, None, sample=False)


def top_k_top_p_sampling_from_probs(probs: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, offset: Tensor) -> Tensor:
    return _launch(probs, top_k, top_p, seed, offset, sample=True)
