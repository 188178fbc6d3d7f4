"""Triton logits ops and min-p sampling: ``softmax`` (each slice's max and sum online, one program a slice,
then each slice written with the row's, combined in an order-free sum), ``top_k_mask_logits`` (the k-th
largest order key among the slices' values above a bound, else by a radix select over slices of the row,
then a masked copy), ``min_p_sampling_from_probs`` (each slice's max, then its kept mass, a program a
slice; then the draw in the slice that holds it, a program a row), the reference's semantics exactly
(``reference.softmax``, ``reference.top_k_mask_logits``, ``reference.min_p_sampling_from_probs``: the
same fixed-point masses and Philox stream as the family)."""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .... import outputs
from ..reference import fixed_point_bits
from ._common import (MASS_CHUNK, _kth_in_registers, _random_bits31, _slice_max_bits, _target, _value_bits,
                      kept_slice_draw, kept_slice_mass, rng_tensors, slice_of_target, slices_max_bits)

_CHUNK = 2048  # values a step: 16 a thread at 4 warps


@triton.jit
def inverse_temperature(t):
    """``1 / t`` in fp32, 0 at ``t == 0`` (FlashInfer's reading: such a row is uniform over its finite logits)."""
    return tl.where(t == 0.0, 0.0, 1.0 / tl.where(t == 0.0, 1.0, t))


@triton.jit
def row_inverse_temperature(t_ptr, t_val, row, HAS_T: tl.constexpr):
    """``1 / t`` of row ``row``: its entry of the per-row temperatures, or the scalar ``t_val``."""
    if HAS_T:
        t = tl.load(t_ptr + row).to(tl.float32)
    else:
        t = t_val
    return inverse_temperature(t)


