"""The sampling family: ``top_k_renorm_probs``, ``top_p_renorm_probs``, ``top_k_top_p_sampling_from_probs``,
the logits ops ``softmax``, ``top_k_mask_logits``, ``min_p_sampling_from_probs``, and
``chain_speculative_sampling`` (their definitions near the end).

Semantics of FlashInfer's ``flashinfer.sampling`` (top-k first, then top-p on the renormalised
survivors; thresholds keep ties), made exact so that the torch and Triton backends return the same kept set
and the same sample as the reference (``torch_kernels/families/sampling/reference.py``, whose docstring is the
definition; FlashInfer's sampling keeps its own random stream: ``registry.OWN_RANDOM_STREAM``): masses are summed in 64-bit fixed point and the random numbers are Philox4x32-10 of
``(seed, offset, row)``, so one ``(seed, offset)`` gives one result on every device and backend.
Randomness comes only from the ``seed``/``offset`` tensors: a CUDA graph captures the op and a
replay draws afresh after the caller updates ``offset`` in place.
"""

import math
from typing import Dict, Iterator, Optional, Union

import torch
from torch import Tensor

from ... import checks as check
from ...opdef import BenchCase, OpDef, Peer

_INDEX_DTYPES = (torch.int32, torch.int64)
_PROBS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # read as fp32 (exact), as FlashInfer reads them
_MAX_VOCAB = 2**31 - 1  # token ids are int32
#: FlashInfer's ``filter_apply_order`` values: top-p over the top-k survivors, or over the whole row
FILTER_ORDERS = ("top_k_first", "joint")


# ----------------------------------------------------------------------------------------------
# Validation: the full checks name the argument at fault; the eager validators first try a cheap
# test of the common valid call, as in norm.py.


def _validate_rows(op: str, name: str, rows: Tensor) -> None:
    """``rows`` (the ``probs`` or ``logits`` argument ``name``): 2-D ``(batch, vocab)`` of a float dtype."""
    check.tensor(op, name, rows)
    if rows.dtype not in _PROBS_DTYPES:
        check.fail(op, name, f"must be float32, float16 or bfloat16, got {rows.dtype}", TypeError)
    if rows.dim() != 2:
        check.fail(op, name, f"must be 2-D (batch, vocab), got shape {tuple(rows.shape)}")
    check.last_dim_contiguous(op, name, rows)
    check.require(rows.shape[1] >= 1, op, name, "must have a vocabulary (dimension 1) of at least 1")
    check.require(rows.shape[1] <= _MAX_VOCAB, op, name,
                  lambda: f"must have a vocabulary of at most {_MAX_VOCAB}, got {rows.shape[1]}")


def _validate_probs(op: str, probs: Tensor) -> None:
    _validate_rows(op, "probs", probs)


def _validate_logits(op: str, logits: Tensor) -> None:
    _validate_rows(op, "logits", logits)


def _validate_per_row(op: str, arg: str, t: Tensor, dtypes, what: str, rows: Tensor, rows_name: str = "probs") -> None:
    """``t``: one value per row of ``rows`` (the argument ``rows_name``), of ``dtypes``, on its device."""
    check.tensor(op, arg, t)
    if t.dtype not in dtypes:
        check.fail(op, arg, f"must be {what}, got {t.dtype}", TypeError)
    check.require(t.dim() == 1 and t.shape[0] == rows.shape[0], op, arg,
                  lambda: f"must have shape ({rows.shape[0]},), one value per row of '{rows_name}', got {tuple(t.shape)}")
    check.same_device(op, arg, t, rows_name, rows)


def _per_row_ok(t: Optional[Tensor], dtypes, rows: Tensor) -> bool:
    """The cheap test of :func:`_validate_per_row` (``None``: the scalar serves every row)."""
    return t is None or (t.dtype in dtypes and t.shape == rows.shape[:1] and t.device == rows.device)


def _validate_top_k(op: str, probs: Tensor, top_k: Optional[Tensor]) -> None:
    if top_k is not None:  # None: the scalar top_k_val serves every row
        _validate_per_row(op, "maybe_top_k_arr", top_k, _INDEX_DTYPES, "int32 or int64", probs)


def _validate_top_p(op: str, probs: Tensor, top_p: Optional[Tensor]) -> None:
    if top_p is not None:
        _validate_per_row(op, "maybe_top_p_arr", top_p, (torch.float32,), "float32", probs)


def _validate_seed_offset(op: str, seed: Tensor, offset: Tensor, data_arg: str, data: Tensor,
                          rows: Optional[int] = None) -> None:
    """One value each (shape ``()`` or ``(1,)``), or one per output row (``rows``, default the data's
    batch): FlashInfer 0.7's per-row form."""
    rows = data.shape[0] if rows is None else rows
    for arg, t in (("seed", seed), ("offset", offset)):
        check.tensor(op, arg, t)
        if t.dtype != torch.int64:
            check.fail(op, arg, f"must be an int64 tensor, got {t.dtype}", TypeError)
        if not _one_or_per_row(t, rows):
            check.fail(op, arg, f"must hold one value (shape () or (1,)) or one per output row, shape ({rows},); "
                                f"got {tuple(t.shape)}")
        check.same_device(op, arg, t, data_arg, data)


def _one_or_per_row(t: Tensor, rows: int) -> bool:
    return (t.dim() <= 1 and t.numel() == 1) or (t.dim() == 1 and t.shape[0] == rows)


def _seed_offset_ok(seed: Tensor, offset: Tensor, data: Tensor, rows: Optional[int] = None) -> bool:
    rows = data.shape[0] if rows is None else rows
    return (seed.dtype == torch.int64 and offset.dtype == torch.int64 and _one_or_per_row(seed, rows)
            and _one_or_per_row(offset, rows) and data.device == seed.device == offset.device)


def _validate_indices(op: str, indices: Optional[Tensor], probs: Tensor) -> None:
    if indices is None:
        return
    check.tensor(op, "indices", indices)
    if indices.dtype not in _INDEX_DTYPES:
        check.fail(op, "indices", f"must be int32 or int64, got {indices.dtype}", TypeError)
    check.require(indices.dim() == 1, op, "indices",
                  lambda: f"must be 1-D (one row of 'probs' per output row), got shape {tuple(indices.shape)}")
    check.same_device(op, "indices", indices, "probs", probs)


def _indices_ok(indices: Optional[Tensor], probs: Tensor) -> bool:
    return indices is None or (indices.dtype in _INDEX_DTYPES and indices.dim() == 1 and indices.device == probs.device)


def _out_rows(indices: Optional[Tensor], probs: Tensor) -> int:
    return probs.shape[0] if indices is None else indices.shape[0]


def _validate_filter_order(op: str, filter_apply_order) -> None:
    if filter_apply_order not in FILTER_ORDERS:
        check.fail(op, "filter_apply_order", f"must be 'top_k_first' or 'joint', got {filter_apply_order!r}")


def _full_top_k_renorm(probs: Tensor, top_k: Optional[Tensor], top_k_val: int = 0) -> None:
    op = "top_k_renorm_probs"
    _validate_probs(op, probs)
    _validate_top_k(op, probs, top_k)


def _full_top_p_renorm(probs: Tensor, top_p: Optional[Tensor], top_p_val: float = 1.0) -> None:
    op = "top_p_renorm_probs"
    _validate_probs(op, probs)
    _validate_top_p(op, probs, top_p)


def _full_sampling(probs: Tensor, top_k: Optional[Tensor], top_p: Optional[Tensor], seed: Tensor, offset: Tensor,
                   top_k_val: int = 0, top_p_val: float = 1.0, filter_apply_order: str = "top_k_first",
                   indices: Optional[Tensor] = None) -> None:
    op = "top_k_top_p_sampling_from_probs"
    _validate_probs(op, probs)
    _validate_top_k(op, probs, top_k)
    _validate_top_p(op, probs, top_p)
    _validate_filter_order(op, filter_apply_order)
    _validate_indices(op, indices, probs)
    _validate_seed_offset(op, seed, offset, "probs", probs, _out_rows(indices, probs))


def _rows_ok(rows: Tensor) -> bool:
    """The cheap test of :func:`_validate_rows` (probabilities or logits)."""
    return rows.dtype in _PROBS_DTYPES and rows.dim() == 2 and rows.stride(1) == 1 and 1 <= rows.shape[1] <= _MAX_VOCAB


def _k_ok(top_k: Optional[Tensor], probs: Tensor) -> bool:
    return _per_row_ok(top_k, _INDEX_DTYPES, probs)


def _p_ok(top_p: Optional[Tensor], probs: Tensor) -> bool:
    return _per_row_ok(top_p, (torch.float32,), probs)


def validate_top_k_renorm(probs: Tensor, top_k: Optional[Tensor], top_k_val: int = 0) -> None:
    try:
        if _rows_ok(probs) and _k_ok(top_k, probs):
            return
    except (AttributeError, IndexError, RuntimeError):
        pass
    _full_top_k_renorm(probs, top_k)


def validate_top_p_renorm(probs: Tensor, top_p: Optional[Tensor], top_p_val: float = 1.0) -> None:
    try:
        if _rows_ok(probs) and _p_ok(top_p, probs):
            return
    except (AttributeError, IndexError, RuntimeError):
        pass
    _full_top_p_renorm(probs, top_p)


def validate_sampling(probs: Tensor, top_k: Optional[Tensor], top_p: Optional[Tensor], seed: Tensor, offset: Tensor,
                      top_k_val: int = 0, top_p_val: float = 1.0, filter_apply_order: str = "top_k_first",
                      indices: Optional[Tensor] = None) -> None:
    try:
        if (_rows_ok(probs) and _k_ok(top_k, probs) and _p_ok(top_p, probs) and filter_apply_order in FILTER_ORDERS
                and _indices_ok(indices, probs) and _seed_offset_ok(seed, offset, probs, _out_rows(indices, probs))):
            return
    except (AttributeError, IndexError, RuntimeError, TypeError):
        pass
    _full_sampling(probs, top_k, top_p, seed, offset, top_k_val, top_p_val, filter_apply_order, indices)


def _fake_top_k_renorm(probs: Tensor, top_k: Optional[Tensor], top_k_val: int = 0) -> Tensor:
    _full_top_k_renorm(probs, top_k)
    return probs.new_empty(probs.shape)


def _fake_top_p_renorm(probs: Tensor, top_p: Optional[Tensor], top_p_val: float = 1.0) -> Tensor:
    _full_top_p_renorm(probs, top_p)
    return probs.new_empty(probs.shape)


def _fake_sampling(probs: Tensor, top_k: Optional[Tensor], top_p: Optional[Tensor], seed: Tensor, offset: Tensor,
                   top_k_val: int = 0, top_p_val: float = 1.0, filter_apply_order: str = "top_k_first",
                   indices: Optional[Tensor] = None) -> Tensor:
    _full_sampling(probs, top_k, top_p, seed, offset, top_k_val, top_p_val, filter_apply_order, indices)
    return probs.new_empty((_out_rows(indices, probs),), dtype=torch.int32)


# ----------------------------------------------------------------------------------------------
# Typed wrappers: what IDEs show, and what docs/ops.md is generated from.


def top_k_renorm_probs(probs: Tensor, top_k: Union[int, Tensor], is_deterministic: bool = True) -> Tensor:
    """``out = where(p >= kth_largest(p, top_k), p, 0) / sum(where(p >= kth_largest(p, top_k), p, 0))`` per row

    Keep the ``top_k`` largest probabilities of each row (every value equal to the k-th largest is
    kept as well), zero the rest, renormalise to sum 1 (FlashInfer's ``top_k_renorm_probs``).
    ``top_k <= 0`` or ``>= V`` keeps the whole row. NaN and negative probabilities count as 0, ``+inf``
    as the largest fp32; a row with nothing positive returns zeros. The kept set is exact: every
    backend keeps the same tokens.

    Args:
        probs: ``(B, V)`` float32, float16 or bfloat16 (read as fp32), last dimension contiguous (rows may
            be strided); need not be normalised.
        top_k: an int for every row, or a ``(B,)`` int32/int64 tensor on the device of ``probs``. The
            op's schema takes the two forms as ``maybe_top_k_arr`` and ``top_k_val``.
        is_deterministic: FlashInfer's keyword; the result is always deterministic.

    Returns:
        ``(B, V)`` in the dtype of ``probs``, contiguous. Not differentiable.
    """
    arr, val = _tensor_or_scalar("top_k_renorm_probs", "top_k", top_k, int, "an int")
    return torch.ops.deepinfer.top_k_renorm_probs.default(probs, arr, val)


