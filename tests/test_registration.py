"""The registration: schemas (golden), opcheck, torch.compile tracing, bad input, the op reference."""

import subprocess
import sys

import expecttest
import pytest
import torch
from torch._dynamo.testing import CompileCounter

import torch_kernels
from torch_kernels import ops
from torch_kernels.testing import assert_close, mutated_args, outputs_of

from conftest import DEVICES
from test_dispatch import ROOT

OP_NAMES = [op.name for op in ops.ALL]


def _overload(name):
    return getattr(torch.ops.deepinfer, name).default


class TestSchemas(expecttest.TestCase):
    def test_registered_schemas(self):
        text = "\n".join(str(_overload(op.name)._schema) for op in ops.ALL)
        self.assertExpectedInline(text, """\
deepinfer::rmsnorm(Tensor input, Tensor weight, float eps=9.9999999999999995e-07) -> Tensor
deepinfer::fused_add_rmsnorm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps=9.9999999999999995e-07) -> ()
deepinfer::gemma_rmsnorm(Tensor input, Tensor weight, float eps=9.9999999999999995e-07) -> Tensor
deepinfer::gemma_fused_add_rmsnorm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps=9.9999999999999995e-07) -> ()""")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", OP_NAMES)
def test_opcheck(op, dtype, device):
    opdef = ops.BY_NAME[op]
    for args in opdef.samples(device, dtype):
        torch.library.opcheck(_overload(op), args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", [op.name for op in ops.ALL if op.backward is not None])
def test_opcheck_with_gradients(op, device):
    for args in ops.BY_NAME[op].samples(device, torch.float32):
        args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.numel() else a for a in args)
        torch.library.opcheck(_overload(op), args)


def _block(op):
    """A small compiled region: a neighbour before and after each op."""
    overload, mutated = _overload(op), mutated_args(_overload(op))

    def fn(*args):
        args = tuple(a * 2 if i == 0 else a for i, a in enumerate(args))
        out = overload(*args)
        return [t + 1 for t in ([out] if out is not None else [args[i] for i in mutated])]
    return fn


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OP_NAMES)
def test_compile_fullgraph_one_node_matches_eager(op, device):
    torch._dynamo.reset()
    counter = CompileCounter()
    fn = _block(op)
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for args in ops.BY_NAME[op].samples(device, torch.float32):
        mutated = mutated_args(_overload(op))
        want = outputs_of(fn, args, mutated)
        got = outputs_of(compiled, args, mutated)
        for g, w in zip(got, want):
            assert_close(g, w)
    assert counter.frame_count >= 1 and counter.op_count >= 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OP_NAMES)
def test_compile_inductor_matches_eager(op, device):
    torch._dynamo.reset()
    fn = _block(op)
    compiled = torch.compile(fn, fullgraph=True)
    mutated = mutated_args(_overload(op))
    args = next(iter(ops.BY_NAME[op].samples(device, torch.bfloat16)))
    for g, w in zip(outputs_of(compiled, args, mutated), outputs_of(fn, args, mutated)):
        assert_close(g, w)


def _token_args(op, tokens, device, hidden=64):
    x = torch.randn(tokens, hidden, device=device)
    w = torch.randn(hidden, device=device)
    if ops.BY_NAME[op].backward is None:
        return x, torch.randn(tokens, hidden, device=device), w, 1e-6
    return x, w, 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OP_NAMES)
def test_token_count_changes_do_not_recompile(op, device):
    """Unbacked token counts: one graph for every count, 1 and 0 included. Backed dynamic shapes:
    one graph for every count >= 2 (Dynamo specialises 0 and 1 on its own)."""
    for mark, counts in [(torch._dynamo.decorators.mark_unbacked, [3, 8, 1, 17, 0, 300]),
                         (torch._dynamo.mark_dynamic, [3, 8, 17, 300])]:
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(_block(op), backend=counter, fullgraph=True)
        for t in counts:
            args = _token_args(op, t, device)
            for a in args[:-2]:
                mark(a, 0)
            compiled(*args)
        assert counter.frame_count == 1, (mark.__name__, counter.frame_count)


