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

from conftest import DEVICES, assert_bad_inputs_raise, chi_square, chi_square_critical, implementations_on

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
    zeros = torch.tensor([[1.0, -0.0, 0.0, -1.0, -0.0]])  # -0.0 == 0.0: a tie at the 2nd largest, kept as -0.0
    got = torch_kernels.top_k_mask_logits(zeros, 2)
    assert torch.equal(got, torch.tensor([[1.0, 0.0, 0.0, NINF, 0.0]])) and torch.equal(got.signbit(), zeros.signbit())


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
    ties = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0], [math.nan, 1.0, 2.0, NINF, 2.0], [1.0, -0.0, 0.0, -1.0, -0.0]],
                        device=device)
    for k in (-5, 0, 1, 2, 3, 4, 5, 2**40):
        got, want = triton_logits.top_k_mask_logits(ties, None, k), reference.top_k_mask_logits(ties, None, k)
        _compare("top_k_mask_logits", f"triton k={k}", got, want)
        assert torch.equal(got.signbit(), want.signbit()), f"triton k={k}: the sign of a kept zero"
    for dtype in (torch.bfloat16, torch.float16):  # the extremes of the order keys
        big = torch.tensor([[torch.finfo(dtype).max, -torch.finfo(dtype).max, 0.0, -0.0, torch.finfo(dtype).tiny,
                             -torch.finfo(dtype).tiny, math.inf, NINF]], device=device, dtype=dtype)
        for k in range(1, 9):
            _compare("top_k_mask_logits", f"triton {dtype} k={k}", triton_logits.top_k_mask_logits(big, None, k),
                     reference.top_k_mask_logits(big, None, k))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_top_k_mask_routes_match_reference(device, dtype):
    """Both routes of the Triton ``top_k_mask_logits`` bit for bit against the reference: k each slice's
    bound serves (1, 50), k past a quarter of the slots (200, 257, V - 1: the radix route), a row of ties
    beyond any slice's slots, a short last slice, one slice, per-row k past the slots (300), one row."""
    if device == "cpu" and not _interpreting():
        pytest.skip("Triton runs on CPU tensors only in its interpreter")
    from torch_kernels.families.sampling.triton import logits as triton_logits
    torch.manual_seed(5)
    for vocab in (700, 9000):
        x = _rows(device, dtype, vocab=vocab, rows=3)
        x[1, ::3] = NINF
        x[2, : vocab // 2] = 1.5  # half the row one value
        for k in (1, 50, 200, 257, vocab - 1):
            _compare("top_k_mask_logits", f"triton {vocab} {dtype} k={k}", triton_logits.top_k_mask_logits(x, None, k),
                     reference.top_k_mask_logits(x, None, k))
        per_row = torch.tensor([50, 300, 2], device=device)
        _compare("top_k_mask_logits", f"triton {vocab} {dtype} per-row k", triton_logits.top_k_mask_logits(x, per_row),
                 reference.top_k_mask_logits(x, per_row))
        _compare("top_k_mask_logits", f"triton {vocab} {dtype} one row", triton_logits.top_k_mask_logits(x[:1], None, 50),
                 reference.top_k_mask_logits(x[:1], None, 50))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [50, 600])
