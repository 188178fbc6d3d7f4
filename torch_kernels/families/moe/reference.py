"""Reference MoE routers, computed in fp32 (fp64 for fp64 logits); fp32 weights, int32 ids.

Selection is deterministic: a stable descending sort, so equal keys resolve to the lower index
(``torch.topk`` does not promise an order among equal values, on CPU or CUDA). A non-finite score
(a softmax row with a NaN or ``+inf`` logit, or all ``-inf``; a sigmoid of NaN) counts as 0, as in
vLLM's ``topk_softmax`` kernel, so weights stay finite and ids distinct; a renormalised row of zero
weights stays zero. A NaN key (from a NaN bias) ranks as ``+inf``. These functions take
already-validated arguments (``ops.py`` validates).
"""

from typing import Optional

import torch
from torch import Tensor

_INF = float("inf")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or the input's dtype where it is wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _rank(key: Tensor) -> Tensor:
    """The key as it ranks: NaN (from a NaN bias: the scores are finite) as ``+inf``."""
    return key.masked_fill(key.isnan(), _INF)


def finite_scores(scores: Tensor) -> Tensor:
    """NaN and ``+-inf`` scores as 0: vLLM's clamp before selection (its topk_softmax kernel)."""
    return scores.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def renormalized(weights: Tensor) -> Tensor:
    """``weights / sum``, a row of zeros (every score clamped) left as zeros instead of 0/0."""
    total = weights.sum(-1, keepdim=True)
    return weights / torch.where(total > 0, total, 1.0)


def top_indices(key: Tensor, k: int, valid: Optional[Tensor] = None) -> Tensor:
    """Indices of the ``k`` largest entries of each row of ``key``, largest first, equal keys in
    ascending index order; NaN ranks as ``+inf``; entries where ``valid`` is False rank below every
    key (``-inf`` included)."""
    order = torch.sort(_rank(key), dim=-1, descending=True, stable=True).indices
    if valid is not None:
        # a second stable sort puts the valid entries first and keeps each part in key order
        invalid = (~valid).gather(-1, order).to(torch.int8)
        order = order.gather(-1, torch.sort(invalid, dim=-1, stable=True).indices)
    return order[..., :k]


def topk_softmax(gating_output: Tensor, topk: int, renormalize: bool = False):
    scores = finite_scores(torch.softmax(gating_output.to(compute_dtype(gating_output.dtype)), dim=-1))
    ids = top_indices(scores, topk)
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = renormalized(weights)
    return weights.to(torch.float32), ids.to(torch.int32)


def grouped_topk(gating_output: Tensor, topk: int, renormalize: bool, num_expert_group: int, topk_group: int,
                 scoring_func: str = "softmax", e_score_correction_bias: Optional[Tensor] = None,
                 routed_scaling_factor: float = 1.0):
    x = gating_output.to(compute_dtype(gating_output.dtype))
    scores = finite_scores(torch.softmax(x, dim=-1) if scoring_func == "softmax" else torch.sigmoid(x))
    tokens, experts = scores.shape
    group_size = experts // num_expert_group
    key = scores if e_score_correction_bias is None else scores + e_score_correction_bias.to(x.dtype)
    grouped = _rank(key).view(tokens, num_expert_group, group_size)
    if e_score_correction_bias is None:
        group_scores = grouped.amax(dim=-1)
    else:  # the sum of the group's two largest keys (values only: their order does not matter)
        group_scores = _rank(grouped.topk(2, dim=-1).values.sum(dim=-1))  # inf + -inf: NaN, ranked +inf
    groups = top_indices(group_scores, topk_group)
    kept = torch.zeros(tokens, num_expert_group, dtype=torch.bool, device=x.device).scatter_(1, groups, True)
    ids = top_indices(key, topk, kept.repeat_interleave(group_size, dim=1))
    weights = scores.gather(-1, ids)  # the unbiased scores: the bias only selects
    if renormalize:
        weights = renormalized(weights)
    # vLLM multiplies by the factor inside grouped_topk, after renormalising
    return (weights * routed_scaling_factor).to(torch.float32), ids.to(torch.int32)
