"""FlashInfer 0.7's argument forms of the samplers: ``filter_apply_order="joint"``, ``indices`` (rows that
share a distribution) and per-row ``seed``/``offset`` tensors. Joint: the reference against an independent
formula, every backend against the reference exactly, and a chi-square test of the sampled distribution;
indices and per-row seeds: bit for bit what the op gives on the gathered rows, or on each row alone."""

import os
import sys

import pytest
import torch

import torch_kernels
from torch_kernels import registry
from torch_kernels.families.sampling import reference
from torch_kernels.spec import Backend

from conftest import DEVICES, assert_bad_inputs_raise, chi_square, chi_square_critical, implementations_on

SAMPLING = "top_k_top_p_sampling_from_probs"
FROM_LOGITS = "top_k_top_p_sampling_from_logits"
MIN_P = "min_p_sampling_from_probs"
FROM_PROBS = "sampling_from_probs"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _softmax(rows, vocab, device, scale=3.0):
    return torch.softmax(torch.randn(rows, vocab, device=device) * scale, -1)


def _t(value, device):
    return torch.tensor(value, dtype=torch.int64, device=device)


def _exact_ids(name, got, want):
    assert got.dtype == torch.int32 and got.shape == want.shape, f"{name}: {got.dtype} {tuple(got.shape)}"
    assert torch.equal(got.cpu(), want.cpu()), f"{name}: {got.tolist()[:12]} vs {want.tolist()[:12]}"


def _own_stream(op, name):
    return (op, name) in {(o, b.value) for o, b in registry.OWN_RANDOM_STREAM}


# ------------------------------------------------------------------------------------------------
# Joint order.


def _joint_formula(probs, top_k, top_p):
    """Kept iff fewer than ``k`` values lie strictly above the token and their mass is below ``top_p``
    of the row's (FlashInfer's joint test), in fp64 of the values; the largest always."""
    p = probs.double()
    V = p.shape[1]
    k = torch.where((top_k > 0) & (top_k < V), top_k, V).double()[:, None]
    above = p[:, None, :] > p[:, :, None]  # [b, i, j]: p_j > p_i
    count = above.sum(-1)
    mass = (above * p[:, None, :]).sum(-1)
    return (count < k) & ((mass == 0) | (mass < top_p.double()[:, None] * p.sum(-1, keepdim=True)))


def test_joint_reference_matches_independent_formula():
    torch.manual_seed(30)
    probs = torch.cat([_softmax(6, 200, "cpu", scale=1.5), _softmax(2, 200, "cpu", scale=4.0)])
    top_k = torch.tensor([10, 10, 50, 0, 200, 3, 20, 5])
    top_p = torch.tensor([0.05, 0.5, 0.3, 0.6, 0.9, 0.0, 0.99, 1.0])
    bits = reference.value_bits(probs)
    q = reference.fixed_point(bits, bits.amax(-1, keepdim=True), reference.fixed_point_bits(200))
    joint, _ = reference.kept_mask(bits, q, top_k, top_p, joint=True)
    assert torch.equal(joint, _joint_formula(probs, top_k, top_p))
    first, _ = reference.kept_mask(bits, q, top_k, top_p)
    assert (first <= joint).all(), "joint keeps every token top-k-first keeps"
    assert (joint.sum(-1) > first.sum(-1)).sum() >= 2, "the rows do not tell the orders apart"
    ties = torch.tensor([[0.3, 0.3, 0.2, 0.1, 0.1]])  # k = 2 keeps both 0.3; joint p = 0.35: both (0 above the first)
    tb = reference.value_bits(ties)
    tq = reference.fixed_point(tb, tb.amax(-1, keepdim=True), reference.fixed_point_bits(5))
    assert reference.kept_mask(tb, tq, 3, 0.35, joint=True)[0].tolist() == [[True, True, False, False, False]]
    assert reference.kept_mask(tb, tq, 3, 0.7, joint=True)[0].tolist() == [[True, True, True, False, False]]


