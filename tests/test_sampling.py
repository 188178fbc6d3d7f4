"""The sampling family: the reference against an independent fp64 formula; every backend against the
reference, exactly (kept sets and sampled ids) over awkward shapes (Triton in its interpreter on CPU,
with small launch configurations as well, so that the buffer compaction, its overflow, the full-pass
route and the split prepass with its fallbacks all run on small rows); the sample distribution
(chi-square); determinism; CUDA graphs; bad input."""

import math
import os

import pytest
import torch

from torch_kernels import registry
from torch_kernels.families.sampling import reference as reference
from torch_kernels.families.sampling import ops as sampling_ops
from torch_kernels.spec import Backend
from torch_kernels.families.sampling.ops import TOP_P_SLACK, assert_ids_kept
from torch_kernels.testing import assert_close

from conftest import DEVICES, arg_names, assert_bad_inputs_raise, chi_square_critical, family_ops, implementations_on

SAMPLING = "top_k_top_p_sampling_from_probs"
# left at their defaults here; tests/test_sampling_ops.py takes them
_DEFAULTED = {"filter_apply_order", "indices"}
# the probability filters; the logits ops and min-p are tested in tests/test_sampling_ops.py
OPS = [op for op in family_ops("sampling")
       if set(arg_names(op)) - _DEFAULTED <= {"probs", "maybe_top_k_arr", "top_k_val", "maybe_top_p_arr", "top_p_val",
                                              "seed", "offset"} and {"maybe_top_k_arr", "maybe_top_p_arr"} & set(arg_names(op))]
assert SAMPLING in OPS, "the sampler's schema grew: say here which of its arguments these tests leave at the default"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _params(op):
    """The op's per-call arguments by what they are: its schema's ``maybe_top_k_arr`` / ``maybe_top_p_arr``
    as ``top_k`` / ``top_p`` (a per-row tensor here; the scalar forms have their own test), no ``*_val``."""
    return [{"maybe_top_k_arr": "top_k", "maybe_top_p_arr": "top_p"}.get(n, n) for n in arg_names(op)
            if not n.endswith("_val") and n not in _DEFAULTED]
FLT_MAX = torch.finfo(torch.float32).max


def _softmax(rows, vocab, device, scale=3.0, stride=None):
    return torch.softmax(torch.randn(rows, stride or vocab, device=device) * scale, -1)[:, :vocab]


def _ties(rows, vocab, device, levels=4):
    return torch.softmax(torch.randint(0, levels, (rows, vocab), device=device).float(), -1)


def _odd_values(rows, vocab, device):
    """NaN, negative, -0.0, +inf, zero and subnormal entries; an all-zero row; a row whose only mass
    is +inf; a row of subnormals."""
    p = _softmax(rows, vocab, device)
    p[0, :6] = torch.tensor([float("nan"), -0.5, -0.0, 0.0, 1e-30, 1e-40])
    p[1] = 0.0
    p[2, 7] = float("inf")
    p[3] = torch.rand(vocab, device=device) * 1e-39
    return p


# ------------------------------------------------------------------------------------------------
# The independent formula: fp64, rank- and pairwise-mass based (no sort, no fixed point).


def _formula(probs, top_k, top_p):
    """(kept mask, renormalised rows, margin): top-k by rank (fewer than k strictly larger values),
    top-p by the fp64 mass of strictly larger survivors; ``margin``: the least distance of a positive
    value's mass-above from the top-p limit, relative to the row's largest value. The fixed-point
    reference rounds each value down by less than 2^-(Q-1) of the largest, so the two agree wherever
    the margin exceeds :func:`_margin_needed`."""
    p = probs.double().nan_to_num(nan=0.0, posinf=FLT_MAX).clamp(min=0.0)
    B, V = p.shape
    larger = p[:, None, :] > p[:, :, None]  # [b, i, j]: p_j > p_i
    kept = torch.ones_like(p, dtype=torch.bool)
    if top_k is not None:
        k = top_k.long().cpu()
        k = torch.where((k > 0) & (k < V), k, V).to(p.device)
        kept = larger.sum(-1) < k[:, None]
    margin = math.inf
    if top_p is not None:
        pk = torch.where(kept, p, 0.0)
        total = pk.sum(-1, keepdim=True)
        above = (larger * pk[:, None, :]).sum(-1)
        limit = top_p.double()[:, None] * total
        positive = kept & (p > 0) & (above > 0)  # above == 0: kept whatever the limit
        if positive.any():
            margin = ((above - limit).abs() / p.amax(-1, keepdim=True))[positive].min().item()
        kept = kept & ((above == 0) | (above < limit))
    kp = torch.where(kept, p, 0.0)
    s = kp.sum(-1, keepdim=True)
    return kept, torch.where(s > 0, kp / s.clamp(min=1e-300), 0.0), margin


def _margin_needed(vocab: int) -> float:
    return 2 * vocab * 2.0 ** (1 - reference.fixed_point_bits(vocab))


FORMULA_CASES = [
    # (probs maker, top_k, top_p)
    (lambda d: _softmax(8, 1000, d), [1, 5, 50, 0, -3, 1000, 999, 2000], [0.9, 0.5, 0.99, 0.1, 1.0, 0.0, 0.7, 1.5]),
    (lambda d: _softmax(4, 257, d, scale=1.0), [7, 0, 200, 3], [0.95, 0.8, 0.3, 1.0]),
    (lambda d: _ties(4, 300, d), [10, 80, 0, 299], [0.5, 0.9, 0.35, 0.6]),
    (lambda d: _odd_values(4, 200, d), [3, 4, 0, 10], [0.9, 0.9, 0.5, 0.6]),
]


