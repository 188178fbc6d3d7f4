"""The sampling family's logits ops (``softmax``, ``top_k_mask_logits``): the reference against an
independent fp64 formula; every backend against the reference over the op's samples and awkward
shapes (Triton in its interpreter on CPU); the edge cases the docstrings promise (all ``-inf`` rows,
ties, ``top_k`` outside ``(0, V)``, temperature 0); bad input; FlashInfer beside them on a GPU."""

import math

import pytest
import torch

import torch_kernels
from torch_kernels import ops, registry
from torch_kernels.families.sampling import reference
from torch_kernels.spec import Backend
from torch_kernels.testing import assert_close

from conftest import DEVICES, assert_bad_inputs_raise, implementations_on

LOGIT_OPS = ["softmax", "top_k_mask_logits"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NINF = float("-inf")


# ------------------------------------------------------------------------------------------------
# Independent formulas: fp64, pairwise ranks (no sort, no order keys).


def _softmax_formula(logits, temperature):
    """fp64 ``exp(x - logsumexp(x))`` with ``x = logits * (1/t)`` in fp32 (0 at t = 0);
    ``-inf`` logits give 0; a row without a finite logit gives NaN."""
    B, V = logits.shape
    t = (temperature.float() if isinstance(temperature, torch.Tensor) else torch.full((B,), float(temperature)))
    inv = torch.where(t == 0, torch.zeros_like(t), 1 / t)[:, None].to(logits.device)
    x = (logits.float() * inv).double()  # the definition's fp32 product: at |x| ~ 8000 its rounding is ~1e-3
    x = torch.where(logits.isneginf(), NINF, x)
    out = torch.empty(B, V, dtype=torch.float64, device=logits.device)
    for b in range(B):
        row = x[b]
        if torch.isneginf(row).all():
            out[b] = math.nan
        else:
            out[b] = torch.exp(row - torch.logsumexp(row, 0))
    return out


def _top_k_formula(logits, top_k):
    """Kept iff fewer than ``k`` logits are strictly larger (NaN as -inf); the rest -inf."""
    x = logits.double().nan_to_num(nan=NINF, posinf=math.inf, neginf=NINF)
    B, V = x.shape
    ks = top_k.tolist() if isinstance(top_k, torch.Tensor) else [top_k] * B
    out = logits.clone()
    for b, k in enumerate(ks):
        if 0 < k < V:
            larger = (x[b][None, :] > x[b][:, None]).sum(-1)  # [i]: how many exceed x_i
            out[b] = torch.where(larger < k, logits[b], NINF)
    return out


def _rows(device, dtype, vocab=1000, rows=4, scale=3.0):
    return (torch.randn(rows, vocab, device=device) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_reference_matches_independent_formula(dtype):
    torch.manual_seed(0)
    logits = _rows("cpu", dtype)
    logits[0, ::4] = NINF
    logits[1, :-1] = NINF  # one finite logit: probability 1
    logits[2] += 5000  # stability: exp of the raw logits overflows
    for temperature in (1.0, 0.6, 1.7, torch.tensor([0.5, 1.0, 2.0, 0.0]), torch.tensor([1.0, 3.0, 0.2, 0.9]).bfloat16()):
        got = torch_kernels.softmax(logits, temperature)
        want = _softmax_formula(logits, temperature)
        assert got.dtype == torch.float32 and got.shape == logits.shape
        assert_close(got, want.float(), msg=f"temperature {temperature}")
        assert torch.isfinite(got).all() and (got[0, ::4] == 0).all() and got[1, -1] == 1.0
        assert_close(got.double().sum(-1), torch.ones(4, dtype=torch.float64), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_mask_reference_matches_independent_formula(dtype):
    torch.manual_seed(1)
    logits = _rows("cpu", dtype, vocab=500, rows=6)
    logits[1] = logits[1].round()  # ~20 distinct values: ties at the k-th largest
    logits[2, :10] = torch.tensor([NINF, math.nan, math.inf, NINF, 0, 0, 0, 0, 0, 0])
    logits[3, 50:] = NINF  # k beyond the finite logits: the -inf tie is kept (it is -inf anyway)
    for top_k in (1, 7, 50, 499, torch.tensor([5, 40, 3, 100, 0, 500]), torch.tensor([1, 1, 2, 499, -3, 250], dtype=torch.int32)):
        got = torch_kernels.top_k_mask_logits(logits, top_k)
        want = _top_k_formula(logits, top_k)
        assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"top_k {top_k}"


def test_top_k_mask_keeps_ties_and_keeps_all_outside_range():
    x = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0], [0.5, 0.25, 0.25, 0.125, 0.125]])
    got = torch_kernels.top_k_mask_logits(x, 2)  # the 2nd largest of row 0 is 3: all three 3s stay
    assert torch.equal(got, torch.tensor([[3.0, NINF, 3.0, NINF, 3.0], [0.5, 0.25, 0.25, NINF, NINF]]))
    assert torch.equal(torch_kernels.top_k_mask_logits(x, torch.tensor([1, 4])),
                       torch.tensor([[3.0, NINF, 3.0, NINF, 3.0], [0.5, 0.25, 0.25, 0.125, 0.125]]))
    nan_row = torch.tensor([[math.nan, 1.0, 2.0, NINF]])
    for k in (0, -1, 5, 6, 2**40):  # V = 5
        assert torch.equal(torch_kernels.top_k_mask_logits(x, k), x), f"top_k {k} keeps all"
        kept = torch_kernels.top_k_mask_logits(nan_row, k - 1 if k == 5 else k)  # V = 4
        assert torch.equal(kept.isnan(), nan_row.isnan()) and torch.equal(kept[:, 1:], nan_row[:, 1:])
    # NaN ranks as -inf: not among the top 2, masked; among the top 3 with -inf, kept as it is
    assert torch.equal(torch_kernels.top_k_mask_logits(nan_row, 2), torch.tensor([[NINF, 1.0, 2.0, NINF]]))
    three = torch_kernels.top_k_mask_logits(nan_row, 3)
    assert three[0, 0].isnan() and torch.equal(three[0, 1:], nan_row[0, 1:])


