"""Triton sampling family: bit-identical to the reference, one filter program per row after optional
prepasses (the split prepass for top-k, the histogram kernels for top-p without a top-k cut), then a
parallel write of renormalised rows.

The semantics (``torch_kernels/families/sampling/reference.py``) reduce every op to one threshold ``T`` on the
row's fp32 bit patterns (kept: ``bits(p) >= T``) and the kept mass ``M`` in 64-bit fixed point; the
kernels find ``T`` and ``M`` with integer arithmetic only, so they agree with the reference exactly,
whatever the summation order. A row takes one of three routes, each in its module:

* ``candidates``: ``0 < top_k <= Config.k_small``, or the whole row fits in ``Config.cap``: the values
  ``>= t_k`` gathered in a per-row buffer in one read (a streaming pass, or the split prepass when
  ``V > cap``), then thresholds and sample in registers.
* ``pivots``: no or large top-k, or ties that overflow the buffer: multi-pivot searches over the bit
  pattern, one read of the row a round, ending in registers.
* ``histogram``: ``V > cap``, top-p rows that top-k leaves whole: four small launches bracket the top-p
  threshold in parallel; the filter kernel ends the search.

``filter`` holds the per-row kernel that chooses among them and the renormalised write, ``_common`` what
the routes share, ``config`` the launch parameters; ``docs/design/sampling.md`` the measurements.

Exactness does not depend on the launch parameters: ``tests/test_sampling.py`` runs every route with
a 64-slot buffer on rows of 1000 against the reference, with and without the split prepass (4 and 16
slices: 16 and 4 slots a slice) and the histogram route (62 fine buckets, levels every 2 octaves: the
route, its fallback, windows placed by the levels and from 0, a limit exactly at a level boundary).

Arguments arrive validated (``ops.py``): probs ``(B, V)`` fp32 with a contiguous
last dim, ``top_k`` int32/int64 ``(B,)`` or an int, ``top_p`` fp32 ``(B,)`` or a float, seed and offset
int64 tensors of one element or one a row (``_common.rng_tensors``), all on one device. ``joint`` (the
``"joint"`` filter order) measures top-p against the whole row's mass (``_row_mass_kernel``); ``indices``
are served by gathering the named rows first.
"""

from typing import Optional

import torch
import triton
from torch import Tensor

from ..reference import fixed_point_bits, gather_rows
from .candidates import _slice_prepass, _stride
from .config import DEFAULT, Config
from ._common import rng_tensors
from .filter import _filter_kernel, _renorm_write_kernel, _row_mass_kernel
from .histogram import _hist_prepasses
from .logits import min_p_sampling_from_probs, softmax, top_k_mask_logits  # noqa: F401  (one module)
from .logits_in import (sampled_token_logprobs, sampling_from_logits, sampling_from_probs,  # noqa: F401
                        top_k_top_p_sampling_from_logits)
from .speculative import chain_speculative_sampling  # noqa: F401  (its own module)


