"""The ``out`` overloads whose kernels write the given tensors themselves (``KernelSpec.out``).

On CUDA the serving backend writes the tensors given to ``torch.ops.deepinfer.<op>.out`` when they are
laid out as it writes (contiguous, column-major scales where the op returns them so, 16-byte aligned)
and apart from the inputs; otherwise the default overload's result is copied there. The CUDA entry runs
here on CPU tensors, as test_dispatch's slots do: ``cuda_platform`` resolves the selection as on an
sm_90 machine, and Triton runs in its interpreter (``triton_world``: TileLang and FlashInfer cannot run
on CPU tensors). On a GPU, the registered ``out`` overloads against the default overload, every backend.
"""

import inspect

import pytest
import torch

from torch_kernels import dispatch, library, ops, outputs, registry, tuning
from torch_kernels.spec import Backend

from conftest import bits, triton_here

#: (op, backend) of every implementation that writes its out overload's tensors itself
OUT_SPECS = sorted((k.op, k.backend.value) for k in registry.KERNELS if k.out)
TRITON_OUT_OPS = sorted(op for op, b in OUT_SPECS if b == Backend.TRITON.value)
FAMILY_OF = {info.name: f.name for f in registry.FAMILIES for info in f.ops}


def _copied_is_not_called(*args, **outs):
    raise AssertionError("the out call went to the copy of the default overload's result")


class _Spy:
    """The copy path, counting its calls."""

    def __init__(self, op):
        self.calls, self.kernel = 0, library._out_entries(ops.BY_NAME[op])[0]

    def __call__(self, *args, **outs):
        self.calls += 1
        return self.kernel(*args, **outs)


def _entry(op, copied=_copied_is_not_called):
    opdef = ops.BY_NAME[op]
    return library._cuda_out_entry(opdef, dispatch.slot(op, opdef.data_arg), copied)


def _tuple(results):
    return (results,) if isinstance(results, torch.Tensor) else tuple(results)


def _random_like(t):
    """A tensor of ``t``'s shape, strides and dtype holding random values (never zeros: a kernel
    that writes nothing is seen)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    if t.numel():
        return out.copy_(torch.randn(t.shape, device=t.device).mul_(100).to(t.dtype))
    return out


def _outs(op, results):
    return {name: _random_like(r) for name, r in zip(ops.BY_NAME[op].out_names, _tuple(results))}


def test_every_out_implementation_takes_out_as_a_keyword():
    """The manifests' ``out_ops`` hold: each such function has the keyword ``out``."""
    checked = 0
    for spec in registry.KERNELS:
        if not spec.out or spec.capability.missing_package():
            continue
        parameter = inspect.signature(spec.load()).parameters.get("out")
        assert parameter is not None and parameter.kind is inspect.Parameter.KEYWORD_ONLY, (spec.op, spec.backend)
        assert parameter.default is None, (spec.op, spec.backend)
        checked += 1
    assert checked >= len(TRITON_OUT_OPS)


def test_only_ops_with_an_out_overload_are_marked():
    for op, _ in OUT_SPECS:
        assert ops.BY_NAME[op].out_names, op


@pytest.mark.usefixtures("triton_world")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", TRITON_OUT_OPS)
def test_triton_writes_the_given_outputs(op, dtype, cuda_platform):
    """Triton's kernels write the given tensors, bit for bit what the default call returns, and the
    entry returns those tensors (no copy: the copy path raises here)."""
    triton_here(FAMILY_OF[op], "cpu")
    slot, entry = dispatch.slot(op, ops.BY_NAME[op].data_arg), _entry(op)
    samples = list(ops.BY_NAME[op].samples("cpu", dtype))
    assert samples
    for args in samples:
        want = _tuple(slot.call(*args))
        outs = _outs(op, want)
        got = _tuple(entry(*args, **outs))
        assert all(g is o for g, o in zip(got, outs.values()))
        for g, w in zip(got, want):
            assert torch.equal(bits(g), bits(w)), (op, dtype, tuple(w.shape))