def test_softmax_edge_rows():
    x = torch.tensor([[NINF] * 4, [NINF, 1.0, NINF, 1.0], [2.0, NINF, 0.0, -1.0], [math.nan, 0.0, 1.0, 2.0],
                      [math.inf, 0.0, 1.0, 2.0]])
    got = torch_kernels.softmax(x)
    assert got[0].isnan().all(), "a row of -inf: NaN, as FlashInfer and torch.softmax"
    assert torch.equal(got[1], torch.tensor([0.0, 0.5, 0.0, 0.5]))
    assert got[3].isnan().all() and got[4].isnan().all()
    zero = torch_kernels.softmax(x[2:3], torch.tensor([0.0]))  # temperature 0: uniform over the finite logits
    assert torch.equal(zero, torch.tensor([[1 / 3, 0.0, 1 / 3, 1 / 3]]))
    assert torch.equal(torch_kernels.softmax(x[2:3], 0.0), zero)
    assert torch.equal(torch_kernels.softmax(x[1:3], None), torch_kernels.softmax(x[1:3], 1.0))
    per_row = torch_kernels.softmax(x[1:3], torch.tensor([0.5, 2.0]))
    assert torch.equal(per_row[1], torch_kernels.softmax(x[2:3], 2.0)[0])


# ------------------------------------------------------------------------------------------------
# Backends against the reference: the op's samples in each dtype, and on CUDA the vocabularies engines use.


