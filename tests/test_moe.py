"""Numerics of the MoE routers: the reference against an independent per-row formula (Python
floats, fp64), explicit ties, non-finite logits, every backend against the reference over dtypes
and awkward shapes (Triton in its interpreter on CPU), and bad input."""

import math
import os

import pytest
import torch

from torch_kernels import ops, registry
from torch_kernels.families.moe.ops import compare_routing, grouped_topk, grouped_topk_args, near_ties, topk_softmax
from torch_kernels.spec import Backend
from torch_kernels.testing import assert_close

from conftest import DEVICES, assert_bad_inputs_raise, family_ops, implementations_on, triton_here

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OPS = family_ops("moe")


_backends = implementations_on


def _reference(op):
    return registry.BY_OP[op][Backend.TORCH].load()


# --- the definition, one row at a time in Python floats ---------------------------------------------

def _softmax(row):
    """A score that is not finite counts as 0: a NaN or +inf logit, or only -inf logits, make every
    probability of the row NaN (inf - inf, -inf + inf), hence 0."""
    if any(math.isnan(v) or v == math.inf for v in row) or all(v == -math.inf for v in row):
        return [0.0] * len(row)
    m = max(row)
    e = [math.exp(v - m) for v in row]
    return [v / sum(e) for v in e]


def _sigmoid(v):
    if math.isnan(v):
        return 0.0  # the only logit whose sigmoid is not finite (+-inf give 1 and 0)
    return 1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))


def _best(keys, candidates, n):
    """The n candidates of largest key, ties to the lower index (NaN ranks as +inf)."""
    rank = lambda i: math.inf if math.isnan(keys[i]) else keys[i]  # noqa: E731
    return sorted(candidates, key=lambda i: (-rank(i), i))[:n]


def _finish(weights, renormalize, factor=1.0):
    total = sum(weights)
    if renormalize and total > 0:  # a row of zeros stays zero
        weights = [w / total for w in weights]
    return [w * factor for w in weights]


def _formula_topk_softmax(x, topk, renormalize=False):
    out = []
    for row in x.double().tolist():
        p = _softmax(row)
        ids = _best(p, range(len(p)), topk)
        out.append((_finish([p[i] for i in ids], renormalize), ids))
    return _tensors(out, topk)


def _formula_grouped_topk(x, topk, renormalize, groups, topk_group, scoring="softmax", bias=None, factor=1.0):
    out = []
    b = None if bias is None else bias.double().tolist()
    for row in x.double().tolist():
        s = _softmax(row) if scoring == "softmax" else [_sigmoid(v) for v in row]
        key = s if b is None else [a + c for a, c in zip(s, b)]
        size = len(row) // groups
        members = [range(g * size, (g + 1) * size) for g in range(groups)]
        if b is None:
            group_key = [max(key[i] for i in m) for m in members]
        else:
            group_key = [sum(key[i] for i in _best(key, m, 2)) for m in members]
        kept = _best(group_key, range(groups), topk_group)
        ids = _best(key, [i for g in kept for i in members[g]], topk)
        out.append((_finish([s[i] for i in ids], renormalize, factor), ids))
    return _tensors(out, topk)


def _tensors(rows, topk):
    w = torch.tensor([r[0] for r in rows], dtype=torch.float32).reshape(-1, topk)
    ids = torch.tensor([r[1] for r in rows], dtype=torch.int32).reshape(-1, topk)
    return w, ids


FORMULA = {"topk_softmax": _formula_topk_softmax, "grouped_topk": _formula_grouped_topk}


def _cpu(args):
    return tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_reference_matches_formula(op, dtype):
    for args in ops.BY_NAME[op].samples("cpu", dtype):
        compare_routing(list(_reference(op)(*args)), list(FORMULA[op](*args)), dtype)