@triton.jit
def softmax_stats(x_row, lo, hi, inv, CHUNK: tl.constexpr):
    """The max ``m`` of ``x = logit * inv`` over columns ``[lo, hi)`` and ``s = sum(exp(x - m))``, online
    over chunks of ``CHUNK`` in order."""
    offs = tl.arange(0, CHUNK)
    m = tl.full((), -float("inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(lo, hi, CHUNK):
        cols = start + offs
        raw = tl.load(x_row + cols, mask=cols < hi, other=-float("inf")).to(tl.float32)
        x = tl.where(raw == -float("inf"), -float("inf"), raw * inv)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # -inf values add nothing; a chunk and running max both -inf would give exp(NaN)
        scale = tl.where(m_new == -float("inf"), 0.0, tl.exp(m - m_new))
        e = tl.where(x == -float("inf"), 0.0, tl.exp(x - m_new))
        s = s * scale + tl.sum(e, axis=0)
        m = m_new
    return m, s


# A row's max and sum in slices of _SLICE values, one program each, then combined by every kernel that
# needs them: one program a row took 74.6 µs for softmax at 1x128256 on the H200 (FlashInfer 20).
_SLICE = 4096
_FIXED_ONE = tl.constexpr(2.0 ** 40)  # a slice's share of the sum, in units of 2^-40, as an int64


@triton.jit
def _slice_stats_kernel(x_ptr, x_stride, t_ptr, t_val, stats_ptr, V, S,
                        HAS_T: tl.constexpr, SLICE: tl.constexpr, CHUNK: tl.constexpr):
    """``stats[row, j] = (m, s)`` of slice ``j`` of the row (:func:`softmax_stats`)."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    inv = row_inverse_temperature(t_ptr, t_val, row, HAS_T)
    lo = j * SLICE
    m, s = softmax_stats(x_ptr + row * x_stride, lo, tl.minimum(lo + SLICE, V), inv, CHUNK)
    tl.store(stats_ptr + (row * S + j) * 2, m)
    tl.store(stats_ptr + (row * S + j) * 2 + 1, s)


@triton.jit
def row_stats(stats_ptr, row, S, BLOCK_S: tl.constexpr):
    """The row's ``m`` and ``s`` from its ``S`` slices' (``_slice_stats_kernel``), the same bits in every
    kernel whatever its launch: each slice's share ``s_j * exp(m_j - m)`` is summed as an exact integer
    of 2^-40 units (the slice holding the max adds at least 1, so the sum loses nothing fp32 keeps);
    NaN anywhere gives NaN."""
    j = tl.arange(0, BLOCK_S)
    live = j < S
    base = stats_ptr + row * S * 2
    mj = tl.load(base + 2 * j, mask=live, other=-float("inf"))
    sj = tl.load(base + 2 * j + 1, mask=live, other=0.0)
    m = tl.max(mj, axis=0)
    t = tl.where(sj == 0.0, 0.0, sj * tl.exp(mj - m))
    nan = tl.max((t != t).to(tl.int32), axis=0) > 0
    s = tl.sum(tl.where(t != t, 0.0, t * _FIXED_ONE).to(tl.int64), axis=0).to(tl.float32) / _FIXED_ONE
    return m, tl.where(nan, float("nan"), s)


def slice_stats(logits: Tensor, maybe_temperature_arr=None, temperature_val: float = 1.0) -> tuple:
    """``(stats, S, BLOCK_S)``: every row's slice statistics for :func:`row_stats`; ``logits`` non-empty."""
    B, V = logits.shape
    S = max(1, triton.cdiv(V, _SLICE))
    stats = torch.empty((B, S, 2), dtype=torch.float32, device=logits.device)
    has_t = maybe_temperature_arr is not None
    _slice_stats_kernel[(B, S)](logits, logits.stride(0), maybe_temperature_arr if has_t else stats,
                                float(temperature_val), stats, V, S, HAS_T=has_t, SLICE=_SLICE, CHUNK=_CHUNK,
                                num_warps=4)
    return stats, S, triton.next_power_of_2(S)


@triton.jit
def _softmax_kernel(x_ptr, x_stride, t_ptr, t_val, stats_ptr, out_ptr, out_stride, V, S,
                    HAS_T: tl.constexpr, BLOCK_S: tl.constexpr, SLICE: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    inv = row_inverse_temperature(t_ptr, t_val, row, HAS_T)
    m, s = row_stats(stats_ptr, row, S, BLOCK_S)
    lo = tl.program_id(1) * SLICE
    softmax_slice(x_row, out_ptr + row * out_stride, lo, tl.minimum(lo + SLICE, V), inv, m, 1.0 / s, CHUNK)


@triton.jit
def softmax_value(x_row, cols, mask, inv, m, inv_s):
    """The softmax at ``cols``, ``exp(x * inv - m) * inv_s`` in fp32 (``-inf`` logits exactly 0): the one
    expression the softmax writes and the samplers recompute, so they agree bit for bit."""
    raw = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
    x = tl.where(raw == -float("inf"), -float("inf"), raw * inv)
    return tl.exp(x - m) * inv_s


@triton.jit
def softmax_slice(x_row, out_row, lo, hi, inv, m, inv_s, CHUNK: tl.constexpr):
    """Columns ``[lo, hi)`` of the row's softmax (a row of all ``-inf``: NaN)."""
    offs = tl.arange(0, CHUNK)
    for start in range(lo, hi, CHUNK):
        cols = start + offs
        tl.store(out_row + cols, softmax_value(x_row, cols, cols < hi, inv, m, inv_s), mask=cols < hi)


_FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def prob_bits(x_row, cols, mask, inv, m, inv_s):
    """The sanitised pattern (``_value_bits``) of the softmax at ``cols``, computed in registers, not
    read; -1 where masked."""
    p = softmax_value(x_row, cols, mask, inv, m, inv_s)
    p = tl.where(p > 0, tl.minimum(p, _FLT_MAX), 0.0)
    return tl.where(mask, p.to(tl.int32, bitcast=True), -1)


@triton.jit
def _order_key(raw):
    """int32 keys ordering like the fp32 values, NaN as -inf (``reference.order_key``)."""
    x = raw.to(tl.float32)
    x = tl.where(x != x, -float("inf"), tl.where(x == 0.0, 0.0, x))  # -0.0 ties with +0.0
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


# top_k_mask_logits: the k-th largest order key T of each row, then a masked copy (keys >= T kept).
# * Bound route (V <= _MASK_SLICE * _MASK_MAX_SLICES): a program a slice of _MASK_SLICE values, held in
#   registers, takes two lower bounds of T from its groups' maxima: tau_s, their k-th largest (k groups
#   reach it, so k values do), and past _MASK_SHARED_FROM, b_s, their m-th largest, m = cdiv(k, full
#   slices) (each full slice holds m values >= min b_s). It writes its values >= tau_s to its _MASK_CAP
#   slots, or where more than _MASK_CAP are, those >= a cover c_s. A program a row then bisects the
#   candidates for T: they hold every value >= L = max(max tau_s, min b_s) where every c_s <= L. Any
#   other row (ties, k past the slots) takes the radix route.
# * Radix route: T by radix select, 8 bits a pass, MSB first, over the key bits the dtype can set (a
#   16-bit value's key has constant low bits: bf16 2 passes, fp16 3, fp32 4); each pass histograms the
#   next byte of the keys matching the bytes chosen so far, over slices in parallel programs (integer
#   counts, any order); the byte where the count from the top reaches k is replayed from the counts by
#   the programs of the next pass and of the copy, so a pass is one launch.
# The radix route alone (4 passes) took 886 µs at 256x128256 bf16, k = 50 on the H200 (FlashInfer
# 121): its histograms (ballots over 512 bins) bound it at ~200 µs a pass.

_RADIX_BITS = 8
_RADIX_PROGRAMS = 512  # (row, slice) programs to aim for: about 4 a streaming multiprocessor
_MASK_SLICE = 4096  # values a program of the bound route holds in registers: 16 keys a thread
_MASK_GROUP = 16
_MASK_GROUPS = _MASK_SLICE // _MASK_GROUP  # tau_s needs k groups (k <= 256); past them the shared bound
_MASK_CAP = 128  # candidate slots a slice: expected k (1 + k / 256) used, ~60 at k = 50
_MASK_MAX_SLICES = 64  # the row kernel holds 64 x 128 candidates: V <= 262144
_MASK_WARPS = 8  # sm_90, bf16: 128 registers a thread, 2 programs an SM; 4 warps: 254
_MASK_PIVOTS = 16  # a bf16 slice's bound in 4 reductions over its groups' maxima (bisection: 32)
_MASK_SHARED_FROM = 64  # k past which a slice also takes the shared bound: ~k (1 + k / 256) > the slots
_KEY_MIN = tl.constexpr(-2147483648)  # below every order key (that of -inf and NaN is -2139095041)


@triton.jit
def _row_k(k_ptr, k_val, row, V, HAS_K: tl.constexpr):
    """Row ``row``'s k, 0 where it keeps every value (k outside (0, V))."""
    if HAS_K:
        k = tl.load(k_ptr + row).to(tl.int64)
    else:
        k = tl.full((), 0, tl.int64) + k_val
    return tl.where((k > 0) & (k < V), k, 0)


@triton.jit
def _kth_by_pivots(vals, k, lo, hi, PIVOTS: tl.constexpr):
    """The largest ``t`` in ``[lo, hi)`` with at least ``k`` of the 1-D int32 ``vals`` ``>= t`` (``lo``
    has; ``hi - lo < 2^31``): each step counts at ``PIVOTS`` evenly spaced pivots in one reduction and
    keeps the span between the last that holds k and the next."""
    i = tl.arange(0, PIVOTS)
    while hi - lo > 1:
        step = (hi - lo + PIVOTS - 1) // PIVOTS
        pivots = lo + i * step
        enough = (tl.sum((vals[None, :] >= pivots[:, None]).to(tl.int32), axis=1) >= k) & (pivots < hi)
        lo = lo + tl.max(tl.where(enough, i, 0), axis=0) * step
        hi = tl.minimum(lo + step, hi)
    return lo


@triton.jit
def _mask_slice_kernel(x_ptr, x_stride, k_ptr, k_val, buf_ptr, meta_ptr, V, S,
                       HAS_K: tl.constexpr, KEY_SHIFT: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                       CAP: tl.constexpr, PIVOTS: tl.constexpr, SHARED_FROM: tl.constexpr):
    """Slice ``j`` of a row: ``meta[row] = (tau_s, c_s, count, b_s)``, a column a slice, and its values
    ``>= c_s`` in its ``CAP`` slots of ``buf`` (any order).

    * ``tau_s``: the k-th largest of the groups' maxima (``_KEY_MIN`` with fewer than k groups).
    * ``b_s`` (k above ``SHARED_FROM``, full slices): the m-th largest of them, ``m = cdiv(k, full
      slices)``: the full slices hold ``>= k`` values ``>= min b_s``. ``_KEY_MIN`` otherwise.
    * ``c_s = tau_s``, or where more than ``CAP`` values are ``>= tau_s``, the least key with at most
      ``CAP`` at or above it.

    The searches run on ``key >> KEY_SHIFT`` (the bits a 16-bit dtype sets; fp32 drops its lowest,
    which only loosens the bounds by an ulp), so their int32 arithmetic cannot overflow."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    k = _row_k(k_ptr, k_val, row, V, HAS_K)
    tau = tl.full((), -2147483648, tl.int64)
    shared = tl.full((), -2147483648, tl.int64)
    cover = tl.full((), 2147483647, tl.int64)  # the row cannot be complete: the radix route
    n = tl.zeros((), tl.int32)
    if k > 0:
        cols = j * GROUPS * GROUP + tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        live = cols < V
        keys = tl.where(live, _order_key(tl.load(x_ptr + row * x_stride + cols, mask=live, other=0.0)), _KEY_MIN)
        bits = keys >> KEY_SHIFT  # int32 searches: spans below 2^31
        top_bits = tl.max(bits, axis=1)  # every group's largest
        lo = tl.min(top_bits, axis=0)
        hi = tl.max(top_bits, axis=0) + 1
        if k <= GROUPS:
            tau = _kth_by_pivots(top_bits, k, lo, hi, PIVOTS).to(tl.int64) << KEY_SHIFT
        full = V // (GROUPS * GROUP)
        m = (k + full - 1) // tl.maximum(full, 1)
        if (k > SHARED_FROM) & (j < full) & (m <= GROUPS):
            shared = _kth_by_pivots(top_bits, m, lo, hi, PIVOTS).to(tl.int64) << KEY_SHIFT
        sel = live & (keys >= tau)
        n = tl.sum(tl.sum(sel.to(tl.int32), axis=1), axis=0)
        cover = tau
        if n > CAP:  # ties, k near CAP or past the groups: the least key with at most CAP at or above it
            flat = tl.reshape(bits, (GROUPS * GROUP,))
            cover = (_kth_in_registers(flat, CAP + 1, (tau >> KEY_SHIFT).to(tl.int32), hi, 0) + 1).to(tl.int64)
            cover = cover << KEY_SHIFT
            sel = live & (keys >= cover)
            n = tl.sum(tl.sum(sel.to(tl.int32), axis=1), axis=0)
        per_group = tl.sum(sel.to(tl.int32), axis=1)
        pos = (tl.cumsum(per_group, axis=0) - per_group)[:, None] + tl.cumsum(sel.to(tl.int32), axis=1) - 1
        tl.store(buf_ptr + (row * S + j) * CAP + pos, keys, mask=sel)
    meta = meta_ptr + row * 4 * S + j
    tl.store(meta, tau.to(tl.int32))
    tl.store(meta + S, tl.minimum(cover, 2147483647).to(tl.int32))
    tl.store(meta + 2 * S, n)
    tl.store(meta + 3 * S, shared.to(tl.int32))


@triton.jit
def _mask_threshold_kernel(k_ptr, k_val, buf_ptr, meta_ptr, state_ptr, counts_ptr, V, S,
                           PASSES: tl.constexpr, HAS_K: tl.constexpr, BLOCK_S: tl.constexpr, CAP: tl.constexpr,
                           SLICE: tl.constexpr):
    """``state[row] = (T_u >> LOW, 0)`` (``T_u`` the unsigned key, ``T + 2^31``; ``LOW = 32 - 8 PASSES``,
    the radix passes' last shift) where the row's candidates hold every value ``>= L = max(max tau_s,
    min b_s) <= T``; ``(0, k)`` and its radix counts cleared where they do not; ``(0, 0)`` where the row
    keeps every value."""
    row = tl.program_id(0).to(tl.int64)
    k = _row_k(k_ptr, k_val, row, V, HAS_K)
    jj = tl.arange(0, BLOCK_S)
    live = jj < S
    meta = meta_ptr + row * 4 * S + jj
    full = V // SLICE
    bound = tl.max(tl.load(meta, mask=live, other=-2147483648), axis=0).to(tl.int64)
    shared = tl.min(tl.load(meta + 3 * S, mask=jj < full, other=2147483647), axis=0).to(tl.int64)
    bound = tl.maximum(bound, tl.where(full > 0, shared, -2147483648))
    cover = tl.max(tl.load(meta + S, mask=live, other=-2147483648), axis=0).to(tl.int64)
    n = tl.load(meta + 2 * S, mask=live, other=0)
    prefix = tl.zeros((), tl.int64)
    k_left = tl.zeros((), tl.int64)
    if k > 0:
        if cover <= bound:
            slots = tl.arange(0, CAP)
            cand = tl.load(buf_ptr + (row * S + jj[:, None]) * CAP + slots[None, :],
                           mask=slots[None, :] < n[:, None], other=-2147483648)
            cand = tl.reshape(cand, (BLOCK_S * CAP,))
            prefix = (_kth_in_registers(cand, k, bound, tl.max(cand, axis=0).to(tl.int64) + 1, 0) + 2147483648)
            prefix = prefix >> (32 - 8 * PASSES)
        else:
            k_left = k
            for p in tl.static_range(PASSES):
                tl.store(counts_ptr + (row * PASSES + p) * 256 + tl.arange(0, 256), tl.zeros((256,), tl.int32))
    tl.store(state_ptr + 2 * row, prefix)
    tl.store(state_ptr + 2 * row + 1, k_left)


@triton.jit
def _radix_init_kernel(k_ptr, k_val, state_ptr, counts_ptr, V, HAS_K: tl.constexpr, PASSES: tl.constexpr):
    """``state[row] = (prefix 0, k)``; ``k`` 0 for a row that keeps every value (k outside (0, V)); the
    row's ``PASSES`` radix counts cleared (here, not by an aten fill: a call of Triton launches only is
    one the C++ entry replays)."""
    row = tl.program_id(0).to(tl.int64)
    for p in tl.static_range(PASSES):
        tl.store(counts_ptr + (row * PASSES + p) * 256 + tl.arange(0, 256), tl.zeros((256,), tl.int32))
    tl.store(state_ptr + 2 * row, tl.zeros((), tl.int64))
    tl.store(state_ptr + 2 * row + 1, _row_k(k_ptr, k_val, row, V, HAS_K))


@triton.jit
def _radix_prefix(state_ptr, counts_ptr, row, PASSES: tl.constexpr, DONE: tl.constexpr):
    """A radix row's key prefix after its first ``DONE`` passes, replayed from their counts: each pass's
    byte ``d`` is where the count of matching keys from the top first reaches k; the prefix gains ``d``
    and k loses the count above it. Replayed by every program that needs it: no select launches."""
    prefix = tl.zeros((), tl.int64)
    k = tl.load(state_ptr + 2 * row + 1)
    digits = tl.arange(0, 256)
    for p in tl.static_range(DONE):
        c = tl.load(counts_ptr + (row * PASSES + p) * 256 + digits).to(tl.int64)
        at_or_above = tl.sum(c, axis=0) - tl.cumsum(c, axis=0) + c  # matching keys with a byte >= d
        d = tl.max(tl.where(at_or_above >= k, digits, -1), axis=0)
        k = k - tl.sum(tl.where(digits > d, c, 0), axis=0)
        prefix = (prefix << 8) | d.to(tl.int64)
    return prefix


@triton.jit
def _radix_count_kernel(x_ptr, x_stride, state_ptr, counts_ptr, V, slice_len,
                        PASSES: tl.constexpr, PASS: tl.constexpr, CHUNK: tl.constexpr):
    """Pass ``PASS`` of a radix row: the histogram of the next byte of the unsigned keys (``key + 2^31``)
    in this program's slice whose higher bytes equal the row's prefix, added to ``counts[row, PASS]``."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(state_ptr + 2 * row + 1) > 0:
        prefix = _radix_prefix(state_ptr, counts_ptr, row, PASSES, PASS)
        shift: tl.constexpr = 24 - 8 * PASS
        x_row = x_ptr + row * x_stride
        lo = tl.program_id(1) * slice_len
        offs = tl.arange(0, CHUNK)
        hist = tl.zeros((2 * 256,), tl.int32)
        for start in range(lo, tl.minimum(lo + slice_len, V), CHUNK):
            cols = start + offs
            live = cols < V
            u = _order_key(tl.load(x_row + cols, mask=live, other=0.0)).to(tl.int64) + 2147483648
            match = live & ((u >> (shift + 8)) == prefix)
            digit = ((u >> shift) & 255).to(tl.int32)
            hist += tl.histogram(tl.where(match, digit, 256 + digit), 2 * 256)  # bins 256.. take the rest
        kept, _ = tl.split(tl.permute(tl.reshape(hist, (2, 256)), (1, 0)))
        tl.atomic_add(counts_ptr + (row * PASSES + PASS) * 256 + tl.arange(0, 256), kept, sem="relaxed")


@triton.jit
def _top_k_mask_copy_kernel(x_ptr, x_stride, state_ptr, counts_ptr, out_ptr, out_stride, V, slice_len,
                            PASSES: tl.constexpr, CHUNK: tl.constexpr):
    """``out = x`` where the unsigned key is at least the row's threshold ``prefix << (32 - 8 PASSES)``,
    else -inf: the prefix from the state (0 for a row keeping every value), or for a radix row from its
    passes' counts."""
    row = tl.program_id(0).to(tl.int64)
    prefix = tl.load(state_ptr + 2 * row)
    if tl.load(state_ptr + 2 * row + 1) > 0:
        prefix = _radix_prefix(state_ptr, counts_ptr, row, PASSES, PASSES)
    threshold = prefix << (32 - 8 * PASSES)
    x_row = x_ptr + row * x_stride
    o_row = out_ptr + row * out_stride
    lo = tl.program_id(1) * slice_len
    offs = tl.arange(0, CHUNK)
    for start in range(lo, tl.minimum(lo + slice_len, V), CHUNK):
        cols = start + offs
        mask = cols < V
        raw = tl.load(x_row + cols, mask=mask, other=0.0)
        keep = _order_key(raw).to(tl.int64) + 2147483648 >= threshold
        tl.store(o_row + cols, tl.where(keep, raw, -float("inf")).to(out_ptr.dtype.element_ty), mask=mask)


def softmax(logits: Tensor, maybe_temperature_arr=None, temperature_val: float = 1.0, *, out=None) -> Tensor:
    B, V = logits.shape
    out = (torch.empty((B, V), dtype=torch.float32, device=logits.device) if out is None
           else outputs.given(out, 0, (B, V), torch.float32, logits.device))
    if B:
        stats, S, block_s = slice_stats(logits, maybe_temperature_arr, temperature_val)
        has_t = maybe_temperature_arr is not None
        _softmax_kernel[(B, S)](logits, logits.stride(0), maybe_temperature_arr if has_t else out,
                                float(temperature_val), stats, out, out.stride(0), V, S, HAS_T=has_t, BLOCK_S=block_s,
                                SLICE=_SLICE, CHUNK=_CHUNK, num_warps=4)
    return out


# Low key bits constant within a sign for the dtype (its fp32 widening's zero mantissa bits): the radix
# passes stop above them (a byte a pass: bf16 2, fp16 3, fp32 4); the bound's searches skip them (fp32: one).
_KEY_SHIFT = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}


def top_k_mask_logits(logits: Tensor, maybe_top_k_arr=None, top_k_val: int = 0, *, out=None) -> Tensor:
    B, V = logits.shape
    out = (torch.empty((B, V), dtype=logits.dtype, device=logits.device) if out is None
           else outputs.given(out, 0, (B, V), logits.dtype, logits.device))
    if B == 0 or V == 0:
        return out
    has_k = maybe_top_k_arr is not None
    k_val = max(min(int(top_k_val), V), -1)  # the kernel takes an int32 scalar; every k outside (0, V) keeps all
    k_arg = maybe_top_k_arr if has_k else out
    shift = _KEY_SHIFT[logits.dtype]
    passes = (32 - shift) // _RADIX_BITS + ((32 - shift) % _RADIX_BITS > 0)
    chunks = triton.cdiv(V, _CHUNK)
    slices = max(1, min(chunks, _RADIX_PROGRAMS // B))
    slice_len = triton.cdiv(chunks, slices) * _CHUNK
    grid = (B, triton.cdiv(V, slice_len))
    state = torch.empty((B, 2), dtype=torch.int64, device=logits.device)
    keeps_all = not has_k and not 0 < k_val < V
    S = triton.cdiv(V, _MASK_SLICE)
    if keeps_all:
        counts = torch.empty(0, dtype=torch.int32, device=logits.device)  # no row is a radix row
        _radix_init_kernel[(B,)](k_arg, k_val, state, counts, V, HAS_K=has_k, PASSES=0)
    # radix alone at one row (14-15 against 19-23 µs at 1 x 128256, k 50-1000) and where a scalar k fills a
    # quarter of the slots (115 against 204 at 256 x 32000, k = 1000: the bounds overflow, then radix runs)
    elif S <= _MASK_MAX_SLICES and B > 1 and (has_k or 4 * k_val <= _MASK_CAP * S):
        buf = torch.empty((B, S, _MASK_CAP), dtype=torch.int32, device=logits.device)
        meta = torch.empty((B, 4, S), dtype=torch.int32, device=logits.device)
        counts = torch.empty((B, passes, 256), dtype=torch.int32, device=logits.device)  # cleared by radix rows
        _mask_slice_kernel[(B, S)](logits, logits.stride(0), k_arg, k_val, buf, meta, V, S, HAS_K=has_k,
                                   KEY_SHIFT=max(shift, 1), GROUPS=_MASK_GROUPS, GROUP=_MASK_GROUP, CAP=_MASK_CAP,
                                   PIVOTS=_MASK_PIVOTS, SHARED_FROM=_MASK_SHARED_FROM, num_warps=_MASK_WARPS)
        _mask_threshold_kernel[(B,)](k_arg, k_val, buf, meta, state, counts, V, S, PASSES=passes, HAS_K=has_k,
                                     BLOCK_S=triton.next_power_of_2(S), CAP=_MASK_CAP, SLICE=_MASK_SLICE, num_warps=4)
    else:
        counts = torch.empty((B, passes, 256), dtype=torch.int32, device=logits.device)
        _radix_init_kernel[(B,)](k_arg, k_val, state, counts, V, HAS_K=has_k, PASSES=passes)
    if not keeps_all:  # the rows the bound route finished (most) return at once
        for p in range(passes):
            _radix_count_kernel[grid](logits, logits.stride(0), state, counts, V, slice_len, PASSES=passes, PASS=p,
                                      CHUNK=_CHUNK, num_warps=4)
    _top_k_mask_copy_kernel[grid](logits, logits.stride(0), state, counts, out, out.stride(0), V, slice_len,
                                  PASSES=passes, CHUNK=_CHUNK, num_warps=4)
    return out


@triton.jit
def _min_p_row(p_ptr, p_stride, idx_ptr, mp_ptr, mp_val, row, HAS_MP: tl.constexpr, HAS_IDX: tl.constexpr):
    """Output row ``row``'s probabilities (row ``idx[row]`` with ``HAS_IDX``) and its ``min_p``."""
    src = row
    if HAS_IDX:
        src = tl.load(idx_ptr + row).to(tl.int64)
    if HAS_MP:
        min_p = tl.load(mp_ptr + src).to(tl.float32)
    else:
        min_p = mp_val
    return p_ptr + src * p_stride, min_p


@triton.jit
def _min_p_cut(mx, min_p):
    """``(threshold, e_max)`` of a row whose largest pattern is ``mx``: kept are the patterns at or above
    ``bits(fp32(min_p * max))`` (the largest only where that is NaN or above the max), massed at the
    largest's exponent."""
    m = mx.to(tl.float32, bitcast=True)
    pivot = min_p * m
    below_max = pivot <= m  # NaN or min_p > 1: the largest only
    pivot = tl.where(pivot > 0, pivot, 0.0)
    return tl.where(below_max, pivot.to(tl.int32, bitcast=True), mx), tl.maximum(mx >> 23, 1)


@triton.jit
def _min_p_slice_kernel(p_ptr, p_stride, mp_ptr, mp_val, idx_ptr, mx_ptr, mass_ptr, V, S, q_bits,
                        MASS: tl.constexpr, HAS_MP: tl.constexpr, HAS_IDX: tl.constexpr, BLOCK_S: tl.constexpr,
                        SLICE: tl.constexpr, CHUNK: tl.constexpr, MASS_CHUNK: tl.constexpr):
    """Slice ``j`` of output row ``row``: its largest pattern (``mx[row, j]``), or with ``MASS`` its kept
    mass (``mass[row, j]``) under the row's threshold, from every slice's largest."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    p_row, min_p = _min_p_row(p_ptr, p_stride, idx_ptr, mp_ptr, mp_val, row, HAS_MP, HAS_IDX)
    lo = j * SLICE
    hi = tl.minimum(lo + SLICE, V)
    if MASS:
        thr, e_max = _min_p_cut(slices_max_bits(mx_ptr, row, S, BLOCK_S), min_p)
        tl.store(mass_ptr + row * S + j, kept_slice_mass(p_row, lo, hi, tl.load(mx_ptr + row * S + j), thr, e_max,
                                                         q_bits, MASS_CHUNK))
    else:
        tl.store(mx_ptr + row * S + j, _slice_max_bits(p_row, lo, hi, CHUNK))


@triton.jit
def _min_p_kernel(p_ptr, p_stride, mp_ptr, mp_val, seed_ptr, offset_ptr, out_ptr, V, S, q_bits, idx_ptr, mx_ptr,
                  mass_ptr, HAS_MP: tl.constexpr, BLOCK_S: tl.constexpr, SLICE: tl.constexpr, CHUNK: tl.constexpr,
                  PER_ROW_RNG: tl.constexpr, HAS_IDX: tl.constexpr):
    """The draw of ``reference.min_p_sampling_from_probs`` from the slices' largest patterns and kept
    masses (exact integers, so their sum is the row's in any order): the target, then the first token
    whose cumulative kept mass exceeds it, scanned in the one slice that holds it. ``HAS_IDX``: output
    row ``row`` reads the probs row ``idx[row]`` and its ``min_p``."""
    row = tl.program_id(0).to(tl.int64)
    p_row, min_p = _min_p_row(p_ptr, p_stride, idx_ptr, mp_ptr, mp_val, row, HAS_MP, HAS_IDX)
    jj = tl.arange(0, BLOCK_S)
    live = jj < S
    thr, e_max = _min_p_cut(slices_max_bits(mx_ptr, row, S, BLOCK_S), min_p)
    masses = tl.load(mass_ptr + row * S + jj, mask=live, other=0)
    target = _target(_random_bits31(seed_ptr, offset_ptr, row, PER_ROW_RNG), tl.sum(masses, axis=0))
    js, base = slice_of_target(masses, jj, S, target)
    # no slice holds it (no mass): js = S, no pass
    tl.store(out_ptr + row, kept_slice_draw(p_row, js * SLICE, tl.minimum(js * SLICE + SLICE, V), thr, e_max, q_bits,
                                            base, target, CHUNK))


def min_p_sampling_from_probs(probs: Tensor, maybe_min_p_arr, min_p_val: float, seed: Tensor, offset: Tensor,
                              indices: Optional[Tensor] = None) -> Tensor:
    V = probs.shape[1]
    B = probs.shape[0] if indices is None else indices.shape[0]  # output rows
    out = torch.empty(B, dtype=torch.int32, device=probs.device)
    if B:
        has_mp, has_idx = maybe_min_p_arr is not None, indices is not None
        seed, offset, per_row = rng_tensors(seed, offset, B)
        S = max(1, triton.cdiv(V, _SLICE))
        mx = torch.empty((B, S), dtype=torch.int32, device=probs.device)
        mass = torch.empty((B, S), dtype=torch.int64, device=probs.device)
        mp = maybe_min_p_arr if has_mp else out
        idx = indices if has_idx else out
        q_bits, block_s = fixed_point_bits(V), triton.next_power_of_2(S)
        for with_mass in (False, True):  # every slice's largest, then every slice's kept mass under the row's
            _min_p_slice_kernel[(B, S)](probs, probs.stride(0), mp, float(min_p_val), idx, mx, mass, V, S, q_bits,
                                        MASS=with_mass, HAS_MP=has_mp, HAS_IDX=has_idx, BLOCK_S=block_s,
                                        SLICE=_SLICE, CHUNK=_CHUNK, MASS_CHUNK=MASS_CHUNK, num_warps=4)
        _min_p_kernel[(B,)](probs, probs.stride(0), mp, float(min_p_val), seed, offset, out, V, S, q_bits, idx, mx,
                            mass, HAS_MP=has_mp, BLOCK_S=block_s, SLICE=_SLICE, CHUNK=_CHUNK, PER_ROW_RNG=per_row,
                            HAS_IDX=has_idx, num_warps=4)
    return out
