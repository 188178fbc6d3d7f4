"""The collective family: tensor parallelism's all-reduce fused with what follows it in a layer,
``all_reduce_fused_add_rmsnorm`` and ``all_reduce_fused_add_rmsnorm_fp8_quant``.

A row-parallel layer's partial output is summed over the ranks, added to the residual and normalised
(vLLM's fused all-reduce + RMSNorm, FlashInfer's ``trtllm_allreduce_fusion``). The group is a
``torch.distributed`` group named as vLLM's registered collectives name theirs (``group.group_name``),
so each op is one ``torch.library`` op. The reference (``reference.py``) is the all-reduce followed by
our fused norm; no kernel fuses them yet.
"""

from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ... import checks as check, fp8
from ...opdef import BenchCase, OpDef, Peer, assert_close

OP = "all_reduce_fused_add_rmsnorm"
QUANT_OP = "all_reduce_fused_add_rmsnorm_fp8_quant"


def process_group(op: str, group_name: str):
    """The ``torch.distributed`` process group registered under ``group_name``."""
    if not isinstance(group_name, str):
        check.fail(op, "group_name", f"must be a process group's name (str), got {type(group_name).__name__}", TypeError)
    if not dist.is_available() or not dist.is_initialized():
        check.fail(op, "group_name", "names a process group, but torch.distributed is not initialized "
                                     "(call torch.distributed.init_process_group first)")
    try:
        return dist.distributed_c10d._resolve_process_group(group_name)
    except (RuntimeError, ValueError, KeyError):
        check.fail(op, "group_name", f"names no process group: {group_name!r} (pass a group's .group_name)")


def _validate_rows(op: str, input: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """fused_add_rmsnorm's arguments, checked before the all-reduce writes anything."""
    for arg, t in (("input", input), ("residual", residual), ("weight", weight)):
        check.tensor(op, arg, t)
    check.floating(op, "input", input)
    check.floating(op, "weight", weight)
    check.last_dim_contiguous(op, "input", input)
    check.require(input.shape[-1] != 0, op, "input", "must have a hidden size (last dimension) of at least 1")
    check.require(weight.dim() == 1 and weight.shape[0] == input.shape[-1], op, "weight",
                  lambda: f"must have shape ({input.shape[-1]},) to match the hidden size of 'input', got {tuple(weight.shape)}")
    check.same_device(op, "weight", weight, "input", input)
    check.residual(op, residual, input)
    check.require(eps >= 0.0, op, "eps", lambda: f"must be >= 0, got {eps}")


def validate(input: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str) -> None:
    process_group(OP, group_name)
    _validate_rows(OP, input, residual, weight, eps)
    check.no_overlap(OP, (("input", input, True), ("residual", residual, True), ("weight", weight, False)))


def validate_quant(input: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str,
                   scale: Optional[Tensor] = None, group_size: int = fp8.PER_TOKEN, column_major_scales: bool = False,
                   scale_ue8m0: bool = False) -> None:
    process_group(QUANT_OP, group_name)
    _validate_rows(QUANT_OP, input, residual, weight, eps)
    fp8.validate_epilogue(QUANT_OP, input, input.shape[-1], scale, group_size, column_major_scales, scale_ue8m0)
    check.no_overlap(QUANT_OP, (("input", input, False), ("residual", residual, True), ("weight", weight, False),
                                ("scale", scale, False)))


def _fake(input: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str) -> None:
    validate(input, residual, weight, eps, group_name)


def _fake_quant(input, residual, weight, eps, group_name, scale=None, group_size=fp8.PER_TOKEN,
                column_major_scales=False, scale_ue8m0=False):
    validate_quant(input, residual, weight, eps, group_name, scale, group_size, column_major_scales, scale_ue8m0)
    return fp8.empty_outputs(input, input.shape[-1], scale, group_size, column_major_scales)


# ----------------------------------------------------------------------------------------------
# Typed wrappers: what IDEs show, and what docs/ops.md is generated from.


def all_reduce_fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str) -> None:
    """``residual += all_reduce(input); input = rmsnorm(residual) * weight``, in place

    The tensor-parallel layer's epilogue: the sum of ``input`` over the ranks of the process group named
    ``group_name`` (a ``torch.distributed`` group's ``group.group_name``; every rank calls the op with
    the same shapes), added to ``residual``, then ``fused_add_rmsnorm``'s norm of the sum written to
    ``input``. Today the all-reduce is ``torch.distributed.all_reduce`` (NCCL on CUDA, gloo on the
    CPU) of ``input`` in place, followed by ``fused_add_rmsnorm``; the result is theirs. In a CUDA
    graph it is captured as NCCL's all-reduce is.

    Args:
        input: ``(..., hidden)`` float32, float16 or bfloat16 on every rank, last dimension contiguous;
            overwritten with the normalised rows.
        residual: the shape and dtype of ``input``; overwritten with ``residual + all_reduce(input)``.
        weight: ``(hidden,)``.
        eps: added to the mean square.
        group_name: the process group's name. A name that resolves to no group is refused.

    Returns:
        Nothing: ``input`` and ``residual`` are updated in place. Not differentiable.
    """
    torch.ops.deepinfer.all_reduce_fused_add_rmsnorm.default(input, residual, weight, eps, group_name)


