"""Triton sampling family: bit-identical to the reference, one program per row after an optional
split prepass (top-k) or histogram prepasses (top-p without top-k), then a parallel write of
renormalised rows.

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
  the sampled token (renormalising: ``_renorm_write_kernel`` writes the row). Top-p rows without a
  top-k cut take the histogram route below instead (unless ``Config.hist_slices == 0``; in a call
  given a top-k tensor, only with ``Config.hist_with_top_k``, off by default).

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

The slice's count search starts from its group maxima (``Config.slice_group`` values a group; 16
since the sweep in ``Config``'s comments, 8 when this was measured): the
k-th largest of 512 maxima of 8 is a lower bound of the slice's k-th largest with ~52 values above it
at k = 50, whatever the distribution, so the search runs on 2 values a thread instead of 16 and one
count over the slice checks it (the plain search goes on from there when it does not fit: ties, k
near ``SLICE_CAP``). Measured before: 8.2/43.1/85.0 µs at 1/32/64 rows (~1.3 µs a row: 1.5 to 2.8
rounds of 16 pivots x 16 values a thread, the instruction issue of 2048 programs). A numpy model of
the new search: 1.3 rounds of 16 x 2 compares at k = 50 on randn * 3 slices (1.0 to 2.0 from
randn * 0.3 to randn * 8, k = 20 to 80), never a full-slice round. Predicted ~7/25/45 µs (the
loads, the scan and the candidates' stores stay; at 64 rows the read itself is ~17 µs from HBM).

**Histogram route** (``V > CAP``, top-p, top-k keeping the whole row: all of ``top_p_renorm_probs``,
and the sampling rows with ``top_k <= 0`` or ``>= V``): the full-pass route's searches are one program
reading the row once a round (~340 µs a row on the H200). Instead, four small launches find the top-p
threshold's bracket in parallel, exactly:

1. ``_hist_prepass_kernel`` (grid ``(B, HIST_SLICES)``): each slice's largest pattern, which fixes the
   row's fixed point (``e_max``: the masses below need it, and a per-slice fixed point would not sum
   exactly); the slice's fp32 mass at or above ``hist_levels`` exponent boundaries ``hist_level_octaves``
   apart (aligned alike in every slice); zeroes the row's histogram. One read of the row. Measured
   2.6/5.3/17.1 µs at 1/32/64 rows before the levels: at 64 rows the 33 MB come from HBM while the
   previous call's 33 MB of renormalised rows are written back out of L2 (~66 MB in 17 µs); the
   levels (3 instructions a value and level) hide under that. Predicted ~3.5/6/18 µs.
2. ``_hist_kernel`` (same grid): from the levels, a fine window ``[A, Z)`` of patterns where the
   threshold surely lies (fp32 sums with a proven slack; usually one 2-octave level); the exact
   fixed-point mass (int64) and count per fine bucket of the window (``hist_buckets - 2`` of them, by
   relaxed atomics: integer sums, exact in any order), and of the two lumps below and above it (one
   atomic a slice). The first version bucketed all 32 octaves below the largest value by two atomics
   a value (16M at 64 rows: 23.6/141/239 µs, atomic-throughput bound, the route's whole cost); now
   ~5-10K atomics a row for a softmax of randn * 3 at p = 0.9. The second read is mostly from L2.
   Predicted ~5/8/14 µs. Thresholds below the levels' reach (p = 0.99 on randn * 3, p = 1) get a
   window from 0 and the old cost.
3. ``_hist_bracket_kernel`` (grid ``(B,)``): scans a row's buckets: the bucket where the top-p
   test turns (a prefix sum), i.e. ``lo`` failing and ``hi`` passing with the exact masses and counts
   above them, the invariants of the full-pass route's search. The window only decides which bucket
   that is, so exactness never depends on the fp32 levels. Measured 3.2/3.4/3.7 µs (unchanged).
4. ``_bracket_compact_kernel`` (grid ``(B, HIST_SLICES)``): when the bracket holds at most ``CAP``
   values (~5 at p = 0.9 for a softmax of randn * 3 at V = 128256: buckets of 1/512 octave), each
   slice appends its own to the row's buffer (slots from an atomic counter; the order does not
   matter to sums and counts). A third read, from L2. Measured 3.8/13.3/23.1 µs with ~240 values a
   bracket, when most slices had some and paid the atomic and the block-wide scan; now most have
   none. Predicted ~3/8/14 µs.

The filter kernel then ends the search in registers (``_top_p_in_registers`` over the bracket's
``2^sh`` patterns: 14 bisection steps for a 2-octave window; 4 pivots a step measured slower, see
``_kth_in_registers``), or, when the bracket
is larger (ties, flat rows, a threshold among many tiny values), goes on with the exact full-pass
search inside the bracket. Sampling then scans the row in index order up to the token, as on the
full-pass route.

**Renormalised rows** are written by ``_renorm_write_kernel`` (grid ``(B, cdiv(V, write_block))``) from
the ``(threshold, 1/S)`` the filter kernel leaves per row: one program walking a whole row was
latency-bound.

Exactness does not depend on the launch parameters: ``tests/test_sampling.py`` runs every route with
a 64-slot buffer on rows of 1000 against the reference, with and without the split prepass (4 and 16
slices: 16 and 4 slots a slice) and the histogram route (62 fine buckets, levels every 2 octaves: the
route, its fallback, windows placed by the levels and from 0, a limit exactly at a level boundary).

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
    # values a group of the slice's group maxima, where its count search starts (0: none): 256 groups
    # of 16 at 4096. Larger groups: fewer maxima to search, but ~k (1 + k / groups) values above their
    # k-th largest (60 at k = 50), more often past SLICE_CAP for large k
    slice_group: int = 16
    slice_warps: int = 8  # a slice program: 16 values, 16 x 16 compares per thread a round; 80 registers
    # for sm_90 without spills (4 warps: 180, so at most 2 programs an SM; 16 warps: 75)
    # registers a thread of a slice program at most (ptxas .maxnreg; 0: its choice): 64 fits 4 programs
    # of 8 warps an SM instead of 3 (80 registers), 2 waves instead of 3 for 32 rows' 1024 programs.
    # bench_sampling.py --prepass-sweep on the H200 (2026-11-30, top_k_renorm_probs k = 50, 1/32/64 rows,
    # µs, FlashInfer 37.5/40.4/88.4 in the same rounds): groups of 8 and ptxas' choice 17.9/45.1/87.5;
    # 64 registers 18.3/42.0/74.5; groups of 16 17.4/44.0/85.2; both 17.8/40.5/71.7; 72 registers
    # 17.6/42.0/76.2; 8 pivots 18.4/43.0/81.1; 16 slices 19.5/45.4/90.6; 4 warps 20.8/46.3/102.7.
    # Around the new default (sampling_prepass_sweep_2.json; FlashInfer 37.5/40.8/88.1): 18.1/40.4/72.1;
    # with 8 pivots 18.9/39.9/70.7; 56 registers 18.5/41.5/74.3; groups of 32 19.8/45.2/77.2
    slice_maxnreg: int = 64
    # the renormalised row's write (_renorm_write_kernel, grid (B, cdiv(V, write_block))): 4096 values
    # a program, 16 a thread at 8 warps: four 16-byte loads and stores in flight per thread, 32 programs
    # a row at V = 128256 (2048 at 64 rows: a few waves over 132 SMs, enough to hide HBM latency),
    # and few enough programs that the launch's block scheduling stays under a microsecond
    write_block: int = 4096
    write_warps: int = 8
    # the histogram route (top-p rows that top-k leaves whole, V > cap; 0 slices: none). A row's exact
    # fixed-point mass by bucket: hist_buckets - 2 fine buckets over a window of patterns where the
    # top-p threshold surely lies, found from fp32 sums at hist_levels exponent boundaries
    # hist_level_octaves apart (the prepass), and two lumps (below, above). At 2048 buckets over a
    # 2-octave window a fine bucket is 2^14 patterns (1/512 octave): the threshold's bucket holds ~5
    # values of a softmax of randn * 3 at p = 0.9 and V = 128256, ~70 at randn * 1: one compaction,
    # and 14 bisection steps in registers.
    hist_slices: int = 32  # slices a row of the histogram kernels (4008 values at V = 128256)
    hist_buckets: int = 2048  # a power of two >= 4 (2 lumps): 24 KB a row of int64 masses and int32 counts
    # levels: the window's resolution and reach (8 x 2 octaves: ~15-16 octaves below the largest value,
    # where p <= 0.95 puts the threshold of softmax(randn * s) rows; deeper thresholds get a window from
    # pattern 0 up to the lowest sure level: nearly every value takes atomics, the old cost). A level
    # costs 3 instructions a value in the prepass
    hist_levels: int = 8
    hist_level_octaves: int = 2
    hist_warps: int = 8  # a slice program: 16 values a thread, as the slice prepass
    # sampling calls too: their rows with top_k <= 0 or >= V would take the route, but the four
    # launches run (and exit at once) when every row's top-k cuts, ~2 µs each in a CUDA graph, on the
    # top_k=50 sampling call: bench_sampling.py --sweep on the H200 (2026-11-29, 64 rows) 119 µs with
    # them against 101 without; top-p-only sampling rows then take the full-pass route (454 µs)
    hist_with_top_k: bool = False


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


# The searches in registers bisect: a step is one block-wide reduction. Four pivots a step (the
# bracket shrinking 5-fold, ~2.3x fewer steps) measured slower on the H200 (torch.profiler,
# 2026-11-29): _filter_kernel 9.4 -> 11.9 µs for top_k_renorm_probs, 21.8 -> 30.6 µs for the sampling
# (both searches): the [4, 4096] int64 selects beside the kernel's ~108 registers a thread cost more
# than the reductions they save.
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
        thr, mass = _exact_top_p(row_ptr, V, lo, hi, g_lo, g_hi, c_lo, c_hi, limit, e_max, q_bits, buf_bits, slots,
                                 CAP, CHUNK_G, NP_MASS)
    if SAMPLE:
        token = _sample_scan(row_ptr, V, thr, mass, e_max, q_bits, seed_ptr, offset_ptr, row, CHUNK_G)
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
def _sample_scan(row_ptr, V, thr, mass, e_max, q_bits, seed_ptr, offset_ptr, row, CHUNK_G: tl.constexpr):
    """The sampled token of a row kept at ``bits >= thr`` with kept mass ``mass``: a scan in index
    order that stops reading at the chunk holding the token (0 for a row without mass)."""
    offs_g = tl.arange(0, CHUNK_G)
    token = tl.full([], 0, tl.int32)
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
    return token


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
def _top_k_row(row_ptr, V, k, q_bits, limit_scale, buf_bits, buf_idx, offs, slots, stats_ptr, seed_ptr, offset_ptr,
               row, HAS_P: tl.constexpr, SAMPLE: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
               K_SMALL: tl.constexpr, CHUNK_G: tl.constexpr, NP_COUNT: tl.constexpr, NP_MASS: tl.constexpr,
               NP_FLOAT: tl.constexpr, FITS: tl.constexpr, SPLIT: tl.constexpr, SLICES: tl.constexpr):
    """(threshold pattern, kept mass, sampled token, e_max) of a row off the histogram route: the split
    candidates when the prepass split it, else pass 1 and the candidate or full-pass route."""
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
    GROUPS: tl.constexpr,  # group maxima the search starts from (<= 1: none)
    GM_CAP: tl.constexpr,  # the group-maxima search stops at g(lo) <= GM_CAP (3/4 of SLICE_CAP)
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
    if GROUPS > 1:
        # the start of the search from the GROUPS group maxima (of SLICE // GROUPS neighbours: the load's
        # layout keeps 4 in a thread, so the maxima cost a max in registers and one shuffle). With
        # g(t) = the number of group maxima >= t: those are values of the slice, so f(t) >= g(t), and a
        # t with g(t) >= k is a valid lower end; and f(t) is only a little above g(t) while g(t) is well
        # below GROUPS (k = 50 of 512 groups of 8: f ~ 52 at g = 50, ~105 at g = 96 = GM_CAP for any
        # continuous distribution: it depends on ranks only). So the count search runs on 2 values a
        # thread instead of 16 (16 pivots: 32 compares a thread a round instead of 256), and one count
        # over the slice checks f(lo) <= SLICE_CAP; if not (ties, k near SLICE_CAP) the full search
        # below goes on from there. The first round's pivots sit j^2 / 8 octaves (j = 1..16) below the
        # slice's largest value, where the k-th largest of a softmax slice lies (for k = 50 of 4008,
        # randn * s logits: ~1.8 s to 2.4 s octaves down): one round for s from ~0.5 to ~12 in a numpy
        # model (1.1 on average at s = 3) against 1.5 to 2.8 for the uniform pivots
        gm = tl.max(tl.reshape(b, [GROUPS, SLICE // GROUPS]), axis=1)
        g_lo = tl.sum((gm >= 0).to(tl.int32), axis=0)
        if (c_lo > SLICE_CAP) & (g_lo >= k) & (k <= GM_CAP):
            g_hi = hi
            jq = tl.arange(0, NP) + 1
            piv = tl.maximum(mx + 1 - ((jq * jq) << 20), 0)
            while (g_hi - lo > 1) & (g_lo > GM_CAP):
                g_counts = tl.sum((gm[None, :] >= piv[:, None]).to(tl.int32), axis=1)
                ok = g_counts >= k
                lo = tl.max(tl.where(ok, piv, lo), axis=0)
                g_lo = tl.min(tl.where(ok, g_counts, g_lo), axis=0)
                g_hi = tl.min(tl.where(ok, g_hi, piv), axis=0)
                piv = lo + ((g_hi - lo).to(tl.int64) * jp // (NP + 1)).to(tl.int32)
            c_lo = tl.sum((b >= lo).to(tl.int32), axis=0)  # f(lo) >= g(lo) >= k
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
        k = tl.load(top_k_ptr + row * top_k_stride).to(tl.int64)
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


@triton.jit
def _hist_kernel(
    probs_ptr, probs_row_stride,  # (B, V) fp32 rows, last dim contiguous
    top_p_ptr, top_p_stride,  # (B,) fp32
    hist_max_ptr, hist_level_ptr,  # (B, SLICES) int32 slice maxima, (B, SLICES, LEVELS + 1) fp32 level sums
    hist_mass_ptr, hist_count_ptr,  # (B, NB) int64 / int32, zeroed: += the slice's fixed-point mass and count
    window_ptr,  # (B, 4) int64 out: A, Z, sh (written by slice 0)
    V, L, q_bits,  # vocabulary size; values a slice; fixed-point bits Q
    SLICES: tl.constexpr, SLICE: tl.constexpr, NB: tl.constexpr,  # buckets a row (NB - 2 fine, 2 lumps)
    LEVELS: tl.constexpr, LEVEL_OCT: tl.constexpr,
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
    top_p = tl.load(top_p_ptr + row * top_p_stride).to(tl.float64)
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


@triton.jit
def _hist_bracket_kernel(
    top_p_ptr, top_p_stride,  # (B,) fp32
    hist_max_ptr, hist_mass_ptr, hist_count_ptr,  # the slice maxima and the row's histogram
    window_ptr,  # (B, 4) int64: A, Z, sh from _hist_kernel
    bracket_ptr,  # (B, 8) int64 out: lo, hi, n = values in (lo, hi] (-1: off the route), g_lo, g_hi, c_lo, c_hi, M
    SLICES: tl.constexpr, NB: tl.constexpr,
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
        limit = tl.load(top_p_ptr + row * top_p_stride).to(tl.float64) * total.to(tl.float64)
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
def _hist_row(row_ptr, V, q_bits, limit_scale, buf_bits, slots, hist_max_ptr, bracket_ptr, seed_ptr, offset_ptr, row,
              SAMPLE: tl.constexpr, CAP: tl.constexpr, CHUNK_G: tl.constexpr, NP_MASS: tl.constexpr,
              HIST_SLICES: tl.constexpr):
    """(threshold pattern, kept mass, sampled token, e_max) of a row on the histogram route (top-p,
    top-k keeping all): from the bracket of ``_hist_bracket_kernel``, in registers when the compaction
    ran (at most ``CAP`` values in it), else by the exact full-pass search inside the bracket."""
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
    token = tl.full([], 0, tl.int32)
    if SAMPLE:
        token = _sample_scan(row_ptr, V, thr, mass, e_max, q_bits, seed_ptr, offset_ptr, row, CHUNK_G)
    return thr, mass, token, e_max


@triton.jit
def _filter_kernel(
    probs_ptr, probs_row_stride,  # (B, V) fp32 rows, last dim contiguous
    top_k_ptr, top_k_stride,  # (B,) int32/int64; <= 0 or >= V keeps all (read when HAS_K)
    top_p_ptr, top_p_stride,  # (B,) fp32 (read when HAS_P)
    seed_ptr, offset_ptr,  # one int64 each (read when SAMPLE)
    out_ptr,  # SAMPLE: (B,) int32 ids; else (B, 2) int32: threshold pattern, bits of the fp32 1/S
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
    hist_max_ptr,  # HIST: (B, HIST_SLICES) int32 slice maxima (_hist_prepass_kernel)
    bracket_ptr,  # HIST: (B, 8) int64 top-p brackets (_hist_bracket_kernel)
    HIST: tl.constexpr,  # the histogram kernels ran: rows whose top-k keeps all take the histogram route
    HIST_SLICES: tl.constexpr,  # slices a row of the histogram kernels (HIST)
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

    if HIST:
        if HAS_K:
            if k == V:  # top-k keeps the whole row: the histogram route
                thr, mass, token, e_max = _hist_row(row_ptr, V, q_bits, limit_scale, buf_bits, slots, hist_max_ptr,
                                                    bracket_ptr, seed_ptr, offset_ptr, row, SAMPLE, CAP, CHUNK_G,
                                                    NP_MASS, HIST_SLICES)
            else:
                thr, mass, token, e_max = _top_k_row(row_ptr, V, k, q_bits, limit_scale, buf_bits, buf_idx, offs,
                                                     slots, stats_ptr, seed_ptr, offset_ptr, row, HAS_P, SAMPLE,
                                                     CAP, CHUNK, K_SMALL, CHUNK_G, NP_COUNT, NP_MASS, NP_FLOAT,
                                                     FITS, SPLIT, SLICES)
        else:
            thr, mass, token, e_max = _hist_row(row_ptr, V, q_bits, limit_scale, buf_bits, slots, hist_max_ptr,
                                                bracket_ptr, seed_ptr, offset_ptr, row, SAMPLE, CAP, CHUNK_G,
                                                NP_MASS, HIST_SLICES)
    else:
        thr, mass, token, e_max = _top_k_row(row_ptr, V, k, q_bits, limit_scale, buf_bits, buf_idx, offs, slots,
                                             stats_ptr, seed_ptr, offset_ptr, row, HAS_P, SAMPLE, CAP, CHUNK,
                                             K_SMALL, CHUNK_G, NP_COUNT, NP_MASS, NP_FLOAT, FITS, SPLIT, SLICES)

    if SAMPLE:
        tl.store(out_ptr + row, token)
    else:
        # ---- renormalised row: p / S, S = sum of the kept values, from the fixed-point mass ---------
        # (exact to 2^-26 relative: each q loses < 1 unit of 2^-(Q-1) of the largest value). The row
        # itself is written by _renorm_write_kernel, many programs a row: here only (thr, 1/S).
        scale = ((e_max - 126 - q_bits + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)  # 2^-s
        total = mass.to(tl.float64) * scale
        inv = tl.where(total > 0, 1.0 / tl.maximum(total, 1e-300), 0.0).to(tl.float32)
        tl.store(out_ptr + row * 2, thr)
        tl.store(out_ptr + row * 2 + 1, inv.to(tl.int32, bitcast=True))


@triton.jit
def _renorm_write_kernel(
    probs_ptr, probs_row_stride,  # (B, V) fp32 rows, last dim contiguous
    thr_inv_ptr,  # (B, 2) int32 from _filter_kernel: threshold pattern, bits of the fp32 1/S
    out_ptr, out_row_stride,  # (B, V) fp32 renormalised rows
    V,  # vocabulary size
    BLOCK: tl.constexpr,  # values a program
):
    """``where(bits(p) >= thr, p * inv, 0)`` for one block of one row (grid ``(B, cdiv(V, BLOCK))``).
    Split from the filter kernel because one program walking a whole row (its old tail) is
    latency-bound: at 32-64 rows it dominated top_k_renorm_probs. The same sanitised ``p`` and the
    same fp32 product as before, so the values are those of the one-program write, bit for bit."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    thr = tl.load(thr_inv_ptr + row * 2)
    inv = tl.load(thr_inv_ptr + row * 2 + 1).to(tl.float32, bitcast=True)
    b = _value_bits(probs_ptr + row * probs_row_stride, cols, cols < V)
    p = b.to(tl.float32, bitcast=True)
    tl.store(out_ptr + row * out_row_stride + cols, tl.where(b >= thr, p * inv, 0.0), mask=cols < V)


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
        K_SPLIT=min(config.cap // slices, config.k_small), NP=config.np_slice,
        GROUPS=triton.next_power_of_2(slice_len) // config.slice_group if config.slice_group else 1,
        GM_CAP=config.cap // slices * 3 // 4, num_warps=config.slice_warps,
        **({"maxnreg": config.slice_maxnreg} if config.slice_maxnreg else {}),
    )
    return stats