def _small_configs():
    """A 64-slot buffer without and with the split prepass, and the histogram route: rows of 1000 reach
    the candidate, split and full-pass routes (as ``test_sampling.py``'s)."""
    from torch_kernels.families.sampling import triton as triton_sampling
    hist = dict(hist_slices=4, hist_buckets=64, hist_levels=8, hist_level_octaves=2, hist_warps=4)
    return {
        "triton-small-buffer": triton_sampling.Config(cap=64, chunk=64, k_small=16, chunk_g=512, np_count=16,
                                                      np_mass=16, num_warps=4, slices=0, write_block=256,
                                                      write_warps=4, hist_slices=0),
        "triton-small-split": triton_sampling.Config(cap=64, chunk=64, k_small=32, chunk_g=512, np_count=16,
                                                     np_mass=16, num_warps=4, slices=4, np_slice=16, slice_warps=4,
                                                     write_block=128, write_warps=4, **hist),
    }


def _joint_cases(device):
    """(probs, top_k, top_p): rows where the joint limit falls inside the top-k survivors and where it
    keeps them all, per-row and scalar parameters; the top-k cut from 1 to beyond the candidate buffer."""
    torch.manual_seed(31)
    probs = torch.cat([_softmax(5, 1000, device, scale=1.0), _softmax(1, 1000, device, scale=3.0)])
    cases = [
        (probs, torch.tensor([5, 16, 40, 100, 1, 0], device=device), torch.tensor([0.01, 0.05, 0.9, 0.2, 0.5, 0.8],
                                                                                 device=device)),
        (probs[:3], 12, 0.03),
        (_softmax(3, 301, device), torch.tensor([7, 300, -1], device=device, dtype=torch.int32), 0.4),
    ]
    if device == "cuda":
        V = 128256
        cases += [(_softmax(16, V, device, scale=1.0), torch.randint(1, 3000, (16,), device=device),
                   torch.rand(16, device=device) * 0.2),
                  (_softmax(4, V, device), 50, 0.9)]
    return cases


def _sampling_args(probs, top_k, top_p, seed=1234, offset=5, order="joint", indices=None):
    k_arr, k_val = (top_k, 0) if isinstance(top_k, torch.Tensor) else (None, top_k)
    p_arr, p_val = (top_p, 1.0) if isinstance(top_p, torch.Tensor) else (None, top_p)
    return (probs, k_arr, p_arr, _t(seed, probs.device), _t([offset], probs.device), k_val, p_val, order, indices)


@pytest.mark.parametrize("device", DEVICES)
def test_joint_backends_match_reference(device):
    ref = registry.BY_OP[SAMPLING][Backend.TORCH].load()
    backends = implementations_on(SAMPLING, device)
    for i, (probs, top_k, top_p) in enumerate(_joint_cases(device)):
        args = _sampling_args(probs, top_k, top_p)
        want = ref(*args)
        if i == 0:
            assert not torch.equal(want, ref(*args[:7], "top_k_first", None)), "joint draws as top-k-first here"
        if probs.shape[1] <= 1000:
            B = probs.shape[0]
            kept = _joint_formula(probs.cpu(), torch.as_tensor(top_k).cpu().expand(B),
                                  torch.as_tensor(top_p).cpu().expand(B))
            assert kept.gather(1, want.long().cpu()[:, None]).all(), "a sampled id outside the joint kept set"
        for name, fn in backends:
            got = fn(*args)
            if _own_stream(SAMPLING, name):
                assert got.dtype == torch.int32 and got.shape == want.shape, name
                continue
            _exact_ids(f"{name} {tuple(probs.shape)}", got, want)


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a GPU or Triton's interpreter")
def test_joint_triton_small_buffer_routes_match_reference():
    from torch_kernels.families.sampling import triton as triton_sampling
    device = "cuda" if torch.cuda.is_available() else "cpu"
    probs, top_k, top_p = _joint_cases(device)[0]
    seed, offset = _t(7, device), _t(3, device)
    want = reference.top_k_top_p_sampling_from_probs(probs, top_k, top_p, seed, offset, 0, 1.0, "joint")
    for name, cfg in _small_configs().items():
        got = triton_sampling._launch(probs, top_k, top_p, seed, offset, True, cfg, joint=True)
        _exact_ids(name, got, want)