def _launch(probs: Tensor, top_k, top_p, seed, offset, sample: bool, config: Config = DEFAULT, joint: bool = False) -> Tensor:
    B, V = probs.shape
    if sample:
        out = torch.empty(B, dtype=torch.int32, device=probs.device)
    else:
        out = torch.empty((B, V), dtype=probs.dtype, device=probs.device)
    if B == 0:
        return out
    # renormalising: the filter kernel leaves (threshold, 1/S) per row here, _renorm_write_kernel the row
    row_out = out if sample else torch.empty((B, 2), dtype=torch.int32, device=probs.device)
    cap = config.cap
    buf_bits = torch.empty((B, cap), dtype=torch.int32, device=probs.device)
    buf_idx = torch.empty((B, cap), dtype=torch.int32, device=probs.device)
    dummy = out  # stands in for the pointers a mode does not read
    # the prepass pays where the streaming pass would walk several chunks; without top-k no row is a
    # candidate row unless it fits
    split = top_k is not None and V > cap and config.slices > 0
    stats = _slice_prepass(probs, top_k, buf_bits, buf_idx, config) if split else dummy
    # the histogram route: top-p rows that top-k leaves whole (all of top_p_renorm_probs), V > cap
    hist = top_p is not None and V > cap and config.hist_slices > 0 and (top_k is None or config.hist_with_top_k)
    hist_max, bracket, _ = _hist_prepasses(probs, top_k, top_p, buf_bits, config) if hist else (dummy, dummy, dummy)
    # joint: top-p against the whole row's mass; only where a top-k cut makes it differ from M_k
    joint = joint and top_p is not None and top_k is not None
    joint_mass = dummy
    if joint:
        joint_mass = torch.empty(B, dtype=torch.int64, device=probs.device)
        _row_mass_kernel[(B,)](probs, probs.stride(0), joint_mass, V, fixed_point_bits(V), CHUNK=config.chunk_g,
                               num_warps=config.num_warps)
    per_row_rng = False
    if sample:
        seed, offset, per_row_rng = rng_tensors(seed, offset, B)
    _filter_kernel[(B,)](
        probs, probs.stride(0),
        top_k if top_k is not None else dummy, _stride(top_k) if top_k is not None else 0,
        top_p if top_p is not None else dummy, _stride(top_p) if top_p is not None else 0,
        seed if seed is not None else dummy, offset if offset is not None else dummy,
        row_out,
        buf_bits, buf_idx, stats,
        V, fixed_point_bits(V),
        HAS_K=top_k is not None, HAS_P=top_p is not None, SAMPLE=sample,
        K_ARR=isinstance(top_k, Tensor), P_ARR=isinstance(top_p, Tensor),
        CAP=cap, CHUNK=config.chunk, K_SMALL=config.k_small, CHUNK_G=config.chunk_g,
        NP_COUNT=config.np_count, NP_MASS=config.np_mass, NP_FLOAT=config.np_float, FITS=V <= cap,
        SPLIT=split, SLICES=config.slices if split else 1,
        hist_max_ptr=hist_max, bracket_ptr=bracket, HIST=hist, HIST_SLICES=config.hist_slices if hist else 1,
        joint_mass_ptr=joint_mass, JOINT=joint, PER_ROW_RNG=per_row_rng,
        num_warps=config.num_warps,
    )
    if not sample:
        block = config.write_block
        _renorm_write_kernel[(B, triton.cdiv(V, block))](probs, probs.stride(0), row_out, out, out.stride(0), V,
                                                         BLOCK=block, num_warps=config.write_warps)
    return out


def top_k_renorm_probs(probs: Tensor, maybe_top_k_arr: Optional[Tensor], top_k_val: int = 0) -> Tensor:
    return _launch(probs, _either(maybe_top_k_arr, top_k_val), None, None, None, sample=False)


def top_p_renorm_probs(probs: Tensor, maybe_top_p_arr: Optional[Tensor], top_p_val: float = 1.0) -> Tensor:
    return _launch(probs, None, _either(maybe_top_p_arr, top_p_val), None, None, sample=False)


def top_k_top_p_sampling_from_probs(probs: Tensor, maybe_top_k_arr: Optional[Tensor], maybe_top_p_arr: Optional[Tensor],
                                    seed: Tensor, offset: Tensor, top_k_val: int = 0, top_p_val: float = 1.0,
                                    filter_apply_order: str = "top_k_first", indices: Optional[Tensor] = None) -> Tensor:
    # indices: the named rows gathered (one copy of N rows), then every route as without
    probs, maybe_top_k_arr, maybe_top_p_arr = gather_rows(indices, probs, maybe_top_k_arr, maybe_top_p_arr)
    return _launch(probs, _either(maybe_top_k_arr, top_k_val), _either(maybe_top_p_arr, top_p_val), seed, offset,
                   sample=True, joint=filter_apply_order == "joint")


def _either(arr: Optional[Tensor], val):
    """The per-row tensor, else the scalar, which the kernels take as an argument (``_common.row_value``)."""
    return val if arr is None else arr
