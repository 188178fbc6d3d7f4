"""Triton ``chain_speculative_sampling``. The acceptance tests one draft position at a time (two loads
and one Philox call each), one program a row; then the residual row ``max(p_j - q_j, 0)`` at the first
rejection ``j`` (or the bonus row ``p_n``) by slices, a program a slice reading it once: each slice's
largest pattern and its fixed-point mass at 1.0's exponent; then one program a row finds the slice that
holds its draw and scans it (a residual without mass, only when the rows do not sum alike: the target
row, and a residual with a value of 2 or more: that residual, each walked whole). Bit-exact with
``reference.chain_speculative_sampling`` (the same sanitised values, exact acceptance test, Philox
counters and fixed-point draw: the masses are exact integers, summed in any order)."""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import fixed_point_bits
from ._common import (MASS_CHUNK, ONE_EXPONENT, _fixed, _fixed_f64, _target, exponent_from_one, f64_mass,
                      philox_w01, rng_row, rng_tensors, slice_of_target, slices_max_bits)

_CHUNK = 2048  # values a step: 16 a thread at 4 warps
_SLICE = 4096  # values a program of the residual passes: one program a row took 225 µs at 1x4x128256 (H200)
_TINY = tl.constexpr(1.1754943508222875e-38)  # 2^-126, the smallest normal fp32 (reference.FLT_TINY)


@triton.jit
def _counter(i):
    """The last counter word of position ``i``: ``2^31 + i`` (``reference.SPECULATIVE_COUNTER``)."""
    return (tl.full((), 2147483648, tl.int64) + i).to(tl.uint32)


@triton.jit
def _values(x):
    """NaN, negatives and subnormals 0, +inf FLT_MAX (``reference.speculative_values``)."""
    return tl.where(x >= _TINY, tl.minimum(x, 3.4028234663852886e38), 0.0)


@triton.jit
def _residual_bits(t_row, d_row, cols, mask, d_len):
    """int32 patterns of ``max(t - d, 0)`` (subnormal results 0), ``d = 0`` past ``d_len``; -1 where masked."""
    t = _values(tl.load(t_row + cols, mask=mask, other=0.0))
    d = _values(tl.load(d_row + cols, mask=cols < d_len, other=0.0))
    r = t - d
    r = tl.where(r >= _TINY, r, 0.0)
    return tl.where(mask, r.to(tl.int32, bitcast=True), -1)


@triton.jit
def _accept_kernel(d_ptr, d_s0, d_s1, ids_ptr, i_s0, i_s1, t_ptr, t_s0, t_s1, seed_ptr, offset_ptr, acc_ptr, emit_ptr,
                   N, V, PER_ROW_RNG: tl.constexpr):
    """The acceptance tests of row ``row``: ``acc[row]`` accepted, ``emit[row]`` the first rejected position
    (``N``: none, the bonus row)."""
    row = tl.program_id(0).to(tl.int64)
    seed, offset, c0 = rng_row(seed_ptr, offset_ptr, row, PER_ROW_RNG)
    pos = tl.full((), 0, tl.int32) + N
    acc = tl.zeros((), tl.int32)
    for i in range(0, N):
        d = tl.load(ids_ptr + row * i_s0 + i * i_s1).to(tl.int64)
        valid = (d >= 0) & (d < V)  # an id outside the vocabulary: probability 0, rejected
        ds = tl.where(valid, d, 0)
        q = tl.where(valid, _values(tl.load(d_ptr + row * d_s0 + i * d_s1 + ds)), 0.0)
        p = tl.where(valid, _values(tl.load(t_ptr + row * t_s0 + i * t_s1 + ds)), 0.0)
        w0, _ = philox_w01(seed, offset, c0, _counter(i))
        u24 = (w0 >> 8).to(tl.float64)
        ok = u24 * q.to(tl.float64) < p.to(tl.float64) * 16777216.0  # exact: 24 x 24 significand bits
        acc += ok.to(tl.int32)
        pos = tl.where((ok == 0) & (pos == N), i, pos)
    tl.store(acc_ptr + row, acc)
    tl.store(emit_ptr + row, pos)