# --- bad input -----------------------------------------------------------------------------------

def _bad_cases(op, device):
    x, w = torch.randn(4, 64, device=device), torch.randn(64, device=device)
    fused = ops.BY_NAME[op].backward is None
    r = torch.randn(4, 64, device=device)

    def args(x=x, w=w, r=r, eps=1e-6):
        return (x, r, w, eps) if fused else (x, w, eps)
    cases = [
        ("integer input", args(x=torch.ones(4, 64, dtype=torch.int32, device=device)), TypeError, "input"),
        ("weight of the wrong size", args(w=torch.randn(63, device=device)), ValueError, "weight"),
        ("2-D weight", args(w=torch.randn(1, 64, device=device)), ValueError, "weight"),
        ("integer weight", args(w=torch.ones(64, dtype=torch.int64, device=device)), TypeError, "weight"),
        ("non-contiguous last dim", args(x=torch.randn(64, 4, device=device).t(),
                                         r=torch.randn(64, 4, device=device).t()), ValueError, "input"),
        ("zero hidden size", args(x=torch.randn(4, 0, device=device), w=torch.randn(0, device=device),
                                  r=torch.randn(4, 0, device=device)), ValueError, "input"),
        ("negative eps", args(eps=-1.0), ValueError, "eps"),
        ("weight on another device", args(w=torch.randn(64, device="meta")), ValueError, "weight"),
    ]
    if fused:
        cases += [
            ("residual of another shape", args(r=torch.randn(5, 64, device=device)), ValueError, "residual"),
            ("residual of another dtype", args(r=r.half()), TypeError, "residual"),
            ("residual that is the input", args(r=x), ValueError, "residual"),
        ]
    return cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OP_NAMES)
def test_bad_input_names_the_op_and_the_argument(op, device):
    for what, args, exc, arg in _bad_cases(op, device):
        before = [a.clone() for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"]
        with pytest.raises(exc, match=rf"^deepinfer::{op}: argument '{arg}' ") as e:
            _overload(op)(*args)
        after = [a for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"]
        assert all(torch.equal(b.nan_to_num(), a.nan_to_num()) for b, a in zip(before, after)), f"{what}: clobbered"
        assert e.value is not None, what


@pytest.mark.gpu
@pytest.mark.parametrize("op", OP_NAMES)
def test_tensors_on_cuda_and_cpu_raise_before_any_kernel(op):
    x, w = torch.randn(4, 64, device="cuda"), torch.randn(64)
    args = (x, torch.randn(4, 64, device="cuda"), w, 1e-6) if ops.BY_NAME[op].backward is None else (x, w, 1e-6)
    with pytest.raises(ValueError, match=rf"deepinfer::{op}: argument 'weight' is on cpu but 'input' is on cuda"):
        _overload(op)(*args)
    torch.cuda.synchronize()  # the CUDA context is intact


def test_bad_input_raises_at_trace_time():
    compiled = torch.compile(lambda x, w: torch.ops.deepinfer.rmsnorm(x, w), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"deepinfer::rmsnorm: argument 'weight' must have shape \(64,\)"):
        compiled(torch.randn(4, 64), torch.randn(63))


# --- the wrappers and the op reference --------------------------------------------------------------

def test_wrappers_are_the_registered_ops():
    x, w = torch.randn(3, 40), torch.randn(40)
    for op in ops.ALL:
        assert op.wrapper is getattr(torch_kernels, op.name)
        assert op.wrapper.__doc__.startswith("``"), f"{op.name}: the docstring opens with the formula"
    assert torch.equal(torch_kernels.rmsnorm(x, w), torch.ops.deepinfer.rmsnorm(x, w))


def test_docs_op_reference_is_up_to_date():
    r = subprocess.run([sys.executable, "-m", "torch_kernels", "docs", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_main_job_runs_the_self_check():
    r = subprocess.run([sys.executable, "-m", "torch_kernels"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all backends match the reference" in r.stdout
    for name in OP_NAMES:
        assert name in r.stdout
