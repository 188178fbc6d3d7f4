"""The candidate-buffer route (``0 < top_k <= Config.k_small``, or a whole row within ``Config.cap``):
the row's values ``>= tau``, ``tau`` a lower bound of the k-th largest value ``t_k``, gathered in index
order into a per-row buffer of ``cap`` slots; then the top-k threshold, the top-p threshold (bisection
on the fixed-point mass) and the sample (a prefix sum) in registers. One read of the row: the path of
``top_k=50``.

The buffer is filled one of two ways:

* **Streaming pass** (``_stream_candidates``): one program walks the row in chunks of ``Config.chunk``,
  appending every value ``>= tau``; when a chunk would overflow the buffer, ``tau`` is raised to the
  k-th largest of buffer + chunk (a bisection on the bit pattern in registers) and the buffer is
  compacted. Ties that still overflow send the row to the full-pass route (``pivots``). When
  ``V <= cap`` every row takes this route and the kernel is compiled without the other (``FITS``).
* **Split prepass** (``_slice_candidates_kernel``, ``V > cap`` with top-k given): the streaming pass is
  latency-bound, one program walking 31 chunks of 4096 at ``V = 128256`` (~135 µs a row on the H200,
  whatever the batch). So grid ``(B, SLICES)`` cuts each row into ``SLICES`` contiguous slices of
  ``L = cdiv(V, SLICES)`` values, each held in registers by its own program, which finds with a
  multi-pivot count search a lower bound ``tau_s`` of its slice's k-th largest pattern (0 if the slice
  has fewer than k values) and a cover ``cover_s`` (``tau_s``, or ``tau_s + 1`` above a tie too large)
  such that at most ``SLICE_CAP = cap / SLICES`` of its values are ``>= cover_s``; those it writes, in
  index order, into its ``SLICE_CAP`` slots of the row's buffer (-1 fills the rest). ``tau = max_s
  tau_s`` is a lower bound of the row's ``t_k``; when every ``cover_s <= tau`` the buffer holds every
  value of the row ``>= tau`` in index order, and the filter kernel goes straight to the register part
  of this route. Otherwise (``k > SLICE_CAP``, ties, or fewer positive values than k) the row goes on
  as if there were no prepass.

The slice's count search starts from its group maxima (``Config.slice_group`` values a group): the k-th
largest of the maxima is a lower bound of the slice's k-th largest with ~k (1 + k / groups) values above
it whatever the distribution (~60 at k = 50 of 256 groups), so the search compares the maxima instead
of the slice's 16 values a thread, and one count over the slice checks it (the plain search goes on
from there when it does not fit: ties, k near ``SLICE_CAP``).
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._common import _fixed, _kth_in_registers, _target, _top_p_in_registers, _value_bits, row_top_k
from .logits import _CHUNK, _SLICE, prob_bits, row_inverse_temperature, row_stats, softmax_slice
from .config import Config, k_split


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
def _candidate_route(buf_bits, buf_idx, slots, n, k, tau, mx, e_max, q_bits, limit_scale, joint_mass, r31, row,
                     HAS_P: tl.constexpr, SAMPLE: tl.constexpr, CAP: tl.constexpr):
    """(threshold pattern, kept mass, sampled token) of a row whose buffer holds every value ``>= t_k``
    (the ``n`` slots at ``buf_bits``/``buf_idx``, in index order): everything in registers."""
    # ---- candidate route: everything >= t_k is in the buffer, in index order -----------------
    tl.debug_barrier()
    vb = tl.load(buf_bits + slots, mask=slots < n, other=-1)
    vi = tl.load(buf_idx + slots, mask=slots < n, other=0)
    return _candidates_in_registers(vb, vi, slots, k, tau, mx, e_max, q_bits, limit_scale, joint_mass, r31, row,
                                    HAS_P, SAMPLE, CAP)


@triton.jit
def _candidates_in_registers(vb, vi, slots, k, tau, mx, e_max, q_bits, limit_scale, joint_mass, r31, row,
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
        # the smallest pattern >= t_k whose larger survivors weigh < top_p * M_k (joint: the row's
        # mass); below t_k "fails" (mass above it: M_k) or all pass, the largest value passes
        limit = limit_scale * tl.where(joint_mass >= 0, joint_mass, mass).to(tl.float64)
        thr, mass = _top_p_in_registers(vb, q, limit, thr - 1, mx, mass, 0)
    if SAMPLE:
        target = _target(r31, mass)
        cum = tl.cumsum(tl.where(vb >= thr, q, 0), axis=0)
        first = tl.min(tl.where(cum > target, slots, CAP), axis=0)
        token = tl.max(tl.where(slots == first, vi, 0), axis=0)  # no hit (no mass): 0
    return thr, mass, token


@triton.jit(do_not_specialize=["top_k_ptr"])
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
    K_ARR: tl.constexpr = True,  # top_k a (B,) tensor, else an int for every row
    FROM_LOGITS: tl.constexpr = False,  # probs_ptr holds logits: each value is softmax's, computed (prob_bits)
    t_ptr=None, t_val=1.0,  # FROM_LOGITS: the temperature, (B,) with HAS_T, else the scalar
    x_stats_ptr=None, S_X=1,  # FROM_LOGITS: the softmax's S_X slice statistics a row (logits.slice_stats)
    HAS_T: tl.constexpr = False,
    BLOCK_S: tl.constexpr = 1,  # FROM_LOGITS: next power of two >= S_X
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
    k = row_top_k(top_k_ptr, top_k_stride, row, V, K_ARR)
    split = k <= K_SPLIT

    cols = s * L + tl.arange(0, SLICE)
    # the slice ends at min((s+1)*L, V): the last slices may be short or empty. The scalar `split` is
    # folded into the bound (the interpreter rejects a mask of vector & scalar)
    end = tl.where(split, tl.minimum(s * L + L, V), 0)
    # -1 outside the slice (and everywhere without a split)
    if FROM_LOGITS:
        m, s_sum = row_stats(x_stats_ptr, row, S_X, BLOCK_S)
        b = prob_bits(row_ptr, cols, cols < end, row_inverse_temperature(t_ptr, t_val, row, HAS_T), m, 1.0 / s_sum)
    else:
        b = _value_bits(row_ptr, cols, cols < end)
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
        # the search starts on the GROUPS group maxima, values of the slice: f(t) >= g(t), so a t with
        # g(t) >= k maxima above it is a valid lower end, found on 2 values a thread instead of 16; one
        # count over the slice then checks f(lo) <= SLICE_CAP (ties, k near the cap: the full search goes
        # on from lo). First pivots j^2/8 octaves below the maximum: 1.1 rounds at randn*3 (design note)
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
def split_row(stats_ptr, row, k, SLICES: tl.constexpr, K_SMALL: tl.constexpr):
    """``(split, tau)`` of a row from the split prepass's stats: ``split``, the buffer holds every value
    of the row ``>= tau`` (a lower bound of ``t_k``) and the filter kernel takes them, reading no row.

    Each tau_s is 0 or has k values of its slice >= it, so the row has k values >= tau = max_s tau_s:
    tau <= t_k (also when slices are shorter than k or empty: their tau_s is 0). Slice s wrote ALL its
    values >= cover_s; where cover_s <= tau for every s, that includes all its values >= tau, so the
    values >= tau of the row are all in the buffer, in index order (slices are contiguous and in order,
    and so are the slots); the other slots are below tau or -1. At most SLICES * SLICE_CAP <= CAP."""
    sl = tl.arange(0, SLICES)
    stats = stats_ptr + row * (4 * SLICES)
    tau = tl.max(tl.load(stats + sl), axis=0)
    n_min = tl.min(tl.load(stats + 2 * SLICES + sl), axis=0)
    cover_max = tl.max(tl.load(stats + 3 * SLICES + sl), axis=0)
    # (the prepass flags k > K_SMALL already)
    return (n_min >= 0) & (cover_max <= tau) & (k <= K_SMALL), tau


@triton.jit(do_not_specialize=["top_k_ptr"])
def _unsplit_softmax_kernel(x_ptr, x_stride, t_ptr, t_val, x_stats_ptr, S_X, top_k_ptr, top_k_stride, stats_ptr,
                            out_ptr, out_stride, V, HAS_T: tl.constexpr, BLOCK_S: tl.constexpr, SLICE: tl.constexpr,
                            CHUNK: tl.constexpr, SLICES: tl.constexpr, K_SMALL: tl.constexpr, K_ARR: tl.constexpr):
    """Slice ``j`` of the softmax of a row the split prepass (from logits) did not finish (:func:`split_row`),
    where the filter kernel's other routes read it; nothing for the rows it finished."""
    row = tl.program_id(0).to(tl.int64)
    split, _ = split_row(stats_ptr, row, row_top_k(top_k_ptr, top_k_stride, row, V, K_ARR), SLICES, K_SMALL)
    if split.to(tl.int32) == 0:
        m, s = row_stats(x_stats_ptr, row, S_X, BLOCK_S)
        lo = tl.program_id(1) * SLICE
        softmax_slice(x_ptr + row * x_stride, out_ptr + row * out_stride, lo, tl.minimum(lo + SLICE, V),
                      row_inverse_temperature(t_ptr, t_val, row, HAS_T), m, 1.0 / s, CHUNK)