def test_grouped_topk_applies_the_scaling_factor_after_renormalising():
    """vLLM's order: weights / sum(weights) * routed_scaling_factor, so the weights sum to it."""
    x, bias = torch.randn(6, 64), torch.randn(64) * 0.1
    w, _ = grouped_topk(x, 6, True, 8, 4, "sigmoid", bias, 2.5)
    assert_close(w.sum(-1), torch.full((6,), 2.5))
    w1, ids1 = grouped_topk(x, 6, False, 8, 4, "sigmoid", bias, 2.5)
    assert_close(w1, torch.sigmoid(x).gather(1, ids1.long()) * 2.5)  # the unbiased scores, scaled


def test_topk_softmax_is_grouped_topk_with_one_group():
    x = torch.randn(5, 40)
    for renormalize in (False, True):
        want = topk_softmax(x, 7, renormalize)
        compare_routing(list(grouped_topk(x, 7, renormalize, 1, 1)), list(want), torch.float32)


# --- every backend against the reference --------------------------------------------------------------

#: extra shapes beyond the op samples: wide routers, topk = E, one expert, group counts and sizes
#: that are not powers of two, many tokens (several programs).
EXTRA = {
    "topk_softmax": [(37, 128, None, 8, False), (1, 1, None, 1, True), (9, 384, 400, 16, True), (3, 7, None, 7, False)],
    "grouped_topk": [(37, 128, None, 8, True, 8, 4, "sigmoid", torch.float32, 2.5),
                     (2, 160, None, 6, True, 8, 3, "sigmoid", torch.float32, 2.5),
                     (5, 30, 32, 12, False, 3, 3, "softmax", None, 1.0), (4, 12, None, 6, True, 6, 3, "sigmoid", "same", 1.0)],
}
GPU_EXTRA = {
    "topk_softmax": [(8192, 256, None, 8, False), (4096, 128, None, 8, True), (1000, 512, None, 4, True),
                     (3, 8192, None, 8, True)],
    "grouped_topk": [(8192, 256, None, 8, True, 8, 4, "sigmoid", torch.float32, 2.5),
                     (4096, 160, None, 6, True, 8, 3, "softmax", None, 16.0)],
}


def _args(op, row, device, dtype):
    if op == "topk_softmax":
        tokens, experts, stride, topk, renormalize = row
        x = torch.randn(tokens, stride or experts, device=device, dtype=dtype)[:, :experts] * 2
        return x, topk, renormalize
    return grouped_topk_args(*row, device=device, dtype=dtype)


def _check_backends(op, args, dtype, skip_rows=None):
    want = _reference(op)(*args)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    for name, fn in _backends(op, args[0].device.type):
        try:
            compare_routing(list(fn(*args)), list(want), dtype, skip_rows)
        except AssertionError as e:
            raise AssertionError(f"backend {name}, {op} {tuple(args[0].shape)} {args[1:]}: {e}") from None
        for b, a in zip(before, args):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a.nan_to_num(), b.nan_to_num()), f"{name} clobbered its input"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_backends_match_reference(op, dtype, device):
    for args in ops.BY_NAME[op].samples(device, dtype):
        _check_backends(op, args, dtype)
    for row in EXTRA[op]:
        _check_backends(op, _args(op, row, device, dtype), dtype)