@pytest.mark.parametrize("source", ["seed_offset", "torch_generator"])
@pytest.mark.parametrize("device", DEVICES)
def test_joint_distributionchi_square(device, source):
    """40k draws of one row of 40 (k 12, p 0.4: the joint nucleus inside the top-k survivors): the
    counts match the joint kept set renormalised, and reject top-k-first's distribution, so the test can
    tell the two orders apart."""
    torch.manual_seed(32)
    V, k, p = 40, 12, 0.4
    row = _softmax(1, V, device, scale=0.5)  # top-k-first keeps 4, joint 10
    joint = _joint_formula(row.cpu(), torch.tensor([k]), torch.tensor([p]))[0]
    bits = reference.value_bits(row.cpu())
    q = reference.fixed_point(bits, bits.amax(-1, keepdim=True), reference.fixed_point_bits(V))
    first = reference.kept_mask(bits, q, k, p)[0][0]
    assert 3 <= int(first.sum()) < int(joint.sum()) < k, (int(first.sum()), int(joint.sum()))
    reps, draws = 4000, 10
    probs = row.repeat(reps, 1)
    counts = torch.zeros(V, dtype=torch.float64)
    for step in range(draws):
        if source == "seed_offset":
            ids = torch_kernels.top_k_top_p_sampling_from_probs(probs, k, p, _t(9, device), _t(step, device),
                                                                filter_apply_order="joint")
        else:
            ids = torch_kernels.top_k_top_p_sampling_from_probs(probs, k, p, filter_apply_order="joint")
        counts += torch.bincount(ids.long().cpu(), minlength=V).double()
    assert counts[~joint].sum() == 0, "a token outside the joint kept set"
    expected = row.cpu()[0].double() * joint
    expected = expected / expected.sum()
    n = int(joint.sum())
    critical = chi_square_critical(n - 1)
    chi2 = chi_square(counts[joint], expected[joint])
    assert chi2 < critical, f"chi-square {chi2:.1f} with {n - 1} degrees of freedom (critical {critical:.1f})"
    top_k_first = row.cpu()[0].double() * first
    top_k_first = (top_k_first / top_k_first.sum())[joint].clamp(min=1e-12)
    assert chi_square(counts[joint], top_k_first) > critical, "the test cannot tell top-k-first from joint"


@pytest.mark.parametrize("device", DEVICES)
def test_joint_from_logits_is_softmax_then_joint_from_probs(device):
    torch.manual_seed(33)
    logits = torch.randn(4, 300, device=device)
    seed, offset = _t(3, device), _t(8, device)
    args = (logits, torch.tensor([5, 20, 0, 60], device=device), 0, None, 0.3, None, 0.8, seed, offset, "joint")
    probs = reference.softmax(logits, None, 0.8)
    want = reference.top_k_top_p_sampling_from_probs(probs, args[1], None, seed, offset, 0, 0.3, "joint")
    assert not torch.equal(want, reference.top_k_top_p_sampling_from_probs(probs, args[1], None, seed, offset, 0, 0.3))
    for name, fn in implementations_on(FROM_LOGITS, device):
        _exact_ids(name, fn(*args), want)


# ------------------------------------------------------------------------------------------------
# indices: output row i draws from probs[indices[i]] with that row's parameters.


def _indices_calls(device):
    """(op, args with indices, the same call on the gathered rows)."""
    torch.manual_seed(34)
    probs = _softmax(3, 500, device)
    idx = torch.tensor([2, 0, 2, 2, 1, 0, 1], device=device)
    k = torch.tensor([5, 0, 40], device=device)
    p = torch.tensor([0.9, 0.5, 0.95], device=device)
    mp = torch.tensor([0.1, 0.0, 0.3], device=device)
    seed, offset = _t(21, device), _t([4], device)
    for order in ("top_k_first", "joint"):
        yield (SAMPLING, (probs, k, p, seed, offset, 0, 1.0, order, idx.int()),
               (probs[idx], k[idx], p[idx], seed, offset, 0, 1.0, order, None))
    yield SAMPLING, (probs, None, None, seed, offset, 8, 0.7, "top_k_first", idx), \
        (probs[idx], None, None, seed, offset, 8, 0.7, "top_k_first", None)
    yield MIN_P, (probs, mp, 0.0, seed, offset, idx), (probs[idx], mp[idx], 0.0, seed, offset, None)
    yield FROM_PROBS, (probs, seed, offset, idx), (probs[idx], seed, offset, None)
    yield FROM_PROBS, (probs, seed, offset, idx[:0]), (probs[:0], seed, offset, None)


