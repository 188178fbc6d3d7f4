"""Triton ``chain_speculative_sampling``: one program per row. The acceptance tests one draft position
at a time (two loads and one Philox call each), then three passes over the residual row
``max(p_j - q_j, 0)`` at the first rejection ``j`` (or the bonus row ``p_n``): its largest pattern, its
fixed-point mass, the scan to the drawn token; bit-exact with ``reference.chain_speculative_sampling``
(the same sanitised values, exact acceptance test, Philox counters and fixed-point draw)."""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import fixed_point_bits
from ._common import _fixed, _target, philox_w01, rng_row, rng_tensors

_CHUNK = 2048  # values a step: 16 a thread at 4 warps
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
def _residual_mass(t_row, d_row, d_len, V, q_bits, CHUNK: tl.constexpr):
    """``(exponent field of the largest residual, its fixed-point mass)``."""
    offs = tl.arange(0, CHUNK)
    mx = tl.full((), -1, tl.int32)
    for start in range(0, V, CHUNK):
        cols = start + offs
        mx = tl.maximum(mx, tl.max(_residual_bits(t_row, d_row, cols, cols < V, d_len), axis=0))
    e_max = tl.maximum(mx >> 23, 1)
    mass = tl.zeros((), tl.int64)
    for start in range(0, V, CHUNK):
        cols = start + offs
        mass += tl.sum(_fixed(_residual_bits(t_row, d_row, cols, cols < V, d_len), e_max, q_bits), axis=0)
    return e_max, mass


@triton.jit
def _chain_kernel(d_ptr, d_s0, d_s1, ids_ptr, i_s0, i_s1, t_ptr, t_s0, t_s1, seed_ptr, offset_ptr,
                  out_ptr, acc_ptr, emit_ptr, N, V, q_bits, CHUNK: tl.constexpr, PER_ROW_RNG: tl.constexpr):
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
    d_len = tl.where(pos < N, V, 0)  # the bonus row (pos == N) has no draft row: the target row itself
    t_row = t_ptr + row * t_s0 + pos.to(tl.int64) * t_s1
    d_row = d_ptr + row * d_s0 + tl.maximum(tl.minimum(pos, N - 1), 0).to(tl.int64) * d_s1
    e_max, mass = _residual_mass(t_row, d_row, d_len, V, q_bits, CHUNK)
    if mass == 0:  # only when the rows do not sum alike: the target row instead
        d_len = d_len * 0
        e_max, mass = _residual_mass(t_row, d_row, d_len, V, q_bits, CHUNK)
    _, w1 = philox_w01(seed, offset, c0, _counter(pos))
    target = _target((w1 >> 1).to(tl.int64), mass)
    offs = tl.arange(0, CHUNK)
    base = tl.zeros((), tl.int64)
    token = tl.full((), 2147483647, tl.int32)
    for start in range(0, V, CHUNK):
        if token == 2147483647:
            cols = start + offs
            q = _fixed(_residual_bits(t_row, d_row, cols, cols < V, d_len), e_max, q_bits)
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
        _chain_kernel[(B,)](draft_probs, draft_probs.stride(0), draft_probs.stride(1),
                            draft_token_ids, draft_token_ids.stride(0), draft_token_ids.stride(1),
                            target_probs, target_probs.stride(0), target_probs.stride(1), seed, offset,
                            out, accepted, emitted, n, V, fixed_point_bits(V), CHUNK=_CHUNK, PER_ROW_RNG=per_row,
                            num_warps=4)
    return out, accepted, emitted
