"""Triton ``sampling_from_probs``, ``sampling_from_logits`` and ``top_k_top_p_sampling_from_logits``.

* ``sampling_from_probs`` and ``sampling_from_logits``: a program a slice reads it once for its largest
  pattern and its fixed-point mass at the exponent of 1.0 (the reference's, for every row whose values are
  below 2), then one program a row draws in the slice that holds its target. For logits the slices first
  take the softmax's statistics and recompute each probability in registers (``exp(x - m) * (1 / s)``,
  the softmax kernel's expression): no probabilities tensor; the ids are those of ``softmax`` then
  ``sampling_from_probs`` on this backend (the same fixed-point masses, exact integers in any order).
* ``top_k_top_p_sampling_from_logits``: ``top_k_top_p_sampling_from_probs``'s kernels with the split
  prepass computing each probability from the logits as ``softmax`` writes it (``prob_bits``, after the
  softmax's slice statistics): the probabilities are written only for the rows the prepass does not
  finish (ties, top-k off or beyond the slices' slots), which the filter kernel reads. Rows that all
  miss the split (a scalar top-k off or large, the joint order) and rows of more than 32 slices of
  ``slice_values`` (V > 131072) take ``softmax`` then the probs-in kernels.
* ``sampled_token_logprobs``: the softmax's slice statistics, then one counting pass for the rank.
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import fixed_point_bits
from ._common import (MASS_CHUNK, ONE_EXPONENT, _fixed, _fixed_f64, _random_bits31, _target, _value_bits,
                      exponent_from_one, f64_mass, rng_tensors, slice_of_target, slices_max_bits)
from .candidates import Logits
from .config import DEFAULT, Config
from .launch import _either, _launch, splits
from .logits import (_CHUNK, _SLICE, inverse_temperature, prob_bits,
                     row_inverse_temperature, row_stats, slice_stats, softmax)


@triton.jit
def _draw_bits(x_row, cols, mask, inv, m, inv_s, LOGITS: tl.constexpr):
    """The sanitised pattern at ``cols``: of the softmax computed in registers (``LOGITS``), else read."""
    if LOGITS:
        b = prob_bits(x_row, cols, mask, inv, m, inv_s)
    else:
        b = _value_bits(x_row, cols, mask)
    return b


@triton.jit
def _draw_row(x_ptr, x_stride, idx_ptr, t_val, stats_ptr, S, row, LOGITS: tl.constexpr, HAS_IDX: tl.constexpr,
              BLOCK_S: tl.constexpr):
    """Output row ``row``'s values (row ``idx[row]`` with ``HAS_IDX``) and, for logits, the softmax's
    ``1 / t``, ``m`` and ``1 / s``."""
    src = row
    if HAS_IDX:
        src = tl.load(idx_ptr + row).to(tl.int64)
    if LOGITS:
        inv = inverse_temperature(t_val)
        m, s = row_stats(stats_ptr, src, S, BLOCK_S)
        inv_s = 1.0 / s
    else:
        inv, m, inv_s = 1.0, 0.0, 1.0
    return x_ptr + src * x_stride, inv, m, inv_s


@triton.jit
def _slice_mass_kernel(x_ptr, x_stride, idx_ptr, t_val, stats_ptr, S, mx_ptr, mass_ptr, V, q_bits,
                       LOGITS: tl.constexpr, HAS_IDX: tl.constexpr, BLOCK_S: tl.constexpr, SLICE: tl.constexpr,
                       CHUNK: tl.constexpr):
    """Slice ``j`` of the row: its largest pattern and its fixed-point mass at the exponent of 1.0
    (``mx[row, j]``, ``mass[row, j]``), in one read."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    x_row, inv, m, inv_s = _draw_row(x_ptr, x_stride, idx_ptr, t_val, stats_ptr, S, row, LOGITS, HAS_IDX, BLOCK_S)
    offs = tl.arange(0, CHUNK)
    acc_mx = tl.full((CHUNK,), -1, tl.int32)
    acc = tl.zeros((CHUNK,), tl.float64)
    lo = j * SLICE
    hi = tl.minimum(lo + SLICE, V)
    for start in range(lo, hi, CHUNK):
        cols = start + offs
        b = _draw_bits(x_row, cols, cols < hi, inv, m, inv_s, LOGITS)
        acc_mx = tl.maximum(acc_mx, b)
        acc += _fixed_f64(b, ONE_EXPONENT, q_bits)
    mx = tl.max(acc_mx, axis=0)
    mass, inexact = f64_mass(acc)
    if inexact & (mx < 0x40000000):  # and used: no value of 2 or more
        acc64 = tl.zeros((CHUNK,), tl.int64)
        for start in range(lo, hi, CHUNK):
            cols = start + offs
            acc64 += _fixed(_draw_bits(x_row, cols, cols < hi, inv, m, inv_s, LOGITS), ONE_EXPONENT, q_bits)
        mass = tl.sum(acc64, axis=0)
    tl.store(mx_ptr + row * S + j, mx)
    tl.store(mass_ptr + row * S + j, mass)


