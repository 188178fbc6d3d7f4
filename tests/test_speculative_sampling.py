"""``chain_speculative_sampling``: the reference against an independent formula (exact rationals for the
acceptance test), the defining property of speculative sampling (each emitted token is distributed as
the target, chi-square that can fail), the acceptance rates, ``-1`` padding, every backend bit for bit
against the reference on awkward shapes (Triton in its interpreter on CPU), determinism, the wrapper's
FlashInfer arguments, bad input; engine shapes, CUDA graphs and FlashInfer's semantics on a GPU."""

import math
from fractions import Fraction

import pytest
import torch

import torch_kernels
from torch_kernels import ops, registry
from torch_kernels.families.sampling import reference
from torch_kernels.spec import Backend

from conftest import DEVICES, assert_bad_inputs_raise, chi_square_critical, implementations_on

OP = "chain_speculative_sampling"
FLT_MAX = torch.finfo(torch.float32).max
TINY = 2.0**-126


def _inputs(B, n, V, device, closeness=1.0, scale=2.0):
    from torch_kernels.families.sampling.ops import speculative_inputs

    return speculative_inputs(B, n, V, device, closeness=closeness, scale=scale)


def _seed(value, device, shape=()):
    return torch.full(shape, value, dtype=torch.int64, device=device)


def _read(x: float) -> float:
    """A probability as the op reads it: NaN, negatives and subnormals 0, +inf FLT_MAX."""
    if math.isnan(x) or x < TINY:
        return 0.0
    return min(x, FLT_MAX)


def _formula(draft, ids, target, seed, offset):
    """Per row, with exact rationals: ``(accepted flags, residual support at the stop, stop position)``.
    The uniforms are the documented stream: word 0 of Philox(row, offset, 2^31 + i), its top 24 bits."""
    B, n, V = draft.shape
    w0, _ = reference.speculative_words(B, n + 1, seed, offset, "cpu")
    draft, target, ids = draft.cpu(), target.cpu(), ids.cpu().long()
    rows = []
    for b in range(B):
        flags = []
        for i in range(n):
            d = int(ids[b, i])
            q = _read(float(draft[b, i, d])) if 0 <= d < V else 0.0
            p = _read(float(target[b, i, d])) if 0 <= d < V else 0.0
            flags.append(Fraction(int(w0[b, i]) >> 8, 2**24) * Fraction(q) < Fraction(p))
        stop = next((i for i, f in enumerate(flags) if not f), n)
        t = torch.tensor([_read(float(x)) for x in target[b, stop]], dtype=torch.float64)
        dq = (torch.tensor([_read(float(x)) for x in draft[b, stop]], dtype=torch.float64) if stop < n
              else torch.zeros(V, dtype=torch.float64))
        r = (t.float() - dq.float()).double()  # the fp32 difference, subnormal results 0
        # masses at 1.0's scale below 2: a residual below one unit of it has none
        unit = 2.0 ** -(reference.fixed_point_bits(V) - 1) if r.max() < 2 else TINY
        support = r >= unit
        if not support.any():
            support = t >= (2.0 ** -(reference.fixed_point_bits(V) - 1) if t.max() < 2 else TINY)
        rows.append((flags, support, stop))
    return rows


def _check_against_formula(draft, ids, target, seed, offset, out):
    got_ids, accepted, emitted = (t.cpu() for t in out)
    for b, (flags, support, stop) in enumerate(_formula(draft, ids, target, seed, offset)):
        n = len(flags)
        assert int(accepted[b]) == sum(flags), f"row {b}: accepted {int(accepted[b])}, flags {flags}"
        assert int(emitted[b]) == stop, f"row {b}: emitted {int(emitted[b])}, first rejection at {stop}"
        assert got_ids[b, :stop].tolist() == ids[b, :stop].cpu().tolist(), f"row {b}: accepted drafts changed"
        assert got_ids[b, stop + 1:].tolist() == [-1] * (n - stop), f"row {b}: no -1 after the stop"
        token = int(got_ids[b, stop])
        if support.any():
            assert support[token], f"row {b}: token {token} has no residual mass at position {stop}"
        else:
            assert token == 0, f"row {b}: no mass at all, token {token}"