@pytest.mark.parametrize("device", DEVICES)
def test_indices_draw_as_the_gathered_rows(device):
    for op, args, gathered in _indices_calls(device):
        want = registry.BY_OP[op][Backend.TORCH].load()(*gathered)
        assert want.shape == (args[-1].shape[0],)
        for name, fn in implementations_on(op, device):
            got = fn(*args)
            if _own_stream(op, name):
                assert got.dtype == torch.int32 and got.shape == want.shape, name
                continue
            _exact_ids(f"{name} {op}", got, want)


# ------------------------------------------------------------------------------------------------
# Per-row seeds and offsets: each row draws as it would alone with its own.


def _per_row_calls(device):
    """(op, args builder taking (rows, seed, offset), rows): every sampler with a seed."""
    torch.manual_seed(35)
    probs = _softmax(4, 300, device)
    logits = torch.randn(4, 300, device=device)
    k = torch.tensor([5, 0, 40, 1], device=device)
    yield SAMPLING, lambda r, s, o: (probs[r], k[r], None, s, o, 0, 0.8, "top_k_first", None)
    yield SAMPLING, lambda r, s, o: (probs[r], k[r], None, s, o, 0, 0.3, "joint", None)
    yield MIN_P, lambda r, s, o: (probs[r], None, 0.05, s, o, None)
    yield FROM_PROBS, lambda r, s, o: (probs[r], s, o, None)
    yield "sampling_from_logits", lambda r, s, o: (logits[r], s, o)
    yield FROM_LOGITS, lambda r, s, o: (logits[r], None, 20, None, 0.9, None, 0.7, s, o, "top_k_first")


@pytest.mark.parametrize("device", DEVICES)
def test_per_row_seeds_draw_each_row_as_alone(device):
    seeds, offsets = _t([11, -7, 2**40, 11], device), _t([0, 3, 2**33, 1], device)
    one_seed, one_offset = _t(11, device), _t([6], device)
    rows = slice(0, 4)
    for op, build in _per_row_calls(device):
        for name, fn in implementations_on(op, device):
            if _own_stream(op, name):
                continue
            for s, o in ((seeds, offsets), (one_seed, offsets), (seeds, one_offset)):
                got = fn(*build(rows, s, o))
                alone = torch.cat([fn(*build(slice(i, i + 1), s[i] if s.numel() > 1 else s,
                                                o[i] if o.numel() > 1 else o)) for i in range(4)])
                _exact_ids(f"{name} {op} seeds {tuple(s.shape)} offsets {tuple(o.shape)}", got, alone)
        ref = registry.BY_OP[op][Backend.TORCH].load()
        want = ref(*build(rows, seeds, offsets))
        moved = ref(*build(rows, _t([12, -7, 2**40, 11], device), offsets))
        assert torch.equal(want[1:], moved[1:]), f"{op}: another seed for row 0 moved another row's draw"


@pytest.mark.parametrize("device", DEVICES)
def test_per_row_seeds_speculative_rows_as_alone(device):
    from torch_kernels.families.sampling import ops as sampling_ops
    torch.manual_seed(36)
    draft, ids, target = sampling_ops.speculative_inputs(3, 2, 50, device, closeness=1.0)
    seeds, offsets = _t([4, 5, 6], device), _t([0, 9, 2**35], device)
    for name, fn in implementations_on("chain_speculative_sampling", device):
        if _own_stream("chain_speculative_sampling", name):
            continue
        got = fn(draft, ids, target, seeds, offsets)
        alone = [fn(draft[i:i + 1], ids[i:i + 1], target[i:i + 1], seeds[i], offsets[i]) for i in range(3)]
        for j in range(3):
            assert torch.equal(got[j], torch.cat([a[j] for a in alone])), f"{name}: output {j}"


# ------------------------------------------------------------------------------------------------
# Bad input: named, nothing written.