class Logits(NamedTuple):
    """The probabilities of a sampling call as softmax's, from its logits: computed where read, written
    only for the rows the split prepass does not finish (``_launch``'s ``logits``)."""
    x: Tensor  # (B, V) logits, last dim contiguous
    t_arr: Optional[Tensor]  # (B,) temperatures, or None: t_val for every row
    t_val: float
    stats: Tensor  # (B, S, 2): the softmax's statistics of its S slices a row (logits.slice_stats)


def _slice_prepass(probs: Tensor, top_k, buf_bits: Tensor, buf_idx: Tensor, config: Config,
                   logits: Optional[Logits] = None) -> Tensor:
    """Run ``_slice_candidates_kernel`` over ``(B, config.slices)``: writes the slices' candidates into
    ``buf_bits``/``buf_idx`` (``(B, cap)``, as ``(B, slices, cap // slices)``) and returns their
    ``(B, 4, slices)`` int32 stats (``tau_s``, largest pattern, ``n_s``, ``cover_s``). With ``logits``
    the values are computed from them (``probs`` is not read) and then written to ``probs`` for the rows
    the filter kernel will read (:func:`split_row`)."""
    B, V = probs.shape
    slices = config.slices
    slice_len = triton.cdiv(V, slices)
    stats = torch.empty((B, 4, slices), dtype=torch.int32, device=probs.device)
    src = probs if logits is None else logits.x
    from_logits = {}
    if logits is not None:
        S_X = logits.stats.shape[1]
        has_t = logits.t_arr is not None
        softmax_args = dict(t_ptr=logits.t_arr if has_t else stats, t_val=float(logits.t_val), x_stats_ptr=logits.stats,
                            S_X=S_X, HAS_T=has_t, BLOCK_S=triton.next_power_of_2(S_X))
        from_logits = dict(FROM_LOGITS=True, **softmax_args)
    _slice_candidates_kernel[(B, slices)](
        src, src.stride(0), top_k, _stride(top_k), stats, buf_bits, buf_idx, V, slice_len,
        SLICES=slices, SLICE=triton.next_power_of_2(slice_len), SLICE_CAP=config.cap // slices,
        K_SPLIT=k_split(config), NP=config.np_slice,
        GROUPS=triton.next_power_of_2(slice_len) // config.slice_group if config.slice_group else 1,
        GM_CAP=config.cap // slices * 3 // 4, K_ARR=isinstance(top_k, Tensor), num_warps=config.slice_warps,
        **from_logits, **({"maxnreg": config.slice_maxnreg} if config.slice_maxnreg else {}),
    )
    if logits is not None:
        _unsplit_softmax_kernel[(B, S_X)](
            logits.x, logits.x.stride(0), top_k_ptr=top_k, top_k_stride=_stride(top_k), stats_ptr=stats, out_ptr=probs,
            out_stride=probs.stride(0), V=V, SLICE=_SLICE, CHUNK=_CHUNK, SLICES=slices, K_SMALL=config.k_small,
            K_ARR=isinstance(top_k, Tensor), num_warps=4, **softmax_args)
    return stats


def _stride(per_row) -> int:
    """A per-row tensor's stride; 0 for a scalar (``_common.row_value``)."""
    return per_row.stride(0) if isinstance(per_row, Tensor) else 0