def _assert_valid_routing(op, args, got, rows, rtol=2e-6):
    """On ``rows`` (near ties, where fp32 implementations may order keys either way): the chosen
    experts are *a* valid top-k under the definition, in fp64 with keys equal within ``rtol``
    (relative) counted as ties, and the weights are the chosen experts' scores. For each row: ids
    distinct and in range; (grouped_topk) the chosen experts' groups are among the ``topk_group``
    best groups within tolerance, with every group clearly above the cut kept; the smallest chosen
    key >= the largest key of an eligible unchosen expert, within tolerance (eligible: in the kept
    groups, the unchosen ones filled in the way most favourable to the choice); exactly equal keys
    go to the lower index; ids ordered by key (largest first) within tolerance; weights at the fp32
    tolerance from the fp64 scores of the chosen ids."""
    idx = rows.nonzero().flatten().cpu()
    if idx.numel() == 0:
        return
    x = args[0].detach().cpu()[idx].double()
    w, ids = got[0].cpu()[idx], got[1].cpu()[idx].long()
    n, experts = x.shape
    if op == "topk_softmax":
        topk, renormalize = args[1], (args[2] if len(args) > 2 else False)
        scores = key = torch.softmax(x, -1).nan_to_num(0.0, 0.0, 0.0)
        groups, topk_group, bias, factor = 1, 1, None, 1.0
    else:
        topk, renormalize, groups, topk_group, scoring, bias, factor = (args[1:8] + ("softmax", None, 1.0))[:7]
        scores = (torch.softmax(x, -1) if scoring == "softmax" else torch.sigmoid(x)).nan_to_num(0.0, 0.0, 0.0)
        key = scores if bias is None else scores + bias.cpu().double()
    assert bool(((ids >= 0) & (ids < experts)).all()), "expert ids out of range"
    chosen = torch.zeros(n, experts, dtype=torch.bool).scatter_(1, ids, True)
    assert bool((chosen.sum(-1) == topk).all()), "repeated expert ids"
    size = experts // groups
    grouped = key.view(n, groups, size)
    group_key = grouped.amax(-1) if bias is None else grouped.topk(min(2, size), -1).values.sum(-1)
    for r in range(n):
        eligible = torch.ones(experts, dtype=torch.bool)
        if topk_group < groups:
            cut = group_key[r].topk(topk_group).values[-1]
            gtol = rtol * cut.abs()
            used = set((ids[r] // size).tolist())
            certain = set((group_key[r] > cut + gtol).nonzero().flatten().tolist())
            possible = set((group_key[r] >= cut - gtol).nonzero().flatten().tolist())
            assert used <= possible, f"row {int(idx[r])}: experts from groups {sorted(used - possible)} below the cut"
            kept = used | certain
            assert len(kept) <= topk_group, f"row {int(idx[r])}: experts from {len(kept)} groups, {topk_group} kept"
            # fill the kept groups with the possible groups whose best unchosen key is smallest
            fill = sorted(possible - kept, key=lambda g: float(grouped[r, g].max()))[:topk_group - len(kept)]
            eligible = torch.tensor([e // size in kept | set(fill) for e in range(experts)])
        k = key[r]
        low = k[chosen[r]].min()
        others = eligible & ~chosen[r]
        if others.any():
            high = k[others].max()
            tol = rtol * torch.maximum(low.abs(), high.abs())
            assert low >= high - tol, f"row {int(idx[r])}: chosen key {float(low)} < unchosen {float(high)}"
            # exact ties go to the lower index: no unchosen u below a chosen c of the same key
            e = torch.arange(experts)
            lost = (k[:, None] == k[None, :]) & others[:, None] & chosen[r][None, :] & (e[:, None] < e[None, :])
            assert not bool(lost.any()), f"row {int(idx[r])}: an exact tie went to the higher index"
        ordered = k[ids[r]]
        assert bool((ordered[:-1] >= ordered[1:] - rtol * ordered[:-1].abs()).all()), f"row {int(idx[r])}: ids not by key"
    want = scores.gather(1, ids)
    if renormalize:
        total = want.sum(-1, keepdim=True)
        want = want / torch.where(total > 0, total, 1.0)
    assert_close(w, (want * factor).float(), torch.float32, msg="near-tie rows: weights of the chosen ids")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_backends_match_reference_large(op, dtype):
    """Ids equal the reference's on every row without a near tie; on near-tie rows (fp16/bf16
    logits make them common: equal logits, sigmoid + bias keys crowded near 1, group scores that
    sum equal; 35 rows in 4096 with fp16, 280 with bf16 at DeepSeek-V3's shape) every backend's
    choice must be a valid top-k within tolerance (:func:`_assert_valid_routing`)."""
    torch.manual_seed(0)
    for row in GPU_EXTRA[op]:
        args = _args(op, row, "cuda", dtype)
        skip = near_ties(op, args)
        _check_backends(op, args, dtype, skip)
        want = _reference(op)(*args)
        _assert_valid_routing(op, args, want, skip)  # the reference too: the check is not vacuous
        for name, fn in _backends(op, "cuda"):
            try:
                _assert_valid_routing(op, args, fn(*args), skip)
            except AssertionError as e:
                raise AssertionError(f"backend {name}, {op} {tuple(args[0].shape)} {args[1:]}: {e}") from None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_valid_routing_check_accepts_the_reference_and_rejects_wrong_choices(op, dtype):
    """The near-tie check of the large test, on CPU: it accepts the reference on every row, and
    rejects a swapped-out expert, an expert from a dropped group, and wrong weights."""
    torch.manual_seed(1)
    row = GPU_EXTRA[op][0]
    args = _args(op, (64,) + row[1:], "cpu", dtype)
    every = torch.ones(64, dtype=torch.bool)
    w, ids = _reference(op)(*args)
    _assert_valid_routing(op, args, (w, ids), every)
    worst = ids.clone()
    worst[:, -1] = torch.stack([torch.tensor([e for e in range(args[0].shape[1]) if e not in r][-1]) for r in ids.tolist()])
    with pytest.raises(AssertionError):
        _assert_valid_routing(op, args, (w, worst), every)
    with pytest.raises(AssertionError, match="weights"):
        _assert_valid_routing(op, args, (w * 1.001, ids), every)


# --- ties, and non-finite logits ---------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_topk_softmax_ties_go_to_the_lower_index(device):
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0], [5.0] * 6], device=device)
    for name, fn in _backends("topk_softmax", device):
        w, ids = fn(x, 4, False)
        assert ids.tolist() == [[1, 2, 4, 3], [0, 1, 2, 3]], name
        assert w[0, 0] == w[0, 1] == w[0, 2] and w[1].eq(w[1, 0]).all(), name


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_topk_ties_go_to_the_lower_group_and_expert(device):
    # groups {0,1} {2,3} {4,5} {6,7}: group 3 is best, groups 1 and 2 tie (the same logits, so the
    # same top-2 sum and the same max); keeping two groups keeps 3 and 1, never 2
    g = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0]], device=device)
    zero = torch.zeros(8, device=device)
    for name, fn in _backends("grouped_topk", device):
        _, ids = fn(g, 4, True, 4, 2, "sigmoid", zero, 1.0)
        assert ids.tolist() == [[6, 7, 2, 3]], name
        _, ids = fn(g, 3, True, 4, 2, "softmax", None, 1.0)
        assert ids.tolist() == [[6, 7, 2]], name