def _odd_inputs(device):
    """NaN, +inf, negatives, subnormals, ids outside the vocabulary, rows that do not sum alike
    (a residual without mass), a target row without mass."""
    draft, ids, target = _inputs(6, 3, 40, device)
    draft[0, 0, :5] = torch.tensor([math.nan, -0.5, 1e-40, math.inf, 0.0])
    target[0, 0, :5] = torch.tensor([0.2, math.nan, 1e-39, 0.1, -0.0])
    ids[0, 0] = 3  # q = +inf: u * FLT_MAX < 0.1 only for u = 0
    ids[1, :] = torch.tensor([-5, 40, 7])  # outside the vocabulary: rejected
    target[2] = 0.5 * torch.cat([draft[2], draft[2, :1]])  # p = q / 2: rejected without residual mass
    ids[3, 0] = 4
    target[3, 0] = 0.0  # rejected, and the target row has no mass: token 0
    draft[3, 0, 4] = 1.0
    draft[4, 1, 9] = 1e-41  # a subnormal q: read as 0, so p > 0 accepts
    ids[4, 1] = 9
    return draft, ids, target


def _scaled_inputs(device):
    """Residuals off 1.0's scale: all below its unit (no mass there: the target row draws), and rows of
    values of 2 or more (unnormalised: drawn at their own exponent), across slices."""
    draft, ids, target = _inputs(4, 2, 5000, device)
    ids[:2, 0] = 7
    target[:2, 0, 7] = 0.0  # rejected at position 0
    draft[0, 0] = 0.0
    draft[0, 0, [7, 100, 200]] = torch.tensor([0.4, 0.3, 0.3], device=device)
    target[0, 0] = 2.0 ** -45  # the residual: 2^-45 but at 7, 100 and 200 (the unit is 2^-43 at V = 5000)
    target[0, 0, [7, 100, 200]] = torch.tensor([0.0, 0.25, 0.25], device=device)  # the target row: 100 or 200
    target[1] = target[1] * 8.0  # residual and bonus rows with values of 2 or more
    target[1, :, 4999] = 3.0
    return draft, ids, target


def test_reference_matches_independent_formula():
    torch.manual_seed(1)
    ref = registry.BY_OP[OP][Backend.TORCH].load()
    cases = [_inputs(8, 3, 17, "cpu", closeness=c) for c in (0.2, 1.0, 4.0)]
    cases += [_inputs(5, 1, 1000, "cpu"), _inputs(3, 0, 9, "cpu"), _odd_inputs("cpu"), _scaled_inputs("cpu")]
    for k, (draft, ids, target) in enumerate(cases):
        for seed, offset in ((3, 0), (-7, 2**33 + 1)):
            s, o = _seed(seed, "cpu"), _seed(offset + k, "cpu")
            _check_against_formula(draft, ids, target, s, o, ref(draft, ids, target, s, o))


def test_acceptance_on_constructed_inputs():
    """q == p: every draft accepted and the bonus drawn; p(d) = 0: rejected wherever it is, counted
    independently of the stop (FlashInfer's accepted_token_num), with -1 after the first rejection."""
    torch.manual_seed(2)
    B, n, V = 64, 3, 11
    draft, ids, _ = _inputs(B, n, V, "cpu")
    bonus = torch.softmax(torch.randn(B, 1, V), -1)
    same = torch.cat([draft, bonus], 1)
    out, acc, emitted = torch_kernels.chain_speculative_sampling(draft, ids, same, seed=5, offset=0)
    assert acc.tolist() == [n] * B and emitted.tolist() == [n] * B
    assert torch.equal(out[:, :n], ids.int()) and (out[:, n] >= 0).all()
    assert bonus[:, 0].gather(1, out[:, n:].long()).gt(0).all(), "the bonus token has no target mass"
    for zero_at in range(n):  # p(d) = 0 at one position, q == p elsewhere
        target = same.clone()
        target[:, zero_at].scatter_(1, ids[:, zero_at:zero_at + 1], 0.0)
        target[:, zero_at] /= target[:, zero_at].sum(-1, keepdim=True)  # the draft's mass moved to the others
        out, acc, emitted = torch_kernels.chain_speculative_sampling(draft, ids, target, seed=6, offset=zero_at)
        assert acc.tolist() == [n - 1] * B, "the other positions pass their tests on their own"
        assert emitted.tolist() == [zero_at] * B
        assert torch.equal(out[:, :zero_at], ids[:, :zero_at].int())
        assert (out[:, zero_at + 1:] == -1).all()
        token = out[:, zero_at].long()
        assert (token != ids[:, zero_at]).all(), "the rejected draft came back from the residual"
        residual = (target[:, zero_at] - draft[:, zero_at]).clamp(min=0)
        assert residual.gather(1, token[:, None]).gt(0).all(), "a residual token without residual mass"
    everywhere = same.clone()
    everywhere[:, :n].scatter_(2, ids[..., None], 0.0)
    _, acc, emitted = torch_kernels.chain_speculative_sampling(draft, ids, everywhere, seed=7, offset=0)
    assert acc.tolist() == [0] * B and emitted.tolist() == [0] * B