def _hist_prepasses(probs: Tensor, top_k, top_p: Tensor, buf_bits: Tensor, config: Config):
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
        probs, probs.stride(0), top_k if has_k else fill, top_k.stride(0) if has_k else 0,
        hist_max, hist_level, hist_mass, hist_count, fill, V, slice_len,
        HAS_K=has_k, SLICES=slices, SLICE=slice_pow2, NB=nb, ZERO=triton.next_power_of_2(triton.cdiv(nb, slices)),
        LEVELS=levels, LEVEL_OCT=level_oct, num_warps=config.hist_warps,
    )
    _hist_kernel[(B, slices)](probs, probs.stride(0), top_p, top_p.stride(0), hist_max, hist_level, hist_mass,
                              hist_count, window, V, slice_len, fixed_point_bits(V), SLICES=slices, SLICE=slice_pow2,
                              NB=nb, LEVELS=levels, LEVEL_OCT=level_oct, num_warps=config.hist_warps)
    _hist_bracket_kernel[(B,)](top_p, top_p.stride(0), hist_max, hist_mass, hist_count, window, bracket,
                               SLICES=slices, NB=nb, num_warps=config.hist_warps)
    _bracket_compact_kernel[(B, slices)](probs, probs.stride(0), bracket, buf_bits, fill, V, slice_len,
                                         CAP=config.cap, SLICE=slice_pow2, num_warps=config.hist_warps)
    return hist_max, bracket, window


