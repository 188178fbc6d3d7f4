"""The filter kernel, one program per row: the row's route (the histogram route's bracket when those
kernels ran and top-k keeps the row whole; the split prepass's candidates when it split the row; else
the streaming pass, then the candidate or the full-pass route), then the sampled id, or the row's
threshold and ``1/S`` from which ``_renorm_write_kernel`` (grid ``(B, cdiv(V, write_block))``) writes
the renormalised row: one program walking a whole row was latency-bound."""

import triton
import triton.language as tl

from ._common import _fixed, _random_bits31, _row_max_bits, _value_bits, row_top_k, row_value
from .candidates import _candidate_route, _candidates_in_registers, _stream_candidates, split_row
from .histogram import _hist_row
from .pivots import _full_pass_route


@triton.jit
def _unsplit_row(row_ptr, V, k, q_bits, limit_scale, joint_mass, buf_bits, buf_idx, offs, slots, r31, row,
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
                                            joint_mass, r31, row, HAS_P, SAMPLE, CAP)
    else:
        if overflow == 0:
            thr, mass, token = _candidate_route(buf_bits, buf_idx, slots, n, k, tau, mx, e_max, q_bits, limit_scale,
                                                joint_mass, r31, row, HAS_P, SAMPLE, CAP)
        else:
            thr, mass, token = _full_pass_route(row_ptr, V, k, tau, mx, e_max, q_bits, limit_scale, joint_mass,
                                                buf_bits, slots, r31, row, HAS_P, SAMPLE, CAP, CHUNK_G,
                                                NP_COUNT, NP_MASS, NP_FLOAT)
    return thr, mass, token, e_max


@triton.jit
def _top_k_row(row_ptr, V, k, q_bits, limit_scale, joint_mass, buf_bits, buf_idx, offs, slots, stats_ptr, r31,
               row, HAS_P: tl.constexpr, SAMPLE: tl.constexpr, CAP: tl.constexpr, CHUNK: tl.constexpr,
               K_SMALL: tl.constexpr, CHUNK_G: tl.constexpr, NP_COUNT: tl.constexpr, NP_MASS: tl.constexpr,
               NP_FLOAT: tl.constexpr, FITS: tl.constexpr, SPLIT: tl.constexpr, SLICES: tl.constexpr):
    """(threshold pattern, kept mass, sampled token, e_max) of a row off the histogram route: the split
    candidates when the prepass split it, else pass 1 and the candidate or full-pass route."""
    if SPLIT:
        split, tau = split_row(stats_ptr, row, k, SLICES, K_SMALL)
        if split:
            # ---- split row: the prepass wrote the candidates; no streaming pass ---------------------
            sl = tl.arange(0, SLICES)
            mx = tl.max(tl.load(stats_ptr + row * (4 * SLICES) + SLICES + sl), axis=0)  # the row's largest pattern
            e_max = tl.maximum(mx >> 23, 1)
            vb = tl.load(buf_bits + slots)  # SLICES x SLICE_CAP = CAP slots (powers of two), all written
            vb = tl.where(vb >= tau, vb, -1)  # below tau (a lower cover_s): harmless, but no candidate
            vi = tl.load(buf_idx + slots, mask=vb >= 0, other=0)
            thr, mass, token = _candidates_in_registers(vb, vi, slots, k, tau, mx, e_max, q_bits, limit_scale,
                                                        joint_mass, r31, row, HAS_P, SAMPLE, CAP)
        else:
            thr, mass, token, e_max = _unsplit_row(row_ptr, V, k, q_bits, limit_scale, joint_mass, buf_bits, buf_idx,
                                                   offs, slots, r31, row, HAS_P, SAMPLE, CAP, CHUNK,
                                                   K_SMALL, CHUNK_G, NP_COUNT, NP_MASS, NP_FLOAT, FITS)
    else:
        thr, mass, token, e_max = _unsplit_row(row_ptr, V, k, q_bits, limit_scale, joint_mass, buf_bits, buf_idx, offs,
                                               slots, r31, row, HAS_P, SAMPLE, CAP, CHUNK, K_SMALL,
                                               CHUNK_G, NP_COUNT, NP_MASS, NP_FLOAT, FITS)

    return thr, mass, token, e_max


