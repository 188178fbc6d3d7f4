"""``sampling_from_probs``, ``sampling_from_logits`` and ``top_k_top_p_sampling_from_logits``: the
reference's kept sets against an independent fp64 formula; the defining identities on every backend
(the probs-in op with its filters off; ``softmax`` followed by the probs-in op, bit for bit); every
backend against the reference over dtypes and awkward shapes (Triton in its interpreter on CPU); the
sampled distribution (chi-square, both random sources); determinism; bad input; CUDA graphs and the
engines' shapes on a GPU."""

import math

import pytest
import torch

import torch_kernels
from torch_kernels import ops, registry
from torch_kernels.families.sampling import reference
from torch_kernels.spec import Backend

from conftest import bits as conftest_bits
from conftest import DEVICES, assert_bad_inputs_raise, chi_square, chi_square_critical, implementations_on, triton_here

FROM_PROBS, FROM_LOGITS, TKTP_LOGITS = "sampling_from_probs", "sampling_from_logits", "top_k_top_p_sampling_from_logits"
NEW_OPS = [FROM_PROBS, FROM_LOGITS, TKTP_LOGITS]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NINF = float("-inf")
FLT_MAX = torch.finfo(torch.float32).max


def _t(v, device):
    return torch.tensor(v, dtype=torch.int64, device=device)


def _softmax(rows, vocab, device, scale=3.0, stride=None):
    return torch.softmax(torch.randn(rows, stride or vocab, device=device) * scale, -1)[:, :vocab]


def _logits(rows, vocab, device, dtype=torch.float32, scale=3.0, stride=None):
    return (torch.randn(rows, stride or vocab, device=device) * scale).to(dtype)[:, :vocab]


# ------------------------------------------------------------------------------------------------
# The independent formula: fp64, ranks and pairwise masses of the fp32 probabilities (no sort, no
# fixed point), the probabilities ``softmax``'s (the definition's first step).


def _kept_formula(probs, top_k=None, top_p=None):
    """(kept, renormalised fp64 rows, margin): top-k by rank (fewer than k strictly larger), top-p by
    the fp64 mass of strictly larger survivors (the largest always kept); ``margin``: the least
    distance of a mass-above from the top-p limit relative to the row's largest value."""
    p = probs.double().nan_to_num(nan=0.0, posinf=FLT_MAX).clamp(min=0.0)
    B, V = p.shape
    larger = p[:, None, :] > p[:, :, None]  # [b, i, j]: p_j > p_i
    kept = p > 0
    if top_k is not None:
        k = top_k.long().to(p.device)
        k = torch.where((k > 0) & (k < V), k, V)
        kept = kept & (larger.sum(-1) < k[:, None])
    margin = math.inf
    if top_p is not None:
        pk = torch.where(kept, p, 0.0)
        above = (larger * pk[:, None, :]).sum(-1)
        limit = top_p.double().to(p.device)[:, None] * pk.sum(-1, keepdim=True)
        inner = kept & (above > 0)
        if inner.any():
            margin = ((above - limit).abs() / p.amax(-1, keepdim=True))[inner].min().item()
        kept = kept & ((above == 0) | (above < limit))
    kp = torch.where(kept, p, 0.0)
    s = kp.sum(-1, keepdim=True)
    return kept, torch.where(s > 0, kp / s.clamp(min=1e-300), 0.0), margin


def _margin_needed(vocab: int) -> float:
    return 2 * vocab * 2.0 ** (1 - reference.fixed_point_bits(vocab))


def _per_row(value, rows, dtype, device):
    return value.to(device) if isinstance(value, torch.Tensor) else torch.full((rows,), value, dtype=dtype, device=device)


def _args(op, x, top_k=0, top_p=1.0, temperature=1.0, seed=1234, offset=5):
    """The registered op's arguments: a scalar as ``<name>_val``, a tensor as ``maybe_<name>_arr``."""
    d = x.device
    s, o = _t(seed, d), _t([offset], d)
    if op != TKTP_LOGITS:
        return x, s, o
    k_arr, k_val = (top_k.to(d), 0) if isinstance(top_k, torch.Tensor) else (None, top_k)
    p_arr, p_val = (top_p.to(d), 0.0) if isinstance(top_p, torch.Tensor) else (None, top_p)
    t_arr, t_val = (temperature.to(d), 1.0) if isinstance(temperature, torch.Tensor) else (None, temperature)
    return x, k_arr, k_val, p_arr, p_val, t_arr, t_val, s, o


def _ids_in(kept, ids):
    """Each id in its row's kept set; a row without mass (all -inf, a NaN, +inf) draws token 0."""
    kept = kept.to(ids.device)
    inside = kept.gather(1, ids.long()[:, None]).squeeze(1)
    return bool(torch.where(kept.any(1), inside, ids == 0).all())


