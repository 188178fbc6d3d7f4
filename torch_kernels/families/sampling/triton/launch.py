"""``_launch``: the top-k/top-p kernels of one call in order (the split prepass, the histogram route's
kernels, the joint order's row mass, the filter kernel, the renormalised write), from probabilities or,
for the logits-in sampler, from logits whose probabilities are computed where read."""

from typing import Optional

import torch
import triton
from torch import Tensor

from .... import outputs
from ..reference import fixed_point_bits
from ._common import MASS_CHUNK, rng_tensors
from .candidates import Logits, _slice_prepass, _stride
from .config import DEFAULT, Config, fitted, k_split
from .filter import _filter_kernel, _renorm_write_kernel, _row_mass_kernel
from .histogram import _hist_prepasses, _kept_draw_kernel, _kept_mass_kernel


def _launch(probs: Tensor, top_k, top_p, seed, offset, sample: bool, config: Config = DEFAULT, joint: bool = False,
            logits: Optional[Logits] = None, out=None) -> Tensor:
    """The op's kernels on ``probs`` (``(B, V)``). With ``logits`` (a sampling call that :func:`splits`)
    ``probs`` is an unwritten fp32 tensor: the split prepass computes its values from the logits, and
    only the rows it does not finish are written, for the filter kernel's other routes. ``out``: the out
    overload's tensors (``outputs.given``)."""
    B, V = probs.shape
    q_bits = fixed_point_bits(V)
    config = fitted(config, B, V)
    if not isinstance(top_k, Tensor) and top_k is not None and not 0 < top_k < V:
        # a scalar top-k that keeps every row whole is none: top-p rows then take the histogram route,
        # not the full-pass searches (459 µs at 64 rows of 128256, p = 0.9; that route's kernels ~120)
        top_k = None
    shape, dtype = ((B,), torch.int32) if sample else ((B, V), probs.dtype)
    out = (torch.empty(shape, dtype=dtype, device=probs.device) if out is None
           else outputs.given(out, 0, shape, dtype, probs.device))
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
    stats = _slice_prepass(probs, top_k, buf_bits, buf_idx, config, logits) if split else dummy
    # the histogram route: top-p rows that top-k leaves whole (all of top_p_renorm_probs), V > cap; its
    # kernels read every row, so not from logits
    hist = (top_p is not None and V > cap and config.hist_slices > 0 and (top_k is None or config.hist_with_top_k)
            and logits is None)
    hist_max, bracket, _ = _hist_prepasses(probs, top_k, top_p, buf_bits, config) if hist else (dummy, dummy, dummy)
    # joint: top-p against the whole row's mass; only where a top-k cut makes it differ from M_k
    joint = joint and top_p is not None and top_k is not None
    joint_mass = dummy
    if joint:
        joint_mass = torch.empty(B, dtype=torch.int64, device=probs.device)
        _row_mass_kernel[(B,)](probs, probs.stride(0), joint_mass, V, q_bits, CHUNK=config.chunk_g,
                               num_warps=config.num_warps)
    # histogram-route sampling: the filter kernel leaves each row's draw to the two kernels below
    draw = torch.empty((B, 3), dtype=torch.int64, device=probs.device) if hist and sample else dummy
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
        V, q_bits,
        HAS_K=top_k is not None, HAS_P=top_p is not None, SAMPLE=sample,
        K_ARR=isinstance(top_k, Tensor), P_ARR=isinstance(top_p, Tensor),
        CAP=cap, CHUNK=config.chunk, K_SMALL=config.k_small, CHUNK_G=config.chunk_g,
        NP_COUNT=config.np_count, NP_MASS=config.np_mass, NP_FLOAT=config.np_float, FITS=V <= cap,
        SPLIT=split, SLICES=config.slices if split else 1,
        hist_max_ptr=hist_max, bracket_ptr=bracket, draw_ptr=draw, HIST=hist,
        HIST_SLICES=config.hist_slices if hist else 1,
        joint_mass_ptr=joint_mass, JOINT=joint, PER_ROW_RNG=per_row_rng,
        num_warps=config.num_warps,
    )
    if hist and sample:
        slices = config.hist_slices
        slice_len, mass = triton.cdiv(V, slices), torch.empty((B, slices), dtype=torch.int64, device=probs.device)
        _kept_mass_kernel[(B, slices)](probs, probs.stride(0), hist_max, draw, mass, V, slice_len, q_bits,
                                       SLICES=slices, CHUNK=MASS_CHUNK, num_warps=4)
        _kept_draw_kernel[(B,)](probs, probs.stride(0), draw, mass, out, V, slice_len, q_bits,
                                SLICES=slices, CHUNK=config.chunk_g, num_warps=8)
    if not sample:
        block = config.write_block
        _renorm_write_kernel[(B, triton.cdiv(V, block))](probs, probs.stride(0), row_out, out, out.stride(0), V,
                                                         BLOCK=block, num_warps=config.write_warps)
    return out


def _either(arr: Optional[Tensor], val):
    """The per-row tensor, else the scalar, which the kernels take as an argument (``_common.row_value``)."""
    return val if arr is None else arr


def splits(top_k, B: int, V: int, config: Config = DEFAULT) -> bool:
    """Whether the split prepass of a call of ``B`` rows runs and can finish a row: a per-row top-k, or
    one in ``(0, K_SPLIT]``."""
    config = fitted(config, B, V)
    if not (V > config.cap and config.slices > 0):
        return False
    return isinstance(top_k, Tensor) or top_k is not None and 0 < top_k <= k_split(config)