def _chi_square(counts, expected_probs):
    keep = expected_probs > 0
    assert counts[~keep].sum() == 0, "a token without target mass was emitted"
    exp = expected_probs[keep] * counts.sum()
    return (((counts[keep] - exp) ** 2) / exp).sum().item(), int(keep.sum()) - 1


def _spec_rows(V, n, device):
    """Fixed draft and target rows per position: one draft near its target, one far, one with a
    token the draft never proposes but the target wants (the residual must supply it)."""
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(n + 1, V, generator=g) * 1.5
    target = torch.softmax(logits, -1)
    draft = torch.softmax(logits[:n] + torch.randn(n, V, generator=g) * torch.tensor([0.3, 2.0, 1.0][:n])[:, None], -1)
    draft[n - 1, 0] = 0.0
    draft[n - 1] /= draft[n - 1].sum()
    return draft.to(device), target.to(device)


@pytest.mark.parametrize("source", ["seed_offset", "torch_generator"])
@pytest.mark.parametrize("V,n", [(5, 2), (13, 3)])
@pytest.mark.parametrize("device", DEVICES)
def test_emitted_tokens_follow_the_target(device, V, n, source):
    """The defining property: at each position, the tokens emitted there (not -1) are distributed as
    the target's row, whatever the draft; the bonus token too. 96k rows, draft ids drawn from the draft
    rows; the same counts reject the draft's distribution (what accepting every draft would give), so
    the test can fail. The acceptance rates match ``sum(min(p, q))`` per position (z < 4.265)."""
    torch.manual_seed(22)
    draft, target = _spec_rows(V, n, device)
    rows, calls = 4096, 24
    counts = torch.zeros(n + 1, V, dtype=torch.float64)
    reached = torch.zeros(n + 2, dtype=torch.float64)  # rows with emitted >= k
    accepted_total = 0.0
    for step in range(calls):
        ids = torch.stack([torch.multinomial(draft[i], rows, replacement=True) for i in range(n)], 1)
        d, t = draft.expand(rows, n, V), target.expand(rows, n + 1, V)
        if source == "seed_offset":
            out, acc, emitted = torch_kernels.chain_speculative_sampling(d, ids, t, seed=_seed(31, device),
                                                                         offset=_seed(step, device))
        else:
            out, acc, emitted = torch_kernels.chain_speculative_sampling(d, ids, t)
        out, emitted = out.cpu().long(), emitted.cpu().long()
        for i in range(n + 1):
            tok = out[:, i][out[:, i] >= 0]
            counts[i] += torch.bincount(tok, minlength=V).double()
            assert torch.equal(out[:, i] >= 0, emitted >= i), "emitted where an earlier draft was rejected"
        for k in range(n + 2):
            reached[k] += (emitted >= k).sum().item()
        accepted_total += acc.sum().item()
    total = rows * calls
    for i in range(n + 1):
        chi2, dof = _chi_square(counts[i], target[i].cpu().double())
        critical = chi_square_critical(dof)
        assert chi2 < critical, f"position {i}: chi-square {chi2:.1f}, {dof} dof (critical {critical:.1f})"
        if i < n:
            wrong, _ = _chi_square(counts[i], draft[i].cpu().double() * 0.999 + target[i].cpu().double() * 0.001)
            assert wrong > critical, f"position {i}: the chi-square cannot tell the draft from the target"
    alpha = torch.minimum(draft, target[:n]).sum(-1).cpu().double()  # P(accept) at each position
    for k in range(1, n + 1):
        z = abs(reached[k] / reached[k - 1] - alpha[k - 1].item()) / math.sqrt(
            alpha[k - 1] * (1 - alpha[k - 1]) / reached[k - 1])
        assert z < 4.265, f"position {k - 1}: acceptance {reached[k] / reached[k - 1]:.4f} vs {alpha[k - 1]:.4f}"
    mean, var = alpha.sum().item(), (alpha * (1 - alpha)).sum().item()
    assert abs(accepted_total / total - mean) < 4.265 * math.sqrt(var / total), "accepted_token_num's mean"