def all_reduce_fused_add_rmsnorm_fp8_quant(input: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str,
                                           scale: Optional[Tensor] = None, group_size: int = fp8.PER_TOKEN,
                                           column_major_scales: bool = False, scale_ue8m0: bool = False):
    """``residual += all_reduce(input); (q, scales) = fp8_quant(rmsnorm(residual) * weight)``

    ``all_reduce_fused_add_rmsnorm`` ending in ``fused_add_rmsnorm_fp8_quant``'s FP8 epilogue: ``input``
    is summed over the group's ranks into a fresh buffer (``input`` itself is only read), added to
    ``residual`` in place, normalised, rounded to the input's dtype and quantised to ``float8_e4m3fn``
    as the quant arguments say (static ``scale``, per token, or groups of ``group_size``). Today the
    all-reduce is ``torch.distributed.all_reduce`` followed by ``fused_add_rmsnorm_fp8_quant``; the
    result is theirs, bit for bit.

    Args:
        input, residual, weight, eps, group_name: as ``all_reduce_fused_add_rmsnorm`` (``input`` read only).
        scale, group_size, column_major_scales, scale_ue8m0: as ``fused_add_rmsnorm_fp8_quant``.

    Returns:
        ``(q, scales)`` as ``fused_add_rmsnorm_fp8_quant`` returns them. Not differentiable.
    """
    return torch.ops.deepinfer.all_reduce_fused_add_rmsnorm_fp8_quant.default(
        input, residual, weight, eps, group_name, scale, group_size, column_major_scales, scale_ue8m0)


# ----------------------------------------------------------------------------------------------
# Samples and bench cases run on a world of one (the all-reduce the identity): the ops' numerics
# across ranks are tests/test_collective.py's, in worlds of gloo processes.


def world_of_one() -> str:
    """The name of a process group of this process alone: the default group, initialised here as a world
    of one (gloo, and NCCL for CUDA tensors) where no default group exists yet. A world of several ranks
    has no group that one rank may run collectives on alone: refused."""
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError(f"{OP}'s samples run on one rank; this process is one of {dist.get_world_size()} ranks")
    return dist.group.WORLD.group_name


#: (leading shape, hidden size, row stride or None): one token, 3-D, strided rows, zero tokens, odd sizes
SAMPLE_SHAPES = (((1,), 1, None), ((3,), 256, None), ((2, 3), 257, None), ((0,), 64, None), ((4,), 96, 160))
#: the FP8 samples' quant modes: (static scale, group_size, column_major_scales, scale_ue8m0)
QUANT_MODES = ((True, -1, False, False), (False, -1, False, False), (False, 32, True, False), (False, -1, False, False),
               (False, 32, False, True))


def _rows(lead, n, stride, device, dtype) -> Tensor:
    if stride is None:
        return torch.randn(*lead, n, device=device, dtype=dtype)
    return torch.randn(*lead, stride, device=device, dtype=dtype)[..., :n]


def _samples(device, dtype) -> Iterator[tuple]:
    group = world_of_one()
    for lead, n, stride in SAMPLE_SHAPES:
        yield (_rows(lead, n, stride, device, dtype), _rows(lead, n, stride, device, dtype),
               torch.randn(n, device=device, dtype=dtype), 1e-5, group)