KEPT_CASES = [
    # (logits maker, top_k, top_p, temperature)
    (lambda: _logits(8, 1000, "cpu"), [1, 5, 50, 0, -3, 1000, 999, 2000], [0.9, 0.5, 0.99, 0.1, 1.0, 0.0, 0.7, 1.5],
     [1.0, 0.7, 1.3, 0.5, 2.0, 1.0, 0.0, 1.0]),
    (lambda: _logits(4, 257, "cpu", scale=1.0), [7, 0, 200, 3], [0.95, 0.8, 0.3, 1.0], 0.8),
    (lambda: _logits(4, 300, "cpu", torch.bfloat16, scale=1.0).round(), [10, 80, 0, 299], [0.5, 0.9, 0.35, 0.6], 1.0),
]


@pytest.mark.parametrize("case", range(len(KEPT_CASES)))
def test_reference_draws_only_from_the_independent_kept_set(case):
    """The reference's top-k then top-p on ``softmax(logits, t)`` keeps the formula's set (the data far
    from a top-p boundary), and 64 draws a row fall in it, each kept token drawn at least once where
    the kept set is small."""
    torch.manual_seed(20 + case)
    make, ks, ps, ts = KEPT_CASES[case]
    logits = make()
    B, V = logits.shape
    top_k, top_p = torch.tensor(ks), torch.tensor(ps, dtype=torch.float32)
    temperature = torch.tensor(ts) if isinstance(ts, list) else ts
    probs = reference.softmax(logits, temperature if isinstance(temperature, torch.Tensor) else None,
                              temperature if not isinstance(temperature, torch.Tensor) else 1.0)
    kept, _, margin = _kept_formula(probs, top_k, top_p)
    assert margin > _margin_needed(V), f"test data too close to a top-p boundary ({margin}): change the seed"
    from torch_kernels.families.sampling.ops import logits_in_kept_set
    args = _args(TKTP_LOGITS, logits, top_k, top_p, temperature)
    assert torch.equal(logits_in_kept_set(TKTP_LOGITS, args), kept)
    reps = 64
    wide = _args(TKTP_LOGITS, logits.repeat(reps, 1), top_k.repeat(reps), top_p.repeat(reps),
                 temperature.repeat(reps) if isinstance(temperature, torch.Tensor) else temperature)
    seen = torch.zeros_like(kept)
    for offset in range(4):
        ids = reference.top_k_top_p_sampling_from_logits(*wide[:-1], _t(offset, "cpu"))
        assert _ids_in(kept.repeat(reps, 1), ids), f"offset {offset}: a token outside the kept set"
        seen.view(-1)[(torch.arange(B * reps) % B * V + ids.long())] = True
    small = kept.sum(-1) <= 4
    assert torch.equal(seen[small], kept[small]), "a kept token of a small set never drawn in 256 draws"


def test_reference_sampling_from_probs_draws_only_positive_probabilities():
    torch.manual_seed(24)
    probs = _softmax(6, 300, "cpu")
    probs[0, :6] = torch.tensor([math.nan, -0.5, -0.0, 0.0, 1e-30, 1e-40])
    probs[1, ::2] = 0.0
    probs[2, 7] = math.inf  # FLT_MAX: every draw
    kept, _, _ = _kept_formula(probs)
    for offset in range(8):
        ids = reference.sampling_from_probs(probs.repeat(32, 1), _t(3, "cpu"), _t(offset, "cpu"))
        assert _ids_in(kept.repeat(32, 1), ids)
        assert (ids.view(32, 6)[:, 2] == 7).all()
    assert reference.sampling_from_probs(torch.zeros(2, 10), _t(1, "cpu"), _t(0, "cpu")).tolist() == [0, 0]


# ------------------------------------------------------------------------------------------------
# The defining identities, bit for bit: on the reference, on each backend, and the registered op.


def _identity_cases(device, dtype):
    """(logits, top_k, top_p, temperature): a row of 1000 with -inf entries, an odd vocabulary across
    three 2048-chunks, strided rows, batch 1, one whole chunk, vocabulary 1, all -inf, NaN and +inf
    rows, ties, t = 0."""
    odd = _logits(6, 301, device, dtype)
    odd[0, ::3] = NINF
    odd[1] = NINF
    odd[2, 5] = math.nan
    odd[3, 9] = math.inf
    odd[4, :300] = NINF  # one finite logit
    yield _logits(3, 1000, device, dtype), _t([5, 0, 1000], device).int(), 0.9, 1.0
    f = lambda v: torch.tensor(v, device=device)  # noqa: E731
    yield _logits(2, 4097 + 900, device, dtype), 50, f([0.8, 1.0]), f([0.6, 0.0])
    yield _logits(4, 1000, device, dtype, stride=1280), _t([1, 2, 100, -1], device), f([0.5, 0.0, 0.95, 0.7]), 1.3
    yield _logits(1, 32000, device, dtype), 40, 0.95, 0.7
    yield _logits(2, 2048, device, dtype), 0, 0.9, 1.0  # a whole chunk, no tail
    yield _logits(1, 1, device, dtype), 1, 0.5, 1.0
    yield odd, 3, 0.9, torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 2.0], device=device)
    yield _logits(3, 129, device, dtype, scale=1.0).round(), 4, 0.6, 1.0  # ties