def test_bad_forms_name_the_op_and_the_argument():
    probs = _softmax(4, 64, "cpu")
    seed, offset = _t(1, "cpu"), _t([0], "cpu")
    idx = torch.tensor([0, 1, 1], dtype=torch.int32)
    base = (probs, None, None, seed, offset, 5, 0.9)
    assert_bad_inputs_raise(SAMPLING, [
        ("unknown order", base + ("top_p_first", None), ValueError, "filter_apply_order"),
        ("order in another case", base + ("Joint", None), ValueError, "filter_apply_order"),
        ("float indices", base + ("joint", idx.float()), TypeError, "indices"),
        ("2-D indices", base + ("joint", idx[None]), ValueError, "indices"),
        ("indices on another device", base + ("joint", idx.to("meta")), ValueError, "indices"),
        ("seeds per probs row, not per output row", (probs, None, None, _t([1, 2, 3, 4], "cpu"), offset, 5, 0.9,
                                                     "joint", idx), ValueError, "seed"),
        ("offsets of the wrong length", (probs, None, None, seed, _t([1, 2], "cpu"), 5, 0.9), ValueError, "offset"),
        ("2-D seeds", (probs, None, None, _t([[1, 2, 3, 4]], "cpu"), offset, 5, 0.9), ValueError, "seed"),
    ])
    assert_bad_inputs_raise(MIN_P, [
        ("float indices", (probs, None, 0.1, seed, offset, idx.float()), TypeError, "indices"),
        ("seeds of the probs rows", (probs, None, 0.1, _t([1, 2, 3, 4], "cpu"), offset, idx), ValueError, "seed"),
    ])
    assert_bad_inputs_raise(FROM_PROBS, [("2-D indices", (probs, seed, offset, idx[None]), ValueError, "indices")])
    logits = torch.randn(4, 64)
    assert_bad_inputs_raise(FROM_LOGITS, [
        ("unknown order", (logits, None, 5, None, 0.9, None, 1.0, seed, offset, "top-k-first"), ValueError,
         "filter_apply_order")])
    with pytest.raises(ValueError, match=rf"^deepinfer::{SAMPLING}: argument 'filter_apply_order' "):
        torch_kernels.top_k_top_p_sampling_from_probs(probs, 5, 0.9, filter_apply_order="both")


# ------------------------------------------------------------------------------------------------
# The FlashInfer backend in these forms, against test_flashinfer.py's fake FlashInfer (on CPU), given
# FlashInfer's joint sampler and its indices and per-row seeds.

_JOINT_SIGNATURE = ("(probs, top_k, top_p, indices=None, filter_apply_order='top_k_first', deterministic=True, "
                    "generator=None, check_nan=False, seed=None, offset=None, return_valid=False, top_k_max=None)")


def _fake_forms_release():
    from test_flashinfer import FakeFlashInfer

    class FakeForms(FakeFlashInfer):
        """Adds FlashInfer's joint sampler, and reads ``indices`` and (0.6.4 on) per-row seed tensors."""

        def install(self):
            super().install()
            sys.modules["flashinfer.sampling"].top_k_top_p_sampling_from_probs = self._fn(
                "sampling.top_k_top_p_sampling_from_probs", self._joint, _JOINT_SIGNATURE)
            return self

        def _draw(self, probs, accepted, seed, offset, out_dtype):
            n = probs.shape[0]
            if self.v < (0, 6, 4):
                assert isinstance(seed, int) and isinstance(offset, int)
                seed, offset = torch.tensor([seed]), torch.tensor([offset])
            assert seed.dtype == offset.dtype == torch.int64 and seed.dim() == offset.dim() == 1
            assert seed.shape[0] in (1, n) and offset.shape[0] in (1, n)
            seed, offset = seed.expand(n), offset.expand(n)
            out = torch.zeros(n, dtype=out_dtype)
            for row in range(n):
                w = torch.where(accepted[row], probs[row], 0.0).double()
                if w.sum() > 0:
                    g = torch.Generator().manual_seed((int(seed[row]) * 1000003 + int(offset[row]) * 7919 + row) % 2**63)
                    out[row] = int(torch.multinomial(w, 1, generator=g))
            return out

        @staticmethod
        def _above(probs):
            above = probs[:, None, :] > probs[:, :, None]
            return above.sum(-1), (above * probs[:, None, :]).sum(-1)

        def _top_p_sampling(self, probs, top_p, indices, deterministic, generator, check_nan, seed, offset,
                            return_valid=False):
            assert probs.dtype == torch.float32 and probs.is_contiguous() and top_p.dtype == torch.float32
            if indices is not None:
                probs, top_p = probs[indices.long()], top_p[indices.long()]
            _, mass = self._above(probs)
            accepted = (probs > 0) & (mass < top_p[:, None])
            return self._draw(probs, accepted, seed, offset, torch.int32 if indices is None else indices.dtype)

        def _joint(self, probs, top_k, top_p, indices, filter_apply_order, deterministic, generator, check_nan, seed,
                   offset, return_valid, top_k_max):
            assert filter_apply_order == "joint" and probs.dtype == torch.float32 and probs.is_contiguous()
            sums = probs.double().sum(-1)
            assert ((sums - 1).abs() < 1e-5).all(), "FlashInfer's joint test reads masses as fractions of 1"
            B, V = probs.shape
            k = top_k.long() if isinstance(top_k, torch.Tensor) else torch.full((B,), top_k)
            p = top_p if isinstance(top_p, torch.Tensor) else torch.full((B,), top_p)
            if indices is not None:
                probs, k, p = probs[indices.long()], k[indices.long()], p[indices.long()]
            count, mass = self._above(probs)
            accepted = (probs > 0) & (count < k[:, None]) & (mass < p[:, None])
            return self._draw(probs, accepted, seed, offset, torch.int32 if indices is None else indices.dtype)

    return FakeForms