@pytest.mark.parametrize("case", range(len(FORMULA_CASES)))
def test_reference_matches_independent_formula(case):
    torch.manual_seed(case)
    make, ks, ps = FORMULA_CASES[case]
    probs = make("cpu")
    top_k, top_p = torch.tensor(ks), torch.tensor(ps, dtype=torch.float32)
    bits = reference.value_bits(probs)
    q = reference.fixed_point(bits, bits.amax(-1, keepdim=True), reference.fixed_point_bits(probs.shape[1]))
    for k, p in [(top_k, None), (None, top_p), (top_k, top_p)]:
        want_kept, want_renorm, margin = _formula(probs, k, p)
        assert margin > _margin_needed(probs.shape[1]), f"test data too close to a top-p boundary ({margin}): change the seed"
        kept, _ = reference.kept_mask(bits, q, k, p)
        rows = (kept != want_kept).any(-1).nonzero().flatten().tolist()
        assert not rows, f"kept sets differ in rows {rows}"
        if p is None:
            assert_close(reference.top_k_renorm_probs(probs, k), want_renorm.float())
        elif k is None:
            assert_close(reference.top_p_renorm_probs(probs, p), want_renorm.float())
    assert torch.isfinite(reference.top_k_renorm_probs(probs, top_k)).all()


def test_reference_top_k_keeps_ties_and_top_p_keeps_the_crossing_token():
    probs = torch.tensor([[0.375, 0.1875, 0.1875, 0.125, 0.125], [0.5, 0.25, 0.125, 0.0625, 0.0625]])  # exact sums
    k = reference.top_k_renorm_probs(probs, torch.tensor([2, 4]))
    assert torch.equal(k > 0, torch.tensor([[True, True, True, False, False], [True, True, True, True, True]]))
    assert_close(k[0], torch.tensor([0.5, 0.25, 0.25, 0.0, 0.0]))
    # row 0: 0.375 < 0.5, 0.375 + 0.1875 (+ its tie) crosses it: keep both; row 1: 0.5 reaches 0.5 alone
    p = reference.top_p_renorm_probs(probs, torch.tensor([0.5, 0.5]))
    assert torch.equal(p > 0, torch.tensor([[True, True, True, False, False], [True, False, False, False, False]]))
    zero = reference.top_p_renorm_probs(probs, torch.tensor([0.0, 0.0]))  # top_p 0: the largest value only
    assert torch.equal(zero > 0, torch.tensor([[True] + [False] * 4] * 2))