def top_p_renorm_probs(probs: Tensor, top_p: Union[float, Tensor], is_deterministic: bool = True) -> Tensor:
    """``out = where(mass(p > p_i) < top_p * sum(p), p, 0) / sum(kept)`` per row

    Nucleus filter (FlashInfer's ``top_p_renorm_probs``): keep the smallest set of largest
    probabilities whose mass reaches ``top_p`` of the row's mass (the token that crosses the
    threshold is kept, ties with it too, and the largest value always), zero the rest, renormalise.
    Masses are compared exactly in 64-bit fixed point (``torch_kernels/families/sampling/reference.py``), so
    every backend keeps the same tokens. ``top_p >= 1`` keeps every token with mass.

    Args:
        probs: ``(B, V)`` float32, float16 or bfloat16 (read as fp32), last dimension contiguous (rows may
            be strided); need not be normalised.
        top_p: a float for every row, or a ``(B,)`` float32 tensor on the device of ``probs``. The op's
            schema takes the two forms as ``maybe_top_p_arr`` and ``top_p_val``.
        is_deterministic: FlashInfer's keyword; the result is always deterministic.

    Returns:
        ``(B, V)`` in the dtype of ``probs``, contiguous. Not differentiable.
    """
    arr, val = _tensor_or_scalar("top_p_renorm_probs", "top_p", top_p, float, "a float")
    return torch.ops.deepinfer.top_p_renorm_probs.default(probs, arr, 1.0 if arr is not None else val)


def top_k_renorm_prob(probs: Tensor, top_k: Union[int, Tensor], is_deterministic: bool = True) -> Tensor:
    """FlashInfer's other name of ``top_k_renorm_probs`` (sglang imports it)."""
    return top_k_renorm_probs(probs, top_k, is_deterministic)


def top_p_renorm_prob(probs: Tensor, top_p: Union[float, Tensor], is_deterministic: bool = True) -> Tensor:
    """FlashInfer's other name of ``top_p_renorm_probs`` (sglang imports it)."""
    return top_p_renorm_probs(probs, top_p, is_deterministic)


def top_k_top_p_sampling_from_probs(probs: Tensor, top_k: Union[int, Tensor], top_p: Union[float, Tensor], seed=None,
                                    offset=None, indices: Optional[Tensor] = None,
                                    filter_apply_order: str = "top_k_first", *, deterministic: bool = True,
                                    generator: Optional[torch.Generator] = None, check_nan: bool = False,
                                    return_valid: bool = False, top_k_max: Optional[int] = None):
    """``ids[b] ~ top_p_renorm(top_k_renorm(probs[b], top_k[b]), top_p[b])``, drawn with Philox(seed, offset, b)

    One token id per row from the row's top-k survivors (ties kept), then nucleus-filtered with ``top_p`` on
    their renormalised mass (FlashInfer's ``filter_apply_order="top_k_first"``); with ``"joint"`` the
    nucleus is measured on the whole row instead (a token is kept iff it passes both filters on the original
    distribution: fewer than ``top_k`` values above it and their mass below ``top_p`` of the row's). A token
    outside the kept set is never returned. The draw is the inverse CDF, in token order, of the kept mass at
    a 31-bit uniform from Philox4x32-10 with counter ``(row, offset, 0)`` and key ``seed``: deterministic
    for a given ``(seed, offset)`` and identical on every device and on the torch and Triton backends; each
    row has its own stream. The FlashInfer backend (served only when selected,
    ``DEEPINFER_OPS_BACKEND=flashinfer``) draws from the same kept set with FlashInfer's own random stream
    and decides the top-p boundary in fp32; its first call says so on stderr. With ``seed`` and ``offset``
    tensors, advance ``offset`` (in place, e.g. ``offset += 1``) between steps: the op reads them on the
    device, so it can be captured in a CUDA graph and replayed. Without them a seed is drawn on the device
    with torch's generator (``torch.manual_seed`` makes it reproducible; a CUDA graph replays a fresh draw).

    Args:
        probs: ``(B, V)`` float32, float16 or bfloat16 (read as fp32), last dimension contiguous (rows may
            be strided); need not be normalised.
        top_k: an int for every row, or a ``(B,)`` int32/int64 tensor; ``<= 0`` or ``>= V`` disables
            top-k for that row. The schema takes the two forms as ``maybe_top_k_arr`` and ``top_k_val``.
        top_p: a float for every row, or a ``(B,)`` float32 tensor; ``>= 1`` disables top-p for that row,
            ``<= 0`` keeps only the largest value (schema: ``maybe_top_p_arr``, ``top_p_val``).
        seed, offset: both ``None``, or each an int or an int64 tensor on the device of ``probs`` of one
            element (shape ``()`` or ``(1,)``) or of one per output row (``(N,)``, FlashInfer 0.7's form):
            per-row values give each row the stream it would have alone (row ``i`` draws as the op on
            that row alone with ``seed[i]``, ``offset[i]``); a one-element one broadcasts. The
            registered op takes them as tensors, always.
        indices: ``None``, or an ``(N,)`` int32/int64 tensor (FlashInfer's ``indices``): output row ``i``
            draws from ``probs[indices[i]]`` with that row's ``top_k``/``top_p`` (rows sharing a
            distribution). Values must lie in ``[0, B)`` (not checked: reading them would sync).
        filter_apply_order: ``"top_k_first"`` (the default) or ``"joint"``, as FlashInfer's.
        deterministic, generator, check_nan: FlashInfer's keywords. Draws here are always deterministic
            (``False`` changes nothing); ``generator`` draws the seed when ``seed`` and ``offset`` are
            ``None``; ``check_nan=True`` raises on a NaN in the input (reading a flag back: a sync).
        return_valid: FlashInfer's: also return ``valid``, ``(N,)`` bool, whether each output row's
            distribution has positive mass (a row without draws 0).
        top_k_max: FlashInfer's: with ``"top_k_first"``, ``top_k_max <= 256`` and ``V >= 65536``, rows
            whose top-k is off or above it sample with ``top_k = top_k_max``; otherwise ignored.

    Returns:
        ``(N,)`` token ids (``N = B`` without ``indices``), int32, or the dtype of ``indices`` as
        FlashInfer's; ``(ids, valid)`` with ``return_valid``. A row with no positive probability returns 0.
    """
    op = "top_k_top_p_sampling_from_probs"
    _checked_nan(op, "probs", probs, check_nan)
    top_k = _top_k_max(top_k, top_k_max, filter_apply_order, probs.shape[-1])
    k_arr, k_val = _tensor_or_scalar(op, "top_k", top_k, int, "an int")
    p_arr, p_val = _tensor_or_scalar(op, "top_p", top_p, float, "a float")
    seed, offset = _seed_offset(op, probs, seed, offset, generator)
    ids = torch.ops.deepinfer.top_k_top_p_sampling_from_probs.default(
        probs, k_arr, p_arr, seed, offset, k_val, 1.0 if p_arr is not None else p_val, filter_apply_order, indices)
    return _flashinfer_ids(ids, probs, indices, return_valid)


def top_p_sampling_from_probs(probs: Tensor, top_p: Union[float, Tensor], seed=None, offset=None,
                              indices: Optional[Tensor] = None, *, deterministic: bool = True,
                              generator: Optional[torch.Generator] = None, check_nan: bool = False,
                              return_valid: bool = False):
    """FlashInfer's ``top_p_sampling_from_probs``: ``top_k_top_p_sampling_from_probs`` with top-k off
    (its arguments, its draw)."""
    return top_k_top_p_sampling_from_probs(probs, 0, top_p, seed, offset, indices, deterministic=deterministic,
                                           generator=generator, check_nan=check_nan, return_valid=return_valid)


def top_k_sampling_from_probs(probs: Tensor, top_k: Union[int, Tensor], seed=None, offset=None,
                              indices: Optional[Tensor] = None, *, deterministic: bool = True,
                              generator: Optional[torch.Generator] = None, check_nan: bool = False,
                              return_valid: bool = False):
    """FlashInfer's ``top_k_sampling_from_probs``: ``top_k_top_p_sampling_from_probs`` with top-p off
    (its arguments, its draw)."""
    return top_k_top_p_sampling_from_probs(probs, top_k, 1.0, seed, offset, indices, deterministic=deterministic,
                                           generator=generator, check_nan=check_nan, return_valid=return_valid)


# ----------------------------------------------------------------------------------------------
# Sample arguments: probabilities in the dtype asked for (float64: float32). Shapes: one token of a one-word vocabulary, a few rows of 1000 (a full top-k,
# a disabled one, the whole row), zero rows, strided rows of an odd vocabulary, ties.


def _probs(rows: int, vocab: int, device, stride=None, scale: float = 3.0, dtype=torch.float32) -> Tensor:
    logits = torch.randn(rows, stride or vocab, device=device) * scale
    return torch.softmax(logits, -1).to(dtype)[:, :vocab]


def _scalar(value: int, device, shape=()) -> Tensor:
    return torch.full(shape, value, dtype=torch.int64, device=device)


def _sample_inputs(device, dtype=torch.float32):
    """(probs, top_k, top_p) per sample shape."""
    dtype = dtype if dtype in _PROBS_DTYPES else torch.float32
    ties = torch.softmax(torch.randint(0, 4, (2, 129), device=device).float(), -1).to(dtype)  # four values a row
    yield (_probs(1, 1, device, dtype=dtype), torch.tensor([1], device=device), torch.tensor([0.5], device=device))
    yield (_probs(3, 1000, device, dtype=dtype), torch.tensor([5, 0, 1000], dtype=torch.int32, device=device),
           torch.tensor([0.9, 0.3, 1.0], device=device))
    yield (_probs(0, 64, device, dtype=dtype), torch.zeros(0, dtype=torch.int64, device=device),
           torch.zeros(0, device=device))
    yield (_probs(4, 301, device, stride=384, dtype=dtype), torch.tensor([-1, 1, 17, 301], device=device),
           torch.tensor([0.5, 0.99, 0.0, 0.75], device=device))
    yield (ties, torch.tensor([3, 40], dtype=torch.int32, device=device), torch.tensor([0.6, 0.95], device=device))


# every other sample takes its parameter as the scalar that serves every row (the schema's ``*_val``)
_SCALAR_K, _SCALAR_P = (5, 0, 1, 17, 40), (0.9, 0.3, 1.0, 0.0, 0.6)


def _samples_top_k_renorm(device, dtype) -> Iterator[tuple]:
    for i, (probs, top_k, _) in enumerate(_sample_inputs(device, dtype)):
        yield (probs, top_k) if i % 2 == 0 else (probs, None, _SCALAR_K[i])


def _samples_top_p_renorm(device, dtype) -> Iterator[tuple]:
    for i, (probs, _, top_p) in enumerate(_sample_inputs(device, dtype)):
        yield (probs, top_p) if i % 2 == 0 else (probs, None, _SCALAR_P[i])


def _samples_sampling(device, dtype) -> Iterator[tuple]:
    for i, (probs, top_k, top_p) in enumerate(_sample_inputs(device, dtype)):
        shape = () if i % 2 else (1,)
        seed, offset = _scalar(1234 + i, device, shape), _scalar(7 * i, device, shape)
        if i % 3 == 0:
            yield probs, top_k, top_p, seed, offset
        elif i % 3 == 1:  # both scalars
            yield probs, None, None, seed, offset, _SCALAR_K[i], _SCALAR_P[i]
        else:  # a per-row top_k with a scalar top_p
            yield probs, top_k, None, seed, offset, 0, _SCALAR_P[i]
    yield from _forms_samples(device, dtype, lambda probs, top_k, top_p, seed, offset, idx: (
        probs, top_k, top_p, seed, offset, 0, 1.0, "joint", idx))


def _forms_samples(device, dtype, build) -> Iterator[tuple]:
    """FlashInfer 0.7's forms: ``indices`` naming rows twice and per-row seeds and offsets, on the rows of
    1000 of ``_sample_inputs``; ``build(probs, top_k, top_p, seed, offset, indices)`` makes the call."""
    probs, top_k, top_p = list(_sample_inputs(device, dtype))[1]
    idx = torch.tensor([2, 0, 2, 1], device=device)
    seeds = torch.tensor([5, -1, 5, 2**40], device=device)
    yield build(probs, top_k, top_p, seeds, _scalar(3, device, (1,)), idx.int())
    yield build(probs, top_k, top_p, seeds[:3], seeds[:3] + 1, None)


def _tokens_args(n: int, device):
    probs = _probs(n, 64, device)
    return probs, torch.full((n,), 8, dtype=torch.int32, device=device), torch.full((n,), 0.8, device=device)


def _tokens_top_k_renorm(n: int, device) -> tuple:
    probs, top_k, _ = _tokens_args(n, device)
    return (probs, top_k), (0, 1)


def _tokens_top_p_renorm(n: int, device) -> tuple:
    probs, _, top_p = _tokens_args(n, device)
    return (probs, top_p), (0, 1)


def _tokens_sampling(n: int, device) -> tuple:
    probs, top_k, top_p = _tokens_args(n, device)
    return (probs, top_k, top_p, _scalar(42, device), _scalar(n, device)), (0, 1, 2)


def compare_samples(got: list, want: list, dtype) -> None:
    """Sampled ids: identical to the reference's (the semantics are exact, see the module docstring)."""
    assert len(got) == len(want) == 1, f"{len(got)} outputs, expected 1"
    (ids,), (ids_ref,) = got, want
    assert ids.dtype == torch.int32 and ids.shape == ids_ref.shape, f"{ids.dtype} {tuple(ids.shape)}"
    if not torch.equal(ids.cpu(), ids_ref.cpu()):
        rows = (ids.cpu() != ids_ref.cpu()).nonzero().flatten().tolist()
        raise AssertionError(f"sampled ids differ from the reference in rows {rows[:10]}: "
                             f"{ids.cpu()[rows[:10]].tolist()} vs {ids_ref.cpu()[rows[:10]].tolist()}")