@pytest.mark.parametrize("release", ["0.6.0", "0.6.18.post1", "0.7.4"])
def test_flashinfer_backend_forms_on_a_fake(release, monkeypatch):
    from torch_kernels.families.sampling.ops import TOP_P_SLACK
    fake = _fake_forms_release()(release, monkeypatch).install()
    s = fake.sampling
    torch.manual_seed(38)
    probs = torch.softmax(torch.randn(5, 40), -1) * 0.3  # unnormalised rows: the backend's scaling
    k = torch.tensor([5, 0, 12, 3, 40])
    p = torch.tensor([0.5, 0.3, 0.9, 1.0, 0.2])
    idx = torch.tensor([4, 2, 2, 0, 1, 3])
    seeds, offsets = torch.arange(6) + 10, torch.arange(6)
    per_row_taken = fake.v >= (0, 6, 4)
    for order in ("top_k_first", "joint"):
        for seed, offset, ix in ((_t(3, "cpu"), _t([1], "cpu"), None), (seeds[:5], offsets[:5], None),
                                 (_t(3, "cpu"), _t(1, "cpu"), idx), (seeds, offsets, idx)):
            args = (probs, k, p, seed, offset, 0, 1.0, order, ix)
            why = s.top_k_top_p_sampling_from_probs_refuses(*args)
            if seed.numel() > 1 and not per_row_taken:
                assert "per-row" in why, why
                continue
            assert why is None, why
            ids = s.top_k_top_p_sampling_from_probs(*args)
            rows, kk, pp = (probs, k, p) if ix is None else (probs[ix], k[ix], p[ix])
            assert ids.dtype == torch.int32 and ids.shape == (rows.shape[0],)
            bits = reference.value_bits(rows)
            q = reference.fixed_point(bits, bits.amax(-1, keepdim=True), reference.fixed_point_bits(40))
            kept = reference.kept_mask(bits, q, kk, pp + TOP_P_SLACK, joint=order == "joint")[0]
            assert kept.gather(1, ids.long()[:, None]).all(), f"{order}: an id outside the kept set"
            name, call = fake.calls[-1]
            assert name == ("sampling.top_k_top_p_sampling_from_probs" if order == "joint"
                            else "sampling.top_p_sampling_from_probs")
            assert call["indices"] is ix and call["deterministic"] is True
            if per_row_taken:
                assert call["seed"].data_ptr() == seed.data_ptr(), "the seeds are read on the device"


# ------------------------------------------------------------------------------------------------
# On a GPU: FlashInfer keeps the same sets in these forms (its own random stream).