def _awkward_cases(device):
    """Vocabularies that are not powers of two, across the kernels' 2048-value chunks and 4096-value
    slices; n = 1; one row; strided positions and rows; int32 ids; the odd values; a negative seed and
    an offset above 2^32."""
    cases = [tuple(a) for a in ops.BY_NAME[OP].samples(device, torch.float32)]
    draft, ids, target = _inputs(3, 1, 2500, device, closeness=3.0)
    cases.append((draft, ids.int(), target, _seed(-3, device), _seed(2**33 + 5, device)))
    draft, ids, target = _inputs(1, 4, 4099, device, closeness=0.5)
    cases.append((draft, ids, target, _seed(9, device, (1,)), _seed(1, device, (1,))))
    d_t, ids_t, t_t = _inputs(3, 5, 301, device)
    cases.append((d_t.transpose(0, 1).contiguous().transpose(0, 1), ids_t.t().contiguous().t(),
                  t_t.transpose(0, 1).contiguous().transpose(0, 1), _seed(4, device), _seed(0, device)))
    wide = torch.softmax(torch.randn(2, 4, 3, 300, device=device), -1)  # rows and positions strided
    cases.append((wide[:, 0, :2, :257], torch.randint(0, 257, (2, 2), device=device),
                  wide[:, 1, :, :257], _seed(8, device), _seed(3, device)))
    cases.append(_odd_inputs(device) + (_seed(12, device), _seed(0, device)))
    draft, ids, target = _inputs(4, 3, 9000, device, closeness=0.5)  # three of the Triton kernels' slices
    target[1] = 0.5 * torch.cat([draft[1], draft[1, :1]])  # no residual mass: the target row draws
    cases.append((draft, ids, target, _seed(21, device), _seed(2, device)))
    cases.append(_scaled_inputs(device) + (_seed(22, device), _seed(5, device)))
    draft, ids, target = _inputs(2, 2, 9000, device)
    target = 1.0 + 0.9 * torch.rand_like(target)  # every draft accepted; a flat bonus row sums past 2^52 a slice
    cases.append((draft, ids, target, _seed(23, device), _seed(6, device)))
    if device == "cuda":
        for B in (1, 32, 256):
            draft, ids, target = _inputs(B, 4, 128256, device)
            cases.append((draft, ids, target, _seed(1234, device), _seed(B, device)))
    return cases


@pytest.mark.parametrize("device", DEVICES)
def test_backends_match_reference(device):
    torch.manual_seed(3)
    ref = registry.BY_OP[OP][Backend.TORCH].load()
    backends = implementations_on(OP, device)
    assert any(name.startswith("triton") for name, _ in backends), [name for name, _ in backends]
    for args in _awkward_cases(device):
        before = [a.clone() for a in args]
        want = ref(*args)
        for name, fn in backends:
            got = fn(*args)
            for g, w, what in zip(got, want, ("ids", "accepted", "emitted")):
                assert g.dtype == torch.int32 and torch.equal(g.cpu(), w.cpu()), \
                    f"{name} {what} {tuple(args[0].shape)}: {g.cpu().tolist()[:4]} vs {w.cpu().tolist()[:4]}"
        assert all(torch.equal(b.nan_to_num(), a.nan_to_num()) for b, a in zip(before, args)), "an input was clobbered"


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 32, 256])
def test_triton_matches_reference_at_engine_shapes(batch):
    """Llama 3's vocabulary, four draft tokens, decode batches; drafts near and far from the target."""
    torch.manual_seed(4)
    ref = registry.BY_OP[OP][Backend.TORCH].load()
    triton_fn = registry.BY_OP[OP][Backend.TRITON].load()
    for closeness in (0.1, 2.0):
        draft, ids, target = _inputs(batch, 4, 128256, "cuda", closeness=closeness)
        for offset in (0, 1, 2**32 + 7):
            args = (draft, ids.int(), target, _seed(99, "cuda"), _seed(offset, "cuda"))
            want = ref(*args)
            for got in (triton_fn(*args), torch.ops.deepinfer.chain_speculative_sampling(*args)):
                assert all(torch.equal(g, w) for g, w in zip(got, want)), f"batch {batch} offset {offset}"


