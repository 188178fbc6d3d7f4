"""The tensor-parallel norm ops (``all_reduce_fused_add_rmsnorm`` and its FP8 form) in worlds of two
and four gloo processes on the CPU, against a formula written here in fp64 from every rank's input;
bad input named before anything is written."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_kernels as tk
from torch_kernels.families.collective.ops import world_of_one

from conftest import assert_bad_inputs_raise

HIDDEN = 96


def _inputs(rank: int, tokens: int, dtype):
    """Rank ``rank``'s partial output, and the residual and weight every rank holds."""
    g = torch.Generator().manual_seed(1000 + rank)
    shared = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    residual = torch.randn(tokens, HIDDEN, generator=shared).to(dtype)
    weight = (1 + 0.3 * torch.randn(HIDDEN, generator=shared)).to(dtype)
    return x, residual, weight


def _formula(world: int, tokens: int, dtype, eps: float):
    """fp64: the residual plus every rank's input (each read at its dtype), then ``y / rms(y) * w``."""
    parts = [_inputs(r, tokens, dtype) for r in range(world)]
    y = parts[0][1].double() + sum(p[0].double() for p in parts)
    w = parts[0][2].double()
    return y, y / torch.sqrt((y * y).mean(-1, keepdim=True) + eps) * w


def _worker(rank: int, world: int, store_path: str):
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        group = dist.group.WORLD.group_name
        eps = 1e-6
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            for tokens in (1, 5, 0):
                x, residual, weight = _inputs(rank, tokens, dtype)
                want_residual, want = _formula(world, tokens, dtype, eps)
                tk.all_reduce_fused_add_rmsnorm(x, residual, weight, eps, group)
                torch.testing.assert_close(residual.double(), want_residual, atol=tol, rtol=tol)
                torch.testing.assert_close(x.double(), want, atol=tol * 4, rtol=tol * 4)
                # FP8: input only read; q * scale is the normalised row within an e4m3 step (2^-3 relative)
                x, residual, weight = _inputs(rank, tokens, dtype)
                before = x.clone()
                q, scales = tk.all_reduce_fused_add_rmsnorm_fp8_quant(x, residual, weight, eps, group)
                assert torch.equal(x, before), "the FP8 op wrote its input"
                torch.testing.assert_close(residual.double(), want_residual, atol=tol, rtol=tol)
                assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scales.shape == (tokens, 1)
                deq = q.double() * scales.double()
                row_max = want.abs().amax(-1, keepdim=True) if tokens else want
                assert ((deq - want).abs() <= 2 ** -3 * want.abs() + row_max / 448 + tol * 8).all()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_worlds_match_the_formula(world, tmp_path):
    """Every rank's outputs against the fp64 formula of the sum over all ranks: fp32 and bf16, one token,
    several, none; the FP8 form's residual and dequantised rows, its input untouched."""
    mp.spawn(_worker, args=(world, str(tmp_path / "store")), nprocs=world, join=True)


def _bad_cases():
    name = world_of_one()
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    return [
        ("a group that does not exist", (x, r, w, 1e-6, "no-such-group"), ValueError, "group_name"),
        ("a weight on another device", (x, r, torch.randn(8, device="meta"), 1e-6, name), ValueError, "weight"),
        ("a residual of another shape", (x, torch.randn(3, 9), w, 1e-6, name), ValueError, "residual"),
        ("the residual as the input", (x, x, w, 1e-6, name), ValueError, "residual"),
    ]


@pytest.mark.parametrize("op", ["all_reduce_fused_add_rmsnorm", "all_reduce_fused_add_rmsnorm_fp8_quant"])
def test_bad_input_names_the_op_and_the_argument(op):
    cases = _bad_cases()
    if op.endswith("fp8_quant"):  # the input only read there: it may be the residual's source, not the residual
        cases = [c for c in cases if c[0] != "the residual as the input"]
    assert_bad_inputs_raise(op, cases)
    fn = getattr(torch.ops.deepinfer, op).default
    with pytest.raises((TypeError, RuntimeError)):  # a schema of str: torch refuses anything else
        fn(torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), 1e-6, dist.group.WORLD)


def test_world_of_one_is_the_fused_op():
    """On one rank the all-reduce is the identity: the op is fused_add_rmsnorm, bit for bit."""
    name = world_of_one()
    x, r, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    x2, r2 = x.clone(), r.clone()
    tk.all_reduce_fused_add_rmsnorm(x, r, w, 1e-6, name)
    tk.fused_add_rmsnorm(x2, r2, w, 1e-6)
    assert torch.equal(x, x2) and torch.equal(r, r2)