@pytest.mark.usefixtures("triton_world")
def test_outputs_laid_out_otherwise_are_copied(cuda_platform):
    """Strided outputs, a misaligned one, and contiguous scales where the op writes column-major ones
    take the copy, with the same values."""
    triton_here("norm", "cpu")
    x, w = torch.randn(5, 96), torch.randn(96)
    want = torch.ops.deepinfer.rmsnorm(x, w, 1e-6)
    spy = _Spy("rmsnorm")
    strided = torch.randn(96, 5).t()
    misaligned = torch.randn(5 * 96 + 1)[1:].view(5, 96)
    for out in (strided, misaligned):
        got = _entry("rmsnorm", spy)(x, w, 1e-6, out=out)
        assert got is out
        torch.testing.assert_close(out, want)
    assert spy.calls == 2

    q_want, s_want = torch.ops.deepinfer.per_token_group_quant_fp8(x, 32, 1e-10, True)
    assert s_want.stride() == (1, 5)  # column-major scales
    spy = _Spy("per_token_group_quant_fp8")
    q, s = torch.empty_like(q_want), torch.randn(5, 3)  # row-major scales
    _entry("per_token_group_quant_fp8", spy)(x, 32, 1e-10, True, out0=q, out1=s)
    assert spy.calls == 1 and torch.equal(bits(q), bits(q_want)) and torch.equal(s, s_want)


@pytest.mark.usefixtures("triton_world")
def test_outputs_meeting_an_input_are_copied(cuda_platform):
    """An output that is the input, or shares its memory, takes the copy: the result is that of the
    input as it was."""
    triton_here("norm", "cpu")
    x, w = torch.randn(4, 64), torch.randn(64)
    want = torch.ops.deepinfer.rmsnorm(x, w, 1e-6)
    spy = _Spy("rmsnorm")
    got = _entry("rmsnorm", spy)(x, w, 1e-6, out=x)
    assert got is x and spy.calls == 1
    torch.testing.assert_close(x, want)

    h = torch.randn(3, 2 * 64)
    want = torch.ops.deepinfer.silu_and_mul(h)
    spy = _Spy("silu_and_mul")
    apart = torch.empty(3, 64)
    torch.testing.assert_close(_entry("silu_and_mul")(h, out=apart), want)  # written directly: a copy would raise
    out = h.view(-1)[64:64 + 3 * 64].view(3, 64)  # contiguous, inside the input's memory
    assert _entry("silu_and_mul", spy)(h, out=out) is out and spy.calls == 1
    torch.testing.assert_close(out, want)


@pytest.mark.usefixtures("triton_world")
def test_inputs_sharing_memory_are_still_written_directly(cuda_platform):
    """Only the outputs must be apart: inputs may share memory (one partial passed twice)."""
    triton_here("attention", "cpu")
    v, lse = torch.randn(3, 2, 16), torch.randn(3, 2)
    want = torch.ops.deepinfer.merge_attn_states(v, lse, v, lse)
    out0, out1 = torch.randn(3, 2, 16), torch.randn(3, 2)
    got = _entry("merge_attn_states")(v, lse, v, lse, out0=out0, out1=out1)  # the copy would raise
    assert got[0] is out0 and got[1] is out1
    torch.testing.assert_close(out0, want[0])
    torch.testing.assert_close(out1, want[1])


