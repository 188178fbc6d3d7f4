"""Triton MoE routers: one kernel serves ``topk_softmax`` and ``grouped_topk``.

One program routes ``BLOCK_R`` tokens. Each token's logits are held in registers as a
``(BLOCK_G, BLOCK_GS)`` tile: for ``grouped_topk`` the expert groups x the experts of a group (each
padded to a power of two), so that group scores are reductions over the last axis; for
``topk_softmax`` the row in chunks of one warp's load. Selection is ``topk`` rounds of argmax over
an order-preserving int32 image of each candidate's fp32 key: the largest rank, then the lowest
expert index holding it (ties to the lower index); the winner's rank drops to ``_NONE``, below
every real key (``-inf`` included). Groups are chosen the same way. As in the reference, a NaN or
infinite score counts as 0 (vLLM's clamp, on the scores and on the recomputed weights), a
renormalised row of zeros stays zero, and a NaN key (from a NaN bias) ranks as ``+inf``: weights are
finite and the ids distinct, valid expert indices. The launch is a :class:`TritonMoeConfig`;
:meth:`TritonMoeConfig.for_shape` picks it. Design notes and measurements: ``docs/design/moe.md``.

Arguments arrive validated (``ops.py``): logits ``(T, E)`` with a contiguous last
dimension, fp16/bf16/fp32; bias ``(E,)`` contiguous. Rows up to ``MAX_TILE`` padded experts: wider
ones are refused (``topk_softmax_refuses``/``grouped_topk_refuses``) and served by the reference.

``wrap``: ``None`` in eager calls; ``torch.library.wrap_triton`` when ``torch.compile`` traces the
op's ``inductor_triton`` route (``torch_kernels/library.py``). Traced, the token count is symbolic:
``BLOCK_R`` then comes from the tile alone (not shrunk to a small batch), and an empty grid is
skipped by Triton's launcher instead of an early return. ``config``: the launch, default
``TritonMoeConfig.for_shape`` (the sweep and tests pass others).
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

#: Padded experts a token holds in registers: 8192 (8 warps, 32 a thread) is 115 registers, no spills.
MAX_TILE = 8192

_NONE = tl.constexpr(-(2 ** 31))  # the rank of a non-candidate: below every real key (-inf ranks -2139095041)


@triton.jit
def _ordered(key):
    """fp32 -> int32 whose signed order is the float order (NaN as +inf, -0 as +0, so that they
    tie as they do in the reference's sort)."""
    key = tl.where(key != key, float("inf"), key)
    key = tl.where(key == 0.0, 0.0, key)
    bits = key.to(tl.int32, bitcast=True)
    # negative floats: flip the magnitude bits, so a larger magnitude is a smaller integer
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _finite_or_zero(v):
    """NaN and +-inf as 0 (the reference's ``finite_scores``); |v| is a free operand modifier."""
    return tl.where(tl.abs(v) < float("inf"), v, 0.0)


@triton.jit
def _route_rows(
    x_ptr, x_row_stride,  # logits (T, E), read; last dimension contiguous, rows may be strided
    bias_ptr,  # (E,) correction bias, read when HAS_BIAS (added to the scores for selection only)
    w_ptr, ids_ptr,  # outputs (T, topk): fp32 weights and int32 expert ids, contiguous
    T, E,  # tokens, experts
    G, GS,  # the tile's groups and experts per group: expert = g * GS + j (grouped_topk: the expert
    #         groups, E = G * GS; topk_softmax: chunks of the row, G = cdiv(E, GS), semantics-free)
    topk, topk_group,  # experts kept per token; groups kept per token (GROUPED only)
    scale,  # routed_scaling_factor: multiplies the final weights
    BLOCK_R: tl.constexpr,  # tokens per program
    BLOCK_G: tl.constexpr,  # G padded to a power of two
    BLOCK_GS: tl.constexpr,  # GS padded to a power of two
    BLOCK_K: tl.constexpr,  # topk padded to a power of two
    SOFTMAX: tl.constexpr,  # scores = softmax over the token's experts; else sigmoid
    HAS_BIAS: tl.constexpr,  # key = score + bias; the group score then sums the group's top two keys
    GROUPED: tl.constexpr,  # keep the topk_group best groups before choosing experts
    RENORMALIZE: tl.constexpr,  # divide the topk weights by their sum
):
    # Tiles (BLOCK_G, BLOCK_R, BLOCK_GS): a token's experts in one warp, so reductions are shuffles;
    # tokens first instead cost two cross-warp reductions (bar.sync) an argmax round (sm_90 PTX).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # int64: T * stride may pass 2^31
    row_ok = rows < T
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_GS)
    expert = g[:, None] * GS + j[None, :]  # (BLOCK_G, BLOCK_GS)
    is_expert = (g[:, None] < G) & (j[None, :] < GS) & (expert < E)  # padding is not an expert
    expert3 = expert[:, None, :]
    valid = is_expert[:, None, :]
    # masked lanes read 0, so rows past T stay finite (no NaN work, nothing stored)
    x = tl.load(x_ptr + rows[None, :, None] * x_row_stride + expert3,
                mask=row_ok[None, :, None] & valid, other=0.0).to(tl.float32)
    if SOFTMAX:
        m = tl.max(tl.max(tl.where(valid, x, float("-inf")), 2), 0)  # (BLOCK_R,)
        e = tl.where(valid, tl.exp(x - m[None, :, None]), 0.0)
        s = tl.sum(tl.sum(e, 2), 0)  # a NaN or +inf logit, or all -inf, makes s NaN: every score NaN
        key = e * (1.0 / s)[None, :, None]  # one division a token; the weights divide exactly
    else:
        key = tl.sigmoid(x)
    key = _finite_or_zero(key)  # vLLM's clamp: an all-NaN row ties at 0, so its ids are 0..topk-1, distinct
    if HAS_BIAS:
        key += tl.load(bias_ptr + expert, mask=is_expert, other=0.0).to(tl.float32)[:, None, :]
    rank = tl.where(valid, _ordered(key), _NONE)  # (BLOCK_G, BLOCK_R, BLOCK_GS) int32

    if GROUPED:
        kv = tl.where(valid, tl.where(key != key, float("inf"), key), float("-inf"))
        top1 = tl.max(kv, 2)  # (BLOCK_G, BLOCK_R)
        if HAS_BIAS:  # + the second largest: top1 again when top1 occurs twice
            is_top = kv == top1[:, :, None]
            second = tl.max(tl.where(is_top, float("-inf"), kv), 2)
            second = tl.where(tl.sum(is_top.to(tl.int32), 2) > 1, top1, second)
            group_score = top1 + second
        else:
            group_score = top1
        grank = tl.where((g < G)[:, None], _ordered(group_score), _NONE)
        kept = tl.zeros([BLOCK_G, BLOCK_R], dtype=tl.int32)
        for _ in range(topk_group):
            best = tl.max(grank, 0)
            best_g = tl.min(tl.where(grank == best[None, :], g[:, None], BLOCK_G), 0)
            hit = g[:, None] == best_g[None, :]
            kept = tl.where(hit, 1, kept)
            grank = tl.where(hit, _NONE, grank)
        rank = tl.where(kept[:, :, None] != 0, rank, _NONE)

    # topk rounds of argmax, two int32 reductions each (the largest rank, then the lowest expert): 115
    # SASS a round against 161 for one packed-int64 max; ids in (1, BLOCK_R, BLOCK_K): no layout change.
    k3 = tl.arange(0, BLOCK_K)[None, None, :]
    ids3 = tl.zeros([1, BLOCK_R, BLOCK_K], dtype=tl.int32)
    for i in range(topk):
        best = tl.max(tl.max(rank, 2), 0)  # (BLOCK_R,)
        idx = tl.min(tl.min(tl.where(rank == best[None, :, None], expert3, E), 2), 0)
        ids3 = tl.where(k3 == i, idx[None, :, None], ids3)
        rank = tl.where(expert3 == idx[None, :, None], _NONE, rank)
    ids = tl.reshape(ids3, [BLOCK_R, BLOCK_K])
    k = tl.arange(0, BLOCK_K)

    # The weights are the unbiased scores of the chosen experts, recomputed from their logits (read
    # again, from L1/L2) rather than gathered out of registers, which would cost a reduction a round.
    k_ok = (k < topk)[None, :]
    out_ok = row_ok[:, None] & k_ok
    xk = tl.load(x_ptr + rows[:, None] * x_row_stride + ids, mask=out_ok, other=0.0).to(tl.float32)
    if SOFTMAX:
        w = tl.exp(xk - m[:, None]) / s[:, None]
    else:
        w = tl.sigmoid(xk)
    w = tl.where(k_ok, _finite_or_zero(w), 0.0)
    if RENORMALIZE:
        total = tl.sum(w, 1)
        w = w / tl.where(total > 0.0, total, 1.0)[:, None]  # weights >= 0: a zero sum is a row of zeros
    w = w * scale
    out = rows[:, None] * topk + k[None, :]
    tl.store(w_ptr + out, w, mask=out_ok)
    tl.store(ids_ptr + out, ids, mask=out_ok)