@triton.jit
def _residual_rows(d_ptr, d_s0, d_s1, t_ptr, t_s0, t_s1, emit_ptr, row, N, V):
    """``(t_row, d_row, d_len, pos)`` of row ``row``'s residual ``max(p_pos - q_pos, 0)``; the bonus row
    (``pos == N``) has no draft row (``d_len`` 0): the target row itself."""
    pos = tl.load(emit_ptr + row)
    t_row = t_ptr + row * t_s0 + pos.to(tl.int64) * t_s1
    d_row = d_ptr + row * d_s0 + tl.maximum(tl.minimum(pos, N - 1), 0).to(tl.int64) * d_s1
    return t_row, d_row, tl.where(pos < N, V, 0), pos


@triton.jit
def _residual_slice_kernel(d_ptr, d_s0, d_s1, t_ptr, t_s0, t_s1, emit_ptr, mx_ptr, mass_ptr, N, V, S, q_bits,
                           SLICE: tl.constexpr, CHUNK: tl.constexpr):
    """Slice ``j`` of row ``row``'s residual, read once: its largest pattern (``mx[row, j]``) and its
    fixed-point mass at the exponent of 1.0 (``mass[row, j]``)."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    t_row, d_row, d_len, _ = _residual_rows(d_ptr, d_s0, d_s1, t_ptr, t_s0, t_s1, emit_ptr, row, N, V)
    lo = j * SLICE
    hi = tl.minimum(lo + SLICE, V)
    offs = tl.arange(0, CHUNK)
    acc_mx = tl.full((CHUNK,), -1, tl.int32)
    acc = tl.zeros((CHUNK,), tl.float64)
    for start in range(lo, hi, CHUNK):
        cols = start + offs
        b = _residual_bits(t_row, d_row, cols, cols < hi, d_len)
        acc_mx = tl.maximum(acc_mx, b)
        acc += _fixed_f64(b, ONE_EXPONENT, q_bits)
    mx = tl.max(acc_mx, axis=0)
    mass, inexact = f64_mass(acc)
    if inexact & (mx < 0x40000000):  # and used: no value of 2 or more
        acc64 = tl.zeros((CHUNK,), tl.int64)
        for start in range(lo, hi, CHUNK):
            cols = start + offs
            acc64 += _fixed(_residual_bits(t_row, d_row, cols, cols < hi, d_len), ONE_EXPONENT, q_bits)
        mass = tl.sum(acc64, axis=0)
    tl.store(mx_ptr + row * S + j, mx)
    tl.store(mass_ptr + row * S + j, mass)


@triton.jit
def _row_mass(t_row, d_row, d_len, V, q_bits, CHUNK: tl.constexpr):
    """``(the larger of the largest residual's exponent field and 1.0's, the fixed-point mass there)`` over
    the whole row, one program."""
    offs = tl.arange(0, CHUNK)
    mx = tl.full((), -1, tl.int32)
    for start in range(0, V, CHUNK):
        cols = start + offs
        mx = tl.maximum(mx, tl.max(_residual_bits(t_row, d_row, cols, cols < V, d_len), axis=0))
    e_max = exponent_from_one(mx)
    mass = tl.zeros((), tl.int64)
    for start in range(0, V, CHUNK):
        cols = start + offs
        mass += tl.sum(_fixed(_residual_bits(t_row, d_row, cols, cols < V, d_len), e_max, q_bits), axis=0)
    return e_max, mass


@triton.jit
def _chain_draw_kernel(d_ptr, d_s0, d_s1, ids_ptr, i_s0, i_s1, t_ptr, t_s0, t_s1, seed_ptr, offset_ptr, out_ptr,
                       emit_ptr, mx_ptr, mass_ptr, N, V, S, q_bits, PER_ROW_RNG: tl.constexpr, BLOCK_S: tl.constexpr,
                       SLICE: tl.constexpr, CHUNK: tl.constexpr):
    """Row ``row``'s token at its first rejection (or the bonus position): the target from the residual's
    slice masses and the scan in the one slice that holds it; where the residual has no mass (only when
    the rows do not sum alike) the target row draws instead, and a residual with a value of 2 or more
    draws at its own exponent, each walked whole by this program. Then the row's output ids."""
    row = tl.program_id(0).to(tl.int64)
    seed, offset, c0 = rng_row(seed_ptr, offset_ptr, row, PER_ROW_RNG)
    t_row, d_row, d_len, pos = _residual_rows(d_ptr, d_s0, d_s1, t_ptr, t_s0, t_s1, emit_ptr, row, N, V)
    _, w1 = philox_w01(seed, offset, c0, _counter(pos))
    r31 = (w1 >> 1).to(tl.int64)
    jj = tl.arange(0, BLOCK_S)
    live = jj < S
    masses = tl.load(mass_ptr + row * S + jj, mask=live, other=0)
    mass = tl.sum(masses, axis=0)
    e_max = exponent_from_one(slices_max_bits(mx_ptr, row, S, BLOCK_S))
    at_one = e_max == ONE_EXPONENT
    if at_one & (mass > 0):
        target = _target(r31, mass)
        js, base = slice_of_target(masses, jj, S, target)
        lo = js * SLICE
        hi = tl.minimum(lo + SLICE, V)
    else:
        d_len = tl.where(at_one, 0, d_len)  # no mass at 1.0's scale: the target row
        e_max, mass = _row_mass(t_row, d_row, d_len, V, q_bits, CHUNK)
        target = _target(r31, mass)
        base = tl.zeros((), tl.int64)
        lo = tl.zeros((), tl.int32)
        hi = lo + V
    offs = tl.arange(0, CHUNK)
    token = tl.full((), 2147483647, tl.int32)
    for start in range(lo, hi, CHUNK):
        if token == 2147483647:
            cols = start + offs
            q = _fixed(_residual_bits(t_row, d_row, cols, cols < hi, d_len), e_max, q_bits)
            cum = base + tl.cumsum(q, axis=0)
            token = tl.min(tl.where(cum > target, cols, 2147483647), axis=0)
            base = tl.max(cum, axis=0)
    token = tl.where(token == 2147483647, 0, token)  # no mass: 0, as the reference
    o_row = out_ptr + row * (N + 1)
    for j in range(0, N + 1):
        i = tl.full((), 0, tl.int32) + j
        d = tl.load(ids_ptr + row * i_s0 + i * i_s1, mask=i < N, other=0).to(tl.int32)
        tl.store(o_row + i, tl.where(i < pos, d, tl.where(i == pos, token, -1)))