def test_triton_top_k_mask_bound_route_finishes_distinct_rows(device, k):
    """The slices' bounds finish rows of distinct values by themselves (the radix passes are left
    nothing): at k = 50 each slice's own, at k = 600 (past its groups) the one the full slices share.
    A row of ties goes to the radix route rather than a guess."""
    if device == "cpu" and not _interpreting():
        pytest.skip("Triton runs on CPU tensors only in its interpreter")
    import triton
    from torch_kernels.families.sampling.triton import logits as tl_mod
    torch.manual_seed(6)
    B, V = 3, 8 * tl_mod._MASK_SLICE + 100
    x = torch.randn(B, V, device=device)
    x[2] = 0.25  # every value tied
    S = triton.cdiv(V, tl_mod._MASK_SLICE)
    buf = torch.empty((B, S, tl_mod._MASK_CAP), dtype=torch.int32, device=device)
    meta = torch.empty((B, 4, S), dtype=torch.int32, device=device)
    state = torch.empty((B, 2), dtype=torch.int64, device=device)
    counts = torch.full((B, 4, 256), 7, dtype=torch.int32, device=device)
    tl_mod._mask_slice_kernel[(B, S)](x, x.stride(0), x, k, buf, meta, V, S, HAS_K=False, KEY_SHIFT=1,
                                      GROUPS=tl_mod._MASK_GROUPS, GROUP=tl_mod._MASK_GROUP, CAP=tl_mod._MASK_CAP,
                                      PIVOTS=tl_mod._MASK_PIVOTS, SHARED_FROM=tl_mod._MASK_SHARED_FROM)
    tl_mod._mask_threshold_kernel[(B,)](x, k, buf, meta, state, counts, V, S, PASSES=4, HAS_K=False,
                                        BLOCK_S=triton.next_power_of_2(S), CAP=tl_mod._MASK_CAP,
                                        SLICE=tl_mod._MASK_SLICE)
    keys = reference.order_key(x[:2].cpu())
    kth = keys.sort(-1, descending=True).values[:, k - 1].long() + 2**31
    assert state[:2, 1].tolist() == [0, 0], "rows of distinct values finished by the bound"
    assert state[:2, 0].cpu().tolist() == kth.tolist(), f"the bound route's threshold is the {k}th largest key"
    assert state[2, 1].item() == k and counts[2].eq(0).all(), "the row of ties goes to the radix route, counts cleared"


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


# ------------------------------------------------------------------------------------------------
# min-p sampling: the kept set against an independent formula, every backend exactly, the sampled
# distribution (chi-square, both random sources), determinism, bad input, CUDA graphs.

MIN_P = "min_p_sampling_from_probs"
FLT_MAX = torch.finfo(torch.float32).max


def _softmax(rows, vocab, device, scale=3.0, stride=None):
    return torch.softmax(torch.randn(rows, stride or vocab, device=device) * scale, -1)[:, :vocab]


def _min_p_formula(probs, min_p):
    """(kept, renormalised fp64 rows): kept iff ``p >= fp32(min_p * max p)`` (the pivot's one fp32
    product, as FlashInfer's kernel), the largest always; NaN and negatives 0, +inf FLT_MAX."""
    p = probs.double().nan_to_num(nan=0.0, posinf=FLT_MAX).clamp(min=0.0)
    B, _ = p.shape
    mp = min_p.float().tolist() if isinstance(min_p, torch.Tensor) else [min_p] * B
    kept = torch.zeros_like(p, dtype=torch.bool)
    for b in range(B):
        m = p[b].max()
        pivot = (torch.tensor(mp[b], dtype=torch.float32) * m.float()).double().item()
        pivot = m.item() if math.isnan(pivot) or pivot > m else max(pivot, 0.0)
        kept[b] = p[b] >= pivot
    kp = torch.where(kept, p, 0.0)
    s = kp.sum(-1, keepdim=True)
    return kept, torch.where(s > 0, kp / s.clamp(min=1e-300), 0.0)


def _odd_probs(rows, vocab, device):
    p = _softmax(rows, vocab, device)
    p[0, :6] = torch.tensor([math.nan, -0.5, -0.0, 0.0, 1e-30, 1e-40])
    p[1] = 0.0
    p[2, 7] = math.inf
    p[3] = torch.randint(0, 4, (vocab,)).float() / 4  # ties at the largest and at the pivot
    return p