def _tie_cases(op, device, dtype):
    """Integer logits (and a bias of two values): ties everywhere, among experts and groups. The
    bias is constant over each group (of 6 or 12), so that keys tie only when their logits do: a
    bias that differs within a group makes sums such as (s(2) + 0.25) + s(1) and s(2) + (s(1) +
    0.25) tie in real arithmetic but not in every rounding."""
    x = torch.randint(-3, 4, (7, 48), device=device).to(dtype)
    if op == "topk_softmax":
        return [(x, 8, True), (x, 48, False)]
    bias = 0.25 * (torch.arange(48, device=device) // 12 % 2).float()
    return [(x, 8, True, 8, 4, "sigmoid", bias, 2.5), (x, 5, False, 6, 2, "softmax", None, 1.0),
            (x, 12, True, 4, 2, "softmax", bias, 1.0)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_many_ties_match_the_formula(op, dtype, device):
    for args in _tie_cases(op, device, dtype):
        want = FORMULA[op](*_cpu(args))
        for name, fn in _backends(op, device):
            got = [t.cpu() for t in fn(*args)]
            try:
                compare_routing(got, list(want), dtype)
            except AssertionError as e:
                raise AssertionError(f"{name} {op} {args[1:]}: {e}") from None


NAN, INF = float("nan"), float("inf")


def _nonfinite_rows(device, dtype, experts=32):
    """Rows 0-8 hold non-finite logits, rows 9-11 are finite: all NaN, one NaN, one +inf, one -inf,
    two +inf, all -inf, all but 4 -inf (fewer finite experts than topk), NaN with +inf and -inf,
    every other logit -inf with a NaN."""
    x = torch.randn(12, experts, generator=torch.Generator().manual_seed(7)) * 2
    x[0] = NAN
    x[1, 5] = NAN
    x[2, 9] = INF
    x[3, 17] = -INF
    x[4, [3, 20]] = INF
    x[5] = -INF
    x[6, :experts - 4] = -INF
    x[7, [1, 12, experts - 2]] = torch.tensor([NAN, INF, -INF])
    x[8, 0::2] = -INF
    x[8, 7] = NAN
    return x.to(device=device, dtype=dtype)


#: rows whose softmax is NaN everywhere, hence all scores 0
SOFTMAX_ZERO_ROWS = [0, 1, 2, 4, 5, 7, 8]


def _nonfinite_cases(op, device, dtype):
    x = _nonfinite_rows(device, dtype)
    if op == "topk_softmax":
        return [(x, 6, False), (x, 6, True), (x, 32, True), (x, 1, False)]
    bias = torch.randn(32, generator=torch.Generator().manual_seed(8)).to(device) * 0.1
    bad_bias = bias.clone()
    bad_bias[[2, 11, 25]] = torch.tensor([NAN, INF, -INF], device=device)  # a NaN key ranks as +inf
    return [(x, 6, True, 4, 2, "sigmoid", bias, 2.5), (x, 6, False, 4, 2, "sigmoid", bias, 1.0),
            (x, 6, True, 4, 2, "softmax", bias, 1.0), (x, 4, False, 8, 3, "softmax", bias, 1.0),
            (x, 4, True, 8, 2, "softmax", None, 1.0), (x, 5, False, 4, 2, "sigmoid", None, 1.0),
            (x, 5, True, 1, 1, "softmax", None, 1.0), (x, 6, True, 4, 2, "sigmoid", bad_bias, 1.0),
            (x, 6, False, 8, 4, "softmax", bad_bias, 2.5)]


def _assert_finite_and_distinct(w, ids, experts, what):
    assert bool(w.isfinite().all()), f"{what}: non-finite weights in rows {(~w.isfinite()).any(-1).nonzero().flatten().tolist()}"
    assert bool(((ids >= 0) & (ids < experts)).all()), f"{what}: ids outside the experts"
    ordered = ids.sort(-1).values
    assert bool((ordered[:, 1:] != ordered[:, :-1]).all()), f"{what}: repeated ids"


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # Triton's interpreter, all-NaN rows
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_nonfinite_logits_match_the_formula(op, dtype, device):
    """NaN and +-inf logits (and in grouped_topk a bias with NaN and +-inf entries): every backend
    gives the independent formula's ids exactly and its weights at the fp32 tolerance, the
    reference's too, with finite weights and distinct ids on every row."""
    for args in _nonfinite_cases(op, device, dtype):
        want = FORMULA[op](*_cpu(args))
        ref = [t.cpu() for t in _reference(op)(*args)]
        for name, fn in _backends(op, device):
            got = [t.cpu() for t in fn(*args)]
            what = f"{name} {op} {dtype} {args[1:]}"
            _assert_finite_and_distinct(*got, 32, what)
            for expected in (want, ref):
                try:
                    compare_routing(got, list(expected), dtype)
                except AssertionError as e:
                    raise AssertionError(f"{what}: {e}") from None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_nonfinite_rows_in_large_batches(op, dtype):
    """Every 16th row of the large shapes poisoned with the patterns of :func:`_nonfinite_rows`, with
    and without renormalising: every backend gives finite weights and distinct ids on every row, the
    reference's ids on every row without a near tie (rows whose scores are all 0 tie exactly, so
    they are always compared), and a valid top-k within tolerance on the near-tie rows."""
    torch.manual_seed(0)
    for row in GPU_EXTRA[op]:
        for renormalize in (False, True):
            args = list(_args(op, row, "cuda", dtype))
            args[2] = renormalize
            x = args[0]
            poisoned = torch.arange(0, x.shape[0], 16, device="cuda")
            patterns = _nonfinite_rows("cuda", dtype, x.shape[1])[:9]
            x[poisoned] = patterns[torch.arange(poisoned.numel(), device="cuda") % 9]
            args = tuple(args)
            want = _reference(op)(*args)
            _assert_finite_and_distinct(*want, x.shape[1], "reference")
            scoring = "softmax" if op == "topk_softmax" else args[5]
            xd = x.double()
            scores = (torch.softmax(xd, -1) if scoring == "softmax" else torch.sigmoid(xd)).nan_to_num(0.0, 0.0, 0.0)
            skip = near_ties(op, args) & ~(scores == 0).all(-1)
            _check_backends(op, args, dtype, skip)
            for name, fn in _backends(op, "cuda"):
                got = fn(*args)
                what = f"backend {name}, {op} {tuple(x.shape)} {args[1:]}"
                _assert_finite_and_distinct(*got, x.shape[1], what)
                try:
                    _assert_valid_routing(op, args, got, skip)
                except AssertionError as e:
                    raise AssertionError(f"{what}: {e}") from None


@pytest.mark.parametrize("renormalize", [False, True])
def test_nonfinite_softmax_rows_route_to_the_first_experts_with_zero_weights(renormalize):
    """vLLM's clamp: a softmax row with a NaN or +inf logit, or only -inf, scores 0 everywhere: ids
    0..topk-1 by the tie rule, weights 0 (renormalised too, no 0/0); a -inf logit is probability 0."""
    x = _nonfinite_rows("cpu", torch.float32)
    w, ids = topk_softmax(x, 6, renormalize)
    assert ids[SOFTMAX_ZERO_ROWS].tolist() == [list(range(6))] * len(SOFTMAX_ZERO_ROWS)
    assert w[SOFTMAX_ZERO_ROWS].eq(0).all()
    assert 17 not in ids[3].tolist() and w[3].gt(0).all()
    assert set(ids[6, :4].tolist()) == {28, 29, 30, 31} and ids[6, 4:].tolist() == [0, 1] and w[6, 4:].eq(0).all()
    p = torch.softmax(x[3], -1).gather(0, ids[3].long())
    assert_close(w[3], p / p.sum() if renormalize else p)
    # grouped_topk with one group and no bias is the same router
    compare_routing(list(grouped_topk(x, 6, renormalize, 1, 1)), [w, ids], torch.float32)


def test_nonfinite_grouped_topk_scores_count_as_zero():
    """Sigmoid: a NaN logit scores 0 (its key is its bias alone), +inf scores 1; softmax: a row with
    a NaN or +inf logit scores 0 everywhere and selects by the bias alone, with weights 0 that stay 0
    when renormalised and scaled. Groups {0,1} {2,3} {4,5} {6,7}, expert 6 biased by 0.9."""
    x = torch.zeros(3, 8)
    x[0, 6] = NAN
    x[1, 2] = INF
    x[2] = NAN
    bias = torch.zeros(8)
    bias[6] = 0.9
    w, ids = grouped_topk(x, 2, False, 4, 2, "sigmoid", bias, 2.0)
    # row 0: key 6 = 0 + 0.9 (group 3: 1.4), every other key 0.5; row 1: key 2 = 1 (group 1: 1.5),
    # key 6 = 1.4 (group 3: 1.9); row 2: keys = bias, group 3 then group 0 by the tie rule
    assert ids.tolist() == [[6, 0], [6, 2], [6, 0]]
    assert_close(w, torch.tensor([[0.0, 1.0], [1.0, 2.0], [0.0, 0.0]]))
    w, ids = grouped_topk(x, 2, True, 4, 2, "softmax", bias, 2.5)
    assert ids.tolist() == [[6, 0]] * 3 and w.eq(0).all()


# --- registration details that the generic tests do not see ----------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_fake_outputs_and_trace(op):
    args = next(iter(ops.BY_NAME[op].samples("meta", torch.bfloat16)))
    w, ids = getattr(torch.ops.deepinfer, op).default(*args)
    assert (w.dtype, ids.dtype, tuple(w.shape)) == (torch.float32, torch.int32, (args[0].shape[0], args[1]))
    assert w.is_contiguous() and ids.is_contiguous()
    compiled = torch.compile(lambda *a: ops.BY_NAME[op].wrapper(*a), backend="eager", fullgraph=True)
    bad = (args[0].new_empty(4, 16, device="cpu").normal_(), 17) + ((True, 4, 2) if op == "grouped_topk" else ())
    with pytest.raises(Exception, match=rf"deepinfer::{op}: argument 'topk' must be at most"):
        compiled(*bad)


def test_topk_softmax_and_grouped_topk_refuse_autograd():
    x = torch.randn(3, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="deepinfer::topk_softmax does not support autograd"):
        topk_softmax(x, 2)
    with pytest.raises(RuntimeError, match="deepinfer::grouped_topk does not support autograd"):
        grouped_topk(x, 2, True, 4, 2)
    with torch.no_grad():
        topk_softmax(x, 2)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="needs Triton")
def test_triton_topk_softmax_and_grouped_topk_refuse_rows_wider_than_the_tile():
    """The Triton kernel holds a token's experts in registers, up to MAX_TILE padded; its
    KernelSpec.check sends wider routers to the reference, and the launcher itself refuses them."""
    from torch_kernels.families.moe import triton as triton_moe
    wide, ok = torch.empty(2, triton_moe.MAX_TILE + 1), torch.empty(2, triton_moe.MAX_TILE)
    assert triton_moe.topk_softmax_refuses(ok, 8) is None and triton_moe.grouped_topk_refuses(ok, 8, True, 8, 4) is None
    assert "experts" in triton_moe.topk_softmax_refuses(wide, 8)
    assert "experts" in triton_moe.grouped_topk_refuses(torch.empty(2, 5 * 2000), 8, True, 5, 2, "sigmoid", None, 1.0)
    with pytest.raises(ValueError, match="exceed"):
        triton_moe.topk_softmax(wide, 8)



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_triton_other_configs_match_reference(op, dtype, device):
    """The entry points under launches other than the heuristic's: one token a program, tokens past
    the batch (masked), other warp counts; strided rows, groups that are not powers of two."""
    triton_moe = triton_here("moe", device)
    Config = triton_moe.TritonMoeConfig
    fn = getattr(triton_moe, op)
    for row in EXTRA[op][:3]:
        args = _args(op, row, device, dtype)
        want = _reference(op)(*args)
        for config in (Config(1, 1), Config(2, 4), Config(8, 2), Config(64, 8)):
            try:
                compare_routing(list(fn(*args, config=config)), list(want), dtype)
            except AssertionError as e:
                raise AssertionError(f"{config}, {op} {tuple(args[0].shape)} {args[1:]}: {e}") from None


def test_triton_heuristic_picks_the_register_budget():
    """4 warps, a token's experts in one warp, about 16 logits a thread; tiles needing over 32 a thread
    take 2048 logits a program across warps."""
    Config = triton_here("moe", "cpu").TritonMoeConfig
    assert Config.for_shape(256, 1, 2) == Config(8, 4)  # 256 experts in bf16: 2 tokens a warp, 16 logits a thread
    assert Config.for_shape(256, 8, 2) == Config(8, 4)  # DeepSeek-V3's 8 groups of 32: 2048 logits a program
    assert Config.for_shape(128, 1, 4) == Config(16, 4)
    assert Config.for_shape(8, 1, 4) == Config(256, 4)
    assert Config.for_shape(1024, 1, 2) == Config(4, 4)
    assert Config.for_shape(4096, 1, 2) == Config(1, 4)
    assert Config.for_shape(8192, 1, 2) == Config(1, 8)


# --- bad input -----------------------------------------------------------------------------------

def _bad_cases(op, device):
    x = torch.randn(4, 64, device=device)
    if op == "topk_softmax":
        def args(x=x, topk=4):
            return (x, topk, False)
        return [
            ("topk larger than the experts", args(topk=65), ValueError, "topk"),
            ("topk 0", args(topk=0), ValueError, "topk"),
            ("1-D logits", args(x=torch.randn(64, device=device)), ValueError, "gating_output"),
            ("3-D logits", args(x=torch.randn(2, 4, 64, device=device)), ValueError, "gating_output"),
            ("integer logits", args(x=torch.ones(4, 64, dtype=torch.int32, device=device)), TypeError, "gating_output"),
            ("non-contiguous experts", args(x=torch.randn(64, 4, device=device).t()), ValueError, "gating_output"),
            ("no experts", args(x=torch.randn(4, 0, device=device), topk=1), ValueError, "gating_output"),
        ]
    bias = torch.randn(64, device=device)

    def args(x=x, topk=4, groups=8, topk_group=2, scoring="sigmoid", bias=bias):
        return (x, topk, True, groups, topk_group, scoring, bias, 2.5)
    return [
        ("topk larger than the kept experts", args(topk=17), ValueError, "topk"),
        ("topk 0", args(topk=0), ValueError, "topk"),
        ("groups not dividing the experts", args(groups=5), ValueError, "num_expert_group"),
        ("no groups", args(groups=0), ValueError, "num_expert_group"),
        ("groups of one expert with a bias", args(groups=64, topk_group=4, topk=2), ValueError, "num_expert_group"),
        ("topk_group above the groups", args(topk_group=9), ValueError, "topk_group"),
        ("topk_group 0", args(topk_group=0), ValueError, "topk_group"),
        ("unknown scoring", args(scoring="relu"), ValueError, "scoring_func"),
        ("bias of the wrong size", args(bias=torch.randn(63, device=device)), ValueError, "e_score_correction_bias"),
        ("2-D bias", args(bias=torch.randn(1, 64, device=device)), ValueError, "e_score_correction_bias"),
        ("integer bias", args(bias=torch.ones(64, dtype=torch.int64, device=device)), TypeError, "e_score_correction_bias"),
        ("strided bias", args(bias=torch.randn(128, device=device)[::2]), ValueError, "e_score_correction_bias"),
        ("bias on another device", args(bias=torch.randn(64, device="meta")), ValueError, "e_score_correction_bias"),
        ("1-D logits", args(x=torch.randn(64, device=device)), ValueError, "gating_output"),
        ("integer logits", args(x=torch.ones(4, 64, dtype=torch.int32, device=device)), TypeError, "gating_output"),
        ("non-contiguous experts", args(x=torch.randn(64, 4, device=device).t()), ValueError, "gating_output"),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_bad_input_names_the_op_and_the_argument(op, device):
    assert_bad_inputs_raise(op, _bad_cases(op, device))


@pytest.mark.gpu
def test_grouped_topk_bias_on_cpu_raises_before_any_kernel():
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(ValueError, match=r"deepinfer::grouped_topk: argument 'e_score_correction_bias' is on cpu"):
        grouped_topk(x, 4, True, 8, 2, "sigmoid", torch.randn(64), 1.0)
    torch.cuda.synchronize()