def test_philox_known_answers():
    """Philox4x32-10 known-answer vectors of Random123 (kat_vectors)."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in cases:
        got = reference.philox4x32_10(*(torch.tensor([v]) for v in counter + key))
        assert [g.item() for g in got] == list(want)


# ------------------------------------------------------------------------------------------------
# Backends against the reference, exactly.


def _small_config():
    """A 64-slot buffer without the split prepass: the one-program routes on rows of 1000."""
    from torch_kernels.families.sampling import triton as triton_sampling
    return triton_sampling.Config(cap=64, chunk=64, k_small=16, chunk_g=512, np_count=16, np_mass=16, num_warps=4,
                                  slices=0, write_block=256, write_warps=4,  # 4 write blocks a row, the last short
                                  hist_slices=0)


def _small_split_config(slices=4, np_slice=16):
    """A 64-slot buffer with the split prepass: ``64 // slices`` slots a slice (16 at 4 slices: rows of
    1000 split at top_k <= 16); k_small = 32 leaves 16 < top_k <= 32 to the unsplit candidate route."""
    from torch_kernels.families.sampling import triton as triton_sampling
    return triton_sampling.Config(cap=64, chunk=64, k_small=32, chunk_g=512, np_count=16, np_mass=16, num_warps=4,
                                  slices=slices, np_slice=np_slice, slice_warps=4, write_block=128, write_warps=4,
                                  **_SMALL_HIST)


# The histogram route on rows of 1000 (a 64-slot buffer): 4 slices of 250, 64 buckets of 2^20 patterns
# (8 an octave) over the 8 octaves below the top of the row's largest: a softmax row's bracket holds
# ~20 values (the route), ties or a cluster far below the largest more than 64 (the fallback).
_SMALL_HIST = dict(hist_slices=4, hist_buckets=64, hist_levels=8, hist_level_octaves=2, hist_warps=4)


def _launcher(op, cfg):
    from torch_kernels.families.sampling import triton as triton_sampling
    names = _params(op)

    def launch(*args, top_k_val=0, top_p_val=1.0):  # the arguments the op lacks are None; an op with a seed samples
        given = dict(zip(names, args))
        if "top_k" in given and given["top_k"] is None:
            given["top_k"] = top_k_val
        if "top_p" in given and given["top_p"] is None:
            given["top_p"] = top_p_val
        return triton_sampling._launch(*map(given.get, ("probs", "top_k", "top_p", "seed", "offset")), "seed" in given, cfg)
    return launch


def _backends(op, device, small=False):
    """(name, callable) for every implementation that runs on ``device`` here; with ``small``, the
    Triton kernel with a small buffer as well, without and with the split prepass."""
    out = implementations_on(op, device)
    if small and any(name.startswith("triton") for name, _ in out):
        out.append(("triton-small-buffer", _launcher(op, _small_config())))
        out.append(("triton-small-split", _launcher(op, _small_split_config())))
    return out


def _args(op, probs, top_k, top_p, seed=1234, offset=5):
    device = probs.device
    given = {"probs": probs, "top_k": top_k, "top_p": top_p, "seed": torch.tensor(seed, device=device),
             "offset": torch.tensor([offset], device=device)}
    return tuple(given[name] for name in _params(op))


def _check(op, name, got, want, args=None):
    if op == SAMPLING and (op, name) in {(o, b.value) for o, b in registry.OWN_RANDOM_STREAM}:
        assert got.dtype == torch.int32 and got.shape == want.shape, f"{name}: {got.dtype} {tuple(got.shape)}"
        assert_ids_kept(*args[:3], got, TOP_P_SLACK)  # its own random stream: held to the kept set
        return
    if args is not None:
        name = f"{name} {tuple(args[0].shape)}"
    if "seed" in arg_names(op):  # a sampler: the reference's ids exactly
        assert got.dtype == torch.int32, f"{name}: {got.dtype}"
        assert torch.equal(got.cpu(), want.cpu()), f"{name}: {got.tolist()[:16]} vs {want.tolist()[:16]}"
    else:
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert torch.equal(got != 0, want != 0), f"{name}: kept sets differ"
        assert_close(got, want, msg=name)


def _cases(device):
    """(probs, top_k, top_p): one token, a full top-k, disabled filters, zero rows, strided rows,
    ties, odd values; on CUDA the benchmark shape and the full-pass route at the Llama-3 vocabulary."""
    t = lambda v, dtype=None: torch.tensor(v, device=device, dtype=dtype)  # noqa: E731
    cases = [
        (_softmax(1, 1, device), t([1]), t([0.5])),
        (_softmax(3, 1000, device), t([5, 0, 1000], torch.int32), t([0.9, 0.3, 1.0])),
        (_softmax(0, 64, device), t([], torch.int64), t([], torch.float32)),
        (_softmax(4, 301, device, stride=384), t([-1, 1, 17, 301]), t([0.5, 0.99, 0.0, 0.75])),
        (_ties(2, 129, device), t([3, 40], torch.int32), t([0.6, 0.95])),
        (_odd_values(4, 200, device), t([3, 4, 0, 10]), t([0.9, 0.9, 0.5, 0.6])),
    ]
    if device == "cuda":
        V = 128256
        cases += [
            (_softmax(64, V, device), torch.full((64,), 50, device=device), torch.full((64,), 0.9, device=device)),
            (_softmax(8, V, device, scale=1.0), t([0, 2000, 1024, 1, V, -1, 100000, 7]),
             t([0.9, 0.9, 0.5, 1.0, 0.2, 1.0, 0.95, 0.0])),
            (_ties(4, V, device, levels=8), t([50, 5000, 0, 1], torch.int32), t([0.9, 0.5, 0.9, 0.9])),
            (_softmax(5, 32000, device, stride=32768), t([40, 0, 600, 3, 31999]), t([0.8, 0.95, 0.99, 0.1, 0.999])),
            # a batch that fits 8 slices a row (512 slots: k up to 512 splits), and 64 histogram slices
            (_softmax(256, 32000, device), torch.randint(-1, 700, (256,), device=device),
             torch.rand(256, device=device) * 0.6 + 0.4),
            (_softmax(3, 256000, device), t([0, 50, 200]), t([0.9, 0.95, 0.5])),
        ]
    return cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_backends_match_reference(op, device):
    torch.manual_seed(1)
    ref = registry.BY_OP[op][Backend.TORCH].load()
    for probs, top_k, top_p in _cases(device):
        args = _args(op, probs, top_k, top_p)
        before = [a.clone() for a in args]
        want = ref(*args)
        for name, fn in _backends(op, device):
            _check(op, name, fn(*args), want, args)
        assert all(torch.equal(b.nan_to_num(), a.nan_to_num()) for b, a in zip(before, args)), "an input was clobbered"


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a GPU or Triton's interpreter")
@pytest.mark.parametrize("op", OPS)
def test_triton_small_buffer_routes_match_reference(op):
    """With a 64-slot buffer and top_k <= 16 on the candidate route, rows of 1000 exercise the buffer
    compaction (k = 5, 16), ties that overflow it (the tie row) and the full-pass route (top_k 0, 100).
    The last two rows put the top-p limit inside a cluster of 999 tiny values whose whole mass is below
    the fp32 search's error bound: it cannot decide there, and the exact search must finish. The same
    rows with the split prepass: k = 5, 16 split, the others fall back to the routes above."""
    torch.manual_seed(2)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cluster = torch.cat([torch.tensor([0.5]), 1e-9 * (1 + torch.rand(999))]).to(device)
    limit_inside = ((0.5 + 0.5 * cluster[1:].sum()) / cluster.sum()).item()
    probs = torch.cat([_softmax(4, 1000, device, scale=2.0), _ties(1, 1000, device, levels=3),
                       cluster.expand(2, -1)])
    top_k = torch.tensor([5, 16, 0, 100, 10, 0, 500], device=device)
    top_p = torch.tensor([0.9, 0.5, 0.7, 0.95, 0.95, limit_inside, limit_inside], device=device)
    args = _args(op, probs, top_k, top_p)
    want = registry.BY_OP[op][Backend.TORCH].load()(*args)
    small = [(n, f) for n, f in _backends(op, device, small=True) if n.startswith("triton-small")]
    assert len(small) == 2
    for name, fn in small:
        _check(op, name, fn(*args), want)


def _split_rows(device):
    """(probs, top_k, top_p, split): rows of 1000 for the 4-slice config (16 slots a slice, k_small 32)
    and whether the prepass splits each (all of the row's values >= tau in its slices' slots)."""
    V = 1000
    rows, ks, ps, split = [], [], [], []

    def add(row, k, p, splits):
        rows.append(row.to(device))
        ks.append(k)
        ps.append(p)
        split.append(splits)

    soft = _softmax(6, V, "cpu", scale=2.0)
    add(soft[0], 5, 0.9, True)
    add(soft[1], 16, 0.5, True)  # k = slots a slice
    add(soft[2], 1, 0.3, True)
    add(soft[3], 20, 0.95, False)  # slots a slice < k <= k_small: the streaming candidate route
    add(soft[4], 40, 0.8, False)  # k > k_small: the full-pass route
    add(soft[5], 0, 0.9, False)  # no top-k (k = V)
    add(_ties(1, V, "cpu", levels=3)[0], 10, 0.9, False)  # ~83 ties at the top of each slice: fall back
    sparse = torch.zeros(V)
    sparse[:100] = torch.softmax(torch.randn(100), -1)
    add(sparse, 8, 0.9, True)  # slices 1-3 all exact zeros: cover 1 (no value), tau >= 1 from slice 0
    few = torch.zeros(V)
    few[[3, 400, 999]] = torch.tensor([0.5, 0.25, 0.25])
    add(few, 8, 0.9, False)  # 3 positive values, k = 8: t_k = 0, 997 kept zeros
    tied_slice = torch.softmax(torch.randn(V), -1) + 1e-3
    tied_slice[250:500] = 1e-4  # slice 1: 250 ties below the row's t_k (its cover: the tie + 1 ulp)
    add(tied_slice / tied_slice.sum(), 5, 0.7, True)
    holes = torch.softmax(torch.randn(V) * 2, -1) * (torch.rand(V) > 0.7)
    add(holes, 12, 1.0, True)  # ~70% exact zeros everywhere
    add(_odd_values(4, V, "cpu")[0], 6, 0.0, True)  # NaN, negative, -0.0, subnormal entries
    inf_row = _softmax(1, V, "cpu")[0]
    inf_row[777] = float("inf")
    add(inf_row, 3, 0.9, True)
    t = lambda v, dtype=None: torch.tensor(v, device=device, dtype=dtype)  # noqa: E731
    return torch.stack(rows), t(ks), t(ps, torch.float32), split


def _split_decisions(probs, top_k, cfg):
    """Whether the filter kernel takes the split path for each row, from the prepass's stats."""
    from torch_kernels.families.sampling.triton.candidates import _slice_prepass
    B, _ = probs.shape
    buf = [torch.empty((B, cfg.cap), dtype=torch.int32, device=probs.device) for _ in range(2)]
    stats = _slice_prepass(probs, top_k, *buf, cfg).cpu()
    tau, n, cover = stats[:, 0].amax(-1), stats[:, 2].amin(-1), stats[:, 3].amax(-1)
    k = top_k.cpu().long()
    k = torch.where((k > 0) & (k < probs.shape[1]), k, probs.shape[1])
    return ((n >= 0) & (cover <= tau) & (k <= cfg.k_small)).tolist(), stats, buf


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a GPU or Triton's interpreter")
def test_triton_slice_prepass_keeps_its_contract():
    """Each slice's stats and candidates against the contract of ``_slice_candidates_kernel``, and the
    rows of ``_split_rows`` split (or not) as intended, so that the test below runs both paths."""
    torch.manual_seed(7)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    probs, top_k, _, want_split = _split_rows(device)
    short = (_softmax(2, 65, device), torch.tensor([16, 3], device=device))  # 4 slices: 17, 17, 17, 14 values
    empty = (_softmax(2, 65, device), torch.tensor([3, 4], device=device))  # 16 slices of 5: the last 3 empty
    for (p, k, cfg, want) in [(probs, top_k, _small_split_config(), want_split),
                              (*short, _small_split_config(), [True, True]),
                              (*empty, _small_split_config(slices=16, np_slice=4), [True, True])]:
        split, stats, (cand_bits, cand_idx) = _split_decisions(p, k, cfg)
        assert split == want, f"{cfg.slices} slices: split rows {split}, want {want}"
        bits = reference.value_bits(p).cpu()
        B, V = bits.shape
        S, L, slots = cfg.slices, -(-V // cfg.slices), cfg.cap // cfg.slices
        cand_bits, cand_idx = cand_bits.cpu().view(B, S, slots), cand_idx.cpu().view(B, S, slots)
        for r in range(B):
            kr = int(k[r]) if 0 < int(k[r]) < V else V
            for s in range(S):
                tau_s, mx, n, cover = stats[r, :, s].tolist()
                x = bits[r, s * L:(s + 1) * L]
                where = f"row {r} slice {s}"
                if kr > min(slots, cfg.k_small):
                    assert n == -1, where
                    continue
                assert mx == (x.max().item() if len(x) else -1), where
                assert tau_s == 0 or (x >= tau_s).sum() >= kr, where  # a lower bound of t_k
                assert cover == tau_s or ((x >= tau_s).sum() > slots and cover == tau_s + 1), where
                sel = (x >= cover).nonzero().flatten()
                assert n == len(sel) <= slots, where
                assert torch.equal(cand_bits[r, s, :n], x[sel]) and torch.equal(cand_idx[r, s, :n], sel + s * L), where
                assert (cand_bits[r, s, n:] == -1).all(), where


def test_triton_slices_a_row_fit_the_vocabulary_and_the_batch():
    """Slices of at most 4096 values, fewer where the batch alone fills 528 programs (the histogram route
    never fewer than 32); never more than the configured 32 (the top-k prepass) and 64 (the histogram
    route); ``slice_values=0`` keeps those."""
    pytest.importorskip("triton")
    from torch_kernels.families.sampling.triton.config import DEFAULT, fitted
    got = {(b, v): (fitted(DEFAULT, b, v).slices, fitted(DEFAULT, b, v).hist_slices)
           for b in (1, 32, 64, 256, 512) for v in (32000, 128256, 256000)}
    assert got == {(1, 32000): (32, 32), (32, 32000): (32, 32), (64, 32000): (16, 32), (256, 32000): (8, 32),
                   (512, 32000): (8, 32), **{(b, 128256): (32, 32) for b in (1, 32, 64, 256, 512)},
                   **{(b, 256000): (32, 64) for b in (1, 32, 64, 256, 512)}}
    assert fitted(DEFAULT._replace(slice_values=0), 256, 32000) == DEFAULT._replace(slice_values=0)
    assert fitted(DEFAULT, 4096, 5000).slices == 2


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a GPU or Triton's interpreter")
def test_triton_scalar_top_k_off_takes_the_histogram_route(monkeypatch):
    """A scalar top-k that keeps every row (0, negative, V and past it: ``top_p_sampling_from_probs``) is
    no top-k: the histogram route's kernels run, not the split prepass, and the ids are the reference's."""
    from torch_kernels.families.sampling.triton import launch
    torch.manual_seed(9)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    probs = torch.softmax(torch.randn(4, 1000, device=device) * 3, -1)
    seed, offset = torch.tensor(11, device=device), torch.tensor(2, device=device)
    ran = []
    for name in ("_hist_prepasses", "_slice_prepass"):
        real = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, real=real, name=name: ran.append(name) or real(*a))
    for k in (0, -1, 1000, 1001):
        want = reference.top_k_top_p_sampling_from_probs(probs, torch.full((4,), k, device=device),
                                                         torch.full((4,), 0.9, device=device), seed, offset)
        got = launch._launch(probs, k, 0.9, seed, offset, True, _small_split_config())
        assert torch.equal(got.cpu(), want.cpu()), f"top_k {k}: {got.tolist()} vs {want.tolist()}"
        assert ran == ["_hist_prepasses"], f"top_k {k}: {ran}"
        ran.clear()


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a GPU or Triton's interpreter")
def test_triton_split_rows_skip_the_streaming_pass(monkeypatch):
    """Sampling reads a split row in the prepass only: with the rows zeroed right after it, the split
    rows of ``_split_rows`` still draw the reference's token and the others draw 0 (no mass)."""
    from torch_kernels.families.sampling.triton import launch
    torch.manual_seed(7)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    probs, top_k, top_p, split = _split_rows(device)
    seed, offset = torch.tensor(3, device=device), torch.tensor([1], device=device)
    want = reference.top_k_top_p_sampling_from_probs(probs, top_k, top_p, seed, offset).cpu()
    split = torch.tensor(split)
    assert (want[~split] != 0).all(), "a falling-back row draws 0 anyway: change the seed"
    prepass = launch._slice_prepass

    def prepass_then_zero(p, *rest):
        stats = prepass(p, *rest)
        p.zero_()
        return stats
    monkeypatch.setattr(launch, "_slice_prepass", prepass_then_zero)
    got = launch._launch(probs.clone(), top_k, top_p, seed, offset, True, _small_split_config()).cpu()
    assert torch.equal(got[split], want[split]) and (got[~split] == 0).all(), f"{got.tolist()} vs {want.tolist()}"


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a GPU or Triton's interpreter")
@pytest.mark.parametrize("op", [op for op in OPS if "top_k" in _params(op)])  # the top-k route
def test_triton_split_prepass_matches_reference(op):
    """The split prepass against the reference: the rows of ``_split_rows`` (split: k <= 16, exact
    zeros, a slice of ties below t_k, odd values; falling back: k beyond the slots of a slice, k beyond
    k_small, no top-k, ties at t_k, fewer positive values than k), one split and one falling-back row
    alone (B = 1), and rows of 65: 4 slices with the last one shorter than k, 16 slices with 3 empty."""
    torch.manual_seed(7)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = registry.BY_OP[op][Backend.TORCH].load()
    probs, top_k, top_p, _ = _split_rows(device)
    short = _softmax(2, 65, device)
    cases = [(probs, top_k, top_p, _small_split_config()),
             (probs[:1], top_k[:1], top_p[:1], _small_split_config()),
             (probs[6:7], top_k[6:7], top_p[6:7], _small_split_config()),
             (short, torch.tensor([16, 3], device=device), torch.tensor([0.9, 0.6], device=device), _small_split_config()),
             (short, torch.tensor([3, 4], device=device), torch.tensor([0.9, 0.6], device=device),
              _small_split_config(slices=16, np_slice=4))]
    for offset, (p, k, t, cfg) in enumerate(cases):
        args = _args(op, p, k, t, offset=offset)
        _check(op, f"triton-split {cfg.slices} slices", _launcher(op, cfg)(*args), ref(*args), args)


