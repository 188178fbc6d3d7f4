"""The rotary embedding's Triton pieces that several families' kernels share (the rope family's
``rotary_embedding`` and ``qk_rmsnorm_rope``, the KV-cache family's fused cache write): a token's
cos/sin and the rotation of a tile of its heads in place, with ``rotary_embedding``'s expressions (fp32,
rounded once), so that the fused ops' rotations are its bits."""

import os

import triton
import triton.language as tl

INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def cos_sin(cache_ptr, cache_stride, pos, max_position, d, rot_half):
    """``(1, BLOCK_D)`` fp32 cosines and sines of position ``pos`` (int64) at pairs ``d``; a position
    outside ``[0, max_position)`` reads no memory and gets NaN (a loud wrong answer, not an illegal address)."""
    in_cache = (pos >= 0) & (pos < max_position)
    # one comparison for both conditions (a scalar & vector mask also trips the interpreter)
    c_mask = d < tl.where(in_cache, rot_half, 0)
    cache_row = cache_ptr + pos * cache_stride
    cos = tl.load(cache_row + d, mask=c_mask, other=float("nan")).to(tl.float32)[None, :]
    sin = tl.load(cache_row + rot_half + d, mask=c_mask, other=float("nan")).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _rounded(asm: tl.constexpr, a, b):
    """``a op b`` in fp32 by one PTX instruction with an explicit rounding (``asm``: ``"mul.rn.f32"`` ...),
    which the compiler never fuses into a multiply-add nor flushes to zero."""
    return tl.inline_asm_elementwise(asm + " $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def rotate_pair(x1, x2, cos, sin):
    """``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` in fp32, each product and sum rounded, as the
    reference computes it: left to the compiler, which product went into a multiply-add changed with the
    code around it (qk_rmsnorm_rope at two heads a warp came out one ulp from rotary_embedding on the H200)."""
    if INTERPRETED:  # the interpreter rounds every operation and runs no PTX
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return (_rounded("sub.rn.f32", _rounded("mul.rn.f32", x1, cos), _rounded("mul.rn.f32", x2, sin)),
            _rounded("add.rn.f32", _rounded("mul.rn.f32", x2, cos), _rounded("mul.rn.f32", x1, sin)))


@triton.jit
def rotate_tile(
    head_ptr,  # (BLOCK_H, 1) pointers: the first element of each head of the tile
    live,  # (BLOCK_H,) the heads to rotate
    cos, sin,  # (1, BLOCK_D) fp32 (cos_sin)
    d, d_mask,  # (BLOCK_D,) pair index i and i < rot_dim/2 (neox only)
    rot_half,  # rot_dim / 2
    BLOCK_H: tl.constexpr,  # heads a tile
    BLOCK_D: tl.constexpr,  # pairs a head: next power of two >= rot_dim/2
    IS_NEOX: tl.constexpr,  # pairs (i, i + rot_dim/2) if True, else GPT-J pairs (2i, 2i + 1)
):
    """Rotate the first ``rot_dim`` dims of the tile's live heads in place."""
    if IS_NEOX:
        mask = live[:, None] & d_mask[None, :]
        # Two contiguous half-rows per head: vector loads.
        p1 = head_ptr + d[None, :]
        p2 = p1 + rot_half
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
        o1, o2 = rotate_pair(x1, x2, cos, sin)
        tl.store(p1, o1.to(head_ptr.dtype.element_ty), mask=mask)
        tl.store(p2, o2.to(head_ptr.dtype.element_ty), mask=mask)
    else:
        # GPT-J: the contiguous row as a (BLOCK_H, 2 * BLOCK_D) tile of 16-byte vectors, split in
        # registers (renames in the sm_90 PTX); a (BLOCK_H, BLOCK_D, 2) load was 4-byte, 2.6x slower.
        r = tl.arange(0, 2 * BLOCK_D)
        m = live[:, None] & (r < 2 * rot_half)[None, :]
        p = head_ptr + r[None, :]
        x = tl.load(p, mask=m, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D, 2)))
        o1, o2 = rotate_pair(x1, x2, cos, sin)
        out = tl.reshape(tl.join(o1, o2), (BLOCK_H, 2 * BLOCK_D))
        tl.store(p, out.to(head_ptr.dtype.element_ty), mask=m)