def chain_speculative_sampling(draft_probs: Tensor, draft_token_ids: Tensor, target_probs: Tensor, seed: Tensor,
                               offset: Tensor):
    B, n, V = draft_probs.shape
    dev = draft_probs.device
    out = torch.empty((B, n + 1), dtype=torch.int32, device=dev)
    accepted = torch.empty(B, dtype=torch.int32, device=dev)
    emitted = torch.empty(B, dtype=torch.int32, device=dev)
    if B:
        seed, offset, per_row = rng_tensors(seed, offset, B)
        d = (draft_probs, draft_probs.stride(0), draft_probs.stride(1))
        ids = (draft_token_ids, draft_token_ids.stride(0), draft_token_ids.stride(1))
        t = (target_probs, target_probs.stride(0), target_probs.stride(1))
        _accept_kernel[(B,)](*d, *ids, *t, seed, offset, accepted, emitted, n, V, PER_ROW_RNG=per_row, num_warps=1)
        S = max(1, triton.cdiv(V, _SLICE))
        mx = torch.empty((B, S), dtype=torch.int32, device=dev)
        mass = torch.empty((B, S), dtype=torch.int64, device=dev)
        q_bits, block_s = fixed_point_bits(V), triton.next_power_of_2(S)
        _residual_slice_kernel[(B, S)](*d, *t, emitted, mx, mass, n, V, S, q_bits, SLICE=_SLICE, CHUNK=MASS_CHUNK,
                                       num_warps=4)
        _chain_draw_kernel[(B,)](*d, *ids, *t, seed, offset, out, emitted, mx, mass, n, V, S, q_bits,
                                 PER_ROW_RNG=per_row, BLOCK_S=block_s, SLICE=_SLICE, CHUNK=_CHUNK, num_warps=4)
    return out, accepted, emitted