def _hist_rows(device):
    """(probs, top_p, route, sure): rows of 1000 for the histogram route of ``_small_split_config`` (64
    slots; 4 slices of 250; 62 fine buckets over the window, levels every 2 octaves, 8 of them) and
    whether each takes the route (its bracket holds at most 64 values) or the fallback (full passes
    inside the bracket), and whether the levels place the window (``A > 0``: a level boundary surely
    fails) or it reaches down to 0 (the threshold below the levels' 16 octaves, or everything passes)."""
    V = 1000
    rows, ps, route, sure = [], [], [], []

    def add(row, p, takes_route, placed):
        rows.append(row.to(device))
        ps.append(p)
        route.append(takes_route)
        sure.append(placed)

    soft = _softmax(6, V, "cpu", scale=2.0)
    add(soft[0], 0.9, True, True)  # a 2-octave window, ~170 values: 2^19 patterns a bucket, 7 in the threshold's
    add(soft[1], 0.5, True, True)
    add(soft[2], 0.0, True, True)  # the largest value alone
    add(soft[3], 1e-6, True, True)
    add(soft[4], 1.0, True, False)  # the threshold among the smallest values, ~17 octaves down: window [0, Z)
    add(soft[5], 1.5, True, False)  # everything passes: bucket 0 is empty with A = 0, bracket (-1, -1]
    add(_ties(1, V, "cpu", levels=3)[0], 0.9, False, True)  # ~333 ties a level: one bucket
    add(torch.full((V,), 1.0 / V), 0.7, False, True)  # all equal: one bucket (one atomic a slice)
    add(torch.zeros(V), 0.9, True, False)  # no mass: an empty bucket 0 passes, threshold -1 (all kept, zeros)
    cluster = torch.cat([torch.tensor([0.5]), 1e-9 * (1 + torch.rand(V - 1))])
    limit_inside = ((0.5 + 0.5 * cluster[1:].sum()) / cluster.sum()).item()
    add(cluster, limit_inside, False, False)  # the limit inside 999 values far below the levels: one bucket
    add(cluster, 0.4, True, True)  # 0.5 alone
    sparse = torch.zeros(V)
    sparse[::20] = torch.softmax(torch.randn(50) * 0.5, -1)
    add(sparse, 1.0, True, False)  # 950 zeros; the threshold at the smallest positive value
    add(_odd_values(4, V, "cpu")[0], 0.8, True, True)  # NaN, negative, -0.0, subnormal entries
    inf_row = _softmax(1, V, "cpu")[0]
    inf_row[777] = float("inf")
    add(inf_row, 0.9, True, True)  # FLT_MAX alone: e_max = 254, the levels' top at 256 (Z = 2^31)
    add(torch.rand(V) * 1e-39, 0.6, False, False)  # subnormals only (exponent 0): one bucket
    lows = torch.softmax(torch.randn(V) * 0.3, -1)
    lows[:10] = 1e-12 * (1 + torch.rand(10))
    add(lows, 1.0, True, False)  # the threshold among 10 values far below the levels, which fit
    flat = torch.softmax(torch.randn(V) * 0.05, -1)
    add(flat, 0.5, False, True)  # within 1/10 octave: ~450 values in the threshold's bucket (1/16 octave)
    # the limit exactly at a level boundary: 0.5 (exponent 126, the boundary at 126) above 512 x 2^-10,
    # M = 1 and p = 0.5: the boundary neither surely fails nor surely passes, the window widens to 12
    # octaves ([116, 128): the next sure ones) and the threshold (0.5 alone) still lies inside
    edge = torch.zeros(V)
    edge[0], edge[1:513] = 0.5, 2.0 ** -10
    add(edge, 0.5, True, True)
    t = lambda v, dtype=None: torch.tensor(v, device=device, dtype=dtype)  # noqa: E731
    return torch.stack(rows), t(ps, torch.float32), route, sure


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a GPU or Triton's interpreter")
def test_triton_histogram_route_keeps_its_contract():
    """The histogram kernels' fine windows and brackets against the reference. The window ``[A, Z)``:
    ``A`` (when above 0) surely fails the top-p test and ``Z`` surely passes, by the exact masses as
    well (so the reference's threshold lies inside), ``NB - 2`` buckets of ``2^sh`` patterns cover it
    (the fewest), and the levels place it (``A > 0``) for the rows of ``_hist_rows`` meant to. The
    bracket: ``lo`` fails and ``hi`` passes (the threshold lies in ``(lo, hi]``), ``g_*``/``c_*`` are
    the exact mass and count above them, the rows take the route or the fallback as intended; the
    compacted buffer holds exactly the values in the bracket. Rows whose top-k cuts are off the route."""
    from torch_kernels.families.sampling.triton.histogram import _hist_prepasses
    torch.manual_seed(8)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    probs, top_p, want_route, want_sure = _hist_rows(device)
    probs, top_p = torch.cat([probs, probs[:1]]), torch.cat([top_p, top_p[:1]])
    cfg = _small_split_config()
    B, V = probs.shape
    buf = torch.full((B, cfg.cap), -7, dtype=torch.int32, device=device)
    top_k = torch.tensor([0, V, -2] + [0] * (B - 4) + [5], device=device)  # the last row is off the route
    _, bracket, window = _hist_prepasses(probs, top_k, top_p, buf, cfg)
    bracket, buf, window = bracket.cpu(), buf.cpu(), window.cpu()
    bits = reference.value_bits(probs).cpu()
    q = reference.fixed_point(bits, bits.amax(-1, keepdim=True), reference.fixed_point_bits(V))
    kept, mass = reference.kept_mask(bits, q, None, top_p.cpu())
    route, sure = [], []
    fine = cfg.hist_buckets - 2
    for r in range(B):
        lo, hi, n, g_lo, g_hi, c_lo, c_hi, total = bracket[r].tolist()
        where = f"row {r}"
        if r == B - 1:
            assert n == -1, where
            continue
        limit = top_p[r].double().item() * total
        a, z, sh = window[r, :3].tolist()
        b64 = bits[r].long()
        assert 0 <= a < z and fine << sh >= z - a and (sh == 0 or fine << (sh - 1) < z - a), f"{where}: window"
        if a > 0:
            g_a = q[r][b64 >= a].sum().item()
            assert g_a > 0 and g_a >= limit, f"{where}: A passes"
        g_z = q[r][b64 >= z].sum().item()
        assert g_z == 0 or g_z < limit, f"{where}: Z fails"
        sure.append(a > 0)
        thr = bits[r][kept[r]].min().item()  # the reference's threshold (kept: bits >= it)
        assert a <= thr < z or (a == 0 and kept[r].all()), f"{where}: the threshold outside the window"
        assert total == q[r].sum().item(), where
        assert lo < thr <= hi or (hi == lo == -1 and kept[r].all()), where
        assert g_lo == q[r][bits[r] > lo].sum().item() and g_hi == q[r][bits[r] > hi].sum().item(), where
        assert c_lo == (bits[r] > lo).sum().item() and c_hi == (bits[r] > hi).sum().item(), where
        assert n == c_lo - c_hi, where
        if lo >= 0:
            assert not (g_lo == 0 or g_lo < limit), f"{where}: lo passes"
        assert g_hi == 0 or g_hi < limit, f"{where}: hi fails"
        assert mass[r].item() == q[r][bits[r] >= thr].sum().item()
        route.append(n <= cfg.cap)
        if n <= cfg.cap:
            inside = bits[r][(bits[r] > lo) & (bits[r] <= hi)]
            assert torch.equal(buf[r, :n].sort().values, inside.sort().values), where
    assert route == want_route, f"route {route}, want {want_route}"
    assert sure == want_sure, f"placed by the levels {sure}, want {want_sure}"


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET), reason="needs a GPU or Triton's interpreter")
@pytest.mark.parametrize("op", [op for op in OPS if "top_p" in _params(op)])  # the top-p route
def test_triton_histogram_route_matches_reference(op):
    """The histogram route (and its fallback) against the reference: the rows of ``_hist_rows``, with
    top-k keeping all (0, V, negative) beside rows that top-k cuts (split or not: they take the other
    routes in the same launch), and one row alone (B = 1)."""
    torch.manual_seed(8)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = registry.BY_OP[op][Backend.TORCH].load()
    probs, top_p, _, _ = _hist_rows(device)
    B, V = probs.shape
    top_k = torch.tensor([0, V, -1, 0, 2000, 0, 8, 0, 0, 0, 0, 0, 3, 0, 0, 0, 40, 0][:B], device=device)
    assert len(top_k) == B
    cfg = _small_split_config()
    cases = [(probs, top_k, top_p), (probs[:1], top_k[:1], top_p[:1])]
    for offset, (p, k, t) in enumerate(cases):
        args = _args(op, p, k, t, offset=offset)
        _check(op, "triton-histogram", _launcher(op, cfg)(*args), ref(*args), args)