def _probs_in(sampling_from_probs, top_k_top_p_from_probs, softmax, args, op):
    """The composition the op is defined as, from one backend's probs-in ops."""
    if op == FROM_LOGITS:
        x, s, o = args
        return sampling_from_probs(softmax(x, None, 1.0), s, o)
    x, k_arr, k_val, p_arr, p_val, t_arr, t_val, s, o = args
    return top_k_top_p_from_probs(softmax(x, t_arr, t_val), k_arr, p_arr, s, o, k_val, p_val)


def _largest_at(probs, value):
    """``probs`` with each row of a positive finite largest value scaled so that it is ``value``."""
    m = torch.where(probs > 0, probs.nan_to_num(0.0, posinf=0.0), 0.0).amax(-1, keepdim=True)
    return torch.where(m > 0, probs * (value / torch.where(m > 0, m, 1.0)), probs)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_from_probs_is_top_k_top_p_with_the_filters_off_from_one(device):
    """Rows whose largest value is at least 1 have their masses at its exponent in both samplers, so they
    draw the same ids: from 1 at the scale fixed in advance (one read), from 2 on the walk of the row."""
    torch.manual_seed(25)
    cases = [_softmax(5, 1000, device), _softmax(4, 301, device, stride=384), _softmax(1, 1, device),
             torch.softmax(torch.randint(0, 4, (2, 129), device=device).float(), -1), _softmax(2, 4096 + 700, device),
             1.0 + 0.9 * torch.rand(2, 9000, device=device)]  # flat: a slice's masses sum past 2^52
    odd = _softmax(4, 200, device)
    odd[0, :6] = torch.tensor([math.nan, -0.5, -0.0, 0.0, 1e-30, 1e-40])
    odd[1], odd[2, 7] = 0.0, math.inf
    cases.append(odd)
    if device == "cpu":
        triton_here("sampling", device)
    fns = {name: fn for name, fn in implementations_on(FROM_PROBS, device)}
    assert "triton" in fns or "triton-interpreted" in fns, fns
    probs_in = {name: fn for name, fn in implementations_on("top_k_top_p_sampling_from_probs", device)}
    for probs in (_largest_at(c, v) for c in cases for v in (1.0, 1.75, 6.0)):
        B = probs.shape[0]
        for top_k, top_p in ((0, 1.0), (-1, 2.0)):
            k, p = torch.full((B,), top_k, device=device), torch.full((B,), top_p, device=device)
            for seed, offset in ((1234, 5), (-7, 2**40)):
                s, o = _t(seed, device), _t(offset, device)
                want = reference.top_k_top_p_sampling_from_probs(probs, k, p, s, o)
                for name, fn in fns.items():
                    assert torch.equal(fn(probs, s, o).cpu(), want.cpu()), f"{name} {tuple(probs.shape)}"
                    if name in probs_in:
                        assert torch.equal(probs_in[name](probs, k, p, s, o).cpu(), want.cpu()), name