@triton.jit
def _draw_kernel(x_ptr, x_stride, idx_ptr, t_val, stats_ptr, S, mx_ptr, mass_ptr, seed_ptr, offset_ptr, out_ptr, V,
                 q_bits, LOGITS: tl.constexpr, HAS_IDX: tl.constexpr, BLOCK_S: tl.constexpr, SLICE: tl.constexpr,
                 CHUNK: tl.constexpr, PER_ROW_RNG: tl.constexpr):
    """``reference.sampling_from_probs``' draw: the masses at the larger of the row's largest exponent and
    1.0's. At 1.0's (every probability row) the slices' masses are the row's (exact integers, any order)
    and the draw scans the one slice that holds the target; a row with a value of 2 or more redoes its
    mass at its own exponent and walks the row, one program."""
    row = tl.program_id(0).to(tl.int64)
    x_row, inv, m, inv_s = _draw_row(x_ptr, x_stride, idx_ptr, t_val, stats_ptr, S, row, LOGITS, HAS_IDX, BLOCK_S)
    offs = tl.arange(0, CHUNK)
    jj = tl.arange(0, BLOCK_S)
    e_max = exponent_from_one(slices_max_bits(mx_ptr, row, S, BLOCK_S))
    r31 = _random_bits31(seed_ptr, offset_ptr, row, PER_ROW_RNG)
    if e_max == ONE_EXPONENT:
        masses = tl.load(mass_ptr + row * S + jj, mask=jj < S, other=0)
        target = _target(r31, tl.sum(masses, axis=0))
        js, base = slice_of_target(masses, jj, S, target)
        lo = js * SLICE  # no slice holds it (no mass): past V, no pass
        hi = tl.minimum(lo + SLICE, V)
    else:
        mass = tl.zeros((), tl.int64)
        for start in range(0, V, CHUNK):
            cols = start + offs
            mass += tl.sum(_fixed(_draw_bits(x_row, cols, cols < V, inv, m, inv_s, LOGITS), e_max, q_bits), axis=0)
        target = _target(r31, mass)
        base = tl.zeros((), tl.int64)
        lo = tl.zeros((), tl.int32)
        hi = lo + V
    token = tl.full((), 2147483647, tl.int32)
    for start in range(lo, hi, CHUNK):
        if token == 2147483647:
            cols = start + offs
            cum = base + tl.cumsum(_fixed(_draw_bits(x_row, cols, cols < hi, inv, m, inv_s, LOGITS), e_max, q_bits),
                                   axis=0)
            token = tl.min(tl.where(cum > target, cols, 2147483647), axis=0)
            base = tl.max(cum, axis=0)
    tl.store(out_ptr + row, tl.where(token == 2147483647, 0, token))  # no mass: 0, as the reference


def _draw(x: Tensor, seed: Tensor, offset: Tensor, indices: Optional[Tensor], logits: bool) -> Tensor:
    V = x.shape[1]
    B = x.shape[0] if indices is None else indices.shape[0]  # output rows
    out = torch.empty(B, dtype=torch.int32, device=x.device)
    if B:
        seed, offset, per_row = rng_tensors(seed, offset, B)
        if logits:
            stats, S, block_s = slice_stats(x)
        else:
            S = max(1, triton.cdiv(V, _SLICE))
            stats, block_s = out, triton.next_power_of_2(S)
        mx = torch.empty((B, S), dtype=torch.int32, device=x.device)
        mass = torch.empty((B, S), dtype=torch.int64, device=x.device)
        idx = indices if indices is not None else out
        q_bits = fixed_point_bits(V)
        common = dict(LOGITS=logits, HAS_IDX=indices is not None, BLOCK_S=block_s, SLICE=_SLICE, CHUNK=_CHUNK)
        _slice_mass_kernel[(B, S)](x, x.stride(0), idx, 1.0, stats, S, mx, mass, V, q_bits,
                                   **dict(common, CHUNK=MASS_CHUNK), num_warps=4)
        # 8 warps: 8.9 against 10.1 µs at 1 x 128256, 14.3 against 15.6 at 32 rows (probs, H100)
        _draw_kernel[(B,)](x, x.stride(0), idx, 1.0, stats, S, mx, mass, seed, offset, out, V, q_bits, **common,
                           PER_ROW_RNG=per_row, num_warps=8)
    return out