@pytest.mark.gpu
def test_flashinfer_forms_keep_the_reference_set():
    spec = registry.BY_OP[SAMPLING].get(Backend.FLASHINFER)
    if spec is None or not spec.is_available(torch_kernels.Platform.detect()):
        pytest.skip("FlashInfer is not installed")
    from torch_kernels.families.sampling.ops import TOP_P_SLACK
    from torch_kernels.testing import as_dispatched
    fn = as_dispatched(spec)
    torch.manual_seed(37)
    V = 128256
    probs = _softmax(8, V, "cuda", scale=1.0)
    k = torch.randint(1, 2000, (8,), device="cuda")
    p = torch.rand(8, device="cuda") * 0.5 + 0.1
    idx = torch.tensor([7, 7, 0, 3, 3, 3], device="cuda")
    seeds, offsets = torch.arange(8, device="cuda") + 100, torch.arange(8, device="cuda")
    for order in ("top_k_first", "joint"):
        for s, o, ix in ((_t(1, "cuda"), _t(2, "cuda"), None), (seeds, offsets, None), (seeds[:6], offsets[:6], idx)):
            ids = fn(probs, k, p, s, o, 0, 1.0, order, ix)
            rows = probs if ix is None else probs[ix]
            kk, pp = (k, p) if ix is None else (k[ix], p[ix])
            bits = reference.value_bits(rows)
            q = reference.fixed_point(bits, bits.amax(-1, keepdim=True), reference.fixed_point_bits(V))
            kept = reference.kept_mask(bits, q, kk, pp + TOP_P_SLACK, joint=order == "joint")[0]
            assert ids.dtype == torch.int32 and ids.shape == (rows.shape[0],)
            assert kept.gather(1, ids.long()[:, None]).all(), f"{order}: an id outside the kept set"


@pytest.mark.gpu
def test_per_row_seeds_cuda_graph_replays_with_the_offsets_advanced():
    """Captured with per-row seed and offset tensors (and indices): each replay after the offsets are
    advanced in place draws what the eager call draws."""
    torch.manual_seed(39)
    probs = _softmax(32, 128256, "cuda")
    seeds = torch.randint(-2**62, 2**62, (48,), device="cuda")
    offsets = torch.zeros(48, dtype=torch.int64, device="cuda")
    idx = torch.randint(0, 32, (48,), device="cuda")
    calls = {
        SAMPLING: lambda s, o: torch_kernels.top_k_top_p_sampling_from_probs(probs, 50, 0.9, s[:32], o[:32],
                                                                             filter_apply_order="joint"),
        MIN_P: lambda s, o: torch_kernels.min_p_sampling_from_probs(probs, 0.1, s[:1], o[:32]),
        FROM_PROBS: lambda s, o: torch_kernels.sampling_from_probs(probs, s, o, indices=idx),
    }
    for op, call in calls.items():
        call(seeds, offsets)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(seeds, offsets)
        for step in range(3):
            offsets.fill_(step)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, call(seeds, offsets)), f"{op}: replay {step} differs from the eager call"


# ----------------------------------------------------------------------------------------------
# FlashInfer's Python API: every sampler's name and keywords, so that FlashInfer's call sites and
# tests (vLLM's `deterministic=True`, FlashInfer's `indices=`, `generator=`) run on ours.

FLASHINFER_SAMPLERS = ("softmax", "sampling_from_logits", "sampling_from_probs", "top_p_sampling_from_probs",
                       "top_k_sampling_from_probs", "min_p_sampling_from_probs", "top_k_top_p_sampling_from_logits",
                       "top_k_top_p_sampling_from_probs", "top_p_renorm_probs", "top_k_renorm_probs",
                       "top_p_renorm_prob", "top_k_renorm_prob", "top_k_mask_logits", "chain_speculative_sampling")


@pytest.mark.parametrize("name", FLASHINFER_SAMPLERS)
def test_every_flashinfer_sampler_is_ours_with_its_arguments(name):
    """Ours takes every argument of FlashInfer's by name, and its required ones in FlashInfer's order."""
    import inspect

    fs = pytest.importorskip("flashinfer.sampling")
    theirs = inspect.signature(getattr(fs, name)).parameters
    ours = inspect.signature(getattr(torch_kernels, name)).parameters
    assert set(theirs) <= set(ours), f"{name}: not taken: {sorted(set(theirs) - set(ours))}"
    required = [n for n, p in theirs.items() if p.default is inspect.Parameter.empty]
    assert list(ours)[:len(required)] == required, f"{name}: {list(ours)} against FlashInfer's {list(theirs)}"