@pytest.mark.parametrize("device", DEVICES)
def test_slice_masses_are_exact_past_fp64_integers(device):
    """The slice passes sum fixed-point masses in fp64, exact below 2^52; a slice past it sums again in
    int64. Large values alternate with values below 2^-20 (masses with low bits set: ~2^53.9 a slice),
    where an fp64 sum is off; the slices' masses equal the int64 sums."""
    triton_here("sampling", device)
    from torch_kernels.families.sampling.triton import logits_in

    torch.manual_seed(26)
    B, V = 2, 9000
    probs = 0.9 + 0.09 * torch.rand(B, V, device=device)
    probs[:, 1::2] = torch.rand(B, V // 2, device=device) * 2.0 ** -21
    S, q_bits = -(-V // logits_in._SLICE), reference.fixed_point_bits(V)
    mx = torch.empty((B, S), dtype=torch.int32, device=device)
    mass = torch.empty((B, S), dtype=torch.int64, device=device)
    logits_in._slice_mass_kernel[(B, S)](probs, probs.stride(0), mx, 1.0, mx, S, mx, mass, V, q_bits, LOGITS=False,
                                         HAS_IDX=False, BLOCK_S=4, SLICE=logits_in._SLICE, CHUNK=logits_in.MASS_CHUNK)
    bits = reference.value_bits(probs.cpu())
    q = reference.fixed_point(bits, torch.full((B, 1), reference.ONE_EXPONENT << 23), q_bits)
    pad = torch.nn.functional.pad(q, (0, S * logits_in._SLICE - V)).view(B, S, -1)
    want = pad.sum(-1)
    assert torch.equal(mass.cpu(), want), (mass.cpu() - want).tolist()
    assert torch.equal(mx.cpu(), torch.stack([b.amax(-1) for b in bits.split(logits_in._SLICE, -1)], -1))
    assert not torch.equal(pad.double().sum(-1).long(), want), "the fp64 sum is exact here: no fallback tested"


def test_sampling_from_probs_masses_sit_at_one_below_it():
    """Below 1 the masses are at 1.0's exponent, not the row's largest: a token of probability below
    2^-(Q-1) has no mass."""
    V = 1000
    q_bits = reference.fixed_point_bits(V)
    probs = torch.full((1, V), 2.0 ** -(q_bits - 1) / 2)  # all below one unit: no mass, token 0
    probs[0, 500] = 2.0 ** -(q_bits - 1)  # one unit: every draw
    for offset in range(16):
        assert reference.sampling_from_probs(probs, _t(3, "cpu"), _t(offset, "cpu")).tolist() == [500]
    # the other samplers scale at the row's largest: every token there has mass
    drawn = {reference.top_k_top_p_sampling_from_probs(probs, None, None, _t(3, "cpu"), _t(o, "cpu")).item()
             for o in range(16)}
    assert drawn != {500}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [FROM_LOGITS, TKTP_LOGITS])
def test_logits_in_is_softmax_then_probs_in_on_every_backend(op, dtype, device):
    """The reference against the composition of the references, and the Triton kernel against the
    composition of the Triton softmax and probs-in kernels (fused: the same ids with no probabilities
    written), over awkward rows; the registered op against the reference's composition."""
    torch.manual_seed(26)
    if device == "cpu":
        triton_here("sampling", device)
    by_op = registry.BY_OP
    for logits, top_k, top_p, temperature in _identity_cases(device, dtype):
        streams = ((99, 0), (2**40 + 1, 3)) if op == FROM_LOGITS or device == "cuda" else ((2**40 + 1, 3),)
        for seed, offset in streams:  # (the interpreter runs top-k/top-p's routes slowly: one stream)
            args = _args(op, logits, top_k, top_p, temperature, seed, offset)
            if op == FROM_LOGITS:
                args = args[:1] + args[-2:]
            for backend in (Backend.TORCH, Backend.TRITON):
                got = by_op[op][backend].load()(*args)
                want = _probs_in(by_op[FROM_PROBS][backend].load(), by_op["top_k_top_p_sampling_from_probs"][backend].load(),
                                 by_op["softmax"][backend].load(), args, op)
                assert got.dtype == torch.int32 and torch.equal(got.cpu(), want.cpu()), \
                    f"{backend.value} {tuple(logits.shape)} seed {seed}: {got.tolist()[:8]} vs {want.tolist()[:8]}"
            registered = getattr(torch.ops.deepinfer, op).default(*args)
            if device == "cpu":  # the registered op is the reference on CPU
                assert torch.equal(registered, by_op[op][Backend.TORCH].load()(*args))
            else:
                assert _ids_in(logits_in_kept(op, args), registered), "registered op: an id outside the kept set"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_logits_in_writes_only_the_rows_the_prepass_does_not_finish(dtype, device):
    """The split prepass from logits: the ids of softmax then the probs-in kernels (and the reference's),
    with the probabilities tensor written only for the rows the filter kernel reads, each exactly as
    softmax writes it; the rows the prepass finishes keep what was there (NaN here). A 64-slot buffer
    of 4 slices (16 slots, k <= 16 splits) on rows of 1000; and the default launch at 32000."""
    ts = triton_here("sampling", device)
    from torch_kernels.families.sampling.triton.candidates import Logits
    from torch_kernels.families.sampling.triton.logits import slice_stats
    from torch_kernels.families.sampling.triton.logits_in import top_k_top_p_sampling_from_logits

    torch.manual_seed(33)
    small = ts.Config(cap=64, chunk=64, k_small=32, chunk_g=512, np_count=16, np_mass=16, num_warps=4, slices=4,
                      slice_warps=4, hist_slices=0)
    x = _logits(8, 1000, device, dtype, stride=1024)
    x[1, ::2] = NINF  # half the row masked
    x[2] = torch.randint(0, 2, (1000,), device=device).to(dtype)  # ties beyond a slice's 16 slots: not finished
    x[3, 5:] = NINF  # fewer finite values than k: ties of zeros
    k = torch.tensor([10, 16, 10, 10, 17, 0, 1, -1], device=device)  # 17, off: not split
    p = torch.tensor([0.9, 0.5, 1.0, 0.8, 0.9, 0.95, 0.3, 0.7], device=device)
    t = torch.tensor([1.0, 0.7, 1.0, 1.0, 1.3, 1.0, 2.0, 0.0], device=device)  # t = 0: uniform, all tied
    cases = [(x, k, 0, p, 1.0, t, 1.0, small, [0, 1, 6]), (x, None, 12, None, 0.9, None, 0.8, small, None),
             (_logits(2, 32000, device, dtype), None, 50, None, 0.9, None, 1.0, ts.DEFAULT, [0, 1])]
    for x, k_arr, k_val, p_arr, p_val, t_arr, t_val, config, finished in cases:
        B, V = x.shape
        s, o = _t(4321, device), _t(9, device)
        softmax = ts.softmax(x, t_arr, t_val)
        want = ts._launch(softmax, ts._either(k_arr, k_val), ts._either(p_arr, p_val), s, o, sample=True, config=config)
        assert torch.equal(want.cpu(), reference.top_k_top_p_sampling_from_logits(
            x, k_arr, k_val, p_arr, p_val, t_arr, t_val, s, o).cpu())
        assert torch.equal(top_k_top_p_sampling_from_logits(x, k_arr, k_val, p_arr, p_val, t_arr, t_val, s, o,
                                                            config=config).cpu(), want.cpu())
        probs = torch.full((B, V), math.nan, device=device)
        stats, _, _ = slice_stats(x, t_arr, t_val)
        got = ts._launch(probs, ts._either(k_arr, k_val), ts._either(p_arr, p_val), s, o, sample=True, config=config,
                         logits=Logits(x, t_arr, t_val, stats))
        assert torch.equal(got.cpu(), want.cpu()), f"{tuple(x.shape)}: {got.tolist()} vs {want.tolist()}"
        untouched = [r for r in range(B) if probs[r].isnan().all()]
        if finished is not None:
            assert untouched == finished, untouched
        for r in set(range(B)) - set(untouched):
            assert torch.equal(conftest_bits(probs[r]), conftest_bits(softmax[r])), f"row {r} not softmax's"


def logits_in_kept(op, args):
    from torch_kernels.families.sampling.ops import logits_in_kept_set
    return logits_in_kept_set(op, args)


# ------------------------------------------------------------------------------------------------
# Every backend against the reference, exactly: the op's samples in each dtype and the awkward rows.
# (Triton's softmax and torch's may round a probability differently in its last bit; the ids agree
# unless a draw falls within that rounding of a boundary, ~2^-24 of a row's mass: never here.)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", NEW_OPS)
def test_backends_match_reference(op, dtype, device):
    torch.manual_seed(27)
    ref = registry.BY_OP[op][Backend.TORCH].load()
    backends = implementations_on(op, device)
    if device == "cpu":
        triton_here("sampling", device)
        assert any(n == "triton-interpreted" for n, _ in backends), backends
    cases = [tuple(a) for a in ops.BY_NAME[op].samples(device, dtype)]
    for logits, top_k, top_p, temperature in _identity_cases(device, dtype):
        if op == FROM_PROBS:
            cases.append(_args(op, reference.softmax(logits).nan_to_num(0.0)))
        else:
            args = _args(op, logits, top_k, top_p, temperature, seed=-5, offset=2**33)
            cases.append(args if op == TKTP_LOGITS else args[:1] + args[-2:])
    for args in cases:
        assert op == FROM_PROBS or args[0].dtype == dtype
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        want = ref(*args)
        indices = args[3] if op == FROM_PROBS and len(args) > 3 else None  # output rows: one per index
        assert want.dtype == torch.int32 and want.shape == (args[0] if indices is None else indices).shape[:1]
        for name, fn in backends:
            got = fn(*args)
            assert got.dtype == torch.int32 and torch.equal(got.cpu(), want.cpu()), \
                f"{name} {tuple(args[0].shape)}: {got.tolist()[:8]} vs {want.tolist()[:8]}"
        assert all(not isinstance(b, torch.Tensor) or torch.equal(b.nan_to_num(), a.nan_to_num())
                   for b, a in zip(before, args)), "an input was clobbered"


# ------------------------------------------------------------------------------------------------
# The sampled distribution: 100k draws of one row against the kept, renormalised probabilities.


def _draw(op, x, source, step, **kw):
    fn = getattr(torch_kernels, op)
    if source == "seed_offset":
        kw.update(seed=torch.tensor(7, device=x.device), offset=torch.tensor(step, device=x.device))
    return fn(x, **kw)


@pytest.mark.parametrize("source", ["seed_offset", "torch_generator"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", NEW_OPS)
def test_distributionchi_square(op, device, source):
    """10 x 10000 draws of one row (fixed seeds): the counts match the kept, renormalised
    probabilities, and the same counts reject two wrong distributions (each token's probability given
    to the next, as an off-by-one inverse CDF would; the largest swapped with the median), so the test has the
    power to fail."""
    torch.manual_seed(28)
    V = 40
    logits = _logits(1, V, device, scale=1.0)
    kw = {}
    if op == FROM_PROBS:
        x = torch.softmax(logits, -1) * 0.5  # unnormalised
        kept, expected, _ = _kept_formula(x)
    elif op == FROM_LOGITS:
        x = logits
        kept, expected, _ = _kept_formula(reference.softmax(logits))
    else:
        x = logits
        kw = dict(top_k=25, top_p=0.7, temperature=0.8)
        kept, expected, margin = _kept_formula(reference.softmax(logits, None, 0.8), torch.tensor([25]),
                                               torch.tensor([0.7]))
        assert margin > _margin_needed(V)
    n_kept = int(kept.sum())
    assert 5 <= n_kept <= V, n_kept
    if op == TKTP_LOGITS:
        assert n_kept < 25, n_kept  # both filters bite
    reps, draws = 10000, 10
    counts = torch.zeros(V, dtype=torch.float64)
    for step in range(draws):
        ids = _draw(op, x.repeat(reps, 1), source, step, **kw)
        counts += torch.bincount(ids.long().cpu(), minlength=V).double()
    k = kept[0].cpu()
    assert counts[~k].sum() == 0
    critical = chi_square_critical(n_kept - 1)
    e = expected[0].cpu()[k]
    chi2 = chi_square(counts[k], e)
    assert chi2 < critical, f"chi-square {chi2:.1f} with {n_kept - 1} degrees of freedom (critical {critical:.1f})"
    swapped = e.clone()
    order = swapped.argsort()
    pair = order[[-1, len(order) // 2]]
    swapped[pair] = swapped[pair.flip(0)]
    for w in (e.roll(1), swapped):
        assert chi_square(counts[k], w) > critical, "the chi-square test cannot tell a wrong distribution"


# ------------------------------------------------------------------------------------------------
# Determinism, the two random sources, the wrapper's argument forms.


@pytest.mark.parametrize("op", NEW_OPS)
def test_deterministic_per_seed_and_offset_and_follows_torch_seed(op):
    torch.manual_seed(29)
    x = _logits(64, 500, "cpu", scale=0.5)
    if op == FROM_PROBS:
        x = torch.softmax(x, -1)
    kw = dict(top_k=200, top_p=0.95) if op == TKTP_LOGITS else {}
    fn = getattr(torch_kernels, op)

    def draw(seed, offset, rows=64, shape=()):
        return fn(x[:rows], **kw, seed=torch.full(shape, seed, dtype=torch.int64),
                  offset=torch.full(shape, offset, dtype=torch.int64))
    a = draw(1, 0)
    assert torch.equal(a, draw(1, 0)) and torch.equal(a, draw(1, 0, shape=(1,)))
    assert torch.equal(a, fn(x, **kw, seed=1, offset=0)), "int seed and offset"
    assert torch.equal(a[:5], draw(1, 0, rows=5)), "a row's stream depends on the batch size"
    for other in (draw(1, 1), draw(2, 0), draw(1, 2**32), draw(-1, 0)):
        assert (other != a).sum() > 32, "another seed or offset gave (nearly) the same draws"
    torch.manual_seed(0)
    g1, g2 = fn(x, **kw), fn(x, **kw)
    torch.manual_seed(0)
    assert torch.equal(g1, fn(x, **kw)), "torch.manual_seed reproduces"
    assert (g1 != g2).sum() > 32, "consecutive draws from torch's generator repeat"


def test_scalar_and_per_row_forms_agree():
    torch.manual_seed(30)
    logits = _logits(6, 300, "cpu")
    s = dict(seed=3, offset=4)
    want = torch_kernels.top_k_top_p_sampling_from_logits(logits, 20, 0.8, 0.9, **s)
    for k in (20, torch.full((6,), 20), torch.full((6,), 20, dtype=torch.int32)):
        for p in (0.8, torch.full((6,), 0.8)):
            for t in (0.9, torch.full((6,), 0.9), torch.full((6,), 0.9, dtype=torch.float64)):
                assert torch.equal(torch_kernels.top_k_top_p_sampling_from_logits(logits, k, p, t, **s), want)
    assert torch.equal(torch_kernels.sampling_from_logits(logits, **s),
                       torch_kernels.sampling_from_probs(torch_kernels.softmax(logits), **s))


# ------------------------------------------------------------------------------------------------
# Bad input: named, nothing written, before any kernel.


def _bad_cases(op, device):
    x = torch.randn(4, 64, device=device)
    seed, offset = torch.tensor(1, device=device), torch.tensor([0], device=device)
    data = "probs" if op == FROM_PROBS else "logits"
    if op == FROM_PROBS:
        x = torch.softmax(x, -1)

    def args(x=x, seed=seed, offset=offset, **change):
        if op != TKTP_LOGITS:
            return x, seed, offset
        given = {**dict(maybe_top_k_arr=None, top_k_val=5, maybe_top_p_arr=None, top_p_val=0.9,
                        maybe_temperature_arr=None, temperature_val=1.0), **change}
        return (x, *given.values(), seed, offset)
    cases = [
        ("1-D", args(x[0]), ValueError, data),
        ("3-D", args(x[None]), ValueError, data),
        ("fp64", args(x.double()), TypeError, data),
        ("int", args(x.int()), TypeError, data),
        ("non-contiguous vocabulary", args(torch.randn(64, 4, device=device).t()), ValueError, data),
        ("empty vocabulary", args(x[:, :0]), ValueError, data),
        ("int32 seed", args(seed=seed.int()), TypeError, "seed"),
        ("two seeds", args(seed=torch.tensor([1, 2], device=device)), ValueError, "seed"),
        ("float offset", args(offset=offset.float()), TypeError, "offset"),
        ("(1, 1) offset", args(offset=offset[None]), ValueError, "offset"),
        ("offset on another device", args(offset=offset.to("meta")), ValueError, "offset"),
    ]
    if op == FROM_PROBS:
        cases.append(("fp64 probs", args(x.double()), TypeError, "probs"))
    if op == TKTP_LOGITS:
        ints, floats = torch.ones(4, dtype=torch.int32, device=device), torch.ones(4, device=device)
        cases += [
            ("top_k of the wrong length", args(maybe_top_k_arr=ints[:3]), ValueError, "maybe_top_k_arr"),
            ("float top_k", args(maybe_top_k_arr=floats), TypeError, "maybe_top_k_arr"),
            ("top_k on another device", args(maybe_top_k_arr=ints.to("meta")), ValueError, "maybe_top_k_arr"),
            ("2-D top_p", args(maybe_top_p_arr=floats[:, None]), ValueError, "maybe_top_p_arr"),
            ("fp64 top_p", args(maybe_top_p_arr=floats.double()), TypeError, "maybe_top_p_arr"),
            ("int temperatures", args(maybe_temperature_arr=ints), TypeError, "maybe_temperature_arr"),
            ("temperatures of the wrong length", args(maybe_temperature_arr=floats[:2]), ValueError,
             "maybe_temperature_arr"),
            ("negative temperature", args(temperature_val=-0.5), ValueError, "temperature_val"),
            ("NaN temperature", args(temperature_val=math.nan), ValueError, "temperature_val"),
        ]
    return cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", NEW_OPS)
def test_bad_input_names_the_op_and_the_argument(op, device):
    assert_bad_inputs_raise(op, _bad_cases(op, device))


@pytest.mark.parametrize("op", NEW_OPS)
def test_wrapper_refuses_bad_argument_forms(op):
    x = torch.softmax(torch.randn(2, 8), -1)
    kw = dict(top_k=2, top_p=0.9) if op == TKTP_LOGITS else {}
    cases = [({"seed": 1}, "offset"), ({"offset": torch.tensor(0)}, "seed"), ({"seed": 1.5, "offset": 0}, "seed"),
             ({"seed": True, "offset": 0}, "seed")]
    if op == TKTP_LOGITS:
        cases += [({"top_k": 2.0}, "top_k"), ({"top_k": False}, "top_k"), ({"top_p": "0.9"}, "top_p"),
                  ({"temperature": "1"}, "temperature")]
    for change, arg in cases:
        with pytest.raises(TypeError, match=rf"^deepinfer::{op}: argument '{arg}' "):
            getattr(torch_kernels, op)(x, **{**kw, **change})


# ------------------------------------------------------------------------------------------------
# On a GPU: the engines' shapes, CUDA graphs, the default selection.

ENGINE_VOCAB = 128256


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 32, 256])
@pytest.mark.parametrize("op,dtype", [pytest.param(op, dtype, id=f"{op}-{str(dtype)[6:]}") for op, dtype in
                                      [(FROM_PROBS, torch.float32)]
                                      + [(op, dtype) for op in (FROM_LOGITS, TKTP_LOGITS) for dtype in DTYPES]])
def test_cuda_engine_shapes_match_reference(op, dtype, batch):
    """Vocabulary 128256: every CUDA backend against the reference (ids in its kept set, and equal to
    its ids but where a draw falls within a last-bit rounding of softmax, at most 1 row in 256), the
    Triton kernel against the Triton composition exactly, on fresh random logits."""
    torch.manual_seed(31 + batch)
    logits = _logits(batch, ENGINE_VOCAB, "cuda", dtype, stride=ENGINE_VOCAB + 64)
    logits[0, ::7] = NINF
    if op == FROM_PROBS:
        cases = [_args(op, torch.softmax(logits.float(), -1), seed=s) for s in (1, 2)]
    elif op == FROM_LOGITS:
        cases = [_args(op, logits, seed=s) for s in (1, 2)]
    else:
        cases = [_args(op, logits, 50, 0.9, 0.7),
                 _args(op, logits, torch.randint(-1, 2000, (batch,), device="cuda"),
                       torch.rand(batch, device="cuda") * 0.5 + 0.5, torch.rand(batch, device="cuda") + 0.3),
                 _args(op, logits, 0, 0.95, 1.0), _args(op, logits, 1024, 1.0, 1.0)]
    ref = registry.BY_OP[op][Backend.TORCH].load()
    backends = [(n, f) for n, f in implementations_on(op, "cuda")]
    assert any(n == "triton" for n, _ in backends), backends
    for args in cases:
        want = ref(*args)
        kept = logits_in_kept(op, args)
        for name, fn in backends:
            got = fn(*args)
            assert got.dtype == torch.int32 and _ids_in(kept, got), f"{name}: an id outside the kept set"
            differ = int((got != want).sum())
            assert differ <= (0 if op == FROM_PROBS else max(1, batch // 256)), f"{name}: {differ} rows differ"
        if op != FROM_PROBS:
            t = registry.BY_OP
            composed = _probs_in(t[FROM_PROBS][Backend.TRITON].load(),
                                 t["top_k_top_p_sampling_from_probs"][Backend.TRITON].load(),
                                 t["softmax"][Backend.TRITON].load(), args, op)
            assert torch.equal(t[op][Backend.TRITON].load()(*args), composed), "fused != Triton composition"


def _fused_launch(args):
    """The fused prepass on ``args`` (the op's), whether or not the op routes them to it."""
    from torch_kernels.families.sampling import triton as ts
    from torch_kernels.families.sampling.triton.candidates import Logits
    from torch_kernels.families.sampling.triton.logits import slice_stats
    x, k_arr, k_val, p_arr, p_val, t_arr, t_val, s, o = args
    stats, _, _ = slice_stats(x, t_arr, t_val)
    probs = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    return ts._launch(probs, ts._either(k_arr, k_val), ts._either(p_arr, p_val), s, o, sample=True,
                      config=ts.DEFAULT, logits=Logits(x, t_arr, t_val, stats))


def test_fused_logits_in_serves_slices_of_at_most_slice_values():
    """The op fuses where a row splits into slices of at most 4096 values: 32000 and 128256 (Llama 3), not
    256000 (8000 values a slice at the 32-slice cap) nor a scalar top-k past the slots."""
    pytest.importorskip("triton")
    from torch_kernels.families.sampling.triton.config import DEFAULT
    from torch_kernels.families.sampling.triton.logits_in import _fuses
    assert _fuses(50, 256, 32000, DEFAULT) and _fuses(50, 1, 128256, DEFAULT) and _fuses(50, 512, 131072, DEFAULT)
    assert not _fuses(50, 256, 256000, DEFAULT) and not _fuses(50, 256, 131073, DEFAULT)
    assert not _fuses(5000, 256, 128256, DEFAULT) and not _fuses(None, 256, 128256, DEFAULT)
    assert _fuses(50, 256, 256000, DEFAULT._replace(slice_values=0))


@pytest.mark.gpu
@pytest.mark.parametrize("batch,vocab", [(256, 32000), (512, 32000), (8, 256000)])
def test_cuda_fused_logits_in_is_the_composition_at_fitted_slices(batch, vocab):
    """The fused top-k/top-p sampler where the launch fits other slice counts (8 a row at 256-512 x 32000,
    64 histogram slices at 256000, where the op itself takes the composition): the Triton composition's
    ids exactly, per-row top-k mixing split rows, rows past the slots and rows without top-k, and the
    reference's but where a draw falls within a last-bit rounding of softmax."""
    torch.manual_seed(34)
    logits = _logits(batch, vocab, "cuda", torch.bfloat16)
    k = torch.randint(-1, 700, (batch,), device="cuda")
    p, temperature = torch.rand(batch, device="cuda") * 0.6 + 0.4, torch.rand(batch, device="cuda") + 0.3
    by_op = registry.BY_OP
    composed = lambda args: _probs_in(by_op[FROM_PROBS][Backend.TRITON].load(),  # noqa: E731
                                      by_op["top_k_top_p_sampling_from_probs"][Backend.TRITON].load(),
                                      by_op["softmax"][Backend.TRITON].load(), args, TKTP_LOGITS)
    for args in (_args(TKTP_LOGITS, logits, k, p, temperature), _args(TKTP_LOGITS, logits, 50, 0.9, 0.8)):
        got = _fused_launch(args)
        assert torch.equal(got, composed(args)), "fused != Triton composition"
        assert torch.equal(by_op[TKTP_LOGITS][Backend.TRITON].load()(*args), got), "the op != the fused launch"
        assert _ids_in(logits_in_kept(TKTP_LOGITS, args), got), "an id outside the kept set"
        want = by_op[TKTP_LOGITS][Backend.TORCH].load()(*args)
        assert int((got != want).sum()) <= max(1, batch // 256), "rows differ from the reference"


@pytest.mark.gpu
@pytest.mark.parametrize("op", NEW_OPS)
def test_cuda_graph_replays_draw_afresh(op):
    torch.manual_seed(32)
    x = _logits(64, ENGINE_VOCAB, "cuda")
    if op == FROM_PROBS:
        x = torch.softmax(x, -1)
    kw = dict(top_k=50, top_p=0.9, temperature=0.7) if op == TKTP_LOGITS else {}
    fn = getattr(torch_kernels, op)
    seed, offset = torch.tensor(11, device="cuda"), torch.tensor(0, device="cuda")
    kept = logits_in_kept(op, _args(op, x, **kw))
    fn(x, **kw, seed=seed, offset=offset)  # compile outside the capture
    fn(x, **kw)
    torch.cuda.synchronize()
    given, drawn = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(given):
        out = fn(x, **kw, seed=seed, offset=offset)
    with torch.cuda.graph(drawn):
        out_g = fn(x, **kw)
    seen, seen_g = [], []
    for step in (3, 4):
        offset.fill_(step)
        given.replay()
        assert torch.equal(out, fn(x, **kw, seed=seed, offset=offset))
        drawn.replay()
        assert _ids_in(kept, out) and _ids_in(kept, out_g)
        seen.append(out.clone())
        seen_g.append(out_g.clone())
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen_g[0], seen_g[1])


@pytest.mark.gpu
def test_cuda_default_selection_is_a_kernel():
    from torch_kernels import dispatch
    for op in NEW_OPS:
        chain, notice = dispatch.plan(op)
        assert chain[0].backend is not Backend.TORCH and notice is None


@pytest.mark.gpu
@pytest.mark.parametrize("op", NEW_OPS)
def test_cuda_and_cpu_tensors_raise_before_any_kernel(op):
    x = torch.softmax(torch.randn(4, 64, device="cuda"), -1)
    args = _bad_cases(op, "cuda")[0][1]
    args = (x,) + args[1:-2] + (torch.tensor(1), torch.tensor(0))
    with pytest.raises(ValueError, match=rf"^deepinfer::{op}: argument 'seed' is on cpu but "):
        getattr(torch.ops.deepinfer, op).default(*args)
    torch.cuda.synchronize()