def _samples_quant(device, dtype) -> Iterator[tuple]:
    group = world_of_one()
    for (lead, n, _), (static, group_size, column_major, ue8m0) in zip(SAMPLE_SHAPES, QUANT_MODES):
        if n % 32 and group_size > 0:
            group_size, column_major, ue8m0 = -1, False, False
        scale = torch.rand((1,), device=device) * 0.01 + 0.005 if static else None
        yield (torch.randn(*lead, n, device=device, dtype=dtype), torch.randn(*lead, n, device=device, dtype=dtype),
               torch.randn(n, device=device, dtype=dtype), 1e-5, group, scale, group_size, column_major, ue8m0)


def _tokens(n: int, device) -> tuple:
    return ((torch.randn(n, 64, device=device), torch.randn(n, 64, device=device), torch.randn(64, device=device),
             1e-6, world_of_one()), (0, 1))


def _tokens_quant(n: int, device) -> tuple:
    return ((torch.randn(n, 128, device=device), torch.randn(n, 128, device=device), torch.randn(128, device=device),
             1e-6, world_of_one(), None, -1, False, False), (0, 1))


def _compare_quant(got: list, want: list, dtype=None) -> None:
    """``(q, scales)`` within one step of the reference (:func:`torch_kernels.fp8.compare_epilogue`)."""
    fp8.compare_epilogue(got[:2], want[:2], dtype)
    assert len(got) == len(want), f"{len(got)} outputs, expected {len(want)}"
    for g, w in zip(got[2:], want[2:]):
        assert_close(g, w, dtype)


def _size(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _bench_shape(tokens: int, hidden: Optional[int], profile: str):
    return tokens, hidden, f"{tokens}x{hidden}"


def _bench_args(rows: int, hidden: int, profile: str, device, dtype) -> tuple:
    return (torch.randn(rows, hidden, device=device, dtype=dtype), torch.randn(rows, hidden, device=device, dtype=dtype),
            torch.randn(hidden, device=device, dtype=dtype), 1e-6, world_of_one())


def _bench_args_quant(rows: int, hidden: int, profile: str, device, dtype) -> tuple:
    return (*_bench_args(rows, hidden, profile, device, dtype), torch.full((1,), 0.01, device=device), -1, False, False)


def _unfused(quant: bool) -> Peer:
    """The all-reduce, then our fused op: what a layer runs without the fused collective."""
    def pair(x, r, w, eps, group_name, *quant_args):
        dist.all_reduce(x, group=process_group(OP, group_name))
        if quant:
            return torch.ops.deepinfer.fused_add_rmsnorm_fp8_quant(x, r, w, eps, *quant_args)
        torch.ops.deepinfer.fused_add_rmsnorm(x, r, w, eps)
    return Peer("unfused", pair, prepare=lambda args: (args[0].clone(), *args[1:]))


def _quant_nbytes(args: tuple) -> int:
    x, scale = args[0], args[5]
    return x.numel() + (4 if scale is not None else x[..., 0].numel() * 4)  # q and the scales, written once


# on one GPU the suite times a world of one; the collective's own figures need several GPUs
_BENCH = BenchCase(_bench_shape, _bench_args, lambda args: 4 * _size(args[0]) + _size(args[2]), takes_hidden=True,
                   peers=(_unfused(False),))
_BENCH_QUANT = BenchCase(_bench_shape, _bench_args_quant,
                         lambda args: 3 * _size(args[0]) + _size(args[2]) + _quant_nbytes(args), takes_hidden=True,
                         peers=(_unfused(True),))

OPS = (
    OpDef(f"{OP}(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps, str group_name) -> ()",
          validate, _fake, all_reduce_fused_add_rmsnorm, _samples, _tokens,
          no_grad_reason="it overwrites input and residual in place", bench=_BENCH),
    OpDef(f"{QUANT_OP}(Tensor input, Tensor(a!) residual, Tensor weight, float eps, str group_name, "
          "Tensor? scale=None, int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False) "
          "-> (Tensor, Tensor)",
          validate_quant, _fake_quant, all_reduce_fused_add_rmsnorm_fp8_quant, _samples_quant, _tokens_quant,
          no_grad_reason="it overwrites residual in place and quantises to float8", compare=_compare_quant,
          bench=_BENCH_QUANT),
)