# ----------------------------------------------------------------------------------------------
# Benchmark cases: batch rows (the token count, capped) x the vocabulary of fp32 probabilities (the
# family's only dtype), top_k 50, top_p 0.9. Rounds of selection over each row: no copy-bandwidth goal.

#: per profile: (vocabulary, batch rows at most); gpu: Llama-3's vocabulary, a decode batch of 64
#: per profile: (default vocabulary, most rows); gpu: Llama-3's vocabulary, batches up to 512
BENCH_SIZES = {"gpu": (128256, 512), "cpu": (1024, 8)}
BENCH_TOP_K, BENCH_TOP_P = 50, 0.9


def _bench_vocab(given: tuple, profile: str) -> tuple:
    """The vocabularies a sampling op runs at: those ``--shapes`` names (``256x32000``), else the default."""
    return given or (BENCH_SIZES[profile][0],)


def _bench_shape(tokens: int, hidden: Optional[int], profile: str):
    vocab, rows_cap = hidden or BENCH_SIZES[profile][0], BENCH_SIZES[profile][1]
    rows = min(tokens, rows_cap)
    return rows, vocab, f"{rows}x{vocab}"


def _bench_inputs(rows: int, vocab: int, device):
    probs = torch.softmax(torch.randn(rows, vocab, device=device, dtype=torch.float32) * 3, -1)
    return (probs, torch.full((rows,), BENCH_TOP_K, dtype=torch.int32, device=device),
            torch.full((rows,), BENCH_TOP_P, device=device))