def _cuda_cases(op, dtype):
    for vocab, rows in ((32000, 5), (128256, 64), (256000, 3), (1000, 1)):
        logits = _rows("cuda", dtype, vocab=vocab, rows=rows)
        logits[0, ::7] = NINF
        if op == "softmax":
            yield logits, torch.rand(rows, device="cuda") + 0.3, 1.0
            yield logits, None, 0.8
        else:
            yield logits, torch.randint(-1, 2000, (rows,), device="cuda", dtype=torch.int32), 0
            yield logits, None, 50
    strided = _rows("cuda", dtype, vocab=128256 + 256, rows=4)[:, :128256]
    yield (strided, None, 1.0) if op == "softmax" else (strided, None, 1024)


def _compare(op, name, got, want):
    if op == "softmax":
        assert got.dtype == torch.float32 and got.is_contiguous(), name
        assert_close(got, want, msg=name)
    else:
        assert got.dtype == want.dtype and got.is_contiguous(), name
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", LOGIT_OPS)
def test_backends_match_reference(op, dtype, device):
    torch.manual_seed(2)
    ref = registry.BY_OP[op][Backend.TORCH].load()
    backends = implementations_on(op, device)
    if device == "cpu":
        assert any(n == "triton-interpreted" for n, _ in backends) or not _interpreting(), backends
    cases = list(ops.BY_NAME[op].samples(device, dtype))
    if device == "cuda":
        cases += list(_cuda_cases(op, dtype))
    for args in cases:
        assert args[0].dtype == dtype
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        want = ref(*args)
        for name, fn in backends:
            _compare(op, f"{name} {tuple(args[0].shape)} {args[1:] if args[1] is None else 'per-row'}", fn(*args), want)
        assert all(not isinstance(b, torch.Tensor) or torch.equal(b.nan_to_num(), a.nan_to_num())
                   for b, a in zip(before, args)), "an input was clobbered"


def _interpreting():
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("device", DEVICES)
def test_triton_edge_rows_match_reference(device):
    """The rows of ``test_softmax_edge_rows`` and ``test_top_k_mask_keeps_ties...`` through Triton:
    NaN where the reference is NaN (all -inf, NaN, +inf), ties, chunks wholly -inf before finite ones."""
    if device == "cpu" and not _interpreting():
        pytest.skip("Triton runs on CPU tensors only in its interpreter")
    from torch_kernels.families.sampling.triton import logits as triton_logits
    x = torch.tensor([[NINF] * 4, [NINF, 1.0, NINF, 1.0], [2.0, NINF, 0.0, -1.0], [math.nan, 0.0, 1.0, 2.0],
                      [math.inf, 0.0, 1.0, 2.0]], device=device)
    late = torch.full((2, 5000), NINF, device=device)  # the first two 2048-chunks all -inf
    late[0, 4500:] = torch.randn(500, device=device)
    late[1, -1] = 3.0
    for rows in (x, late):
        for t in (None, torch.tensor([0.0, 0.5, 1.0, 2.0, 0.0][:rows.shape[0]], device=device)):
            _compare("softmax", "triton", triton_logits.softmax(rows, t, 1.0), reference.softmax(rows, t, 1.0))
    ties = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0], [math.nan, 1.0, 2.0, NINF, 2.0]], device=device)
    for k in (-5, 0, 1, 2, 3, 4, 5, 2**40):
        _compare("top_k_mask_logits", f"triton k={k}", triton_logits.top_k_mask_logits(ties, None, k),
                 reference.top_k_mask_logits(ties, None, k))
    for dtype in (torch.bfloat16, torch.float16):  # the extremes of the order keys
        big = torch.tensor([[torch.finfo(dtype).max, -torch.finfo(dtype).max, 0.0, -0.0, torch.finfo(dtype).tiny,
                             -torch.finfo(dtype).tiny, math.inf, NINF]], device=device, dtype=dtype)
        for k in range(1, 9):
            _compare("top_k_mask_logits", f"triton {dtype} k={k}", triton_logits.top_k_mask_logits(big, None, k),
                     reference.top_k_mask_logits(big, None, k))