# ------------------------------------------------------------------------------------------------
# Sampling: the kept set, the distribution, determinism.


def _kept_of(probs, top_k, top_p):
    bits = reference.value_bits(probs)
    q = reference.fixed_point(bits, bits.amax(-1, keepdim=True), reference.fixed_point_bits(probs.shape[1]))
    return reference.kept_mask(bits, q, top_k, top_p)[0]


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_ids_are_always_kept(device):
    """Never a token outside the kept set, over 8 offsets x 256 rows per distribution (2048 draws
    each, every row its own stream), checked against the reference's kept mask and the formula's."""
    torch.manual_seed(3)
    base = torch.cat([_softmax(2, 300, device, scale=2.0), _ties(1, 300, device), _odd_values(4, 300, device)[[0, 2, 3]]])
    top_k = torch.tensor([20, 0, 25, 3, 300, 40], device=device)
    top_p = torch.tensor([0.8, 0.6, 0.5, 0.9, 0.3, 0.7], device=device)
    kept = _kept_of(base, top_k, top_p)
    formula_kept, _, margin = _formula(base, top_k, top_p)
    assert margin > _margin_needed(300) and torch.equal(kept, formula_kept)
    reps = 256
    probs, k, p = base.repeat(reps, 1), top_k.repeat(reps), top_p.repeat(reps)
    row_kept = kept.repeat(reps, 1)
    for offset in range(8):
        ids = sampling_ops.top_k_top_p_sampling_from_probs(probs, k, p, torch.tensor(99, device=device),
                                                            torch.tensor(offset, device=device))
        assert row_kept.gather(1, ids.long()[:, None]).all(), f"offset {offset}: a token outside the kept set"