def _bench_args_top_k_renorm(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    probs, top_k, _ = _bench_inputs(rows, hidden, device)
    return probs, top_k


def _bench_args_top_p_renorm(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    probs, _, top_p = _bench_inputs(rows, hidden, device)
    return probs, top_p


def _bench_args_sampling(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    return _bench_inputs(rows, hidden, device) + (torch.tensor(1234, device=device), torch.tensor(0, device=device))


def _bench_nbytes(reads: int):
    # one read of the probabilities (the renormalisers also write them): a floor
    return lambda args: args[0].numel() * args[0].element_size() * reads


def kept_set(probs: Tensor, top_k, top_p, joint: bool = False) -> Tensor:
    """``(B, V)`` bool: the tokens the reference's top-k then top-p filter keeps (where any correct
    sampler's ids must fall, whatever its random stream); ``top_k``/``top_p`` per-row tensors or scalars."""
    from . import reference

    bits = reference.value_bits(probs)
    q = reference.fixed_point(bits, bits.amax(-1, keepdim=True), reference.fixed_point_bits(probs.shape[1]))
    return reference.kept_mask(bits, q, top_k, top_p, joint=joint)[0]


#: slack on top_p for the kept set of an implementation that decides the top-p boundary in fp32
TOP_P_SLACK = 1e-4


def assert_ids_kept(probs, top_k, top_p, ids, top_p_slack: float = 0.0, joint: bool = False) -> None:
    """Every sampled id lies in the reference's kept set (``top_p`` raised by ``top_p_slack``)."""
    from .reference import per_row

    top_p = per_row(top_p, probs.shape[0], torch.float32, probs.device) + top_p_slack
    inside = kept_set(probs, top_k, top_p, joint).gather(1, ids.long()[:, None]).squeeze(1)
    assert bool(inside.all()), f"ids outside the kept set in rows {(~inside).nonzero().flatten().tolist()[:10]}"


def _check_draw(args: tuple, ids: Tensor) -> None:
    """``top_k_top_p_sampling_from_probs`` from another random stream: ids of int32, one an output row,
    each in the reference's kept set (its top-p boundary decided in fp32: ``TOP_P_SLACK``)."""
    from .reference import gather_rows

    probs, k_arr, p_arr, _, _, k_val, p_val, order, indices = (tuple(args) + (0, 1.0, "top_k_first", None)[len(args) - 5:])
    rows, k_arr, p_arr = gather_rows(indices, probs, k_arr, p_arr)
    assert ids.shape == rows.shape[:1], f"ids of shape {tuple(ids.shape)} for {rows.shape[0]} rows"
    assert_ids_kept(rows, k_val if k_arr is None else k_arr, p_val if p_arr is None else p_arr, ids, TOP_P_SLACK,
                    joint=order == "joint")


def _kept_set_compare(kept_set_of):
    """A benchmark comparison: the reference's ids, or, from another random stream, ids all in the kept
    set ``kept_set_of(args)`` (a ``(batch, vocab)`` bool mask)."""
    def compare(got: list, want: list, dtype, args: tuple) -> Optional[str]:
        try:
            compare_samples(got, want, dtype)
            return None
        except AssertionError:
            inside = kept_set_of(args).gather(1, got[0].long()[:, None]).float().mean().item()
            if inside < 1.0:
                raise AssertionError(f"{inside:.1%} of the ids in the kept set") from None
            return "another random stream; every id in the kept set"
    return compare


def _flashinfer_sampling(make):
    """A benchmark peer from ``flashinfer.sampling``: ``make(fs, args)`` gives the Peer; a string saying
    why when FlashInfer does not import (reported in the results)."""
    def peer(args: tuple):
        try:
            import flashinfer.sampling as fs
        except Exception as e:  # noqa: BLE001
            return f"FlashInfer not importable: {type(e).__name__}: {e}"[:200]
        return make(fs, args)
    return peer


def flashinfer_peers(op: str, args: tuple) -> Dict[str, Union[Peer, str]]:
    """FlashInfer's sampling peers of a call: ``{name: Peer, or a string saying why there is none}``.
    Only its sampling JIT module is used: with per-row ``top_k`` tensors its default ``top_k_first``
    order is ``top_k_renorm_probs`` then ``top_p_sampling_from_probs``, both in that module, and is our
    semantics (top-p over the renormalised top-k survivors); ``joint`` (one kernel) is another filter,
    timed for reference. Seed and offset are passed as ints where the API takes them (graph capture
    then reads no generator state)."""
    try:
        import inspect

        import flashinfer.sampling as fs
    except Exception as e:  # noqa: BLE001
        return {"flashinfer": f"not importable: {type(e).__name__}: {e}"[:200]}
    if op == "top_k_renorm_probs":
        return {"flashinfer": Peer("flashinfer.sampling.top_k_renorm_probs", fs.top_k_renorm_probs)}
    if op == "top_p_renorm_probs":
        return {"flashinfer": Peer("flashinfer.sampling.top_p_renorm_probs", fs.top_p_renorm_probs)}
    probs, k, p, seed, offset = args
    rng = {}
    if "seed" in inspect.signature(fs.top_p_sampling_from_probs).parameters:
        rng = dict(seed=int(seed), offset=int(offset))
    if int(k.max()) <= 0:  # top-k off: FlashInfer's top-p sampling alone
        return {"flashinfer": Peer("flashinfer.sampling.top_p_sampling_from_probs",
                                   lambda probs, k, p, *_: fs.top_p_sampling_from_probs(probs, p, **rng))}
    return {"flashinfer": Peer("flashinfer.sampling.top_k_top_p_sampling_from_probs (top_k_first)",
                               lambda probs, k, p, *_: fs.top_k_top_p_sampling_from_probs(
                                   probs, k, p, filter_apply_order="top_k_first", **rng)),
            "flashinfer joint (other filter)": Peer(
                "flashinfer.sampling.top_k_top_p_sampling_from_probs (joint)",
                lambda probs, k, p, *_: fs.top_k_top_p_sampling_from_probs(probs, k, p, filter_apply_order="joint", **rng))}


def _flashinfer(op: str):
    return _flashinfer_sampling(lambda fs, args: flashinfer_peers(op, args)["flashinfer"])


def _bench(op: str, args, reads: int, compare=None) -> BenchCase:
    return BenchCase(_bench_shape, args, _bench_nbytes(reads), own_hidden=_bench_vocab, flashinfer=_flashinfer(op),
                     compare=compare, axis="rows")


# ----------------------------------------------------------------------------------------------
# The logits ops, FlashInfer's ``softmax`` and ``top_k_mask_logits``. Each schema takes its per-row
# parameter as FlashInfer's own ops do, an optional tensor beside the scalar that serves where it is
# None; the wrapper takes either (``temperature=0.7`` or a ``(B,)`` tensor), so a scalar never
# becomes a tensor on the host.

_LOGIT_DTYPES = _PROBS_DTYPES
_TEMPERATURE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _temperature_ok(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _validate_temperature(op: str, logits: Tensor, maybe_temperature_arr: Optional[Tensor], temperature_val) -> None:
    if maybe_temperature_arr is not None:
        _validate_per_row(op, "maybe_temperature_arr", maybe_temperature_arr, _TEMPERATURE_DTYPES,
                          "float16, bfloat16, float32 or float64", logits, "logits")
    if not _temperature_ok(temperature_val):
        check.fail(op, "temperature_val", f"must be a finite float >= 0, got {temperature_val!r}")


def _full_softmax(logits: Tensor, maybe_temperature_arr: Optional[Tensor] = None, temperature_val: float = 1.0) -> None:
    op = "softmax"
    _validate_logits(op, logits)
    _validate_temperature(op, logits, maybe_temperature_arr, temperature_val)


def validate_softmax(logits: Tensor, maybe_temperature_arr: Optional[Tensor] = None, temperature_val: float = 1.0) -> None:
    try:
        if (_rows_ok(logits) and _temperature_ok(temperature_val)
                and _per_row_ok(maybe_temperature_arr, _TEMPERATURE_DTYPES, logits)):
            return
    except (AttributeError, IndexError, RuntimeError):
        pass
    _full_softmax(logits, maybe_temperature_arr, temperature_val)


def _fake_softmax(logits: Tensor, maybe_temperature_arr: Optional[Tensor] = None, temperature_val: float = 1.0) -> Tensor:
    _full_softmax(logits, maybe_temperature_arr, temperature_val)
    return logits.new_empty(logits.shape, dtype=torch.float32)


def _full_top_k_mask(logits: Tensor, maybe_top_k_arr: Optional[Tensor] = None, top_k_val: int = 0) -> None:
    op = "top_k_mask_logits"
    _validate_logits(op, logits)
    if maybe_top_k_arr is not None:
        _validate_per_row(op, "maybe_top_k_arr", maybe_top_k_arr, _INDEX_DTYPES, "int32 or int64", logits, "logits")


def validate_top_k_mask(logits: Tensor, maybe_top_k_arr: Optional[Tensor] = None, top_k_val: int = 0) -> None:
    try:
        if _rows_ok(logits) and _per_row_ok(maybe_top_k_arr, _INDEX_DTYPES, logits):
            return
    except (AttributeError, IndexError, RuntimeError):
        pass
    _full_top_k_mask(logits, maybe_top_k_arr, top_k_val)


def _fake_top_k_mask(logits: Tensor, maybe_top_k_arr: Optional[Tensor] = None, top_k_val: int = 0) -> Tensor:
    _full_top_k_mask(logits, maybe_top_k_arr, top_k_val)
    return logits.new_empty(logits.shape)


def _tensor_or_scalar(op: str, arg: str, value, kind: type, what: str):
    """``(tensor, scalar)`` for a schema's ``maybe_<arg>_arr`` and ``<arg>_val``: FlashInfer's split."""
    if isinstance(value, Tensor):
        return value, kind(0)
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        check.fail(op, arg, f"must be {what} or a (batch,) tensor, got {type(value).__name__}", TypeError)
    return None, kind(value)


def softmax(logits: Tensor, temperature: Union[float, Tensor, None] = 1.0, enable_pdl: Optional[bool] = None) -> Tensor:
    """``out[b] = exp(x[b] - max(x[b])) / sum(exp(x[b] - max(x[b])))``, ``x[b] = logits[b] * (1 / t[b])``

    FlashInfer's ``flashinfer.sampling.softmax``: the probabilities of each row at its temperature,
    computed in fp32 (``1 / t`` rounded to fp32, and 0 where ``t == 0``, as FlashInfer: such a row is
    uniform over its finite logits). Numerically stable (the row's maximum is subtracted). A ``-inf``
    logit gives probability 0 at any temperature; a row whose logits are all ``-inf`` returns NaN, as
    FlashInfer's kernel and ``torch.softmax`` do; a NaN or ``+inf`` logit makes its row NaN.

    Args:
        logits: ``(B, V)`` float32, float16 or bfloat16, last dimension contiguous (rows may be strided).
        temperature: a float ``>= 0`` for every row (``None``: 1), or a ``(B,)`` float16/bfloat16/
            float32/float64 tensor on the device of ``logits``, one temperature a row (read as fp32).
            The op's schema takes the two forms as ``maybe_temperature_arr`` and ``temperature_val``.
        enable_pdl: FlashInfer's keyword; changes nothing here (kernels choose their own launch).

    Returns:
        ``(B, V)`` float32 probabilities, contiguous. Not differentiable.
    """
    arr, val = _tensor_or_scalar("softmax", "temperature", 1.0 if temperature is None else temperature, float,
                                 "a float")
    return torch.ops.deepinfer.softmax.default(logits, arr, val if arr is None else 1.0)


def top_k_mask_logits(logits: Tensor, top_k: Union[int, Tensor]) -> Tensor:
    """``out = where(logits >= kth_largest(logits, top_k), logits, -inf)`` per row

    FlashInfer's ``flashinfer.sampling.top_k_mask_logits``: keep each row's ``top_k`` largest logits
    and set the rest to ``-inf``. Ties are kept, as FlashInfer's pivot keeps them: every logit equal
    to the k-th largest stays, so a row may keep more than ``top_k``. ``top_k <= 0`` or ``>= V``
    keeps the whole row (the output equals the input). NaN ranks as ``-inf``, ``-0.0`` ties with
    ``0.0``; a kept value is copied unchanged. The result is exact (a comparison of the values): every backend returns the same.

    Args:
        logits: ``(B, V)`` float32, float16 or bfloat16, last dimension contiguous (rows may be strided).
        top_k: an int for every row, or a ``(B,)`` int32/int64 tensor on the device of ``logits``. The
            op's schema takes the two forms as ``maybe_top_k_arr`` and ``top_k_val``.

    Returns:
        ``(B, V)`` in the dtype of ``logits``, contiguous. Not differentiable.
    """
    arr, val = _tensor_or_scalar("top_k_mask_logits", "top_k", top_k, int, "an int")
    return torch.ops.deepinfer.top_k_mask_logits.default(logits, arr, val)


def _logit_dtype(dtype) -> torch.dtype:
    return dtype if dtype in _LOGIT_DTYPES else torch.float32


def _logits(rows: int, vocab: int, device, dtype, stride=None, scale: float = 3.0) -> Tensor:
    return (torch.randn(rows, stride or vocab, device=device) * scale).to(_logit_dtype(dtype))[:, :vocab]


def _logit_inputs(device, dtype):
    """(logits, per-row tensor maker or None, scalar): one logit, one row of Llama 2's vocabulary, rows of
    1000 with -inf entries, zero rows, strided rows of an odd vocabulary, ties (bf16 rounds randn * 3
    to ~300 distinct values)."""
    masked = _logits(3, 1000, device, dtype)
    masked[0, ::3] = float("-inf")
    masked[2, :999] = float("-inf")  # one finite logit
    yield _logits(1, 1, device, dtype), None, 1
    yield _logits(1, 32000, device, dtype), None, 50
    yield masked, "per-row", 5
    yield _logits(0, 64, device, dtype), "per-row", 3
    yield _logits(4, 301, device, dtype, stride=384), "per-row", 17
    yield _logits(2, 129, device, dtype, scale=1.0).round(), None, 3  # ~7 distinct values a row


def _samples_softmax(device, dtype) -> Iterator[tuple]:
    for i, (logits, per_row, _) in enumerate(_logit_inputs(device, dtype)):
        if per_row:
            t = torch.rand(logits.shape[0], device=device) * 2 + 0.1
            t[:1] = 0.0 if i == 4 else t[:1]  # temperature 0: uniform over the finite logits
            yield logits, t.to((torch.float32, torch.bfloat16, torch.float64)[i % 3]), 1.0
        else:
            yield logits, None, (1.0, 0.7, 1.3)[i % 3]


def _samples_top_k_mask(device, dtype) -> Iterator[tuple]:
    for i, (logits, per_row, k) in enumerate(_logit_inputs(device, dtype)):
        B, V = logits.shape
        if per_row:
            ks = torch.tensor([k, 0, V, -1, 1][:B] if B else [], device=device)
            yield logits, ks.to((torch.int32, torch.int64)[i % 2]), 0
        else:
            yield logits, None, k


def _tokens_softmax(n: int, device) -> tuple:
    return (torch.randn(n, 64, device=device) * 3, torch.full((n,), 0.8, device=device), 1.0), (0, 1)


def _tokens_top_k_mask(n: int, device) -> tuple:
    return (torch.randn(n, 64, device=device) * 3, torch.full((n,), 8, dtype=torch.int32, device=device), 0), (0, 1)


#: the benchmark's temperature (a scalar: the common call; FlashInfer's kernel reads either form alike)
BENCH_TEMPERATURE = 0.7


def _bench_args_softmax(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    logits = torch.randn(rows, hidden, device=device) * 3
    return logits.to(_logit_dtype(dtype)), None, BENCH_TEMPERATURE


def _bench_args_top_k_mask(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    logits = torch.randn(rows, hidden, device=device) * 3
    return logits.to(_logit_dtype(dtype)), None, BENCH_TOP_K


def _bench_nbytes_softmax(args: tuple) -> int:
    return args[0].numel() * (args[0].element_size() + 4)  # read the logits, write fp32 probabilities


def _bench_nbytes_top_k_mask(args: tuple) -> int:
    return 2 * args[0].numel() * args[0].element_size()  # read the logits, write them masked


def _flashinfer_logits(op: str):
    def make(fs, args: tuple) -> Peer:
        if op == "softmax":
            return Peer("flashinfer.sampling.softmax",
                        lambda logits, arr, val: fs.softmax(logits, arr if arr is not None else val))
        return Peer("flashinfer.sampling.top_k_mask_logits",
                    lambda logits, arr, val: fs.top_k_mask_logits(logits, arr if arr is not None else val))
    return _flashinfer_sampling(make)


# ----------------------------------------------------------------------------------------------
# min-p sampling (FlashInfer's ``min_p_sampling_from_probs``): the family's exact masses and Philox
# stream; ``min_p`` a scalar or a per-row tensor as the logits ops take theirs.


def _full_min_p(probs: Tensor, maybe_min_p_arr: Optional[Tensor], min_p_val: float, seed: Tensor, offset: Tensor,
                indices: Optional[Tensor] = None) -> None:
    op = "min_p_sampling_from_probs"
    _validate_probs(op, probs)
    if maybe_min_p_arr is not None:
        _validate_per_row(op, "maybe_min_p_arr", maybe_min_p_arr, (torch.float32,), "float32", probs)
    _validate_indices(op, indices, probs)
    _validate_seed_offset(op, seed, offset, "probs", probs, _out_rows(indices, probs))


def validate_min_p(probs: Tensor, maybe_min_p_arr: Optional[Tensor], min_p_val: float, seed: Tensor,
                   offset: Tensor, indices: Optional[Tensor] = None) -> None:
    try:
        if (_rows_ok(probs) and _indices_ok(indices, probs)
                and _seed_offset_ok(seed, offset, probs, _out_rows(indices, probs))
                and _per_row_ok(maybe_min_p_arr, (torch.float32,), probs)):
            return
    except (AttributeError, IndexError, RuntimeError):
        pass
    _full_min_p(probs, maybe_min_p_arr, min_p_val, seed, offset, indices)


def _fake_min_p(probs: Tensor, maybe_min_p_arr: Optional[Tensor], min_p_val: float, seed: Tensor, offset: Tensor,
                indices: Optional[Tensor] = None) -> Tensor:
    _full_min_p(probs, maybe_min_p_arr, min_p_val, seed, offset, indices)
    return probs.new_empty((_out_rows(indices, probs),), dtype=torch.int32)


def _seed_offset(op: str, probs: Tensor, seed, offset, generator: Optional[torch.Generator] = None):
    """One-element int64 tensors; both ``None``: a seed drawn by ``generator``, else torch's generator of
    the device."""
    if seed is None and offset is None:
        # a torch random op: it advances the device's generator and replays afresh in a CUDA graph
        seed = torch.randint(-2**63, 2**63 - 1, (), dtype=torch.int64, device=probs.device, generator=generator)
        return seed, torch.zeros((), dtype=torch.int64, device=probs.device)
    out = []
    for arg, value in (("seed", seed), ("offset", offset)):
        if value is None:
            check.fail(op, arg, "must be given with the other of 'seed' and 'offset', or both left None", TypeError)
        if not isinstance(value, Tensor):
            if isinstance(value, bool) or not isinstance(value, int):
                check.fail(op, arg, f"must be an int or an int64 tensor, got {type(value).__name__}", TypeError)
            value = torch.full((), value, dtype=torch.int64, device=probs.device)
        out.append(value)
    return tuple(out)


# FlashInfer's keyword arguments, which every sampling wrapper takes as its FlashInfer namesake does:
# ``deterministic`` (our draws always are: False changes nothing), ``generator`` (the seed's when ``seed``
# and ``offset`` are None), ``check_nan`` (raises on a NaN: a device sync, asked for), ``return_valid``.
def _checked_nan(op: str, arg: str, data: Tensor, check_nan: bool) -> None:
    if check_nan and bool(torch.isnan(data).any()):  # opt-in: reads a flag back from the device
        check.fail(op, arg, "contains NaN (check_nan=True)")


def _flashinfer_ids(ids: Tensor, probs: Tensor, indices: Optional[Tensor], return_valid: bool):
    """FlashInfer's outputs: ids in the dtype of ``indices`` where given, and with ``return_valid``
    ``(ids, valid)``, ``valid[i]`` whether output row ``i``'s distribution has mass (else it drew 0)."""
    if indices is not None:
        ids = ids.to(indices.dtype)
    if not return_valid:
        return ids
    rows = probs if indices is None else probs.index_select(0, indices.long())
    return ids, rows.amax(-1) > 0 if rows.shape[-1] else torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)


def _top_k_max(top_k, top_k_max: Optional[int], filter_apply_order: str, vocab: int):
    """FlashInfer's ``top_k_max``: with top-k first, ``top_k_max <= 256`` and a vocabulary of 65536 or
    more, rows whose top-k is off or above it sample with ``top_k = top_k_max``; otherwise ignored."""
    if top_k_max is None or filter_apply_order != "top_k_first" or top_k_max > 256 or vocab < 65536:
        return top_k
    if isinstance(top_k, Tensor):
        return torch.where((top_k <= 0) | (top_k > top_k_max), top_k_max, top_k).to(top_k.dtype)
    return top_k_max if top_k <= 0 or top_k > top_k_max else top_k


def min_p_sampling_from_probs(probs: Tensor, min_p: Union[float, Tensor], seed=None, offset=None,
                              indices: Optional[Tensor] = None, *, deterministic: bool = True,
                              generator: Optional[torch.Generator] = None, check_nan: bool = False,
                              return_valid: bool = False):
    """``ids[b] ~ where(p >= min_p[b] * max(p[b]), p, 0)`` renormalised, drawn with Philox(seed, offset, b)

    FlashInfer's ``min_p_sampling_from_probs``: one token id per row from the tokens whose probability
    is at least ``min_p`` times the row's largest (the pivot ``fp32(min_p * max)``, as FlashInfer's
    kernel; ``min_p <= 0`` keeps every token, ``min_p >= 1`` or NaN the largest value and its ties). A
    token outside the kept set is never returned. The draw is the family's: the kept masses in 64-bit
    fixed point, the inverse CDF in token order at a 31-bit uniform from Philox4x32-10 with counter
    ``(row, offset, 0)`` and key ``seed`` (``top_k_top_p_sampling_from_probs``), identical on every
    device and backend. Without ``seed`` and ``offset`` a seed is drawn on the device with torch's
    generator (``torch.manual_seed`` makes it reproducible; a CUDA graph replays a fresh draw).

    Args:
        probs: ``(B, V)`` float32, float16 or bfloat16 (read as fp32), last dimension contiguous (rows may
            be strided); need not be normalised.
            NaN and negative values count as 0, ``+inf`` as the largest fp32.
        min_p: a float for every row, or a ``(B,)`` float32 tensor on the device of ``probs``. The op's
            schema takes the two forms as ``maybe_min_p_arr`` and ``min_p_val``.
        seed, offset: both ``None``, or each an int or an int64 tensor on the device of ``probs`` of one
            element or one per output row, as ``top_k_top_p_sampling_from_probs``'s (read on the device:
            advance ``offset`` in place between steps of a CUDA graph). The registered op takes them as
            tensors, always.
        indices: ``None``, or ``(N,)`` int32/int64: output row ``i`` draws from ``probs[indices[i]]``
            with that row's ``min_p``, as ``top_k_top_p_sampling_from_probs``'s.
        deterministic, generator, check_nan: FlashInfer's keywords, as ``top_k_top_p_sampling_from_probs``'s.
        return_valid: FlashInfer's: also return ``valid``, ``(N,)`` bool, as ``top_k_top_p_sampling_from_probs``'s.

    Returns:
        ``(N,)`` token ids (``N = B`` without ``indices``), int32 or the dtype of ``indices``;
        ``(ids, valid)`` with ``return_valid``. A row with no positive probability returns 0. Not
        differentiable.
    """
    op = "min_p_sampling_from_probs"
    _checked_nan(op, "probs", probs, check_nan)
    arr, val = _tensor_or_scalar(op, "min_p", min_p, float, "a float")
    seed, offset = _seed_offset(op, probs, seed, offset, generator)
    ids = torch.ops.deepinfer.min_p_sampling_from_probs.default(probs, arr, val, seed, offset, indices)
    return _flashinfer_ids(ids, probs, indices, return_valid)


def _samples_min_p(device, dtype) -> Iterator[tuple]:
    for i, (probs, _, top_p) in enumerate(_sample_inputs(device, dtype)):
        shape = () if i % 2 else (1,)
        seed, offset = _scalar(99 + i, device, shape), _scalar(3 * i, device, shape)
        if i % 2:
            yield probs, (1 - top_p) * 0.5, 0.0, seed, offset  # per-row: 0.05 to 0.5, and 0
        else:
            yield probs, None, (0.1, 0.0, 1.0)[i // 2 % 3], seed, offset
    yield from _forms_samples(device, dtype, lambda probs, top_k, top_p, seed, offset, idx: (
        probs, (1 - top_p) * 0.5, 0.0, seed, offset, idx))


def _tokens_min_p(n: int, device) -> tuple:
    probs, _, _ = _tokens_args(n, device)
    return (probs, torch.full((n,), 0.1, device=device), 0.0, _scalar(42, device), _scalar(n, device)), (0, 1)


BENCH_MIN_P = 0.1


def _bench_args_min_p(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    probs, _, _ = _bench_inputs(rows, hidden, device)
    return probs, None, BENCH_MIN_P, torch.tensor(1234, device=device), torch.tensor(0, device=device)


def min_p_kept_set(probs: Tensor, maybe_min_p_arr: Optional[Tensor], min_p_val: float) -> Tensor:
    """``(B, V)`` bool: the tokens the reference's min-p filter keeps."""
    from . import reference

    bits = reference.value_bits(probs)
    return bits >= reference.min_p_threshold(bits, maybe_min_p_arr, min_p_val)


def _flashinfer_min_p(fs, args: tuple) -> Peer:
    seed, offset = int(args[3]), int(args[4])  # ints: graph capture reads no generator state
    return Peer("flashinfer.sampling.min_p_sampling_from_probs",
                lambda probs, arr, val, *_: fs.min_p_sampling_from_probs(
                    probs, arr if arr is not None else val, deterministic=True, seed=seed, offset=offset))


_NO_GRAD = "top-k/top-p filtering and sampling are not differentiable (data-dependent thresholds, integer ids)"

OPS = (
    OpDef("top_k_renorm_probs(Tensor probs, Tensor? maybe_top_k_arr, int top_k_val=0) -> Tensor",
          validate_top_k_renorm, _fake_top_k_renorm, top_k_renorm_probs, _samples_top_k_renorm, _tokens_top_k_renorm,
          no_grad_reason=_NO_GRAD, bench=_bench("top_k_renorm_probs", _bench_args_top_k_renorm, 2),
          aliases=(top_k_renorm_prob,)),
    OpDef("top_p_renorm_probs(Tensor probs, Tensor? maybe_top_p_arr, float top_p_val=1.0) -> Tensor",
          validate_top_p_renorm, _fake_top_p_renorm, top_p_renorm_probs, _samples_top_p_renorm, _tokens_top_p_renorm,
          no_grad_reason=_NO_GRAD, bench=_bench("top_p_renorm_probs", _bench_args_top_p_renorm, 2),
          aliases=(top_p_renorm_prob,)),
    OpDef("top_k_top_p_sampling_from_probs(Tensor probs, Tensor? maybe_top_k_arr, Tensor? maybe_top_p_arr, Tensor seed, "
          "Tensor offset, int top_k_val=0, float top_p_val=1.0, str filter_apply_order=\"top_k_first\", "
          "Tensor? indices=None) -> Tensor",
          validate_sampling, _fake_sampling, top_k_top_p_sampling_from_probs, _samples_sampling, _tokens_sampling,
          no_grad_reason=_NO_GRAD, compare=compare_samples, check_draw=_check_draw,
          bench=_bench("top_k_top_p_sampling_from_probs", _bench_args_sampling, 1, _kept_set_compare(lambda args: kept_set(*args[:3]))),
          aliases=(top_p_sampling_from_probs, top_k_sampling_from_probs)),
    OpDef("softmax(Tensor logits, Tensor? maybe_temperature_arr=None, float temperature_val=1.0) -> Tensor",
          validate_softmax, _fake_softmax, softmax, _samples_softmax, _tokens_softmax,
          no_grad_reason="it is an inference kernel",
          bench=BenchCase(_bench_shape, _bench_args_softmax, _bench_nbytes_softmax, own_hidden=_bench_vocab, memory_bound=True,
                          flashinfer=_flashinfer_logits("softmax"), axis="rows")),
    OpDef("top_k_mask_logits(Tensor logits, Tensor? maybe_top_k_arr=None, int top_k_val=0) -> Tensor",
          validate_top_k_mask, _fake_top_k_mask, top_k_mask_logits, _samples_top_k_mask, _tokens_top_k_mask,
          no_grad_reason=_NO_GRAD,
          bench=BenchCase(_bench_shape, _bench_args_top_k_mask, _bench_nbytes_top_k_mask, own_hidden=_bench_vocab,
                          flashinfer=_flashinfer_logits("top_k_mask_logits"), axis="rows")),
    OpDef("min_p_sampling_from_probs(Tensor probs, Tensor? maybe_min_p_arr, float min_p_val, Tensor seed, Tensor offset, "
          "Tensor? indices=None) -> Tensor",
          validate_min_p, _fake_min_p, min_p_sampling_from_probs, _samples_min_p, _tokens_min_p,
          no_grad_reason=_NO_GRAD, compare=compare_samples,
          bench=BenchCase(_bench_shape, _bench_args_min_p, _bench_nbytes(1), own_hidden=_bench_vocab,
                          flashinfer=_flashinfer_sampling(_flashinfer_min_p),
                          compare=_kept_set_compare(lambda args: min_p_kept_set(*args[:3])), axis="rows")),
)


# ----------------------------------------------------------------------------------------------
# Chain speculative sampling (FlashInfer's ``chain_speculative_sampling``): accept or reject each draft
# token against the target's probability, the residual or bonus token drawn with the family's
# fixed-point masses on a Philox stream of its own (``reference.speculative_words``).

SPEC = "chain_speculative_sampling"


def _validate_spec_probs(op: str, arg: str, t: Tensor, layout: str) -> None:
    check.tensor(op, arg, t)
    if t.dtype != torch.float32:
        check.fail(op, arg, f"must be float32 (cast with .float()), got {t.dtype}", TypeError)
    if t.dim() != 3:
        check.fail(op, arg, f"must be 3-D {layout}, got shape {tuple(t.shape)}")
    check.last_dim_contiguous(op, arg, t)
    check.require(t.shape[2] >= 1, op, arg, "must have a vocabulary (dimension 2) of at least 1")
    check.require(t.shape[2] <= _MAX_VOCAB, op, arg,
                  lambda: f"must have a vocabulary of at most {_MAX_VOCAB}, got {t.shape[2]}")


def _full_spec(draft_probs: Tensor, draft_token_ids: Tensor, target_probs: Tensor, seed: Tensor, offset: Tensor) -> None:
    op = SPEC
    _validate_spec_probs(op, "draft_probs", draft_probs, "(batch, num_speculate_tokens, vocab)")
    B, n, V = draft_probs.shape
    check.tensor(op, "draft_token_ids", draft_token_ids)
    if draft_token_ids.dtype not in _INDEX_DTYPES:
        check.fail(op, "draft_token_ids", f"must be int32 or int64, got {draft_token_ids.dtype}", TypeError)
    ids_shape = lambda: (f"must have shape ({B}, {n}) (batch, num_speculate_tokens) as 'draft_probs', "  # noqa: E731
                         f"got {tuple(draft_token_ids.shape)}")
    check.require(draft_token_ids.dim() == 2, op, "draft_token_ids", ids_shape)
    check.require(draft_token_ids.shape[0] == B, op, "draft_token_ids", ids_shape)
    check.require(draft_token_ids.shape[1] == n, op, "draft_token_ids", ids_shape)
    check.same_device(op, "draft_token_ids", draft_token_ids, "draft_probs", draft_probs)
    _validate_spec_probs(op, "target_probs", target_probs, "(batch, num_speculate_tokens + 1, vocab)")
    t_shape = lambda: (f"must have shape ({B}, {n + 1}, {V}), one more position than 'draft_probs' "  # noqa: E731
                       f"{tuple(draft_probs.shape)}, got {tuple(target_probs.shape)}")
    check.require(target_probs.shape[0] == B, op, "target_probs", t_shape)
    check.require(target_probs.shape[1] == n + 1, op, "target_probs", t_shape)
    check.require(target_probs.shape[2] == V, op, "target_probs", t_shape)
    check.same_device(op, "target_probs", target_probs, "draft_probs", draft_probs)
    _validate_seed_offset(op, seed, offset, "draft_probs", draft_probs)


def _spec_probs_ok(t: Tensor) -> bool:
    return t.dtype == torch.float32 and t.dim() == 3 and t.stride(2) == 1 and 1 <= t.shape[2] <= _MAX_VOCAB


def validate_chain_speculative(draft_probs: Tensor, draft_token_ids: Tensor, target_probs: Tensor, seed: Tensor,
                               offset: Tensor) -> None:
    try:
        B, n, V = draft_probs.shape
        if (_spec_probs_ok(draft_probs) and _spec_probs_ok(target_probs) and target_probs.shape == (B, n + 1, V)
                and draft_token_ids.dtype in _INDEX_DTYPES and draft_token_ids.shape == (B, n)
                and _seed_offset_ok(seed, offset, draft_probs)
                and draft_probs.device == draft_token_ids.device == target_probs.device):
            return
    except (AttributeError, IndexError, RuntimeError, ValueError, TypeError):
        pass
    _full_spec(draft_probs, draft_token_ids, target_probs, seed, offset)


def _fake_chain_speculative(draft_probs: Tensor, draft_token_ids: Tensor, target_probs: Tensor, seed: Tensor,
                            offset: Tensor):
    _full_spec(draft_probs, draft_token_ids, target_probs, seed, offset)
    B, n = draft_probs.shape[0], draft_probs.shape[1]
    return (draft_probs.new_empty((B, n + 1), dtype=torch.int32), draft_probs.new_empty((B,), dtype=torch.int32),
            draft_probs.new_empty((B,), dtype=torch.int32))


def _validate_spec_count(arg: str, t, draft_probs: Tensor) -> None:
    op = SPEC
    check.tensor(op, arg, t)
    if t.dtype not in _INDEX_DTYPES:
        check.fail(op, arg, f"must be int32 or int64, got {t.dtype}", TypeError)
    check.require(t.dim() == 1 and t.shape[0] == draft_probs.shape[0], op, arg,
                  lambda: f"must have shape ({draft_probs.shape[0]},), one count per row of 'draft_probs', "
                          f"got {tuple(t.shape)}")
    check.same_device(op, arg, t, "draft_probs", draft_probs)


def chain_speculative_sampling(draft_probs: Tensor, draft_token_ids: Tensor, target_probs: Tensor,
                               maybe_output_accepted_token_num: Optional[Tensor] = None,
                               maybe_output_emitted_draft_token_num: Optional[Tensor] = None,
                               deterministic: bool = True, generator: Optional[torch.Generator] = None,
                               seed=None, offset=None) -> tuple[Tensor, Tensor, Tensor]:
    """``out[b] = (d_0 .. d_{j-1}, t_j, -1 ..)``: ``d_i`` kept while ``u_i * q_i(d_i) < p_i(d_i)``, ``t_j ~ max(p_j - q_j, 0)``

    FlashInfer's ``chain_speculative_sampling`` (speculative decoding, Leviathan et al. 2023; Chen et
    al. 2023): per row, the draft tokens ``d_i = draft_token_ids[b, i]`` are tested in order; ``d_i``
    is accepted iff ``u_i * q_i(d_i) < p_i(d_i)`` (``q = draft_probs``, ``p = target_probs``,
    ``u_i`` uniform: accepted with probability ``min(1, p/q)``). At the first rejection, at ``j``, the
    token is drawn from the residual ``max(p_j - q_j, 0)`` renormalised, and the positions after it
    are ``-1``; if all ``n`` are accepted, the bonus token at ``n`` is drawn from ``p_n``. Each
    emitted token is then distributed as the target's ``p`` at its position, whatever the draft.
    A draft id outside ``[0, V)`` counts as probability 0 (rejected). ``p`` and ``q`` are read as
    fp32 with NaN, negatives and subnormals as 0 and ``+inf`` as the largest fp32; the residual is the
    fp32 difference (subnormal results 0). A residual with no mass (possible only when the rows do not
    sum alike) is replaced by ``p_j``; a row with no mass there returns token 0.

    Randomness, identical on every backend and device: position ``i`` of row ``b`` has Philox4x32-10
    with counter ``(b, offset_lo, offset_hi, 2^31 + i)`` and key ``(seed_lo, seed_hi)`` (the family's
    other ops use last counter word 0, so their draws never share a uniform with this one). Word 0's
    top 24 bits give ``u_i = w0 / 2^32`` rounded down to 24 bits, and the acceptance test is exact
    (fp64 of 24-bit products); word 1's top 31 bits give the residual or bonus draw at the position
    where it happens: the family's inverse CDF over 64-bit fixed-point masses, in token order, at the
    scale of ``sampling_from_probs`` (1.0's for a row whose values are below 2: a residual below
    ``2^-43`` at ``V = 128256`` has no mass). Without ``seed`` and ``offset`` a seed is drawn on the
    device with torch's generator (or ``generator``); a CUDA graph replays a fresh draw.

    FlashInfer's arguments: this wrapper takes FlashInfer's signature, in its order. The registered op
    is functional (``draft_probs, draft_token_ids, target_probs, seed, offset``, three new tensors
    returned); given ``maybe_output_accepted_token_num`` or ``maybe_output_emitted_draft_token_num``,
    the wrapper adds the op's counts to them in place and returns them, as FlashInfer does.
    ``deterministic`` is accepted and ignored (every backend is deterministic). ``seed`` and ``offset``
    are one value for every row, or ``(B,)`` tensors of one a row (FlashInfer's per-row form; the row
    word of the counter is then 0, so a row draws as it would alone).

    Args:
        draft_probs: ``(B, n, V)`` float32, last dimension contiguous (other strides free); ``n >= 0``.
        draft_token_ids: ``(B, n)`` int32 or int64, the draft model's tokens.
        target_probs: ``(B, n + 1, V)`` float32, last dimension contiguous.
        maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num: ``None``, or ``(B,)``
            int32/int64 tensors on the device of ``draft_probs`` that the counts are added to.
        deterministic: ignored (kept for FlashInfer's signature).
        generator: a ``torch.Generator`` of the device for the seed drawn when ``seed`` and ``offset``
            are ``None``.
        seed, offset: both ``None``, or each an int or an int64 tensor on the device of ``draft_probs``
            of one element or ``(B,)`` (read on the device: advance ``offset`` in place between steps of
            a CUDA graph). The registered op takes them as tensors, always.

    Returns:
        ``(output_token_ids (B, n + 1) int32, output_accepted_token_num (B,), output_emitted_draft_token_num (B,))``:
        the accepted drafts, then the residual or bonus token, then ``-1``; the number of drafts that
        pass the test, each considered on its own (FlashInfer's metric, not stopped at the first
        rejection); the number emitted before the first rejection (the bonus not counted). The counts
        are int32, or the given tensors. Not differentiable.
    """
    op = SPEC
    check.tensor(op, "draft_probs", draft_probs)
    for arg, t in (("maybe_output_accepted_token_num", maybe_output_accepted_token_num),
                   ("maybe_output_emitted_draft_token_num", maybe_output_emitted_draft_token_num)):
        if t is not None:
            _validate_spec_count(arg, t, draft_probs)
    if generator is not None and seed is None and offset is None:
        seed = torch.randint(-2**63, 2**63 - 1, (), dtype=torch.int64, device=draft_probs.device, generator=generator)
        offset = torch.zeros((), dtype=torch.int64, device=draft_probs.device)
    seed, offset = _seed_offset(op, draft_probs, seed, offset)
    ids, accepted, emitted = torch.ops.deepinfer.chain_speculative_sampling.default(
        draft_probs, draft_token_ids, target_probs, seed, offset)
    if maybe_output_accepted_token_num is not None:
        accepted = maybe_output_accepted_token_num.add_(accepted)
    if maybe_output_emitted_draft_token_num is not None:
        emitted = maybe_output_emitted_draft_token_num.add_(emitted)
    return ids, accepted, emitted


def speculative_inputs(B: int, n: int, V: int, device, closeness: float = 1.0, stride=None, scale: float = 2.0):
    """``(draft_probs, draft_token_ids, target_probs)``: softmax rows, the target's logits the draft's plus
    ``closeness`` times fresh noise, the draft ids drawn from the draft rows (as a draft model does)."""
    width = stride or V
    logits = torch.randn(B, n + 1, width, device=device) * scale
    target = torch.softmax(logits + closeness * torch.randn_like(logits), -1)[..., :V]
    draft = torch.softmax(logits[:, :n], -1)[..., :V]
    rows = draft.reshape(B * n, V)
    ids = (torch.multinomial(rows / rows.sum(-1, keepdim=True), 1).reshape(B, n) if B * n
           else torch.zeros((B, n), dtype=torch.int64, device=device))
    return draft, ids, target


def _samples_chain_speculative(device, dtype) -> Iterator[tuple]:
    """One token of a one-word vocabulary, drafts near and far from the target, zero rows, no draft
    position (the bonus only), strided positions of an odd vocabulary, q == p (all accepted), p(d) = 0."""
    same_d, same_ids, _ = speculative_inputs(2, 3, 50, device)
    zero_t = torch.softmax(torch.randn(2, 4, 50, device=device), -1)
    zero_t[:, :3].scatter_(2, same_ids[..., None], 0.0)  # the target gives the drafts 0: rejected
    shapes = [
        speculative_inputs(1, 1, 1, device),
        speculative_inputs(3, 3, 1000, device, closeness=0.3),
        speculative_inputs(4, 2, 1000, device, closeness=3.0),
        speculative_inputs(0, 2, 64, device),
        speculative_inputs(2, 0, 33, device),
        speculative_inputs(4, 2, 301, device, stride=384),
        (same_d, same_ids.int(), torch.cat([same_d, torch.softmax(torch.randn(2, 1, 50, device=device), -1)], 1)),
        (same_d, same_ids, zero_t),
    ]
    for i, (draft, ids, target) in enumerate(shapes):
        shape = () if i % 2 else (1,)
        ids = ids.to((torch.int64, torch.int32)[i % 2])
        yield draft, ids, target, _scalar(77 + i, device, shape), _scalar(5 * i, device, shape)


def _tokens_chain_speculative(n: int, device) -> tuple:
    draft, ids, target = speculative_inputs(n, 2, 64, device)
    return (draft, ids, target, _scalar(42, device), _scalar(n, device)), (0, 1, 2)


def compare_speculative(got: list, want: list, dtype) -> None:
    """Token ids and both counts: identical to the reference's (exact semantics)."""
    assert len(got) == len(want) == 3, f"{len(got)} outputs, expected 3"
    for name, g, w in zip(("output_token_ids", "output_accepted_token_num", "output_emitted_draft_token_num"), got, want):
        assert g.dtype == torch.int32 and g.shape == w.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        if not torch.equal(g.cpu(), w.cpu()):
            rows = (g.cpu() != w.cpu()).reshape(g.shape[0], -1).any(-1).nonzero().flatten().tolist()
            raise AssertionError(f"{name} differs from the reference in rows {rows[:10]}: "
                                 f"{g.cpu()[rows[:5]].tolist()} vs {w.cpu()[rows[:5]].tolist()}")


#: the benchmark's draft length (EAGLE and n-gram drafts of 4 tokens are vLLM's common setting)
BENCH_SPEC_TOKENS = 4


def _bench_shape_spec(tokens: int, hidden: Optional[int], profile: str):
    vocab, rows_cap = hidden or BENCH_SIZES[profile][0], BENCH_SIZES[profile][1]
    rows = min(tokens, rows_cap)
    return rows, vocab, f"{rows}x{BENCH_SPEC_TOKENS}x{vocab}"


def _bench_args_spec(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    draft, ids, target = speculative_inputs(rows, BENCH_SPEC_TOKENS, hidden, device)
    return draft, ids.int(), target, torch.tensor(1234, device=device), torch.tensor(0, device=device)


def _bench_nbytes_spec(args: tuple) -> int:
    # a floor: one target row a batch row (the residual or bonus row), whatever the acceptances
    return args[2].shape[0] * args[2].shape[2] * 4


def well_formed_speculative(outputs: list, draft_token_ids: Tensor) -> Optional[str]:
    """Why ``(ids, accepted, emitted)`` cannot be a chain speculative sampler's result, or ``None``:
    the first ``emitted`` ids are the drafts, one token in the vocabulary follows, then ``-1``."""
    ids, accepted, emitted = (t.cpu().long() for t in outputs)
    drafts = draft_token_ids.cpu().long()
    B, n1 = ids.shape
    col = torch.arange(n1)[None, :]
    e = emitted[:, None]
    if not ((emitted >= 0) & (emitted <= n1 - 1) & (accepted >= emitted) & (accepted <= n1 - 1)).all():
        return "counts out of range"
    padded = torch.cat([drafts, torch.full((B, 1), -2)], 1)
    if not torch.where(col < e, ids == padded, True).all():
        return "an emitted id is not its draft"
    if not torch.where(col > e, ids == -1, True).all():
        return "no -1 after the first rejection"
    if not (ids.gather(1, e) >= 0).all():
        return "no token at the first rejection"
    return None


def _bench_compare_spec(got: list, want: list, dtype, args: tuple) -> Optional[str]:
    """The reference's outputs, or, from another random stream, well-formed ones."""
    try:
        compare_speculative(got, want, dtype)
        return None
    except AssertionError:
        why = well_formed_speculative(got, args[1])
        if why is not None:
            raise AssertionError(why) from None
        return "another random stream; well-formed"


def _flashinfer_spec(fs, args: tuple) -> Peer:
    seed, offset = int(args[3]), int(args[4])  # ints: graph capture reads no generator state
    return Peer("flashinfer.sampling.chain_speculative_sampling",
                lambda draft, ids, target, *_: fs.chain_speculative_sampling(
                    draft, ids, target, deterministic=True, seed=seed, offset=offset))


# appended to the family's definitions (the manifest lists it last)
OPS = OPS + (
    OpDef("chain_speculative_sampling(Tensor draft_probs, Tensor draft_token_ids, Tensor target_probs, Tensor seed, "
          "Tensor offset) -> (Tensor, Tensor, Tensor)",
          validate_chain_speculative, _fake_chain_speculative, chain_speculative_sampling, _samples_chain_speculative,
          _tokens_chain_speculative, no_grad_reason=_NO_GRAD, compare=compare_speculative,
          bench=BenchCase(_bench_shape_spec, _bench_args_spec, _bench_nbytes_spec, own_hidden=_bench_vocab,
                          flashinfer=_flashinfer_sampling(_flashinfer_spec),
                          compare=_bench_compare_spec, axis="rows")),
)


# ----------------------------------------------------------------------------------------------
# FlashInfer's ``sampling_from_probs``, ``sampling_from_logits`` and ``top_k_top_p_sampling_from_logits``:
# the family's draw without a filter, and ``softmax`` followed by the probs-in ops, fused where a
# backend can; ``top_k``/``top_p``/``temperature`` a scalar or a per-row tensor, seed and offset optional.

_SAMPLING_FROM_PROBS = "sampling_from_probs"
_SAMPLING_FROM_LOGITS = "sampling_from_logits"
_TOP_K_TOP_P_FROM_LOGITS = "top_k_top_p_sampling_from_logits"


def _full_sampling_from_probs(probs: Tensor, seed: Tensor, offset: Tensor, indices: Optional[Tensor] = None) -> None:
    _validate_probs(_SAMPLING_FROM_PROBS, probs)
    _validate_indices(_SAMPLING_FROM_PROBS, indices, probs)
    _validate_seed_offset(_SAMPLING_FROM_PROBS, seed, offset, "probs", probs, _out_rows(indices, probs))


def validate_sampling_from_probs(probs: Tensor, seed: Tensor, offset: Tensor, indices: Optional[Tensor] = None) -> None:
    try:
        if _rows_ok(probs) and _indices_ok(indices, probs) and _seed_offset_ok(seed, offset, probs,
                                                                               _out_rows(indices, probs)):
            return
    except (AttributeError, IndexError, RuntimeError):
        pass
    _full_sampling_from_probs(probs, seed, offset, indices)


def _fake_sampling_from_probs(probs: Tensor, seed: Tensor, offset: Tensor, indices: Optional[Tensor] = None) -> Tensor:
    _full_sampling_from_probs(probs, seed, offset, indices)
    return probs.new_empty((_out_rows(indices, probs),), dtype=torch.int32)


def _full_sampling_from_logits(logits: Tensor, seed: Tensor, offset: Tensor) -> None:
    _validate_logits(_SAMPLING_FROM_LOGITS, logits)
    _validate_seed_offset(_SAMPLING_FROM_LOGITS, seed, offset, "logits", logits)


def validate_sampling_from_logits(logits: Tensor, seed: Tensor, offset: Tensor) -> None:
    try:
        if _rows_ok(logits) and _seed_offset_ok(seed, offset, logits):
            return
    except (AttributeError, IndexError, RuntimeError):
        pass
    _full_sampling_from_logits(logits, seed, offset)


def _fake_sampling_from_logits(logits: Tensor, seed: Tensor, offset: Tensor) -> Tensor:
    _full_sampling_from_logits(logits, seed, offset)
    return logits.new_empty(logits.shape[:1], dtype=torch.int32)


def _full_top_k_top_p_from_logits(logits: Tensor, maybe_top_k_arr: Optional[Tensor], top_k_val: int,
                                  maybe_top_p_arr: Optional[Tensor], top_p_val: float,
                                  maybe_temperature_arr: Optional[Tensor], temperature_val: float,
                                  seed: Tensor, offset: Tensor, filter_apply_order: str = "top_k_first") -> None:
    op = _TOP_K_TOP_P_FROM_LOGITS
    _validate_logits(op, logits)
    if maybe_top_k_arr is not None:
        _validate_per_row(op, "maybe_top_k_arr", maybe_top_k_arr, _INDEX_DTYPES, "int32 or int64", logits, "logits")
    if maybe_top_p_arr is not None:
        _validate_per_row(op, "maybe_top_p_arr", maybe_top_p_arr, (torch.float32,), "float32", logits, "logits")
    _validate_temperature(op, logits, maybe_temperature_arr, temperature_val)
    _validate_filter_order(op, filter_apply_order)
    _validate_seed_offset(op, seed, offset, "logits", logits)


def validate_top_k_top_p_from_logits(logits: Tensor, maybe_top_k_arr: Optional[Tensor], top_k_val: int,
                                     maybe_top_p_arr: Optional[Tensor], top_p_val: float,
                                     maybe_temperature_arr: Optional[Tensor], temperature_val: float,
                                     seed: Tensor, offset: Tensor, filter_apply_order: str = "top_k_first") -> None:
    try:
        if (_rows_ok(logits) and _seed_offset_ok(seed, offset, logits) and _temperature_ok(temperature_val)
                and filter_apply_order in FILTER_ORDERS
                and _per_row_ok(maybe_top_k_arr, _INDEX_DTYPES, logits)
                and _per_row_ok(maybe_top_p_arr, (torch.float32,), logits)
                and _per_row_ok(maybe_temperature_arr, _TEMPERATURE_DTYPES, logits)):
            return
    except (AttributeError, IndexError, RuntimeError, TypeError):
        pass
    _full_top_k_top_p_from_logits(logits, maybe_top_k_arr, top_k_val, maybe_top_p_arr, top_p_val,
                                  maybe_temperature_arr, temperature_val, seed, offset, filter_apply_order)


def _fake_top_k_top_p_from_logits(logits: Tensor, *args) -> Tensor:
    _full_top_k_top_p_from_logits(logits, *args)
    return logits.new_empty(logits.shape[:1], dtype=torch.int32)


def sampling_from_probs(probs: Tensor, seed=None, offset=None, indices: Optional[Tensor] = None, *,
                        deterministic: bool = True, generator: Optional[torch.Generator] = None,
                        check_nan: bool = False, return_valid: bool = False):
    """``ids[b] ~ probs[b] / sum(probs[b])``, drawn with Philox(seed, offset, b)

    FlashInfer's ``sampling_from_probs``: one token id per row from the whole (unnormalised) row, with
    the family's draw: the masses in 64-bit fixed point, the inverse CDF in token order at a 31-bit
    uniform from Philox4x32-10 with counter ``(row, offset, 0)`` and key ``seed``, identical on every
    device and backend. The masses sit at the scale of 1.0 for a row whose values are all below 2 (so a
    kernel reads the row once): a token of probability below ``2^-43`` (at ``V = 128256``) is never
    drawn; a row with a larger value is scaled at its largest, as the other samplers scale every row
    (a row whose largest value is at least 1 draws the ids of ``top_k_top_p_sampling_from_probs`` with
    ``top_k = 0`` and ``top_p = 1`` on the same ``(seed, offset)``). Without ``seed`` and ``offset`` a
    seed is drawn on the device with torch's generator (``torch.manual_seed`` makes it reproducible; a
    CUDA graph replays a fresh draw).

    Args:
        probs: ``(B, V)`` float32, last dimension contiguous (rows may be strided); need not be normalised.
            NaN and negative values count as 0, ``+inf`` as the largest fp32.
        seed, offset: both ``None``, or each an int or an int64 tensor on the device of ``probs`` of one
            element or one per output row, as ``top_k_top_p_sampling_from_probs``'s (read on the device:
            advance ``offset`` in place between steps of a CUDA graph). The registered op takes them as
            tensors, always.
        indices: ``None``, or ``(N,)`` int32/int64: output row ``i`` draws from ``probs[indices[i]]``.
        deterministic, generator, check_nan: FlashInfer's keywords, as ``top_k_top_p_sampling_from_probs``'s.
        return_valid: FlashInfer's: also return ``valid``, ``(N,)`` bool, as ``top_k_top_p_sampling_from_probs``'s.

    Returns:
        ``(N,)`` token ids (``N = B`` without ``indices``), int32 or the dtype of ``indices``;
        ``(ids, valid)`` with ``return_valid``. A row with no positive probability returns 0. Not
        differentiable.
    """
    _checked_nan(_SAMPLING_FROM_PROBS, "probs", probs, check_nan)
    seed, offset = _seed_offset(_SAMPLING_FROM_PROBS, probs, seed, offset, generator)
    ids = torch.ops.deepinfer.sampling_from_probs.default(probs, seed, offset, indices)
    return _flashinfer_ids(ids, probs, indices, return_valid)


def sampling_from_logits(logits: Tensor, seed=None, offset=None, indices: Optional[Tensor] = None, *,
                         deterministic: bool = True, generator: Optional[torch.Generator] = None,
                         check_nan: bool = False) -> Tensor:
    """``ids[b] ~ softmax(logits[b])``, drawn with Philox(seed, offset, b)

    One token id per row from the probabilities of ``softmax(logits)`` (fp32, as the ``softmax`` op)
    with the draw of ``sampling_from_probs``: the ids are those of ``softmax`` followed by
    ``sampling_from_probs`` on the same ``(seed, offset)`` and backend, bit for bit. Backends agree
    wherever their ``softmax`` rounds alike (Triton's and torch's may differ in a probability's last
    bit, which moves a draw only when it falls within that rounding of a token's boundary).
    FlashInfer's ``sampling_from_logits`` draws the same distribution by Gumbel-max, another random
    stream. The Triton kernel is fused: it never writes the probabilities. A ``-inf`` logit is never drawn.

    Args:
        logits: ``(B, V)`` float32, float16 or bfloat16, last dimension contiguous (rows may be strided).
        seed, offset: as ``sampling_from_probs``'s (both ``None``: torch's generator of the device;
            per-row tensors of ``(N,)`` allowed).
        indices: ``None``, or ``(N,)`` int32/int64: output row ``i`` draws from ``logits[indices[i]]``
            (FlashInfer's; the rows are gathered before the op).
        deterministic, generator, check_nan: FlashInfer's keywords, as ``top_k_top_p_sampling_from_probs``'s.

    Returns:
        ``(N,)`` token ids (``N = B`` without ``indices``), int32 or the dtype of ``indices``. A row
        without a probability (all ``-inf``, or a NaN or ``+inf`` logit: ``softmax`` gives NaN) returns
        0. Not differentiable.
    """
    _checked_nan(_SAMPLING_FROM_LOGITS, "logits", logits, check_nan)
    seed, offset = _seed_offset(_SAMPLING_FROM_LOGITS, logits, seed, offset, generator)
    from .reference import gather_rows

    (rows,) = gather_rows(indices, logits)  # output row i draws from logits[indices[i]]
    return _flashinfer_ids(torch.ops.deepinfer.sampling_from_logits.default(rows, seed, offset), logits, indices, False)


def top_k_top_p_sampling_from_logits(logits: Tensor, top_k: Union[int, Tensor], top_p: Union[float, Tensor],
                                     temperature: Union[float, Tensor, None] = 1.0, seed=None, offset=None,
                                     filter_apply_order: str = "top_k_first", *, indices: Optional[Tensor] = None,
                                     deterministic: bool = True, generator: Optional[torch.Generator] = None,
                                     check_nan: bool = False, top_k_max: Optional[int] = None) -> Tensor:
    """``ids[b] ~ top_p_renorm(top_k_renorm(softmax(logits[b] / t[b]), top_k[b]), top_p[b])``, Philox(seed, offset, b)

    FlashInfer's ``top_k_top_p_sampling_from_logits`` (``filter_apply_order`` ``"top_k_first"``, the
    default, or ``"joint"``, as ``top_k_top_p_sampling_from_probs``'s) with a temperature: ``softmax(logits,
    temperature)`` (fp32, the ``softmax`` op), then the top-k and top-p filters and the draw of
    ``top_k_top_p_sampling_from_probs`` on those probabilities: the ids are those of the two ops in sequence
    on the same ``(seed, offset)`` and backend, bit for bit (across backends as ``sampling_from_logits``).
    The Triton backend computes the probabilities where its top-k prepass reads them and writes them only
    for the rows that prepass does not finish (ties, top-k off or large); with a scalar top-k off or past
    the prepass's 128 slots a slice, or the joint order, it runs the two ops' kernels in sequence.

    Args:
        logits: ``(B, V)`` float32, float16 or bfloat16, last dimension contiguous (rows may be strided).
        top_k: an int for every row, or a ``(B,)`` int32/int64 tensor; ``<= 0`` or ``>= V`` disables top-k.
        top_p: a float for every row (read as fp32), or a ``(B,)`` float32 tensor; ``>= 1`` disables
            top-p, ``<= 0`` keeps only the largest probability (and its ties).
        temperature: as ``softmax``'s: a float ``>= 0`` (``None``: 1) or a ``(B,)`` tensor; 0 makes a
            row uniform over its finite logits, as FlashInfer's softmax.
        seed, offset: as ``sampling_from_probs``'s (both ``None``: torch's generator of the device;
            per-row tensors of ``(B,)`` allowed). The op's schema takes ``top_k``, ``top_p`` and
            ``temperature`` each as ``maybe_<name>_arr`` and ``<name>_val``, and ``seed`` and ``offset``
            as tensors.
        filter_apply_order: ``"top_k_first"`` or ``"joint"``.
        indices: ``None``, or ``(N,)`` int32/int64: output row ``i`` draws from ``logits[indices[i]]``
            with that row's ``top_k``, ``top_p`` and temperature (FlashInfer's; gathered before the op).
        deterministic, generator, check_nan: FlashInfer's keywords, as ``top_k_top_p_sampling_from_probs``'s.
        top_k_max: as ``top_k_top_p_sampling_from_probs``'s.

    Returns:
        ``(N,)`` token ids (``N = B`` without ``indices``), int32 or the dtype of ``indices``. A row
        without a probability (as ``sampling_from_logits``) returns 0. Not differentiable.
    """
    op = _TOP_K_TOP_P_FROM_LOGITS
    _checked_nan(op, "logits", logits, check_nan)
    top_k = _top_k_max(top_k, top_k_max, filter_apply_order, logits.shape[-1])
    k_arr, k_val = _tensor_or_scalar(op, "top_k", top_k, int, "an int")
    p_arr, p_val = _tensor_or_scalar(op, "top_p", top_p, float, "a float")
    t_arr, t_val = _tensor_or_scalar(op, "temperature", 1.0 if temperature is None else temperature, float, "a float")
    seed, offset = _seed_offset(op, logits, seed, offset, generator)
    from .reference import gather_rows

    # output row i draws from logits[indices[i]] with that row's parameters, as FlashInfer's
    rows, k_arr, p_arr, t_arr = gather_rows(indices, logits, k_arr, p_arr, t_arr)
    ids = torch.ops.deepinfer.top_k_top_p_sampling_from_logits.default(
        rows, k_arr, k_val, p_arr, p_val, t_arr, t_val if t_arr is None else 1.0, seed, offset, filter_apply_order)
    return _flashinfer_ids(ids, logits, indices, False)


def _samples_sampling_from_probs(device, dtype) -> Iterator[tuple]:
    for i, (probs, _, _) in enumerate(_sample_inputs(device)):
        shape = () if i % 2 else (1,)
        yield probs, _scalar(4321 + i, device, shape), _scalar(5 * i, device, shape)
    yield from _forms_samples(device, torch.float32, lambda probs, top_k, top_p, seed, offset, idx: (
        probs, seed, offset, idx))


def _samples_sampling_from_logits(device, dtype) -> Iterator[tuple]:
    for i, (logits, _, _) in enumerate(_logit_inputs(device, dtype)):
        shape = () if i % 2 else (1,)
        yield logits, _scalar(77 + i, device, shape), _scalar(2**33 + i, device, shape)
        if i == 2:  # per-row seeds and offsets
            yield logits, torch.tensor([3, -3, 2**50], device=device), torch.tensor([0, 1, 2], device=device)


def _samples_top_k_top_p_from_logits(device, dtype) -> Iterator[tuple]:
    for i, (logits, per_row, k) in enumerate(_logit_inputs(device, dtype)):
        B, V = logits.shape
        shape = () if i % 2 else (1,)
        seed, offset = _scalar(555 + i, device, shape), _scalar(i, device, shape)
        if per_row:
            ks = torch.tensor([k, 0, V, -1, 1][:B] if B else [], device=device).to((torch.int32, torch.int64)[i % 2])
            ps = torch.tensor([0.9, 0.5, 1.0, 0.0, 0.95][:B] if B else [], device=device)
            ts = torch.tensor([0.7, 1.0, 0.0, 1.5, 1.0][:B] if B else [], device=device)
            yield logits, ks, 0, ps, 0.0, ts.to((torch.float32, torch.bfloat16)[i % 2]), 1.0, seed, offset
            if B == 3:  # the joint order, per-row seeds
                yield (logits, ks, 0, ps * 0.3, 0.0, None, 0.8, torch.tensor([1, 2, 3], device=device), offset,
                       "joint")
        else:
            yield logits, None, k, None, (0.9, 0.6, 1.0)[i % 3], None, (1.0, 0.7, 1.3)[i % 3], seed, offset


def _tokens_sampling_from_probs(n: int, device) -> tuple:
    return (_probs(n, 64, device), _scalar(42, device), _scalar(n, device)), (0,)


def _tokens_sampling_from_logits(n: int, device) -> tuple:
    return (torch.randn(n, 64, device=device) * 3, _scalar(42, device), _scalar(n, device)), (0,)


def _tokens_top_k_top_p_from_logits(n: int, device) -> tuple:
    return ((torch.randn(n, 64, device=device) * 3, torch.full((n,), 8, dtype=torch.int32, device=device), 0,
             torch.full((n,), 0.8, device=device), 0.0, None, 0.7, _scalar(42, device), _scalar(n, device)), (0, 1, 3))


def _bench_logits(rows: int, vocab: int, device, dtype) -> Tensor:
    return (torch.randn(rows, vocab, device=device) * 3).to(_logit_dtype(dtype))


def _bench_args_sampling_from_probs(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    probs, _, _ = _bench_inputs(rows, hidden, device)
    return probs, torch.tensor(1234, device=device), torch.tensor(0, device=device)


def _bench_args_sampling_from_logits(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    return _bench_logits(rows, hidden, device, dtype), torch.tensor(1234, device=device), torch.tensor(0, device=device)


def _bench_args_top_k_top_p_from_logits(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    return (_bench_logits(rows, hidden, device, dtype), None, BENCH_TOP_K, None, BENCH_TOP_P, None, 1.0,
            torch.tensor(1234, device=device), torch.tensor(0, device=device))


def logits_in_kept_set(op: str, args: tuple) -> Tensor:
    """``(B, V)`` bool: the tokens the reference of ``op`` may draw from (a probability with mass, after
    the op's filters), where any correct sampler's ids must fall, whatever its random stream."""
    from . import reference

    if op == _SAMPLING_FROM_PROBS:
        probs, top_k, top_p = args[0], None, None
    elif op == _SAMPLING_FROM_LOGITS:
        probs, top_k, top_p = reference.softmax(args[0]), None, None
    else:
        logits, k_arr, k_val, p_arr, p_val, t_arr, t_val = args[:7]
        probs = reference.softmax(logits, t_arr, t_val)
        top_k, top_p = (k_val if k_arr is None else k_arr), (p_val if p_arr is None else p_arr)  # kept_mask takes either
    bits = reference.value_bits(probs)
    q = reference.fixed_point(bits, bits.amax(-1, keepdim=True), reference.fixed_point_bits(probs.shape[1]))
    kept, _ = reference.kept_mask(bits, q, top_k, top_p)
    return kept & (q > 0)


def _flashinfer_logits_in(op: str):
    def make(fs, args: tuple) -> Peer:
        seed, offset = int(args[-2]), int(args[-1])  # ints: graph capture reads no generator state
        if op == _SAMPLING_FROM_PROBS:
            return Peer("flashinfer.sampling.sampling_from_probs",
                        lambda probs, *_: fs.sampling_from_probs(probs, deterministic=True, seed=seed, offset=offset))
        if op == _SAMPLING_FROM_LOGITS:
            return Peer("flashinfer.sampling.sampling_from_logits",
                        lambda logits, *_: fs.sampling_from_logits(logits, deterministic=True, seed=seed, offset=offset))
        return Peer("flashinfer.sampling.top_k_top_p_sampling_from_logits (top_k_first)",
                    lambda logits, k_arr, k_val, p_arr, p_val, *_: fs.top_k_top_p_sampling_from_logits(
                        logits, k_arr if k_arr is not None else k_val, p_arr if p_arr is not None else p_val,
                        filter_apply_order="top_k_first", deterministic=True, seed=seed, offset=offset))
    return _flashinfer_sampling(make)


def _unfused_logits_in(logits, k_arr, k_val, p_arr, p_val, t_arr, t_val, seed, offset, order="top_k_first"):
    probs = torch.ops.deepinfer.softmax(logits, t_arr, t_val)
    return torch.ops.deepinfer.top_k_top_p_sampling_from_probs(probs, k_arr, p_arr, seed, offset, k_val, p_val, order)


#: our softmax then our probs-in sampler, as the default selection serves them (the fused op's 1.2x goal)
_UNFUSED_LOGITS_IN = Peer("unfused", _unfused_logits_in)


def _bench_logits_in(op: str, args) -> BenchCase:
    return BenchCase(_bench_shape, args, _bench_nbytes(1), own_hidden=_bench_vocab, flashinfer=_flashinfer_logits_in(op),
                     peers=(_UNFUSED_LOGITS_IN,) if op == _TOP_K_TOP_P_FROM_LOGITS else (),
                     compare=_kept_set_compare(lambda args: logits_in_kept_set(op, args)), axis="rows")


OPS = OPS + (
    OpDef("sampling_from_probs(Tensor probs, Tensor seed, Tensor offset, Tensor? indices=None) -> Tensor",
          validate_sampling_from_probs, _fake_sampling_from_probs, sampling_from_probs, _samples_sampling_from_probs,
          _tokens_sampling_from_probs, no_grad_reason=_NO_GRAD, compare=compare_samples,
          bench=_bench_logits_in(_SAMPLING_FROM_PROBS, _bench_args_sampling_from_probs)),
    OpDef("sampling_from_logits(Tensor logits, Tensor seed, Tensor offset) -> Tensor",
          validate_sampling_from_logits, _fake_sampling_from_logits, sampling_from_logits,
          _samples_sampling_from_logits, _tokens_sampling_from_logits, no_grad_reason=_NO_GRAD, compare=compare_samples,
          bench=_bench_logits_in(_SAMPLING_FROM_LOGITS, _bench_args_sampling_from_logits)),
    OpDef("top_k_top_p_sampling_from_logits(Tensor logits, Tensor? maybe_top_k_arr, int top_k_val, "
          "Tensor? maybe_top_p_arr, float top_p_val, Tensor? maybe_temperature_arr, float temperature_val, "
          "Tensor seed, Tensor offset, str filter_apply_order=\"top_k_first\") -> Tensor",
          validate_top_k_top_p_from_logits, _fake_top_k_top_p_from_logits, top_k_top_p_sampling_from_logits,
          _samples_top_k_top_p_from_logits, _tokens_top_k_top_p_from_logits, no_grad_reason=_NO_GRAD,
          compare=compare_samples,
          bench=_bench_logits_in(_TOP_K_TOP_P_FROM_LOGITS, _bench_args_top_k_top_p_from_logits)),
)


# ----------------------------------------------------------------------------------------------
# The log-probabilities of sampled tokens, as vLLM's sampler returns them beside the ids (its
# ``logprobs_mode="raw_logprobs"``, or ``"processed_logprobs"`` with a temperature): one pass of the
# softmax's statistics and one count, no log-probabilities tensor of the vocabulary.

_LOGPROBS = "sampled_token_logprobs"


def _full_logprobs(logits: Tensor, token_ids: Tensor, maybe_temperature_arr: Optional[Tensor] = None,
                   temperature_val: float = 1.0) -> None:
    op = _LOGPROBS
    _validate_logits(op, logits)
    _validate_per_row(op, "token_ids", token_ids, _INDEX_DTYPES, "int32 or int64", logits, "logits")
    _validate_temperature(op, logits, maybe_temperature_arr, temperature_val)


def validate_logprobs(logits: Tensor, token_ids: Tensor, maybe_temperature_arr: Optional[Tensor] = None,
                      temperature_val: float = 1.0) -> None:
    try:
        if (_rows_ok(logits) and _temperature_ok(temperature_val) and _per_row_ok(token_ids, _INDEX_DTYPES, logits)
                and token_ids is not None and _per_row_ok(maybe_temperature_arr, _TEMPERATURE_DTYPES, logits)):
            return
    except (AttributeError, IndexError, RuntimeError):
        pass
    _full_logprobs(logits, token_ids, maybe_temperature_arr, temperature_val)


def _fake_logprobs(logits: Tensor, token_ids: Tensor, maybe_temperature_arr: Optional[Tensor] = None,
                   temperature_val: float = 1.0):
    _full_logprobs(logits, token_ids, maybe_temperature_arr, temperature_val)
    B = logits.shape[0]
    return logits.new_empty((B,), dtype=torch.float32), logits.new_empty((B,), dtype=torch.int64)


def sampled_token_logprobs(logits: Tensor, token_ids: Tensor,
                           temperature: Union[float, Tensor, None] = 1.0) -> tuple[Tensor, Tensor]:
    """``logprob[b] = log_softmax(logits[b] / t[b])[token_ids[b]]``, ``rank[b] = #{j: x[b, j] >= x[b, token_ids[b]]}``

    The log-probability of each row's sampled token and its rank, as vLLM's sampler returns them
    beside the ids (``logprobs_mode="raw_logprobs"`` at temperature 1, ``"processed_logprobs"`` with
    the sampling temperature before top-k/top-p), without writing a log-probabilities tensor of the
    vocabulary. ``x = logits * (1 / t)`` in fp32 as the ``softmax`` op reads it (``-inf`` stays
    ``-inf``, ``t == 0`` makes the row uniform over its finite logits); the log-probability is
    ``x_tok - max(x) - log(sum(exp(x - max(x))))`` in fp32, the rank counts the values at or above
    the token's (1 for the largest, ties counted; vLLM counts on the rounded log-probabilities, which
    may merge values within an ulp). An id outside ``[0, V)`` gives NaN and rank 0 (not checked: a
    sync); a NaN logit or a row of all ``-inf`` gives NaN. Backends agree on the rank exactly and on
    the log-probability to fp32 rounding (the order of the sum).

    Args:
        logits: ``(B, V)`` float32, float16 or bfloat16, last dimension contiguous (rows may be strided).
        token_ids: ``(B,)`` int32 or int64 on the device of ``logits``, one sampled id a row.
        temperature: as ``softmax``'s: a float ``>= 0`` (``None``: 1) or a ``(B,)`` tensor. The op's
            schema takes it as ``maybe_temperature_arr`` and ``temperature_val``.

    Returns:
        ``(logprobs (B,) float32, ranks (B,) int64)``. Not differentiable.
    """
    arr, val = _tensor_or_scalar(_LOGPROBS, "temperature", 1.0 if temperature is None else temperature, float,
                                 "a float")
    return torch.ops.deepinfer.sampled_token_logprobs.default(logits, token_ids, arr, val if arr is None else 1.0)


def _samples_logprobs(device, dtype) -> Iterator[tuple]:
    for i, (logits, per_row, _) in enumerate(_logit_inputs(device, dtype)):
        B, V = logits.shape
        ids = torch.randint(0, V, (B,), device=device).to((torch.int64, torch.int32)[i % 2])
        if B:
            ids[0] = logits[0].float().argmax()  # the largest: rank 1 (or its ties)
        if per_row:
            t = torch.rand(B, device=device) * 2 + 0.1
            t[:1] = 0.0 if i == 4 else t[:1]  # temperature 0: uniform over the finite logits
            yield logits, ids, t.to((torch.float32, torch.bfloat16)[i % 2]), 1.0
        else:
            yield logits, ids, None, (1.0, 0.7, 1.3)[i % 3]


def _tokens_logprobs(n: int, device) -> tuple:
    return ((torch.randn(n, 64, device=device) * 3, torch.randint(0, 64, (n,), device=device), None, 1.0), (0, 1))


def _bench_args_logprobs(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    logits = _bench_logits(rows, hidden, device, dtype)
    return logits, torch.randint(0, logits.shape[1], (rows,), device=device), None, 1.0


def _bench_nbytes_logprobs(args: tuple) -> int:
    return 2 * args[0].numel() * args[0].element_size()  # two reads of the logits


def _torch_logprobs(logits, token_ids, *_):
    logprobs = logits.float().log_softmax(-1)  # vLLM's compute_logprobs, then gather_logprobs' two lines
    token = logprobs.gather(-1, token_ids.long()[:, None])
    return token.squeeze(-1), (logprobs >= token).sum(-1)


OPS = OPS + (
    OpDef("sampled_token_logprobs(Tensor logits, Tensor token_ids, Tensor? maybe_temperature_arr=None, "
          "float temperature_val=1.0) -> (Tensor, Tensor)",
          validate_logprobs, _fake_logprobs, sampled_token_logprobs, _samples_logprobs, _tokens_logprobs,
          no_grad_reason="it is an inference kernel",
          bench=BenchCase(_bench_shape, _bench_args_logprobs, _bench_nbytes_logprobs, own_hidden=_bench_vocab,
                          memory_bound=True,
                          flashinfer=lambda args: "FlashInfer has no log-probability op",
                          peers=(Peer("torch log_softmax + gather (vLLM's)", _torch_logprobs),), axis="rows")),
)