# ------------------------------------------------------------------------------------------------
# Bad input: named, nothing written.


def _bad_cases(op, device):
    logits = torch.randn(4, 64, device=device)
    arr = torch.ones(4, device=device) if op == "softmax" else torch.ones(4, dtype=torch.int32, device=device)
    arg = "maybe_temperature_arr" if op == "softmax" else "maybe_top_k_arr"
    val = 1.0 if op == "softmax" else 3
    cases = [
        ("1-D logits", (logits[0], arr[:1], val), ValueError, "logits"),
        ("3-D logits", (logits[None], arr, val), ValueError, "logits"),
        ("fp64 logits", (logits.double(), arr, val), TypeError, "logits"),
        ("int logits", (logits.int(), arr, val), TypeError, "logits"),
        ("non-contiguous vocabulary", (torch.randn(64, 4, device=device).t(), arr, val), ValueError, "logits"),
        ("empty vocabulary", (logits[:, :0], arr, val), ValueError, "logits"),
        ("per-row of the wrong length", (logits, arr[:3], val), ValueError, arg),
        ("2-D per-row", (logits, arr[:, None], val), ValueError, arg),
        ("per-row on another device", (logits, arr.to("meta"), val), ValueError, arg),
    ]
    if op == "softmax":
        cases += [("int temperatures", (logits, arr.int(), val), TypeError, arg),
                  ("negative temperature", (logits, None, -0.5), ValueError, "temperature_val"),
                  ("NaN temperature", (logits, None, math.nan), ValueError, "temperature_val"),
                  ("infinite temperature", (logits, None, math.inf), ValueError, "temperature_val")]
    else:
        cases += [("float top_k", (logits, arr.float(), val), TypeError, arg),
                  ("bool top_k", (logits, arr.bool(), val), TypeError, arg)]
    return cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", LOGIT_OPS)
def test_bad_input_names_the_op_and_the_argument(op, device):
    assert_bad_inputs_raise(op, _bad_cases(op, device))


def test_wrapper_refuses_what_is_neither_scalar_nor_tensor():
    logits = torch.randn(2, 8)
    for op, arg, bad in (("softmax", "temperature", "0.7"), ("softmax", "temperature", True),
                         ("top_k_mask_logits", "top_k", 2.0), ("top_k_mask_logits", "top_k", False)):
        with pytest.raises(TypeError, match=rf"^deepinfer::{op}: argument '{arg}' "):
            getattr(torch_kernels, op)(logits, bad)


# ------------------------------------------------------------------------------------------------
# On a GPU: the default is a kernel, and FlashInfer agrees.


@pytest.mark.gpu
def test_cuda_default_selection_is_a_kernel():
    from torch_kernels import dispatch
    for op in LOGIT_OPS:
        chain, notice = dispatch.plan(op)
        assert chain[0].backend is not Backend.TORCH and notice is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_flashinfer_agrees(dtype):
    fs = pytest.importorskip("flashinfer.sampling")
    torch.manual_seed(3)
    for vocab, rows in ((32000, 4), (128256, 33), (1000, 1)):
        logits = _rows("cuda", dtype, vocab=vocab, rows=rows)
        logits[0, ::5] = NINF
        t = torch.rand(rows, device="cuda") + 0.3
        for temperature in (0.7, t):
            assert_close(torch_kernels.softmax(logits, temperature), fs.softmax(logits, temperature),
                         msg=f"softmax {vocab} {dtype}")
        for k in (1, 50, torch.randint(1, vocab, (rows,), device="cuda", dtype=torch.int32)):
            got, want = torch_kernels.top_k_mask_logits(logits, k), fs.top_k_mask_logits(logits, k)
            assert torch.equal(got, want), f"top_k_mask_logits {vocab} {dtype} k={k if isinstance(k, int) else 'per-row'}"
