"""Triton attention-state merge: ``merge_attn_states(v_a, lse_a, v_b, lse_b) -> (v, lse)``.

A streaming kernel, written for bandwidth: a decomposition over tokens x head blocks x head-size
blocks; each program merges ``BLOCK_H`` heads of one token, ``BLOCK_D`` values each, weighting both
partials in fp32 by their LSE (computed once per head and broadcast over the head's values).
Programs are numbered head block fastest on one flat axis (token-major, so consecutive programs
stream consecutive memory of contiguous ``v``); ``FLAT=False`` launches a (tokens, head blocks,
head-size blocks) grid instead, kept for the GPU sweep to compare. The launch is a
:class:`TritonMergeConfig`; :meth:`TritonMergeConfig.for_shape` picks it. Arguments arrive
validated (``ops.py``): ``v`` last dim contiguous, fp16/bf16/fp32; LSE fp32 with
any strides. Empty partials (LSE ``-inf``, or FA2's ``+inf``) as the reference treats them.

``wrap``: ``None`` in eager calls; ``torch.library.wrap_triton`` when ``torch.compile`` traces the
op's ``inductor_triton`` route (``torch_kernels/library.py``). Traced, the token count is symbolic:
one launch, checked when it runs to fit the grid, and an empty grid skipped by Triton's launcher
instead of an early return. ``config``: the launch, default ``TritonMergeConfig.for_shape`` (the sweep
and tests pass others).
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import outputs

# 2048 values a program, 16 a thread, 4 warps: 4139 GB/s at 8192x32x128 against 3895 at 8 a thread
# (H200, bf16; docs/design/attention.md).
_TILE = 2048
_ELEMENTS_PER_THREAD = 16
_MAX_BLOCK_D = 1024  # wider heads (none in use: MLA's 512 is the widest) take several programs
# CUDA grid limits: axis 0 takes 2^31 - 1 programs, axes 1 and 2 only 65535; larger launches are split.
_MAX_GRID_0 = 2**31 - 1
_MAX_GRID_12 = 65535


@dataclass(frozen=True)
class TritonMergeConfig:
    """How the merge kernel is launched; :meth:`for_shape` is what the launcher uses."""

    block_h: int  # heads per program
    block_d: int  # values of each head per program
    num_warps: int
    # Program order: flat, head block fastest: 0.5-5% above the 3-D grid at the chosen tile.
    flat: bool = True

    @classmethod
    @functools.lru_cache(maxsize=None)
    def for_shape(cls, H: int, D: int, tile: int = _TILE, per_thread: int = _ELEMENTS_PER_THREAD) -> "TritonMergeConfig":
        """The launcher's configuration for ``H`` heads of ``D`` values: the whole head (up to
        ``_MAX_BLOCK_D``), as many heads as fill ``tile`` values, one warp per ``32 * per_thread``
        values (1 to 16); the sweep passes other ``tile`` and ``per_thread``."""
        block_d = min(triton.next_power_of_2(D), _MAX_BLOCK_D)
        block_h = min(max(1, tile // block_d), triton.next_power_of_2(H))
        return cls(block_h, block_d, min(max(block_h * block_d // (32 * per_thread), 1), 16))


@triton.jit
def _merge_kernel(
    va_ptr, va_stride_t, va_stride_h,  # v_a (T, H, D): token and head strides; head_size contiguous; read
    la_ptr, la_stride_t, la_stride_h,  # lse_a (T, H) fp32, natural log, any strides; read
    vb_ptr, vb_stride_t, vb_stride_h,  # v_b, as v_a
    lb_ptr, lb_stride_t, lb_stride_h,  # lse_b, as lse_a
    out_ptr, out_stride_t, out_stride_h,  # merged v (T, H, D), head_size contiguous; written
    out_lse_ptr, out_lse_stride_t, out_lse_stride_h,  # merged LSE (T, H) fp32; written
    H,  # heads in this launch
    D,  # head size (elements in each head in this launch)
    n_head_blocks,  # cdiv(H, BLOCK_H): programs per token on the flat grid
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_D: tl.constexpr,  # values of each head per program (the whole head up to _MAX_BLOCK_D)
    EVEN: tl.constexpr,  # H % BLOCK_H == 0 and D % BLOCK_D == 0: no masks on the values
    FLAT: tl.constexpr,  # grid (tokens * head blocks, head-size blocks); else (tokens, head blocks, head-size blocks)
):
    if FLAT:
        pid_t = tl.program_id(0) // n_head_blocks
        pid_h = tl.program_id(0) - pid_t * n_head_blocks
        pid_d = tl.program_id(1)
    else:
        pid_t = tl.program_id(0)
        pid_h = tl.program_id(1)
        pid_d = tl.program_id(2)
    # int64 token and head offsets: T x H x D passes 2^31 elements at 512k tokens of 32 x 128, and
    # a head stride times the head index overflows int32 for head-major buffers of long sequences.
    t = pid_t.to(tl.int64)
    heads = (pid_h * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    hmask = heads < H

    a = tl.load(la_ptr + t * la_stride_t + heads * la_stride_h, mask=hmask, other=0.0)
    b = tl.load(lb_ptr + t * lb_stride_t + heads * lb_stride_h, mask=hmask, other=0.0)
    a = tl.where(a == float("inf"), float("-inf"), a)  # FA2 marks an empty row +inf, FA3 -inf
    b = tl.where(b == float("inf"), float("-inf"), b)
    a_empty = a == float("-inf")
    b_empty = b == float("-inf")
    m = tl.maximum(a, b)
    ea = tl.exp(a - m)  # NaN where both are empty: those heads take the where() branches below
    eb = tl.exp(b - m)
    s = ea + eb
    lse = tl.where(b_empty, a, tl.where(a_empty, b, m + tl.log(s)))
    if pid_d == 0:  # every head-size block computes the weights; the first writes the LSE
        tl.store(out_lse_ptr + t * out_lse_stride_t + heads * out_lse_stride_h, lse, mask=hmask)
    wa = (ea / s)[:, None]  # the weights first, then the values: v * exp(lse - m) could overflow
    wb = (eb / s)[:, None]

    va_ptrs = va_ptr + t * va_stride_t + heads[:, None] * va_stride_h + cols[None, :]
    vb_ptrs = vb_ptr + t * vb_stride_t + heads[:, None] * vb_stride_h + cols[None, :]
    out_ptrs = out_ptr + t * out_stride_t + heads[:, None] * out_stride_h + cols[None, :]
    if EVEN:
        va = tl.load(va_ptrs).to(tl.float32)
        vb = tl.load(vb_ptrs).to(tl.float32)
    else:
        mask = hmask[:, None] & (cols[None, :] < D)
        va = tl.load(va_ptrs, mask=mask, other=0.0).to(tl.float32)
        vb = tl.load(vb_ptrs, mask=mask, other=0.0).to(tl.float32)
    # An empty partial is never read into the result (its values may be NaN); both empty: v_a.
    v = tl.where(b_empty[:, None], va, tl.where(a_empty[:, None], vb, va * wa + vb * wb))
    if EVEN:
        tl.store(out_ptrs, v.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptrs, v.to(out_ptr.dtype.element_ty), mask=mask)


def launch(v_a: Tensor, lse_a: Tensor, v_b: Tensor, lse_b: Tensor, out: Tensor, out_lse: Tensor,
           config: TritonMergeConfig, wrap=None) -> None:
    T, H, D = v_a.shape[0], int(v_a.shape[1]), int(v_a.shape[2])
    if H == 0 or (wrap is None and T == 0):
        return
    block_h, block_d = config.block_h, config.block_d
    if config.flat:
        per_h, per_d = _MAX_GRID_0 * block_h, _MAX_GRID_12 * block_d
        per_t = _MAX_GRID_0 // triton.cdiv(min(H, per_h), block_h)
    else:
        per_t, per_h, per_d = _MAX_GRID_0, _MAX_GRID_12 * block_h, _MAX_GRID_12 * block_d
    if wrap is not None:  # traced: T is symbolic, so one launch, checked when it runs
        torch._check(H <= per_h and D <= per_d)
        torch._check(T <= per_t, lambda: f"{T} tokens of {H} heads exceed one launch of the traced route")
        _launch_one(v_a, lse_a, v_b, lse_b, out, out_lse, config, wrap)
        return
    if T <= per_t and H <= per_h and D <= per_d:  # every realistic shape: one launch
        _launch_one(v_a, lse_a, v_b, lse_b, out, out_lse, config)
        return
    # Views of each chunk; every head-size chunk rewrites its heads' LSE with the same value.
    for t0 in range(0, T, per_t):
        for h0 in range(0, H, per_h):
            th = (slice(t0, t0 + per_t), slice(h0, h0 + per_h))
            for d0 in range(0, D, per_d):
                v = (*th, slice(d0, d0 + per_d))
                _launch_one(v_a[v], lse_a[th], v_b[v], lse_b[th], out[v], out_lse[th], config)


def _launch_one(v_a, lse_a, v_b, lse_b, out, out_lse, config, wrap=None):
    T, H, D = v_a.shape[0], int(v_a.shape[1]), int(v_a.shape[2])
    block_h, block_d, flat = config.block_h, config.block_d, config.flat
    head_blocks, d_blocks = triton.cdiv(H, block_h), triton.cdiv(D, block_d)
    grid = (T * head_blocks, d_blocks) if flat else (T, head_blocks, d_blocks)
    (_merge_kernel if wrap is None else wrap(_merge_kernel))[grid](
        v_a, v_a.stride(0), v_a.stride(1),
        lse_a, lse_a.stride(0), lse_a.stride(1),
        v_b, v_b.stride(0), v_b.stride(1),
        lse_b, lse_b.stride(0), lse_b.stride(1),
        out, out.stride(0), out.stride(1),
        out_lse, out_lse.stride(0), out_lse.stride(1),
        H, D, head_blocks,
        BLOCK_H=block_h, BLOCK_D=block_d, EVEN=H % block_h == 0 and D % block_d == 0, FLAT=flat,
        num_warps=config.num_warps,
    )


def merge_attn_states(v_a: Tensor, lse_a: Tensor, v_b: Tensor, lse_b: Tensor, *, wrap=None,
                      config: Optional[TritonMergeConfig] = None, out=None):
    if out is None:
        v = torch.empty(v_a.shape, dtype=v_a.dtype, device=v_a.device)
        lse = torch.empty(lse_a.shape, dtype=torch.float32, device=v_a.device)
    else:
        v = outputs.given(out, 0, v_a.shape, v_a.dtype, v_a.device)
        lse = outputs.given(out, 1, lse_a.shape, torch.float32, v_a.device)
    config = config or TritonMergeConfig.for_shape(int(v_a.shape[1]), int(v_a.shape[2]))
    launch(v_a, lse_a, v_b, lse_b, v, lse, config, wrap=wrap)
    return v, lse