@pytest.mark.parametrize("device", DEVICES)
def test_sample_distribution_chi_square(device):
    """100k draws (fixed seed) of one row: the counts match the renormalised kept distribution."""
    torch.manual_seed(4)
    V = 40
    row = _softmax(1, V, device, scale=1.0)
    top_k, top_p = torch.tensor([25], device=device), torch.tensor([0.7], device=device)
    kept, expected, _ = _formula(row, top_k, top_p)
    n_kept = int(kept.sum())
    assert 5 <= n_kept < 25, n_kept  # both filters bite
    reps, draws = 10000, 10
    probs = row.repeat(reps, 1)
    counts = torch.zeros(V, dtype=torch.float64, device=device)
    for offset in range(draws):
        ids = sampling_ops.top_k_top_p_sampling_from_probs(probs, top_k.repeat(reps), top_p.repeat(reps),
                                                            torch.tensor(7, device=device), torch.tensor(offset, device=device))
        counts += torch.bincount(ids.long(), minlength=V).double()
    n = reps * draws
    assert counts[~kept[0]].sum() == 0
    exp = expected[0][kept[0]] * n
    chi2 = (((counts[kept[0]] - exp) ** 2) / exp).sum().item()
    assert chi2 < chi_square_critical(n_kept - 1), f"chi-square {chi2:.1f} with {n_kept - 1} degrees of freedom"


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_is_deterministic_per_seed_and_offset(device):
    torch.manual_seed(5)
    probs = _softmax(64, 500, device, scale=0.5)
    top_k, top_p = torch.full((64,), 200, device=device), torch.full((64,), 0.95, device=device)

    def draw(seed, offset, rows=64, shape=()):
        return sampling_ops.top_k_top_p_sampling_from_probs(
            probs[:rows], top_k[:rows], top_p[:rows], torch.full(shape, seed, dtype=torch.int64, device=device),
            torch.full(shape, offset, dtype=torch.int64, device=device))
    a = draw(1, 0)
    assert torch.equal(a, draw(1, 0)) and torch.equal(a, draw(1, 0, shape=(1,)))
    assert torch.equal(a[:5], draw(1, 0, rows=5)), "a row's stream depends on the batch size"
    for other in (draw(1, 1), draw(2, 0), draw(1, 2**32), draw(-1, 0)):
        assert (other != a).sum() > 32, "another seed or offset gave (nearly) the same draws"


