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

import triton
import triton.language as tl
from torch import Tensor

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
        head_ptr = row_ptr + heads.to(tl.int64)[:, None] * head_stride
        if IS_NEOX:
            mask = (heads < h_end)[:, None] & d_mask[None, :]
            # Two contiguous half-rows per head: vector loads.
            p1 = head_ptr + d[None, :]
            p2 = p1 + rot_half
            x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
            tl.store(p1, (x1 * cos - x2 * sin).to(row_ptr.dtype.element_ty), mask=mask)
            tl.store(p2, (x2 * cos + x1 * sin).to(row_ptr.dtype.element_ty), mask=mask)
        else:
            # GPT-J: the contiguous row as a (BLOCK_H, 2 * BLOCK_D) tile of 16-byte vectors, split in
            # registers (renames in the sm_90 PTX); a (BLOCK_H, BLOCK_D, 2) load was 4-byte, 2.6x slower.
            r = tl.arange(0, 2 * BLOCK_D)
            m = (heads < h_end)[:, None] & (r < 2 * rot_half)[None, :]
            p = head_ptr + r[None, :]
            x = tl.load(p, mask=m, other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D, 2)))
            out = tl.reshape(tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin), (BLOCK_H, 2 * BLOCK_D))
            tl.store(p, out.to(row_ptr.dtype.element_ty), mask=m)


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
    # The op validates positions in eager calls; inside a CUDA graph capture it cannot (that needs a
    # sync), so an out-of-range position must still read nothing: it gets NaN cos/sin instead, a loud
    # wrong answer rather than an illegal address.
    in_cache = (pos >= 0) & (pos < max_position)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < rot_half
    # One comparison for both conditions (a scalar & vector mask also trips the interpreter).
    c_mask = d < tl.where(in_cache, rot_half, 0)
    cache_row = cache_ptr + pos * cache_stride
    cos = tl.load(cache_row + d, mask=c_mask, other=float("nan")).to(tl.float32)[None, :]
    sin = tl.load(cache_row + rot_half + d, mask=c_mask, other=float("nan")).to(tl.float32)[None, :]
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
    launch(positions, query, key, head_size, cos_sin_cache, is_neox, config, wrap=wrap)