@dataclass(frozen=True)
class TritonMoeConfig:
    """How the router kernel is launched; :meth:`for_shape` is what the launchers use."""

    block_r: int  # tokens per program, at most: an eager launch takes no more than the batch's power of two
    num_warps: int

    @classmethod
    @functools.lru_cache(maxsize=None)
    def for_shape(cls, experts: int, groups: int, element_size: int) -> "TritonMoeConfig":
        """The launchers' configuration for rows of ``experts`` logits of ``element_size`` bytes in
        ``groups`` expert groups (1: ``topk_softmax``).

        ``block_r`` = (tokens a warp covers) x 4 warps keeps every reduction within a warp; about 16
        logits a thread keeps registers near 56, so an 8192-token batch is resident in one wave; tiles
        needing over 32 a thread route 2048 logits a program across warps. Register budgets, not a sweep
        (``benchmarks/bench_moe.py --sweep``; docs/design/moe.md)."""
        vec = _vec(element_size)
        g, gs = _geometry(experts, groups, vec)
        block_gs = triton.next_power_of_2(gs)
        tile = triton.next_power_of_2(g) * block_gs
        num_warps = 4
        block_r = 32 // min(32, max(1, block_gs // vec)) * num_warps
        per_thread = tile * block_r // (32 * num_warps)
        if per_thread <= 32:
            return cls(block_r * max(1, 16 // per_thread), num_warps)
        block_r = max(1, 2048 // tile)
        return cls(block_r, min(16, max(4, block_r * tile // 1024)))


def _vec(element_size: int) -> int:
    """Elements of one 16-byte load."""
    return max(1, 16 // element_size)


def _geometry(experts: int, groups: int, vec: int):
    """(G, GS) of the tile: the expert groups, or for one group the row in chunks as wide as one
    warp loads (32 threads x ``vec``), so that a token's chunks stack in the first axis."""
    if groups > 1:
        return groups, experts // groups
    chunk = min(triton.next_power_of_2(experts), 32 * vec)
    return triton.cdiv(experts, chunk), chunk


def _route(x: Tensor, topk: int, renormalize: bool, groups: int, topk_group: int, softmax: bool,
           bias: Optional[Tensor], scale: float, wrap=None, config: Optional[TritonMoeConfig] = None):
    tokens, experts = x.shape[0], int(x.shape[1])
    weights = torch.empty((tokens, topk), dtype=torch.float32, device=x.device)
    ids = torch.empty((tokens, topk), dtype=torch.int32, device=x.device)
    if wrap is None and tokens == 0:
        return weights, ids
    g, gs = _geometry(experts, groups, _vec(x.element_size()))
    block_g, block_gs = triton.next_power_of_2(g), triton.next_power_of_2(gs)
    if block_g * block_gs > MAX_TILE:  # the op's KernelSpec.check sends these to the next backend
        raise ValueError(f"triton MoE router: {experts} experts ({block_g}x{block_gs} padded) exceed {MAX_TILE}")
    if config is None:
        config = TritonMoeConfig.for_shape(experts, groups, x.element_size())
    block_r = config.block_r
    if wrap is None:
        block_r = min(block_r, triton.next_power_of_2(tokens))
    grid = (triton.cdiv(tokens, block_r),)
    (_route_rows if wrap is None else wrap(_route_rows))[grid](
        x, x.stride(0), bias if bias is not None else x, weights, ids,
        tokens, experts, g, gs, topk, topk_group, float(scale),
        BLOCK_R=block_r, BLOCK_G=block_g, BLOCK_GS=block_gs, BLOCK_K=triton.next_power_of_2(topk),
        SOFTMAX=softmax, HAS_BIAS=bias is not None, GROUPED=groups > 1, RENORMALIZE=bool(renormalize),
        num_warps=config.num_warps,
    )
    return weights, ids


def topk_softmax(gating_output: Tensor, topk: int, renormalize: bool = False, *, wrap=None, config=None):
    return _route(gating_output, topk, renormalize, 1, 1, True, None, 1.0, wrap, config)


def grouped_topk(gating_output: Tensor, topk: int, renormalize: bool, num_expert_group: int, topk_group: int,
                 scoring_func: str = "softmax", e_score_correction_bias: Optional[Tensor] = None,
                 routed_scaling_factor: float = 1.0, *, wrap=None, config=None):
    return _route(gating_output, topk, renormalize, num_expert_group, topk_group, scoring_func == "softmax",
                  e_score_correction_bias, routed_scaling_factor, wrap, config)


def _tile(x: Tensor, groups: int) -> int:
    """Padded experts a token's tile holds."""
    g, gs = _geometry(x.shape[1], groups, _vec(x.element_size()))
    return triton.next_power_of_2(g) * triton.next_power_of_2(gs)


# Per-call eligibility (KernelSpec.check): why this backend cannot take the call, or None. Up to
# 4096 experts always fit: next_power_of_2(G) * next_power_of_2(E / G) < 2^13 when E <= 2^12.

def topk_softmax_refuses(gating_output: Tensor, topk: int, renormalize: bool = False) -> Optional[str]:
    if gating_output.shape[1] <= 4096:
        return None
    tile = _tile(gating_output, 1)
    return None if tile <= MAX_TILE else f"{gating_output.shape[1]} experts exceed the {MAX_TILE} a row holds in registers"


def grouped_topk_refuses(gating_output: Tensor, topk: int, renormalize: bool, num_expert_group: int, topk_group: int,
                         *args) -> Optional[str]:
    if gating_output.shape[1] <= 4096:
        return None
    tile = _tile(gating_output, num_expert_group)
    return None if tile <= MAX_TILE else (f"{gating_output.shape[1]} experts in {num_expert_group} groups pad to "
                                          f"{tile}, more than the {MAX_TILE} a row holds in registers")