@pytest.mark.parametrize("device", DEVICES)
def test_flashinfer_keywords_behave_as_flashinfers(device):
    """``generator`` draws the seed, ``deterministic`` changes nothing, ``check_nan`` refuses a NaN,
    ``return_valid`` marks the rows without mass, ``indices`` of int64 returns int64 ids."""
    probs = _softmax(6, 300, device)
    probs[2] = 0  # no mass: draws 0, not valid
    g1, g2 = torch.Generator(device).manual_seed(5), torch.Generator(device).manual_seed(5)
    a = torch_kernels.top_k_top_p_sampling_from_probs(probs, 20, 0.9, generator=g1)
    b = torch_kernels.top_k_top_p_sampling_from_probs(probs, 20, 0.9, generator=g2, deterministic=False)
    assert torch.equal(a, b), "the same generator state draws the same"
    ids, valid = torch_kernels.top_k_top_p_sampling_from_probs(probs, 20, 0.9, 3, 4, return_valid=True)
    assert torch.equal(ids, torch_kernels.top_k_top_p_sampling_from_probs(probs, 20, 0.9, 3, 4))
    assert valid.dtype == torch.bool and valid.tolist() == [True, True, False, True, True, True] and int(ids[2]) == 0
    idx = torch.tensor([5, 0, 5, 2], device=device)
    wide = torch_kernels.sampling_from_probs(probs, 3, 4, idx)
    assert wide.dtype == torch.int64
    assert torch.equal(wide, torch_kernels.sampling_from_probs(probs, 3, 4, idx.int()).long())
    ids, valid = torch_kernels.min_p_sampling_from_probs(probs, 0.1, 3, 4, idx, return_valid=True)
    assert ids.dtype == torch.int64 and valid.tolist() == [True, True, True, False]
    nan = probs.clone()
    nan[1, 7] = float("nan")
    for call in (lambda: torch_kernels.sampling_from_probs(nan, check_nan=True),
                 lambda: torch_kernels.top_k_top_p_sampling_from_logits(nan, 5, 0.9, check_nan=True)):
        with pytest.raises(ValueError, match="contains NaN"):
            call()
    torch_kernels.sampling_from_probs(nan)  # not asked: no check, no sync


@pytest.mark.parametrize("device", DEVICES)
def test_flashinfer_named_forms_are_the_joint_sampler(device):
    """``top_p_sampling_from_probs`` and ``top_k_sampling_from_probs`` are the top-k/top-p sampler with the
    other filter off; logits-in ``indices`` are the op on the gathered rows; ``top_k_max`` caps top-k
    where FlashInfer's does (top-k first, at most 256, 65536 tokens or more) and nothing elsewhere."""
    probs = _softmax(5, 400, device)
    k, p = torch.tensor([3, 0, 50, 400, 7], device=device), torch.tensor([0.5, 0.9, 1.0, 0.2, 0.8], device=device)
    assert torch.equal(torch_kernels.top_p_sampling_from_probs(probs, p, 1, 2),
                       torch_kernels.top_k_top_p_sampling_from_probs(probs, 0, p, 1, 2))
    assert torch.equal(torch_kernels.top_k_sampling_from_probs(probs, k, 1, 2),
                       torch_kernels.top_k_top_p_sampling_from_probs(probs, k, 1.0, 1, 2))
    assert torch.equal(torch_kernels.top_k_renorm_prob(probs, k), torch_kernels.top_k_renorm_probs(probs, k))
    assert torch.equal(torch_kernels.top_p_renorm_prob(probs, p), torch_kernels.top_p_renorm_probs(probs, p))
    logits = torch.randn(5, 400, device=device) * 3
    idx = torch.tensor([4, 4, 1, 0, 3, 2], device=device)
    assert torch.equal(torch_kernels.sampling_from_logits(logits, 8, 9, indices=idx),
                       torch_kernels.sampling_from_logits(logits[idx], 8, 9).long())
    t = torch.tensor([0.5, 1.0, 2.0, 0.7, 1.3], device=device)
    assert torch.equal(torch_kernels.top_k_top_p_sampling_from_logits(logits, k, p, t, 8, 9, indices=idx),
                       torch_kernels.top_k_top_p_sampling_from_logits(logits[idx], k[idx], p[idx], t[idx], 8, 9).long())
    big = _softmax(2, 65536, device)
    capped = torch_kernels.top_k_top_p_sampling_from_probs(big, torch.tensor([0, 300], device=device), 1.0, 1, 2,
                                                           top_k_max=4)
    assert torch.equal(capped, torch_kernels.top_k_top_p_sampling_from_probs(big, 4, 1.0, 1, 2))
    assert torch.equal(torch_kernels.top_k_top_p_sampling_from_probs(probs, k, p, 1, 2, top_k_max=2),
                       torch_kernels.top_k_top_p_sampling_from_probs(probs, k, p, 1, 2)), "under 65536 tokens: ignored"
