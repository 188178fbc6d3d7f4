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

``filter`` holds the per-row kernel that chooses among them and the renormalised write, ``launch`` the
call's kernels in order, ``_common`` what the routes share, ``config`` the launch parameters;
``docs/design/sampling.md`` the measurements. The logits ops and the samplers by slices of the row are
in ``logits``, ``logits_in`` and ``speculative``.

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

from torch import Tensor

from ..reference import gather_rows
from .config import DEFAULT, Config  # noqa: F401  (the launch parameters, for sweeps)
from .launch import _either, _launch
from .logits import min_p_sampling_from_probs, softmax, top_k_mask_logits  # noqa: F401  (one module)
from .logits_in import (sampled_token_logprobs, sampling_from_logits, sampling_from_probs,  # noqa: F401
                        top_k_top_p_sampling_from_logits)
from .speculative import chain_speculative_sampling  # noqa: F401  (its own module)


def top_k_renorm_probs(probs: Tensor, maybe_top_k_arr: Optional[Tensor], top_k_val: int = 0, *, out=None) -> Tensor:
    return _launch(probs, _either(maybe_top_k_arr, top_k_val), None, None, None, sample=False, out=out)


def top_p_renorm_probs(probs: Tensor, maybe_top_p_arr: Optional[Tensor], top_p_val: float = 1.0, *,
                       out=None) -> Tensor:
    return _launch(probs, None, _either(maybe_top_p_arr, top_p_val), None, None, sample=False, out=out)


def top_k_top_p_sampling_from_probs(probs: Tensor, maybe_top_k_arr: Optional[Tensor], maybe_top_p_arr: Optional[Tensor],
                                    seed: Tensor, offset: Tensor, top_k_val: int = 0, top_p_val: float = 1.0,
                                    filter_apply_order: str = "top_k_first", indices: Optional[Tensor] = None) -> Tensor:
    # indices: the named rows gathered (one copy of N rows), then every route as without
    probs, maybe_top_k_arr, maybe_top_p_arr = gather_rows(indices, probs, maybe_top_k_arr, maybe_top_p_arr)
    return _launch(probs, _either(maybe_top_k_arr, top_k_val), _either(maybe_top_p_arr, top_p_val), seed, offset,
                   sample=True, joint=filter_apply_order == "joint")