@pytest.mark.parametrize("device", DEVICES)
def test_no_autograd(device):
    probs = _softmax(2, 10, device).requires_grad_()
    with pytest.raises(RuntimeError, match=r"deepinfer::top_k_renorm_probs does not support autograd"):
        sampling_ops.top_k_renorm_probs(probs, torch.tensor([2, 3], device=device))


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay_with_new_offset():
    torch.manual_seed(6)
    probs = _softmax(64, 128256, "cuda")
    top_k, top_p = torch.full((64,), 50, device="cuda"), torch.full((64,), 0.9, device="cuda")
    seed, offset = torch.tensor(11, device="cuda"), torch.tensor(0, device="cuda")
    op = torch.ops.deepinfer.top_k_top_p_sampling_from_probs.default
    op(probs, top_k, top_p, seed, offset)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(probs, top_k, top_p, seed, offset)
    seen = []
    for step in (3, 4, 1000):
        offset.fill_(step)
        graph.replay()
        want = reference.top_k_top_p_sampling_from_probs(probs, top_k, top_p, seed, offset)
        assert torch.equal(out, op(probs, top_k, top_p, seed, offset)) and torch.equal(out, want)
        seen.append(out.clone())
    assert not torch.equal(seen[0], seen[1])


@pytest.mark.gpu
def test_cuda_default_selection_is_a_kernel():
    from torch_kernels import dispatch
    for op in OPS:
        chain, notice = dispatch.plan(op)
        assert chain[0].backend is not Backend.TORCH and notice is None


# ------------------------------------------------------------------------------------------------
# Bad input.


def _bad_cases(op, device):
    probs = _softmax(4, 64, device)
    good = {"probs": probs, "top_k": torch.tensor([1, 2, 3, 4], device=device),
            "top_p": torch.full((4,), 0.9, device=device), "seed": torch.tensor(1, device=device),
            "offset": torch.tensor([0], device=device)}
    names = _params(op)

    def args(**change):
        return tuple({**good, **change}[n] for n in names)
    cases = [
        ("1-D probs", args(probs=probs[0]), ValueError, "probs"),
        ("3-D probs", args(probs=probs[None]), ValueError, "probs"),
        ("int probs", args(probs=probs.int()), TypeError, "probs"),
        ("fp64 probs", args(probs=probs.double()), TypeError, "probs"),
        ("non-contiguous vocabulary", args(probs=_softmax(64, 4, device).t()), ValueError, "probs"),
        ("empty vocabulary", args(probs=probs[:, :0]), ValueError, "probs"),
    ]
    if "top_k" in names:
        cases += [
            ("top_k of the wrong length", args(top_k=torch.tensor([1, 2, 3], device=device)), ValueError, "maybe_top_k_arr"),
            ("2-D top_k", args(top_k=torch.ones(4, 1, dtype=torch.int64, device=device)), ValueError, "maybe_top_k_arr"),
            ("float top_k", args(top_k=torch.full((4,), 5.0, device=device)), TypeError, "maybe_top_k_arr"),
            ("top_k on another device", args(top_k=torch.ones(4, dtype=torch.int64, device="meta")), ValueError, "maybe_top_k_arr"),
        ]
    if "top_p" in names:
        cases += [
            ("top_p of the wrong length", args(top_p=torch.full((5,), 0.9, device=device)), ValueError, "maybe_top_p_arr"),
            ("int top_p", args(top_p=torch.ones(4, dtype=torch.int32, device=device)), TypeError, "maybe_top_p_arr"),
            ("fp64 top_p", args(top_p=torch.full((4,), 0.9, dtype=torch.float64, device=device)), TypeError, "maybe_top_p_arr"),
        ]
    if "seed" in names:
        cases += [
            ("int32 seed", args(seed=torch.tensor(1, dtype=torch.int32, device=device)), TypeError, "seed"),
            ("two seeds", args(seed=torch.tensor([1, 2], device=device)), ValueError, "seed"),
            ("float offset", args(offset=torch.tensor(1.0, device=device)), TypeError, "offset"),
            ("(1, 1) offset", args(offset=torch.zeros(1, 1, dtype=torch.int64, device=device)), ValueError, "offset"),
            ("offset on another device", args(offset=torch.tensor(0, device="meta")), ValueError, "offset"),
        ]
    return cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_bad_input_names_the_op_and_the_argument(op, device):
    assert_bad_inputs_raise(op, _bad_cases(op, device))