def test_deterministic_per_seed_and_offset_and_follows_torch_seed():
    torch.manual_seed(5)
    draft, ids, target = _inputs(64, 3, 50, "cpu", closeness=2.0)

    def draw(seed, offset, rows=64):
        return torch_kernels.chain_speculative_sampling(draft[:rows], ids[:rows], target[:rows], seed=seed, offset=offset)
    a = draw(1, 0)
    assert all(torch.equal(x, y) for x, y in zip(a, draw(_seed(1, "cpu", (1,)), _seed(0, "cpu"))))
    assert all(torch.equal(x[:5], y) for x, y in zip(a, draw(1, 0, rows=5))), "a row's stream depends on the batch"
    for other in (draw(1, 1), draw(2, 0), draw(1, 2**32), draw(-1, 0)):
        assert (other[0] != a[0]).any(-1).sum() > 16, "another seed or offset gave (nearly) the same draws"
    torch.manual_seed(0)
    g1, g2 = (torch_kernels.chain_speculative_sampling(draft, ids, target) for _ in range(2))
    torch.manual_seed(0)
    assert torch.equal(g1[0], torch_kernels.chain_speculative_sampling(draft, ids, target)[0]), "manual_seed"
    assert (g1[0] != g2[0]).any(-1).sum() > 16, "consecutive draws from torch's generator repeat"
    gen = torch.Generator().manual_seed(7)
    h1 = torch_kernels.chain_speculative_sampling(draft, ids, target, generator=gen)
    gen.manual_seed(7)
    assert torch.equal(h1[0], torch_kernels.chain_speculative_sampling(draft, ids, target, generator=gen)[0])


def test_own_random_stream():
    """The speculative uniforms are not the family's draws on the same (seed, offset)."""
    seed, offset = _seed(3, "cpu"), _seed(4, "cpu")
    w0, w1 = reference.speculative_words(8, 1, seed, offset, "cpu")
    family = reference.random_bits31(8, seed, offset, "cpu")
    assert not torch.equal(w1[:, 0] >> 1, family) and not torch.equal(w0[:, 0] >> 1, family)


def test_wrapper_takes_flashinfers_arguments():
    """The optional count tensors are added to in place and returned; positional order as FlashInfer's."""
    torch.manual_seed(6)
    draft, ids, target = _inputs(16, 3, 30, "cpu")
    want = torch_kernels.chain_speculative_sampling(draft, ids, target, seed=2, offset=1)
    acc, emitted = torch.full((16,), 10, dtype=torch.int32), torch.full((16,), 20, dtype=torch.int64)
    got = torch_kernels.chain_speculative_sampling(draft, ids, target, acc, emitted, True, None, 2, 1)
    assert got[1] is acc and got[2] is emitted
    assert torch.equal(got[0], want[0]) and torch.equal(acc, want[1] + 10) and torch.equal(emitted, want[2] + 20)
    direct = torch.ops.deepinfer.chain_speculative_sampling(draft, ids, target, _seed(2, "cpu"), _seed(1, "cpu"))
    assert all(torch.equal(x, y) for x, y in zip(want, direct))


