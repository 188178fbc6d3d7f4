"""The attention-state family: ``merge_attn_states``.

Merges two partial attention results over disjoint key sets (split-KV decoding, a cached prefix and
a new suffix, cascade attention) by their log-sum-exp: vLLM's ``merge_attn_states``, FlashInfer's
``flashinfer.cascade.merge_state`` (which takes base-2 LSE; ours are natural-log). The reference is
``torch_kernels/families/attention/reference.py``.

Empty partials follow vLLM's CUDA kernel (``csrc/attention/merge_attn_states.cu``): an LSE of
``+inf`` (FlashAttention-2's marker for a row that saw no keys) is read as ``-inf``; a partial whose
LSE is ``-inf`` contributes nothing and the other is returned exactly; when both are ``-inf`` the
result is ``v_a`` with LSE ``-inf``. One deliberate difference: vLLM multiplies the empty partial's
values by a zero weight, so NaN or Inf values there poison the result; here they are never read into it.
"""

import math
from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor

from ... import checks as check
from ...opdef import BenchCase, OpDef, Peer, assert_close

_OP = "merge_attn_states"
V_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _validate_full(v_a: Tensor, lse_a: Tensor, v_b: Tensor, lse_b: Tensor) -> None:
    op = _OP
    for name, t in (("v_a", v_a), ("lse_a", lse_a), ("v_b", v_b), ("lse_b", lse_b)):
        check.tensor(op, name, t)
    if v_a.dtype not in V_DTYPES:
        check.fail(op, "v_a", f"must be float16, bfloat16 or float32, got {v_a.dtype}", TypeError)
    if v_a.dim() != 3:
        check.fail(op, "v_a", f"must have shape (tokens, heads, head_size), got {tuple(v_a.shape)}")
    check.require(v_a.shape[2] != 0, op, "v_a", "must have a head size (last dimension) of at least 1")
    check.last_dim_contiguous(op, "v_a", v_a)
    if v_b.dtype != v_a.dtype:
        check.fail(op, "v_b", f"must have the dtype of 'v_a' ({v_a.dtype}), got {v_b.dtype}", TypeError)
    check.same_shape(op, "v_b", v_b, "v_a", v_a)
    check.last_dim_contiguous(op, "v_b", v_b)
    check.same_device(op, "v_b", v_b, "v_a", v_a)
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if lse.dtype != torch.float32:
            check.fail(op, name, f"must be float32 (natural-log LSE), got {lse.dtype}", TypeError)
        msg = lambda lse=lse: (f"must have shape (tokens, heads) = {tuple(v_a.shape[:2])} to match 'v_a', "  # noqa: E731
                               f"got {tuple(lse.shape)}")
        check.require(lse.dim() == 2, op, name, msg)
        check.require(lse.shape[0] == v_a.shape[0], op, name, msg)
        check.require(lse.shape[1] == v_a.shape[1], op, name, msg)
        check.same_device(op, name, lse, "v_a", v_a)


def _validate(v_a: Tensor, lse_a: Tensor, v_b: Tensor, lse_b: Tensor) -> None:
    # The common valid call in few attribute reads; anything else through the full checks.
    try:
        shape, device = v_a.shape, v_a.device
        if (v_a.dtype in V_DTYPES and v_b.dtype == v_a.dtype and lse_a.dtype == torch.float32
                and lse_b.dtype == torch.float32 and len(shape) == 3 and shape[2] and v_b.shape == shape
                and lse_a.shape == lse_b.shape == shape[:2] and v_a.is_contiguous() and v_b.is_contiguous()
                and device == v_b.device == lse_a.device == lse_b.device):
            return  # strided v (allowed) takes the full checks: 2 us here against 3.3 with stride reads
    except (IndexError, RuntimeError, AttributeError):  # non-tensors: the full checks say what is wrong
        pass
    _validate_full(v_a, lse_a, v_b, lse_b)