@pytest.mark.usefixtures("triton_world")
def test_a_call_its_backend_refuses_is_copied(cuda_platform):
    """fp64 goes to the reference, which has no ``out``: the copy serves it."""
    triton_here("norm", "cpu")
    x, w = torch.randn(3, 32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    spy = _Spy("rmsnorm")
    out = torch.randn(3, 32, dtype=torch.float64)
    _entry("rmsnorm", spy)(x, w, 1e-6, out=out)
    assert spy.calls == 1
    torch.testing.assert_close(out, torch.ops.deepinfer.rmsnorm(x, w, 1e-6))


@pytest.mark.usefixtures("triton_world")
@pytest.mark.parametrize("op, args, name, bad", [
    ("rmsnorm", lambda: (torch.randn(4, 64), torch.randn(64), 1e-6), "out", torch.randn(4, 63)),
    ("rmsnorm", lambda: (torch.randn(4, 64), torch.randn(64), 1e-6), "out", torch.randn(4, 64, dtype=torch.float64)),
    ("silu_and_mul", lambda: (torch.randn(4, 64),), "out", torch.randn(4, 64)),
    ("scaled_fp8_quant", lambda: (torch.randn(4, 64), None, True), "out1", torch.randn(1)),
    ("merge_attn_states", lambda: (torch.randn(3, 2, 16), torch.randn(3, 2), torch.randn(3, 2, 16), torch.randn(3, 2)),
     "out1", torch.randn(3, 2, dtype=torch.float16)),
])
def test_a_wrong_output_names_the_overload_and_the_argument(op, args, name, bad, cuda_platform):
    """Refused before anything is written, as the copy path refuses it."""
    triton_here(FAMILY_OF[op], "cpu")
    args = args()
    outs = _outs(op, _tuple(getattr(torch.ops.deepinfer, op)(*args)))
    outs[name] = bad
    before = {n: t.clone() for n, t in outs.items()}
    with pytest.raises(ValueError, match=rf"^deepinfer::{op}.out: argument '{name}' must be "):
        _entry(op)(*args, **outs)
    assert all(torch.equal(bits(outs[n]), bits(before[n])) for n in outs)


@pytest.mark.usefixtures("triton_world")
def test_zero_tokens_write_the_static_scale(cuda_platform):
    triton_here("quant", "cpu")
    scale = torch.tensor([0.5])
    q, s = torch.empty(0, 64, dtype=torch.float8_e4m3fn), torch.randn(1)
    _entry("scaled_fp8_quant")(torch.randn(0, 64), scale, out0=q, out1=s)
    assert torch.equal(s, scale)


def test_given_checks_shape_dtype_device_then_layout():
    t = torch.randn(4, 8)
    assert outputs.given((t,), 0, (4, 8), torch.float32, t.device) is t
    with pytest.raises(outputs.WrongOutput):
        outputs.given((t,), 0, (4, 9), torch.float32, t.device)
    with pytest.raises(outputs.WrongOutput):
        outputs.given((t,), 0, (4, 8), torch.float16, t.device)
    with pytest.raises(outputs.Restage):
        outputs.given((t.t(),), 0, (8, 4), torch.float32, t.device)
    column_major = torch.empty(8, 4).t()
    assert outputs.given((column_major,), 0, (4, 8), torch.float32, t.device, (1, 4)) is column_major


@pytest.mark.gpu
@pytest.mark.parametrize("op, backend", OUT_SPECS)
def test_registered_out_overload_writes_in_place_on_cuda(op, backend):
    """Each backend serving the op alone: ``op.out`` returns the given tensors holding, bit for bit,
    what the default overload returns, written by the backend (no copy counted)."""
    spec = registry.BY_OP[op][Backend(backend)]
    if spec.capability.missing_package():
        pytest.skip(spec.capability.missing_package())
    dispatch.configure(backend=backend)
    opdef, overload = ops.BY_NAME[op], getattr(torch.ops.deepinfer, op)
    slot = dispatch.slot(op, opdef.data_arg)
    dtype = torch.bfloat16 if backend == Backend.FLASHINFER.value else torch.float32
    served = 0
    for args in opdef.samples("cuda", dtype):
        server = slot.server(args)
        if server is None or server.spec is not spec:
            continue  # a call this backend refuses
        want = _tuple(overload.default(*args))
        outs = _outs(op, want)
        copies = library.out_copies[op]
        got = _tuple(overload.out(*args, **outs))
        assert library.out_copies[op] == copies, (op, backend, "copied")
        assert all(g is o for g, o in zip(got, outs.values()))
        for g, w in zip(got, want):
            assert torch.equal(bits(g), bits(w)), (op, backend, tuple(w.shape))
        served += 1
    assert served, f"{backend} served no sample of {op}"


@pytest.mark.usefixtures("triton_world")
def test_under_auto_the_buckets_winner_writes_or_copies(cuda_platform, tmp_path, monkeypatch):
    """``auto``: the out call goes to the winner of its bucket, as the default call does; a winner that
    writes outputs writes them, the reference (no ``out``) is copied."""
    triton_here("norm", "cpu")
    monkeypatch.setenv(tuning.ENV_TUNE_DIR, str(tmp_path / "tune"))
    entries = [{"op": "rmsnorm", "dtype": "float32", "width": 96, "rows": rows, "winner": winner,
                "fingerprints": {winner: tuning.current_fingerprint("rmsnorm", winner)}}
               for rows, winner in ((1, "torch"), (64, "triton"))]
    tuning.save(entries, tuning.table_key(cuda_platform), tuning.user_dir() / tuning.file_name(cuda_platform))
    dispatch.configure(backend="auto")
    w = torch.randn(96)
    for rows, copies in ((1, 1), (64, 0)):
        x, spy = torch.randn(rows, 96), _Spy("rmsnorm")
        out = torch.randn(rows, 96)
        assert _entry("rmsnorm", spy)(x, w, 1e-6, out=out) is out and spy.calls == copies, rows
        torch.testing.assert_close(out, torch.ops.deepinfer.rmsnorm(x, w, 1e-6))