@pytest.mark.gpu
@pytest.mark.parametrize("op", [op for op in OPS if {"top_k", "top_p"} & set(_params(op))])
def test_tensors_on_cuda_and_cpu_raise_before_any_kernel(op):
    probs = _softmax(4, 64, "cuda")
    args = _args(op, probs, torch.tensor([1, 2, 3, 4]), torch.full((4,), 0.9))
    with pytest.raises(ValueError, match=rf"^deepinfer::{op}: argument 'maybe_top_[kp]_arr' is on cpu but 'probs' is on cuda"):
        getattr(torch.ops.deepinfer, op).default(*args)
    torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", [op for op in OPS if {"top_k", "top_p"} & set(_params(op))])
def test_scalar_parameters_are_the_per_row_tensors_they_fill(op, device):
    """``top_k`` / ``top_p`` as the schema's scalars (``maybe_*_arr`` None): every backend returns what it
    returns for a per-row tensor holding the scalar (a float top_p rounded to fp32, as the tensor's),
    including the disabling values (``top_k`` 0 and V, ``top_p`` 1 and 0) and one top_p that fp32 rounds."""
    probs = torch.cat([_softmax(3, 301, device), _ties(2, 301, device)])
    B, V = probs.shape
    params = _params(op)
    for k, p in ((5, 0.9), (0, 1.0), (V, 0.0), (1, 0.3000000001), (40, 0.6)):
        tensors = dict(top_k=torch.full((B,), k, device=device), top_p=torch.full((B,), p, device=device))
        given = {"probs": probs, "seed": torch.tensor(77, device=device), "offset": torch.tensor(3, device=device)}
        per_row = tuple({**given, **tensors}[n] for n in params)
        scalar = tuple({**given, "top_k": None, "top_p": None}[n] for n in params)
        scalars = {"top_k_val": k, "top_p_val": p}
        names = arg_names(op)
        kwargs = {n: scalars[n] for n in names if n.endswith("_val")}
        for name, fn in _backends(op, device, small=True):  # small buffers: the split and histogram routes
            want = fn(*per_row)
            got = fn(*scalar, **kwargs)
            _check(op, f"{name} k={k} p={p}", got, want, per_row)


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_wrapper_takes_scalars_and_draws_from_torch_without_a_seed(device):
    """The wrapper: ints and floats as FlashInfer takes them; no seed and offset: a seed drawn with
    torch's generator, so ``torch.manual_seed`` repeats a draw and the next call draws afresh."""
    probs = _softmax(64, 500, device)
    tk = sampling_ops.top_k_top_p_sampling_from_probs
    with_seed = tk(probs, 20, 0.8, 5, 9)
    assert torch.equal(with_seed, tk(probs, torch.full((64,), 20, device=device), torch.full((64,), 0.8, device=device),
                                     torch.tensor(5, device=device), torch.tensor(9, device=device)))
    torch.manual_seed(11)
    first, second = tk(probs, 20, 0.8), tk(probs, 20, 0.8)
    torch.manual_seed(11)
    assert torch.equal(first, tk(probs, 20, 0.8))
    assert not torch.equal(first, second)  # 64 rows of 20 candidates: equal draws have odds below 1e-40
    kept = sampling_ops.kept_set(probs, torch.full((64,), 20, device=device), torch.full((64,), 0.8, device=device))
    assert kept.gather(1, first.long()[:, None]).all() and kept.gather(1, second.long()[:, None]).all()
    renorm_k = sampling_ops.top_k_renorm_probs(probs, 20)
    assert torch.equal(renorm_k, sampling_ops.top_k_renorm_probs(probs, torch.full((64,), 20, device=device)))
    renorm_p = sampling_ops.top_p_renorm_probs(probs, 0.8)
    assert torch.equal(renorm_p, sampling_ops.top_p_renorm_probs(probs, torch.full((64,), 0.8, device=device)))
    for bad in (2.0, "5", True):
        with pytest.raises(TypeError, match="deepinfer::top_k_renorm_probs: argument 'top_k'"):
            sampling_ops.top_k_renorm_probs(probs, bad)
    with pytest.raises(TypeError, match="deepinfer::top_k_top_p_sampling_from_probs: argument 'offset'"):
        tk(probs, 20, 0.8, seed=5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_half_precision_probs_are_read_as_their_fp32_values(op, dtype, device):
    """fp16/bf16 probabilities (FlashInfer takes them): every backend samples what it samples from the
    same values in fp32 (the widening is exact), and renormalises to the fp32 result rounded to the
    dtype, keeping the same tokens; fp16's +inf and subnormals included."""
    probs = torch.cat([_softmax(3, 301, device), _ties(2, 301, device)]).to(dtype)
    if dtype == torch.float16:
        probs[0, 7], probs[1, :3] = float("inf"), torch.tensor([1e-7, 6e-8, 0.0])
    wide = probs.float()
    top_k, top_p = torch.tensor([5, 0, 40, 1, 301], device=device), torch.tensor([0.9, 0.5, 1.0, 0.0, 0.7], device=device)
    for name, fn in _backends(op, device, small=True):
        got, want = fn(*_args(op, probs, top_k, top_p)), fn(*_args(op, wide, top_k, top_p))
        if "seed" in arg_names(op):
            _check(op, name, got, want, _args(op, wide, top_k, top_p))
        else:
            assert got.dtype == dtype and got.is_contiguous(), name
            assert torch.equal(got != 0, want.to(dtype) != 0), f"{name}: kept sets differ"  # tiny kept values: 0
            assert_close(got, want.to(dtype), msg=name)