def _fake(v_a: Tensor, lse_a: Tensor, v_b: Tensor, lse_b: Tensor):
    _validate_full(v_a, lse_a, v_b, lse_b)
    return v_a.new_empty(v_a.shape), lse_a.new_empty(lse_a.shape)


# ----------------------------------------------------------------------------------------------
# Typed wrapper: what IDEs show, and what docs/ops.md is generated from.


def merge_attn_states(v_a: Tensor, lse_a: Tensor, v_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """``v = (v_a * exp(lse_a - m) + v_b * exp(lse_b - m)) / (exp(lse_a - m) + exp(lse_b - m))``,
    ``lse = m + log(exp(lse_a - m) + exp(lse_b - m))``, ``m = max(lse_a, lse_b)``

    Merges two partial attention outputs over disjoint key sets by their natural-log log-sum-exp
    (vLLM's ``merge_attn_states``; FlashInfer's ``merge_state`` with base-2 LSE), per token and
    head, in fp32. A partial whose LSE is ``-inf`` (it saw no keys) contributes nothing: the other
    partial's ``v`` and LSE come back exactly, never NaN, whatever the empty partial's ``v`` holds.
    Both ``-inf``: ``v_a`` and ``-inf`` (vLLM's choice). An LSE of ``+inf`` (FlashAttention-2's
    mark of an empty row) counts as ``-inf``, as in vLLM.

    Args:
        v_a: ``(T, H, D)`` fp16/bf16/fp32, head_size contiguous (token and head strides free).
        lse_a: ``(T, H)`` fp32, any strides (vLLM's ``(H, T)`` layout passes as ``lse.t()``).
        v_b: ``(T, H, D)``, the dtype of ``v_a``.
        lse_b: ``(T, H)`` fp32.

    Returns:
        ``(v, lse)``: ``(T, H, D)`` in the dtype of ``v_a`` and ``(T, H)`` fp32, both contiguous.
        Not differentiable.
    """
    return torch.ops.deepinfer.merge_attn_states.default(v_a, lse_a, v_b, lse_b)


# ----------------------------------------------------------------------------------------------
# Sample arguments for opcheck, the self-check and the tests: awkward shapes, never zeros.

#: (tokens, heads, head_size): one of each, head sizes that are not powers of two, zero tokens.
SAMPLE_SHAPES = ((1, 1, 1), (1, 4, 64), (3, 2, 128), (5, 3, 40), (0, 4, 32))


def _lse(T: int, H: int, device, empty: tuple, transposed: bool = False) -> Tensor:
    """LSEs around 3 +- 2; the partials at flat index ``i`` with ``i % empty[0] == empty[1]`` saw no
    keys (-inf), and the first, when there are more than 3, carries FlashAttention-2's +inf."""
    lse = torch.randn(T, H, device=device) * 2 + 3
    flat = torch.arange(T * H, device=device).view(T, H)
    lse[flat % empty[0] == empty[1]] = float("-inf")
    if T * H > 3:
        lse[0, 0] = float("inf")
    return lse.t().contiguous().t() if transposed else lse


def _samples(device, dtype) -> Iterator[tuple]:
    for T, H, D in SAMPLE_SHAPES:
        # a empty at 1, 5, 9, ...; b at 2, 5, 8, ...: both at 5, 17, ...; both +inf (FA2) at 0
        yield (torch.randn(T, H, D, device=device, dtype=dtype), _lse(T, H, device, (4, 1)),
               torch.randn(T, H, D, device=device, dtype=dtype), _lse(T, H, device, (3, 2)))
    # strided token and head dims (a slice of a wider buffer) and vLLM's (H, T) LSE layout
    T, H, D = 6, 3, 48
    wide = lambda: torch.randn(T, H + 2, D + 16, device=device, dtype=dtype)[:, 1:H + 1, :D]  # noqa: E731
    yield wide(), _lse(T, H, device, (4, 1), transposed=True), wide(), _lse(T, H, device, (3, 2))


def _tokens(n: int, device) -> tuple:
    return (torch.randn(n, 4, 32, device=device), torch.randn(n, 4, device=device),
            torch.randn(n, 4, 32, device=device), torch.randn(n, 4, device=device)), (0, 1, 2, 3)


def _compare(got: list, want: list, dtype) -> None:
    """``v`` at the tolerance of its dtype; the LSE at fp32's (it is fp32 whatever ``v`` is)."""
    assert len(got) == len(want) == 2, f"{len(got)} outputs, expected 2"
    assert_close(got[0], want[0], dtype, msg="v")
    assert_close(got[1], want[1], torch.float32, msg="lse")


# ----------------------------------------------------------------------------------------------
# Benchmark case: tokens x heads x head size; FlashInfer's flashinfer.cascade.merge_state as peer.

#: per profile: (heads, head size); gpu: Llama-3-8B's query heads
BENCH_SIZES = {"gpu": (32, 128), "cpu": (4, 64)}
LOG2E = 1.0 / math.log(2.0)


def merge_inputs(tokens: int, heads: int, head_size: int, device, dtype=torch.bfloat16) -> tuple:
    """``(v_a, lse_a, v_b, lse_b)``: random partial results and natural-log LSEs around 3."""
    v_a = torch.randn(tokens, heads, head_size, device=device, dtype=dtype)
    v_b = torch.randn(tokens, heads, head_size, device=device, dtype=dtype)
    lse_a = torch.randn(tokens, heads, device=device) * 2 + 3
    lse_b = torch.randn(tokens, heads, device=device) * 2 + 3
    return v_a, lse_a, v_b, lse_b


def _bench_shape(tokens: int, hidden: Optional[int], profile: str):
    heads, head_size = BENCH_SIZES[profile]
    return tokens, None, f"{tokens}x{heads}x{head_size}"


def _bench_args(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    return merge_inputs(rows, *BENCH_SIZES[profile], device, dtype)


def _bench_nbytes(args: tuple) -> int:
    v_a, lse_a = args[0], args[1]
    return 3 * v_a.numel() * v_a.element_size() + 3 * lse_a.numel() * 4  # read two v and two LSEs, write one of each


def _compare_base2_merge(got: list, want: list, dtype) -> None:
    """FlashInfer's merge: ``v`` at its dtype's tolerance; the LSE at fp16's only, as FlashInfer's
    ``exp2``/``log2`` are approximate instructions (tests/test_attention.py checks the same)."""
    assert_close(got[0], want[0], dtype, msg="v")
    assert_close(got[1], want[1], torch.float16, msg="lse")


def _flashinfer(args: tuple):
    try:
        import flashinfer.cascade
    except Exception as e:  # noqa: BLE001  (reported in the results)
        return f"FlashInfer not importable: {type(e).__name__}: {e}"[:200]
    # its LSEs are base 2: converted once outside the timed call (an engine built on FlashInfer keeps
    # base-2 LSEs throughout), and its output LSE back for the check
    return Peer("flashinfer.cascade.merge_state (base-2 LSE)", flashinfer.cascade.merge_state,
                prepare=lambda a: (a[0], (a[1] * LOG2E).contiguous(), a[2], (a[3] * LOG2E).contiguous()),
                adapt=lambda outs: [outs[0], outs[1] / LOG2E], compare=_compare_base2_merge)


OPS = (
    OpDef("merge_attn_states(Tensor v_a, Tensor lse_a, Tensor v_b, Tensor lse_b) -> (Tensor, Tensor)",
          _validate, _fake, merge_attn_states, _samples, _tokens,
          no_grad_reason="it is an inference kernel; differentiate the formula in its docstring instead",
          compare=_compare,
          bench=BenchCase(_bench_shape, _bench_args, _bench_nbytes, memory_bound=True, flashinfer=_flashinfer)),
)