def _min_p_cases(device):
    yield _softmax(6, 1000, device), [0.1, 0.0, 1.0, -1.0, math.nan, 0.5]
    yield _softmax(3, 257, device, scale=1.0), [0.05, 0.9, 0.3]
    yield _odd_probs(4, 200, device), [0.2, 0.2, 0.5, 0.75]
    yield _odd_probs(4, 9000, device), [0.0, 0.2, 0.0, 1e-3]  # three slices of the Triton kernels' 4096
    yield _softmax(3, 9005, device), [0.1, 0.3, 0.02]  # peaked: slices wholly below the threshold, others not
    yield 1.0 + 0.9 * torch.rand(2, 9000, device=device), [0.0, 0.6]  # flat: a slice's masses sum past 2^52
    yield _softmax(1, 1, device), [0.5]
    yield _softmax(0, 64, device), []


def test_min_p_kept_set_matches_independent_formula():
    from torch_kernels.families.sampling.ops import min_p_kept_set
    torch.manual_seed(10)
    for probs, mps in _min_p_cases("cpu"):
        for min_p in [torch.tensor(mps, dtype=torch.float32)] + mps[:2]:
            arr, val = (min_p, 0.0) if isinstance(min_p, torch.Tensor) else (None, min_p)
            want, _ = _min_p_formula(probs, min_p)
            got = min_p_kept_set(probs, arr, val)
            rows = (got != want).any(-1).nonzero().flatten().tolist()
            assert not rows, f"min_p {min_p}: kept sets differ in rows {rows}"
    ties = torch.tensor([[0.4, 0.2, 0.4, 0.1, 0.04]])
    assert min_p_kept_set(ties, None, 0.5).tolist() == [[True, True, True, False, False]]  # 0.2 = 0.5 * 0.4 kept
    assert min_p_kept_set(ties, None, 2.0).tolist() == [[True, False, True, False, False]]  # the largest, ties too