def sampling_from_probs(probs: Tensor, seed: Tensor, offset: Tensor, indices: Optional[Tensor] = None) -> Tensor:
    return _draw(probs, seed, offset, indices, logits=False)


def sampling_from_logits(logits: Tensor, seed: Tensor, offset: Tensor) -> Tensor:
    return _draw(logits, seed, offset, None, logits=True)


def _fuses(top_k, B: int, V: int, config: Config) -> bool:
    """Whether the split prepass reads the logits itself: where the row splits, into slices of at most
    ``slice_values`` (with 8000 values a slice, 256 x 256000, it took 621 against the composition's 553 µs).
    The fitted count reaches that size unless capped at ``slices``: hence ``V <= slices * slice_values``."""
    return splits(top_k, B, V, config) and (not config.slice_values or V <= config.slices * config.slice_values)


def top_k_top_p_sampling_from_logits(logits: Tensor, maybe_top_k_arr, top_k_val: int, maybe_top_p_arr,
                                     top_p_val: float, maybe_temperature_arr, temperature_val: float,
                                     seed: Tensor, offset: Tensor, filter_apply_order: str = "top_k_first",
                                     config: Config = DEFAULT) -> Tensor:
    top_k = _either(maybe_top_k_arr, top_k_val)  # a scalar: a kernel argument
    top_p = _either(maybe_top_p_arr, top_p_val)
    B, V = logits.shape
    if B and filter_apply_order != "joint" and _fuses(top_k, B, V, config):
        # fused: the split prepass computes the probabilities from the logits; the rows it does not
        # finish get theirs written for the filter kernel's other routes
        stats, _, _ = slice_stats(logits, maybe_temperature_arr, temperature_val)
        probs = torch.empty((B, V), dtype=torch.float32, device=logits.device)
        source = Logits(logits, maybe_temperature_arr, temperature_val, stats)
        return _launch(probs, top_k, top_p, seed, offset, sample=True, config=config, logits=source)
    probs = softmax(logits, maybe_temperature_arr, temperature_val)
    return _launch(probs, top_k, top_p, seed, offset, sample=True, config=config,
                   joint=filter_apply_order == "joint")


@triton.jit
def _sampled_logprobs_kernel(x_ptr, x_stride, t_ptr, t_val, stats_ptr, S, ids_ptr, lp_ptr, rank_ptr, V,
                             HAS_T: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr):
    """The row's ``m`` and ``s`` as ``_softmax_kernel`` takes them; one pass counts the values at or above
    the token's: ``log p = x_tok - m - log(s)`` and its rank (``reference.sampled_token_logprobs``)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    inv = row_inverse_temperature(t_ptr, t_val, row, HAS_T)
    m, s = row_stats(stats_ptr, row, S, BLOCK_S)
    tok = tl.load(ids_ptr + row).to(tl.int64)
    valid = (tok >= 0) & (tok < V)
    raw_tok = tl.load(x_row + tl.where(valid, tok, 0)).to(tl.float32)
    x_tok = tl.where(raw_tok == -float("inf"), -float("inf"), raw_tok * inv)
    offs = tl.arange(0, CHUNK)
    count = tl.zeros([CHUNK], dtype=tl.int64)
    for start in range(0, V, CHUNK):
        cols = start + offs
        raw = tl.load(x_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        x = tl.where(raw == -float("inf"), -float("inf"), raw * inv)
        count += ((x >= x_tok) & (cols < V)).to(tl.int64)
    tl.store(lp_ptr + row, tl.where(valid, x_tok - m - tl.log(s), float("nan")))
    tl.store(rank_ptr + row, tl.where(valid, tl.sum(count, axis=0), 0))


def sampled_token_logprobs(logits: Tensor, token_ids: Tensor, maybe_temperature_arr=None, temperature_val: float = 1.0):
    B, V = logits.shape
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    ranks = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        has_t = maybe_temperature_arr is not None
        stats, S, block_s = slice_stats(logits, maybe_temperature_arr, temperature_val)
        _sampled_logprobs_kernel[(B,)](logits, logits.stride(0), maybe_temperature_arr if has_t else logprobs,
                                       float(temperature_val), stats, S, token_ids, logprobs, ranks, V, HAS_T=has_t,
                                       BLOCK_S=block_s, CHUNK=_CHUNK, num_warps=4)
    return logprobs, ranks