@triton.jit(do_not_specialize=["top_k_ptr", "top_p_ptr"])
def _filter_kernel(
    probs_ptr, probs_row_stride,  # (B, V) fp32 rows, last dim contiguous
    top_k_ptr, top_k_stride,  # (B,) int32/int64; <= 0 or >= V keeps all (read when HAS_K)
    top_p_ptr, top_p_stride,  # (B,) fp32 (read when HAS_P)
    seed_ptr, offset_ptr,  # int64, one each or (B,) each with PER_ROW_RNG (read when SAMPLE)
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
    draw_ptr,  # HIST and SAMPLE: (B, 3) int64 out: (thr, e_max, target) of a histogram-route row, e_max 0 for others
    HIST: tl.constexpr,  # the histogram kernels ran: rows whose top-k keeps all take the histogram route
    HIST_SLICES: tl.constexpr,  # slices a row of the histogram kernels (HIST)
    K_ARR: tl.constexpr = True,  # top_k a (B,) tensor, else an int for every row
    P_ARR: tl.constexpr = True,  # top_p a (B,) tensor, else a float for every row
    joint_mass_ptr=None,  # JOINT: (B,) int64 fixed-point mass of the whole row (_row_mass_kernel)
    JOINT: tl.constexpr = False,  # top-p against the whole row's mass (filter_apply_order="joint")
    PER_ROW_RNG: tl.constexpr = False,  # seed/offset (B,): each row keyed alone (_common._random_bits31)
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = probs_ptr + row * probs_row_stride
    buf_bits = buf_bits_ptr + row * CAP
    buf_idx = buf_idx_ptr + row * CAP
    offs = tl.arange(0, CHUNK)
    slots = tl.arange(0, CAP)

    k = V
    if HAS_K:
        k = row_top_k(top_k_ptr, top_k_stride, row, V, K_ARR)

    limit_scale = 0.0
    if HAS_P:
        limit_scale = row_value(top_p_ptr, top_p_stride, row, P_ARR, tl.float64)
    joint_mass = tl.full((), -1, tl.int64)  # < 0: top-p against the top-k survivors' mass
    if JOINT:
        joint_mass = tl.load(joint_mass_ptr + row)
    r31 = tl.zeros((), tl.int64)
    if SAMPLE:
        r31 = _random_bits31(seed_ptr, offset_ptr, row, PER_ROW_RNG)

    if HIST:
        if HAS_K:
            if k == V:  # top-k keeps the whole row: the histogram route
                thr, mass, e_max = _hist_row(row_ptr, V, q_bits, limit_scale, buf_bits, slots, hist_max_ptr,
                                             bracket_ptr, r31, row, SAMPLE, CAP, CHUNK_G, NP_MASS, HIST_SLICES,
                                             draw_ptr)
                token = tl.full([], 0, tl.int32)  # the draw kernels' (draw_ptr)
            else:
                thr, mass, token, e_max = _top_k_row(row_ptr, V, k, q_bits, limit_scale, joint_mass, buf_bits,
                                                     buf_idx, offs, slots, stats_ptr, r31, row, HAS_P, SAMPLE,
                                                     CAP, CHUNK, K_SMALL, CHUNK_G, NP_COUNT, NP_MASS, NP_FLOAT,
                                                     FITS, SPLIT, SLICES)
                if SAMPLE:
                    tl.store(draw_ptr + row * 3 + 1, tl.zeros((), tl.int64))  # drawn here: no draw
        else:
            thr, mass, e_max = _hist_row(row_ptr, V, q_bits, limit_scale, buf_bits, slots, hist_max_ptr,
                                         bracket_ptr, r31, row, SAMPLE, CAP, CHUNK_G, NP_MASS, HIST_SLICES, draw_ptr)
            token = tl.full([], 0, tl.int32)  # the draw kernels' (draw_ptr)
    else:
        thr, mass, token, e_max = _top_k_row(row_ptr, V, k, q_bits, limit_scale, joint_mass, buf_bits, buf_idx, offs,
                                             slots, stats_ptr, r31, row, HAS_P, SAMPLE, CAP, CHUNK,
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
    out_ptr, out_row_stride,  # (B, V) renormalised rows in the probabilities' dtype (the fp32 product rounded)
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


@triton.jit
def _row_mass_kernel(probs_ptr, probs_row_stride, out_ptr, V, q_bits, CHUNK: tl.constexpr):
    """``out[row]``: the fixed-point mass of the whole row (its largest pattern first), the measure of
    the joint order's top-p test; two reads of the row."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = probs_ptr + row * probs_row_stride
    offs = tl.arange(0, CHUNK)
    mx = _row_max_bits(row_ptr, V, CHUNK)
    e_max = tl.maximum(mx >> 23, 1)
    acc = tl.zeros([CHUNK], dtype=tl.int64)
    for start in range(0, V, CHUNK):
        cols = start + offs
        acc += _fixed(_value_bits(row_ptr, cols, cols < V), e_max, q_bits)
    tl.store(out_ptr + row, tl.sum(acc, axis=0))
