"""vLLM's batched form of the rope ops: ``positions (B, S)`` with ``query``/``key`` ``(B, S, H * head_size)``
or ``(B, S, H, head_size)``, served as the ``(B * S, ...)`` call (vLLM flattens them the same way:
``num_tokens = positions.numel()``). The validators (``ops.py``) accept the form only where the batch and
sequence dims of query and key collapse into one token stride, so these are views: written in place."""

from typing import Optional, Tuple

from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true, sym_or


def collapses(t: Tensor):
    """Whether ``t``'s first two dims are one token dim of a view: a bool, or on symbolic sizes a SymBool
    for ``checks.require`` (no guard: unbacked batch and sequence sizes trace)."""
    return sym_or(t.stride(0) == t.shape[1] * t.stride(1), t.shape[0] == 1, t.shape[1] == 1)


def flat_tokens(positions: Tensor, query: Tensor, key: Optional[Tensor]) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """The ``(B * S, ...)`` views of a batched call; a call with ``(T,)`` positions as it is."""
    if positions.dim() != 2:
        return positions, query, key
    n = positions.shape[0] * positions.shape[1]
    flat_positions = _rows(positions, n) if guard_or_true(collapses(positions)) else positions.reshape(n)
    return flat_positions, _rows(query, n), None if key is None else _rows(key, n)


def _rows(t: Tensor, n) -> Tensor:
    """``t`` ``(B, S, ...)``, whose first two dims collapse, as its ``(B*S, ...)`` view: ``as_strided``,
    which unlike ``view`` asks nothing of symbolic sizes (unbacked ones failed on a guard). An unbacked
    ``S`` is taken for more than 1: only the fake's strides, which the checks read, depend on it."""
    token_stride = t.stride(0) if guard_or_false(t.shape[1] == 1) else t.stride(1)
    return t.as_strided((n, *t.shape[2:]), (token_stride, *t.stride()[2:]), t.storage_offset())