def _min_p_args(probs, min_p, seed=1234, offset=5):
    device = probs.device
    arr, val = (min_p.to(device), 0.0) if isinstance(min_p, torch.Tensor) else (None, min_p)
    return probs, arr, val, torch.tensor(seed, device=device), torch.tensor([offset], device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_backends_match_reference(device):
    torch.manual_seed(11)
    ref = registry.BY_OP[MIN_P][Backend.TORCH].load()
    backends = implementations_on(MIN_P, device)
    cases = [tuple(a) for a in ops.BY_NAME[MIN_P].samples(device, torch.float32)]
    for probs, mps in _min_p_cases(device):
        cases += [_min_p_args(probs, torch.tensor(mps)), _min_p_args(probs, 0.1, seed=-3, offset=2**33)]
    if device == "cuda":
        for vocab, rows in ((128256, 64), (32000, 5), (256000, 2)):
            probs = _softmax(rows, vocab, device, stride=vocab + 64)
            cases += [_min_p_args(probs, 0.05), _min_p_args(probs, torch.rand(rows) * 0.3)]
    for args in cases:
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        want = ref(*args)
        for name, fn in backends:
            got = fn(*args)
            assert got.dtype == torch.int32 and torch.equal(got.cpu(), want.cpu()), f"{name} {tuple(args[0].shape)}"
        assert all(not isinstance(b, torch.Tensor) or torch.equal(b.nan_to_num(), a.nan_to_num())
                   for b, a in zip(before, args)), "an input was clobbered"


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_sampled_ids_are_always_kept(device):
    torch.manual_seed(12)
    base = torch.cat([_softmax(2, 300, device, scale=2.0), _odd_probs(4, 300, device)[[0, 2, 3]]])
    min_p = torch.tensor([0.1, 0.02, 0.3, 0.6, 0.5])
    kept, _ = _min_p_formula(base.cpu(), min_p)
    reps = 256
    probs, mp, row_kept = base.repeat(reps, 1), min_p.to(device).repeat(reps), kept.to(device).repeat(reps, 1)
    for offset in range(4):
        ids = torch_kernels.min_p_sampling_from_probs(probs, mp, torch.tensor(5, device=device),
                                                      torch.tensor(offset, device=device))
        assert row_kept.gather(1, ids.long()[:, None]).all(), f"offset {offset}: a token outside the kept set"
        ids = torch_kernels.min_p_sampling_from_probs(probs, mp)  # torch's generator
        assert row_kept.gather(1, ids.long()[:, None]).all(), "torch's generator: a token outside the kept set"


@pytest.mark.parametrize("source", ["seed_offset", "torch_generator"])
@pytest.mark.parametrize("device", DEVICES)
def test_min_p_distributionchi_square(device, source):
    """100k draws of one row (fixed seeds): the counts match the kept, renormalised probabilities, and
    the same counts reject two wrong distributions (a tenth of the mass spread uniformly; the two
    largest probabilities swapped), so the test has the power to fail."""
    torch.manual_seed(13)
    V = 40
    row = _softmax(1, V, device, scale=1.0)
    min_p = 0.3
    kept, expected = _min_p_formula(row.cpu(), min_p)
    n_kept = int(kept.sum())
    assert 5 <= n_kept < 30, n_kept  # the filter bites
    reps, draws = 10000, 10
    probs = row.repeat(reps, 1)
    counts = torch.zeros(V, dtype=torch.float64)
    for step in range(draws):
        if source == "seed_offset":
            ids = torch_kernels.min_p_sampling_from_probs(probs, min_p, torch.tensor(7, device=device),
                                                          torch.tensor(step, device=device))
        else:
            ids = torch_kernels.min_p_sampling_from_probs(probs, min_p)
        counts += torch.bincount(ids.long().cpu(), minlength=V).double()
    assert counts[~kept[0]].sum() == 0
    k = kept[0]
    critical = chi_square_critical(n_kept - 1)
    chi2 = chi_square(counts[k], expected[0][k])
    assert chi2 < critical, f"chi-square {chi2:.1f} with {n_kept - 1} degrees of freedom (critical {critical:.1f})"
    wrong = [expected[0][k] * 0.9 + 0.1 / n_kept]  # a tenth of the mass spread uniformly
    swapped = expected[0][k].clone()
    top2 = swapped.topk(2).indices
    swapped[top2] = swapped[top2.flip(0)]
    if not torch.equal(swapped, expected[0][k]):
        wrong.append(swapped)
    for w in wrong:
        assert chi_square(counts[k], w) > critical, "the chi-square test cannot tell a wrong distribution"


def test_min_p_is_deterministic_per_seed_and_offset_and_follows_torch_seed():
    torch.manual_seed(14)
    probs = _softmax(64, 500, "cpu", scale=0.5)

    def draw(seed, offset, rows=64, shape=()):
        return torch_kernels.min_p_sampling_from_probs(probs[:rows], 0.05, torch.full(shape, seed, dtype=torch.int64),
                                                       torch.full(shape, offset, dtype=torch.int64))
    a = draw(1, 0)
    assert torch.equal(a, draw(1, 0)) and torch.equal(a, draw(1, 0, shape=(1,)))
    assert torch.equal(a, torch_kernels.min_p_sampling_from_probs(probs, 0.05, 1, 0)), "int seed and offset"
    assert torch.equal(a[:5], draw(1, 0, rows=5)), "a row's stream depends on the batch size"
    for other in (draw(1, 1), draw(2, 0), draw(1, 2**32), draw(-1, 0)):
        assert (other != a).sum() > 32, "another seed or offset gave (nearly) the same draws"
    torch.manual_seed(0)
    g1, g2 = torch_kernels.min_p_sampling_from_probs(probs, 0.05), torch_kernels.min_p_sampling_from_probs(probs, 0.05)
    torch.manual_seed(0)
    assert torch.equal(g1, torch_kernels.min_p_sampling_from_probs(probs, 0.05)), "torch.manual_seed reproduces"
    assert (g1 != g2).sum() > 32, "consecutive draws from torch's generator repeat"


def _min_p_bad_cases(device):
    probs = _softmax(4, 64, device)
    mp, seed, offset = torch.full((4,), 0.1, device=device), torch.tensor(1, device=device), torch.tensor([0], device=device)
    return [
        ("1-D probs", (probs[0], mp[:1], 0.0, seed, offset), ValueError, "probs"),
        ("fp64 probs", (probs.double(), mp, 0.0, seed, offset), TypeError, "probs"),
        ("non-contiguous vocabulary", (_softmax(64, 4, device).t(), mp, 0.0, seed, offset), ValueError, "probs"),
        ("empty vocabulary", (probs[:, :0], mp, 0.0, seed, offset), ValueError, "probs"),
        ("min_p of the wrong length", (probs, mp[:3], 0.0, seed, offset), ValueError, "maybe_min_p_arr"),
        ("fp64 min_p", (probs, mp.double(), 0.0, seed, offset), TypeError, "maybe_min_p_arr"),
        ("min_p on another device", (probs, mp.to("meta"), 0.0, seed, offset), ValueError, "maybe_min_p_arr"),
        ("int32 seed", (probs, None, 0.1, seed.int(), offset), TypeError, "seed"),
        ("two seeds", (probs, None, 0.1, torch.tensor([1, 2], device=device), offset), ValueError, "seed"),
        ("float offset", (probs, None, 0.1, seed, offset.float()), TypeError, "offset"),
        ("offset on another device", (probs, None, 0.1, seed, offset.to("meta")), ValueError, "offset"),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_bad_input_names_the_op_and_the_argument(device):
    assert_bad_inputs_raise(MIN_P, _min_p_bad_cases(device))
    probs = _softmax(2, 8, device)
    for kwargs, arg in (({"seed": 1}, "offset"), ({"offset": torch.tensor(0, device=device)}, "seed"),
                        ({"seed": 1.5, "offset": 0}, "seed"), ({"min_p": "0.1"}, "min_p")):
        with pytest.raises(TypeError, match=rf"^deepinfer::{MIN_P}: argument '{arg}' "):
            torch_kernels.min_p_sampling_from_probs(probs, **{"min_p": 0.1, **kwargs})


@pytest.mark.gpu
def test_min_p_cuda_graph_replays_draw_afresh():
    torch.manual_seed(15)
    probs = _softmax(64, 128256, "cuda")
    kept, _ = _min_p_formula(probs.cpu(), 0.05)
    seed, offset = torch.tensor(11, device="cuda"), torch.tensor(0, device="cuda")
    torch_kernels.min_p_sampling_from_probs(probs, 0.05, seed, offset)  # compile outside the capture
    torch_kernels.min_p_sampling_from_probs(probs, 0.05)
    torch.cuda.synchronize()
    given, drawn = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(given):
        out = torch_kernels.min_p_sampling_from_probs(probs, 0.05, seed, offset)
    with torch.cuda.graph(drawn):
        out_g = torch_kernels.min_p_sampling_from_probs(probs, 0.05)  # torch's generator inside the graph
    seen = []
    for step in (3, 4):
        offset.fill_(step)
        given.replay()
        assert torch.equal(out, reference.min_p_sampling_from_probs(probs, None, 0.05, seed, offset))
        drawn.replay()
        assert kept.cuda().gather(1, out_g.long()[:, None]).all()
        seen.append(out_g.clone())
    assert not torch.equal(seen[0], seen[1]), "a replay drew the same ids from torch's generator"


@pytest.mark.gpu
def test_min_p_flashinfer_keeps_the_same_set():
    fs = pytest.importorskip("flashinfer.sampling")
    torch.manual_seed(16)
    for vocab, rows in ((128256, 64), (32000, 5)):
        probs = _softmax(rows, vocab, "cuda")
        for min_p in (0.05, torch.rand(rows, device="cuda") * 0.5):
            kept, _ = _min_p_formula(probs.cpu(), min_p.cpu() if isinstance(min_p, torch.Tensor) else min_p)
            ids = fs.min_p_sampling_from_probs(probs, min_p, deterministic=True, seed=1, offset=0)
            assert kept.cuda().gather(1, ids.long()[:, None]).all(), "FlashInfer drew outside our kept set"