def _bad_cases(device):
    draft, ids, target = _inputs(4, 2, 16, device)
    seed, offset = _seed(1, device), _seed(0, device, (1,))
    return [
        ("2-D draft_probs", (draft[:, 0], ids, target, seed, offset), ValueError, "draft_probs"),
        ("fp16 draft_probs", (draft.half(), ids, target, seed, offset), TypeError, "draft_probs"),
        ("non-contiguous vocabulary", (draft.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :2], ids[:, :2],
                                       target[:, :, :2], seed, offset), ValueError, "draft_probs"),
        ("empty vocabulary", (draft[..., :0], ids, target[..., :0], seed, offset), ValueError, "draft_probs"),
        ("float ids", (draft, ids.float(), target, seed, offset), TypeError, "draft_token_ids"),
        ("ids of another length", (draft, ids[:, :1], target, seed, offset), ValueError, "draft_token_ids"),
        ("ids of another batch", (draft, ids[:3], target, seed, offset), ValueError, "draft_token_ids"),
        ("ids on another device", (draft, ids.to("meta"), target, seed, offset), ValueError, "draft_token_ids"),
        ("bf16 target", (draft, ids, target.bfloat16(), seed, offset), TypeError, "target_probs"),
        ("target without the bonus position", (draft, ids, target[:, :2], seed, offset), ValueError, "target_probs"),
        ("target of another vocabulary", (draft, ids, target[..., :15], seed, offset), ValueError, "target_probs"),
        ("target of another batch", (draft, ids, target[:3], seed, offset), ValueError, "target_probs"),
        ("target on another device", (draft, ids, target.to("meta"), seed, offset), ValueError, "target_probs"),
        ("int32 seed", (draft, ids, target, seed.int(), offset), TypeError, "seed"),
        ("two seeds", (draft, ids, target, _seed(1, device, (2,)), offset), ValueError, "seed"),
        ("float offset", (draft, ids, target, seed, offset.float()), TypeError, "offset"),
        ("offset on another device", (draft, ids, target, seed, offset.to("meta")), ValueError, "offset"),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_names_the_op_and_the_argument(device):
    assert_bad_inputs_raise(OP, _bad_cases(device))
    draft, ids, target = _inputs(2, 2, 8, device)
    count = torch.zeros(2, dtype=torch.int32, device=device)
    wrapper_cases = [
        ("accepted count of another length", (draft, ids, target, count[:1]), ValueError, "maybe_output_accepted_token_num"),
        ("float emitted count", (draft, ids, target, None, count.float()), TypeError,
         "maybe_output_emitted_draft_token_num"),
        ("emitted count on another device", (draft, ids, target, None, count.to("meta")), ValueError,
         "maybe_output_emitted_draft_token_num"),
        ("seed without offset", (draft, ids, target, None, None, True, None, 1), TypeError, "offset"),
        ("float seed", (draft, ids, target, None, None, True, None, 1.5, 0), TypeError, "seed"),
        ("list draft_probs", (draft.tolist(), ids, target), TypeError, "draft_probs"),
    ]
    assert_bad_inputs_raise(OP, wrapper_cases, call=torch_kernels.chain_speculative_sampling)


@pytest.mark.gpu
def test_cuda_graph_replays_draw_afresh():
    torch.manual_seed(7)
    draft, ids, target = _inputs(32, 4, 128256, "cuda")
    seed, offset = _seed(11, "cuda"), _seed(0, "cuda")
    torch_kernels.chain_speculative_sampling(draft, ids, target, seed=seed, offset=offset)  # compile outside
    torch_kernels.chain_speculative_sampling(draft, ids, target)
    torch.cuda.synchronize()
    given, drawn = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(given):
        out = torch_kernels.chain_speculative_sampling(draft, ids, target, seed=seed, offset=offset)
    with torch.cuda.graph(drawn):
        out_g = torch_kernels.chain_speculative_sampling(draft, ids, target)
    seen = []
    for step in (3, 4):
        offset.fill_(step)
        given.replay()
        want = reference.chain_speculative_sampling(draft, ids, target, seed, offset)
        assert all(torch.equal(g, w) for g, w in zip(out, want)), f"replay at offset {step}"
        drawn.replay()
        seen.append(out_g[0].clone())
    assert not torch.equal(seen[0], seen[1]), "a replay drew the same tokens from torch's generator"


@pytest.mark.gpu
def test_flashinfer_agrees_on_constructed_inputs():
    """FlashInfer's kernel (another random stream) gives the same counts where they are forced: q == p
    accepts every draft, p(d) = 0 at one position rejects it and is not counted."""
    fs = pytest.importorskip("flashinfer.sampling")
    torch.manual_seed(8)
    B, n, V = 32, 4, 128256
    draft, ids, _ = _inputs(B, n, V, "cuda")
    same = torch.cat([draft, torch.softmax(torch.randn(B, 1, V, device="cuda"), -1)], 1)
    zero = same.clone()
    zero[:, 2].scatter_(1, ids[:, 2:3], 0.0)
    zero[:, 2] /= zero[:, 2].sum(-1, keepdim=True)
    for target, acc_want, emitted_want in ((same, n, n), (zero, n - 1, 2)):
        ours = torch_kernels.chain_speculative_sampling(draft, ids, target, seed=1, offset=0)
        theirs = fs.chain_speculative_sampling(draft, ids.int(), target, seed=1, offset=0)
        for out in (ours, theirs):
            assert out[1].tolist() == [acc_want] * B and out[2].tolist() == [emitted_want] * B
            assert torch.equal(out[0][:, :emitted_want], ids[:, :emitted_want].int())
            assert (out[0][:, emitted_want + 1:] == -1).all()
