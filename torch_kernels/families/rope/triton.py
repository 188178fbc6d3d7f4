"""Triton rotary embedding: one program per (token, chunk of heads), in place on query and key.

A program loads its token's position and the ``rot_dim/2`` cosines and sines once, then rotates
every head of its chunk, ``BLOCK_H`` heads at a time, out of the combined head list (query heads,
then key heads): with many tokens a chunk is every head of the token, so each cache row is read once
and one launch serves query and key. Only the first ``rot_dim`` dims of each head are read and
written; the pass-through dims of a partial rotary are never touched. The launch is a
:class:`TritonRopeConfig`; :meth:`TritonRopeConfig.for_shape` picks it. Arguments arrive validated
(``ops.py``): last dimension contiguous (rows and heads may be strided), q/k fp16,
bf16 or fp32, cache fp32 or the q/k dtype, ``rot_dim`` even and at most ``head_size``.

``wrap``: ``None`` in eager calls; ``torch.library.wrap_triton`` when ``torch.compile`` traces the
op's ``inductor_triton`` route (``torch_kernels/library.py``). Traced, the token count is symbolic,
so the launch cannot choose its chunks by it: every program takes one tile of heads (the small-batch
choice; with many tokens it loads each token's cos/sin once per tile rather than once).
``config``: the launch, default ``TritonRopeConfig.for_shape`` (the sweep and tests pass others).
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...backends.triton_rotary import cos_sin, rotate_pair, rotate_tile
from .tokens import flat_tokens

# 1024 pairs a tile over 4 warps: a 16-byte vector of bf16 per half-row at head size 128 (untuned:
# `bench_rope.py --sweep`; docs/design/rope.md).
_TILE_PAIRS = 1024
# Below this many (token, chunk) programs the heads of a token are split over several programs so
# that a small batch still spreads over the GPU's SMs (132 on the H200: about 8 programs each).
_MIN_PROGRAMS = 1024


@dataclass(frozen=True)
class TritonRopeConfig:
    """How the rotary kernel is launched; :meth:`for_shape` is what the launcher uses."""

    heads_per_program: int  # size of a chunk of the combined head list (query heads, then key heads)
    block_h: int  # heads per tile
    block_d: int  # pairs per head per tile: at least rot_dim/2 (the kernel rotates one tile of pairs a head)
    num_warps: int

    @classmethod
    def for_shape(cls, num_tokens: Optional[int], num_heads: int, rot_half: int) -> "TritonRopeConfig":
        """The launcher's configuration for ``num_tokens`` tokens (``None``: not known, traced) of
        ``num_heads`` heads (query and key) with ``rot_half`` pairs each."""
        # Many tokens: one chunk of every head, so cos/sin are loaded once per token. Few tokens: chunks
        # of whole tiles, as many as it takes to reach _MIN_PROGRAMS programs; traced, one tile each.
        if num_tokens is None:
            return cls._pick(num_heads, rot_half, num_heads)
        if num_tokens < _MIN_PROGRAMS:
            return cls._pick(num_heads, rot_half, -(-_MIN_PROGRAMS // max(num_tokens, 1)))
        return cls._pick(num_heads, rot_half, 1)

    @classmethod
    @functools.lru_cache(maxsize=None)
    def _pick(cls, num_heads: int, rot_half: int, chunks: int) -> "TritonRopeConfig":
        """Heads in up to ``chunks`` chunks of whole tiles."""
        block_d = triton.next_power_of_2(rot_half)
        block_h = min(triton.next_power_of_2(num_heads), max(1, _TILE_PAIRS // block_d))
        tiles = triton.cdiv(num_heads, block_h)
        heads_per_program = block_h * triton.cdiv(tiles, min(tiles, chunks))
        return cls(heads_per_program, block_h, block_d, max(1, min(8, block_h * block_d // 256)))


@triton.jit
def _rotate_heads(
    row_ptr,  # this token's first element of head 0 (int64 offset already applied)
    head_stride,  # elements between consecutive heads
    h_start, h_end,  # the heads [h_start, h_end) of this tensor that this program rotates
    cos, sin,  # (1, BLOCK_D) fp32: this token's cosines and sines, NaN for a position outside the cache
    d, d_mask,  # (BLOCK_D,) pair index i and i < rot_dim/2 (neox only)
    rot_half,  # rot_dim / 2
    BLOCK_H: tl.constexpr,  # heads per tile
    BLOCK_D: tl.constexpr,  # pairs per head per tile: next power of two >= rot_dim/2
    IS_NEOX: tl.constexpr,  # pairs (i, i + rot_dim/2) if True, else GPT-J pairs (2i, 2i + 1)
):
    for h0 in range(h_start, h_end, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        rotate_tile(row_ptr + heads.to(tl.int64)[:, None] * head_stride, heads < h_end, cos, sin, d, d_mask, rot_half,
                    BLOCK_H, BLOCK_D, IS_NEOX)


@triton.jit
def _rope_kernel(
    pos_ptr, pos_stride,  # positions (T,), int32 or int64, any stride
    q_ptr, q_tok_stride, q_head_stride,  # query: token and head strides in elements (last dim contiguous)
    k_ptr, k_tok_stride, k_head_stride,  # key, the same; unused when not HAS_KEY
    cache_ptr, cache_stride,  # cos_sin_cache (max_position, rot_dim), row stride; cos then sin per row
    max_position,  # rows of the cache: a position outside [0, max_position) reads no memory and yields NaN
    num_q_heads, num_k_heads,  # heads of query and of key (0 without key)
    heads_per_program,  # size of a chunk of the combined head list (q heads then k heads)
    rot_half,  # rot_dim / 2: pairs per head
    BLOCK_H: tl.constexpr,  # heads per tile
    BLOCK_D: tl.constexpr,  # next power of two >= rot_half
    IS_NEOX: tl.constexpr,  # neox (halves) or GPT-J (interleaved) pairing
    HAS_KEY: tl.constexpr,  # key is given
):
    tok = tl.program_id(0).to(tl.int64)
    h_lo = tl.program_id(1) * heads_per_program
    h_hi = h_lo + heads_per_program
    pos = tl.load(pos_ptr + tok * pos_stride).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < rot_half
    # positions are not checked on CUDA (a sync): one outside the cache reads nothing, NaN cos/sin
    cos, sin = cos_sin(cache_ptr, cache_stride, pos, max_position, d, rot_half)
    _rotate_heads(q_ptr + tok * q_tok_stride, q_head_stride, h_lo, tl.minimum(h_hi, num_q_heads),
                  cos, sin, d, d_mask, rot_half, BLOCK_H, BLOCK_D, IS_NEOX)
    if HAS_KEY:
        _rotate_heads(k_ptr + tok * k_tok_stride, k_head_stride, tl.maximum(h_lo - num_q_heads, 0),
                      tl.minimum(h_hi - num_q_heads, num_k_heads), cos, sin, d, d_mask, rot_half,
                      BLOCK_H, BLOCK_D, IS_NEOX)


def _heads(x: Tensor, head_size: int):
    """(number of heads, token stride, head stride) of a validated 2-D or 3-D query/key."""
    if x.dim() == 3:
        return int(x.shape[1]), x.stride(0), x.stride(1)
    return int(x.shape[1]) // head_size, x.stride(0), head_size


def launch(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int, cos_sin_cache: Tensor,
           is_neox: bool, config: Optional[TritonRopeConfig] = None, wrap=None) -> None:
    num_tokens = query.shape[0]
    if wrap is None and num_tokens == 0:
        return
    rot_half = int(cos_sin_cache.shape[1]) // 2
    hq, q_tok, q_head = _heads(query, head_size)
    hk, k_tok, k_head = _heads(key, head_size) if key is not None else (0, 0, 0)
    if config is None:
        config = TritonRopeConfig.for_shape(num_tokens if wrap is None else None, hq + hk, rot_half)
    hpp = config.heads_per_program
    grid = (num_tokens, triton.cdiv(hq + hk, hpp))
    (_rope_kernel if wrap is None else wrap(_rope_kernel))[grid](
        positions, positions.stride(0),
        query, q_tok, q_head,
        key if key is not None else query, k_tok, k_head,
        cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0],
        hq, hk, hpp, rot_half,
        BLOCK_H=config.block_h, BLOCK_D=config.block_d, IS_NEOX=bool(is_neox), HAS_KEY=key is not None,
        num_warps=config.num_warps,
    )


def rotary_embedding(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int,
                     cos_sin_cache: Tensor, is_neox: bool, *, wrap=None, config=None) -> None:
    positions, query, key = flat_tokens(positions, query, key)
    launch(positions, query, key, head_size, cos_sin_cache, is_neox, config, wrap=wrap)


# ----------------------------------------------------------------------------------------------
# qk_rmsnorm_rope: each head RMS-normalised (rounded to the dtype), then rotated as above.
#
# Bit for bit this backend's rmsnorm on (T*H, head_size) rows, then rotary_embedding: the sum of squares
# of a head is reduced in the layout the rmsnorm kernel gives its row (``sizePerThread`` p elements, 32
# lanes, its warps: a different layout reduces in another order), with rmsnorm's expressions; the
# rotation is the kernel above on the rounded values. rmsnorm's row layout: the coalescing pass gives
# each thread min(max 16-byte vector of its accesses, row / threads) elements, its widest access being
# its contiguous output (16 bytes of the dtype) or the weight; ours are the head tile and a tile of the
# weight, so the same p whenever the heads are 16-byte aligned (the launcher copies the rare others).
# A tile of whole heads a warp has that layout when p * 32 is the padded row (one vector a lane, one warp
# a row) and every access of the tile is pinned to p elements (``LANE_VEC``: with several heads a lane the
# coalescing pass would otherwise widen the vector, so the reduction's order); any other row (fp32 at 256:
# two vectors a lane) is reduced one head a tile over rmsnorm's warps.

from ...backends.norm_rows import TRITON_ONE_PASS_MAX, triton_num_warps  # noqa: E402  (rmsnorm's row launch)

# Two heads a warp over four warps, rotated in registers: 100 against 103 µs (a head a warp, the pairs
# loaded again) at 16384 tokens of 32+8 heads on the H200 (benchmarks/sweep_triton_qk.py; docs/design/rope.md).
_QK_WARPS = 4
_QK_HEADS_PER_WARP = 2


@dataclass(frozen=True)
class TritonQKNormRopeConfig:
    """How the QK-norm + rotary kernel is launched; :meth:`for_shape` is what the launcher uses."""

    heads_per_program: int  # a chunk of the combined head list (query heads, then key heads)
    block_h: int  # heads per tile: whole heads a warp, or 1 (see the section's comment)
    block_n: int  # the head padded to a power of two (the rmsnorm kernel's BLOCK_N)
    block_d: int  # pairs per head per tile: the next power of two >= rot_dim/2
    num_warps: int
    lane_vec: int = 0  # elements a lane holds of a head, pinned to rmsnorm's row layout; 0: the tile's own
    in_regs: bool = False  # at full rotary, the pairs from the rounded tile in registers, not loaded again

    @classmethod
    def for_shape(cls, num_tokens: Optional[int], num_heads: int, head_size: int, rot_half: int, in_bytes: int,
                  q_w_bytes: int, k_w_bytes: int) -> "TritonQKNormRopeConfig":
        """The launcher's configuration for ``num_tokens`` tokens (``None``: traced) of ``num_heads``
        heads, q/k elements of ``in_bytes``, the weights' elements of ``q_w_bytes`` and ``k_w_bytes``
        (each tensor's head load takes its own layout, from its own weight)."""
        if num_tokens is None:
            chunks = num_heads
        else:
            chunks = -(-_MIN_PROGRAMS // max(num_tokens, 1)) if num_tokens < _MIN_PROGRAMS else 1
        return cls._pick(num_heads, head_size, rot_half, in_bytes, q_w_bytes, k_w_bytes, chunks)

    @classmethod
    @functools.lru_cache(maxsize=None)
    def _pick(cls, num_heads: int, head_size: int, rot_half: int, in_bytes: int, q_w_bytes: int, k_w_bytes: int,
              chunks: int, warps: int = _QK_WARPS, heads_per_warp: int = _QK_HEADS_PER_WARP) -> "TritonQKNormRopeConfig":
        if head_size > TRITON_ONE_PASS_MAX:
            raise ValueError(f"deepinfer::qk_rmsnorm_rope: argument 'head_size' must be at most {TRITON_ONE_PASS_MAX} "
                             f"on Triton (rmsnorm's one-pass rows), got {head_size}")
        block_n, row_warps = triton.next_power_of_2(head_size), triton_num_warps(head_size)  # rmsnorm's one pass
        lanes = max(block_n // (32 * row_warps), 1)
        lane_vec = 0
        if row_warps == 1 and all(min(row_vector(head_size, in_bytes, w), lanes) * 32 == block_n
                                  for w in (q_w_bytes, k_w_bytes)):
            block_h = min(triton.next_power_of_2(num_heads), warps * heads_per_warp)
            row_warps, lane_vec = max(1, min(warps, block_h)), lanes
        else:
            block_h = 1
        tiles = triton.cdiv(num_heads, block_h)
        hpp = block_h * triton.cdiv(tiles, min(tiles, chunks))
        return cls(hpp, block_h, block_n, triton.next_power_of_2(rot_half), row_warps, lane_vec, lane_vec > 0)


def row_vector(head_size: int, in_bytes: int, w_bytes: int) -> int:
    """Elements of the widest vector among rmsnorm's accesses of a row (its output, its weight): 16
    bytes of the narrower type, or 1 where the row size is not a multiple of 16 (Triton then knows
    no alignment of a row, nor the mask's)."""
    return 1 if head_size % 16 else 16 // min(in_bytes, w_bytes)


@triton.jit
def _norm_rotate_heads(
    row_ptr,  # this token's first element of head 0
    head_stride,  # elements between consecutive heads
    h_start, h_end,  # the heads [h_start, h_end) of this tensor that this program takes
    w_ptr,  # the norm's weight (head_size,), contiguous
    eps, head_size,  # rmsnorm's eps and row size (runtime values, as rmsnorm takes them)
    cos, sin, d, d_mask, rot_half,  # as in _rotate_heads
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, LANE_VEC: tl.constexpr,
    HAS_PASS: tl.constexpr, IN_REGS: tl.constexpr, IS_NEOX: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_N)
    if LANE_VEC:  # every access of the tile in LANE_VEC-element vectors: rmsnorm's row layout, heads a lane
        cols = tl.max_contiguous(cols, LANE_VEC)
    for h0 in range(h_start, h_end, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        live = heads < h_end
        head_ptr = row_ptr + heads.to(tl.int64)[:, None] * head_stride
        n_mask = live[:, None] & (cols < head_size)[None, :]
        x = tl.load(head_ptr + cols[None, :], mask=n_mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / head_size + eps)[:, None]  # rmsnorm's expression
        # Dims rot_dim.. keep the rounded norm. The weight as a tile of the heads' shape: an access of
        # the weight's vector width, as in rmsnorm's row (its layout).
        w = tl.load(w_ptr + (cols[None, :] + 0 * heads[:, None]), mask=n_mask, other=0.0).to(tl.float32)
        if HAS_PASS:
            tl.store(head_ptr + cols[None, :], (x * rstd * w).to(row_ptr.dtype.element_ty),
                     mask=n_mask & (cols >= 2 * rot_half)[None, :])
        if IN_REGS:  # full rotary: the pairs out of the rounded tile itself, one store of the head
            xn = (x * rstd * w).to(row_ptr.dtype.element_ty).to(tl.float32)
            if IS_NEOX:
                x1, x2 = tl.split(tl.permute(tl.reshape(xn, (BLOCK_H, 2, BLOCK_D)), (0, 2, 1)))
                o1, o2 = rotate_pair(x1, x2, cos, sin)
                out = tl.permute(tl.join(o1, o2), (0, 2, 1))
            else:
                x1, x2 = tl.split(tl.reshape(xn, (BLOCK_H, BLOCK_D, 2)))
                o1, o2 = rotate_pair(x1, x2, cos, sin)
                out = tl.join(o1, o2)
            tl.store(head_ptr + cols[None, :], tl.reshape(out, (BLOCK_H, BLOCK_N)).to(row_ptr.dtype.element_ty),
                     mask=n_mask)
        elif IS_NEOX:
            mask = live[:, None] & d_mask[None, :]
            p1 = head_ptr + d[None, :]
            p2 = p1 + rot_half
            w1 = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + rot_half + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
            x1 = (x1 * rstd * w1).to(row_ptr.dtype.element_ty).to(tl.float32)  # what rmsnorm writes
            x2 = (x2 * rstd * w2).to(row_ptr.dtype.element_ty).to(tl.float32)
            o1, o2 = rotate_pair(x1, x2, cos, sin)
            tl.store(p1, o1.to(row_ptr.dtype.element_ty), mask=mask)
            tl.store(p2, o2.to(row_ptr.dtype.element_ty), mask=mask)
        else:
            r = tl.arange(0, 2 * BLOCK_D)
            if LANE_VEC:  # at full rotary this tile has the head's shape: the same vectors, or x's layout moves
                r = tl.max_contiguous(r, LANE_VEC)
            r_mask = r < 2 * rot_half
            m = live[:, None] & r_mask[None, :]
            p = head_ptr + r[None, :]
            wr = tl.load(w_ptr + r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
            xr = tl.load(p, mask=m, other=0.0).to(tl.float32)
            xr = (xr * rstd * wr).to(row_ptr.dtype.element_ty).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(xr, (BLOCK_H, BLOCK_D, 2)))
            o1, o2 = rotate_pair(x1, x2, cos, sin)
            out = tl.reshape(tl.join(o1, o2), (BLOCK_H, 2 * BLOCK_D))
            tl.store(p, out.to(row_ptr.dtype.element_ty), mask=m)


@triton.jit
def _qk_norm_rope_kernel(
    pos_ptr, pos_stride,
    q_ptr, q_tok_stride, q_head_stride,
    k_ptr, k_tok_stride, k_head_stride,
    qw_ptr, kw_ptr,  # the weights (head_size,); kw unused when not HAS_KEY
    eps, head_size,
    cache_ptr, cache_stride, max_position,
    num_q_heads, num_k_heads, heads_per_program, rot_half,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, LANE_VEC: tl.constexpr,
    HAS_PASS: tl.constexpr, IN_REGS: tl.constexpr, IS_NEOX: tl.constexpr, HAS_KEY: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    h_lo = tl.program_id(1) * heads_per_program
    h_hi = h_lo + heads_per_program
    pos = tl.load(pos_ptr + tok * pos_stride).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < rot_half
    cos, sin = cos_sin(cache_ptr, cache_stride, pos, max_position, d, rot_half)
    _norm_rotate_heads(q_ptr + tok * q_tok_stride, q_head_stride, h_lo, tl.minimum(h_hi, num_q_heads), qw_ptr,
                       eps, head_size, cos, sin, d, d_mask, rot_half, BLOCK_H, BLOCK_N, BLOCK_D, LANE_VEC, HAS_PASS,
                       IN_REGS, IS_NEOX)
    if HAS_KEY:
        _norm_rotate_heads(k_ptr + tok * k_tok_stride, k_head_stride, tl.maximum(h_lo - num_q_heads, 0),
                           tl.minimum(h_hi - num_q_heads, num_k_heads), kw_ptr, eps, head_size, cos, sin, d,
                           d_mask, rot_half, BLOCK_H, BLOCK_N, BLOCK_D, LANE_VEC, HAS_PASS,
                           IN_REGS, IS_NEOX)


def _aligned_heads(x: Optional[Tensor], head_size: int) -> bool:
    """Whether Triton's specialisation sees ``x``'s heads 16-byte aligned: data pointer, token and
    head strides multiples of 16 bytes / elements (what fixes the vector width of a head's load)."""
    if x is None:
        return True
    _, tok, head = _heads(x, head_size)
    return not (x.data_ptr() % 16 or tok % 16 or head % 16)


def qk_launch(positions: Tensor, query: Tensor, key: Optional[Tensor], q_weight: Tensor, k_weight: Optional[Tensor],
              eps: float, head_size: int, cos_sin_cache: Tensor, is_neox: bool,
              config: Optional[TritonQKNormRopeConfig] = None, wrap=None) -> None:
    num_tokens = query.shape[0]
    if wrap is None and num_tokens == 0:
        return
    rot_half = int(cos_sin_cache.shape[1]) // 2
    hq, q_tok, q_head = _heads(query, head_size)
    hk, k_tok, k_head = _heads(key, head_size) if key is not None else (0, 0, 0)
    if config is None:
        # a weight off 16 bytes loads value by value, in rmsnorm's row as here: counted as no vector
        w_bytes = lambda w: w.element_size() if wrap is not None or w.data_ptr() % 16 == 0 else 16  # noqa: E731
        config = TritonQKNormRopeConfig.for_shape(num_tokens if wrap is None else None, hq + hk, head_size, rot_half,
                                                  query.element_size(), w_bytes(q_weight),
                                                  w_bytes(k_weight if k_weight is not None else q_weight))
    hpp = config.heads_per_program
    grid = (num_tokens, triton.cdiv(hq + hk, hpp))
    (_qk_norm_rope_kernel if wrap is None else wrap(_qk_norm_rope_kernel))[grid](
        positions, positions.stride(0),
        query, q_tok, q_head,
        key if key is not None else query, k_tok, k_head,
        q_weight, k_weight if k_weight is not None else q_weight,
        eps, head_size,
        cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0],
        hq, hk, hpp, rot_half,
        BLOCK_H=config.block_h, BLOCK_N=config.block_n, BLOCK_D=config.block_d, LANE_VEC=config.lane_vec,
        HAS_PASS=2 * rot_half < head_size, IN_REGS=config.in_regs and 2 * rot_half == config.block_n,
        IS_NEOX=bool(is_neox), HAS_KEY=key is not None,
        num_warps=config.num_warps,
    )


def qk_rmsnorm_rope(positions: Tensor, query: Tensor, key: Optional[Tensor], q_weight: Tensor,
                    k_weight: Optional[Tensor], eps: float, head_size: int, cos_sin_cache: Tensor, is_neox: bool, *,
                    wrap=None, config=None) -> None:
    positions, query, key = flat_tokens(positions, query, key)
    if wrap is None and query.shape[0] and head_size % 16 == 0 and not (
            _aligned_heads(query, head_size) and _aligned_heads(key, head_size)):
        # rare: heads off 16 bytes would narrow the head's vector (rmsnorm's row keeps its output's), so its
        # reduction order; on fresh copies (``.contiguous()`` returns a contiguous misaligned view itself)
        q = query.clone(memory_format=torch.contiguous_format)
        k = None if key is None else key.clone(memory_format=torch.contiguous_format)
        qk_launch(positions, q, k, q_weight, k_weight, eps, head_size, cos_sin_cache, is_neox, config)
        query.copy_(q)
        if key is not None:
            key.copy_(k)
        return
    qk_launch(positions, query, key, q_weight, k_weight, eps, head_size, cos_sin_cache, is_neox, config, wrap)