def _launch(probs: Tensor, top_k, top_p, seed, offset, sample: bool, config: Config = DEFAULT) -> Tensor:
    B, V = probs.shape
    if sample:
        out = torch.empty(B, dtype=torch.int32, device=probs.device)
    else:
        out = torch.empty((B, V), dtype=torch.float32, device=probs.device)
    if B == 0:
        return out
    # renormalising: the filter kernel leaves (threshold, 1/S) per row here, _renorm_write_kernel the row
    row_out = out if sample else torch.empty((B, 2), dtype=torch.int32, device=probs.device)
    cap = config.cap
    buf_bits = torch.empty((B, cap), dtype=torch.int32, device=probs.device)
    buf_idx = torch.empty((B, cap), dtype=torch.int32, device=probs.device)
    dummy = out  # stands in for the pointers a mode does not read
    # the prepass pays where the streaming pass would walk several chunks; without top-k no row is a
    # candidate row unless it fits
    split = top_k is not None and V > cap and config.slices > 0
    stats = _slice_prepass(probs, top_k, buf_bits, buf_idx, config) if split else dummy
    # the histogram route: top-p rows that top-k leaves whole (all of top_p_renorm_probs), V > cap
    hist = top_p is not None and V > cap and config.hist_slices > 0 and (top_k is None or config.hist_with_top_k)
    hist_max, bracket, _ = _hist_prepasses(probs, top_k, top_p, buf_bits, config) if hist else (dummy, dummy, dummy)
    _filter_kernel[(B,)](
        probs, probs.stride(0),
        top_k if top_k is not None else dummy, top_k.stride(0) if top_k is not None else 0,
        top_p if top_p is not None else dummy, top_p.stride(0) if top_p is not None else 0,
        seed if seed is not None else dummy, offset if offset is not None else dummy,
        row_out,
        buf_bits, buf_idx, stats,
        V, fixed_point_bits(V),
        HAS_K=top_k is not None, HAS_P=top_p is not None, SAMPLE=sample,
        CAP=cap, CHUNK=config.chunk, K_SMALL=config.k_small, CHUNK_G=config.chunk_g,
        NP_COUNT=config.np_count, NP_MASS=config.np_mass, NP_FLOAT=config.np_float, FITS=V <= cap,
        SPLIT=split, SLICES=config.slices if split else 1,
        hist_max_ptr=hist_max, bracket_ptr=bracket, HIST=hist, HIST_SLICES=config.hist_slices if hist else 1,
        num_warps=config.num_warps,
    )
    if not sample:
        block = config.write_block
        _renorm_write_kernel[(B, triton.cdiv(V, block))](probs, probs.stride(0), row_out, out, out.stride(0), V,
                                                         BLOCK=block, num_warps=config.write_warps)
    return out


def top_k_renorm_probs(probs: Tensor, top_k: Tensor) -> Tensor:
    return _launch(probs, top_k, None, None, None, sample=False)


def top_p_renorm_probs(probs: Tensor, top_p: Tensor) -> Tensor:
    return _launch(probs, None, top_p, None, None, sample=False)


def top_k_top_p_sampling_from_probs(probs: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, offset: Tensor) -> Tensor:
    return _launch(probs, top_k, top_p, seed, offset, sample=True)
