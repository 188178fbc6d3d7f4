"""Numerics of the rotary embedding: the reference against RoFormer's complex-number rotation (fp64,
written independently of the reference and of the cache builder), and every backend against the
reference over dtypes, pairings, partial rotary, no key and strided layouts (Triton in its interpreter
on CPU); bad input; the in-place contract."""

import os

import pytest
import torch

import torch_kernels
from torch_kernels import dispatch, registry
from torch_kernels.families.rope import ops as rope
from torch_kernels.spec import Backend
from torch_kernels.testing import assert_close, clone_keep_strides

from conftest import DEVICES, assert_bad_inputs_raise, implementations_on, triton_here

OP = "rotary_embedding"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REFERENCE = registry.BY_OP[OP][Backend.TORCH].load()

# (tokens, q heads, k heads (0: no key), head_size, rot_dim, is_neox, layout): one token, GPT-J,
# partial rotary (a non-power-of-two half), no key, zero tokens, strided rows of a fused qkv tensor,
# 3-D head views, many heads (several BLOCK_H tiles and chunks), more key heads than query heads.
CASES = [
    (1, 1, 1, 64, 64, True, "2d"),
    (3, 4, 2, 128, 128, False, "2d"),
    (5, 3, 1, 96, 48, True, "qkv"),
    (4, 2, 0, 80, 80, False, "2d"),
    (2, 3, 0, 64, 32, True, "qkv"),
    (0, 4, 2, 64, 32, True, "2d"),
    (6, 5, 3, 32, 16, False, "3d"),
    (2, 3, 1, 40, 24, False, "qkv"),
    (3, 37, 5, 16, 8, True, "3d"),
    (2, 1, 3, 16, 16, True, "qkv"),
]
# The benchmark shape, a decode step, partial GPT-J (ChatGLM-style), and a long cache.
GPU_CASES = [
    (8192, 32, 8, 128, 128, True, "qkv"),
    (1, 32, 8, 128, 128, True, "qkv"),
    (1000, 16, 2, 128, 64, False, "2d"),
    (333, 28, 4, 64, 64, True, "3d"),
]


def _ids(case):
    t, hq, hk, hs, rd, neox, layout = case
    return f"T{t}-{hq}q{hk}k-hs{hs}-rot{rd}-{'neox' if neox else 'gptj'}-{layout}"


def _args(case, device, dtype, cache_dtype=torch.float32, positions_dtype=torch.int64, max_position=37):
    t, hq, hk, hs, rd, neox, layout = case
    return rope.make_args(t, hq, hk, hs, rd, neox, layout, device, dtype, cache_dtype, positions_dtype, max_position)


def _copy(args):
    """A deep copy that keeps the layout: query and key views of one fused base stay views of a copy
    of that base. Returns (args, the base or None)."""
    positions, q, k, hs, cache, neox = args
    base = q._base
    if base is None:
        return (positions, q.clone(), None if k is None else k.clone(), hs, cache, neox), None
    b = base.clone()
    view = lambda t: None if t is None else b.as_strided(t.size(), t.stride(), t.storage_offset())  # noqa: E731
    return (positions, view(q), view(k), hs, cache, neox), b


def _roformer(positions, x, head_size, rot_dim, is_neox, base=10000.0):
    """RoFormer's rotation in fp64 as complex numbers: pair ``j`` of each head is ``z_j = a_j + i b_j``
    and becomes ``z_j * exp(i * p * base^(-2j/rot_dim))``; the other dims pass through."""
    heads = (x if x.dim() == 3 else x.unflatten(-1, (-1, head_size))).double()
    half = rot_dim // 2
    angle = positions.double()[:, None] * base ** (-2.0 * torch.arange(half, dtype=torch.float64) / rot_dim)
    rotor = torch.polar(torch.ones_like(angle), angle)[:, None, :]  # (T, 1, half)
    if is_neox:
        z = torch.complex(heads[..., :half], heads[..., half:rot_dim]) * rotor
        rotated = torch.cat((z.real, z.imag), dim=-1)
    else:
        z = torch.view_as_complex(heads[..., :rot_dim].reshape(*heads.shape[:-1], half, 2).contiguous()) * rotor
        rotated = torch.view_as_real(z).flatten(-2)
    out = torch.cat((rotated, heads[..., rot_dim:]), dim=-1)
    return out.reshape(x.shape)


def _backends(device):
    return implementations_on(OP, device)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_rotary_embedding_reference_matches_roformer_formula(case, dtype):
    # Positions up to 4095: angles of thousands of radians, as in long contexts.
    args, _ = _copy(_args(case, "cpu", dtype, torch.float64 if dtype == torch.float64 else torch.float32,
                          max_position=4096))
    positions, q, k, hs, cache, neox = args
    rot_dim = cache.shape[1]
    want_q = _roformer(positions, q, hs, rot_dim, neox)
    want_k = None if k is None else _roformer(positions, k, hs, rot_dim, neox)
    before_q = q.clone()
    assert REFERENCE(*args) is None
    assert_close(q, want_q.to(dtype))
    if k is not None:
        assert_close(k, want_k.to(dtype))
    heads = lambda x: x if x.dim() == 3 else x.unflatten(-1, (-1, hs))  # noqa: E731
    assert torch.equal(heads(q)[..., rot_dim:], heads(before_q)[..., rot_dim:]), "pass-through dims changed"


def _check_backends(case, device, dtype, cache_dtype, positions_dtype, strided_positions=False):
    args = _args(case, device, dtype, cache_dtype, positions_dtype)
    if strided_positions:  # every other element of a longer tensor
        p = torch.randint(0, 37, (2 * args[0].shape[0],), device=device, dtype=positions_dtype)[::2]
        args = (p,) + args[1:]
    want, want_base = _copy(args)
    REFERENCE(*want)
    positions_before, cache_before = args[0].clone(), args[4].clone()
    for name, fn in _backends(device):
        got, got_base = _copy(args)
        assert fn(*got) is None, name
        assert_close(got[1], want[1], msg=f"{name}: query")
        if got[2] is not None:
            assert_close(got[2], want[2], msg=f"{name}: key")
        if got_base is not None:  # the rest of the fused tensor (the value heads) is untouched
            assert_close(got_base, want_base, msg=f"{name}: fused qkv")
            v = sum(x.shape[-1] if x.dim() == 2 else x.shape[1] * x.shape[2] for x in args[1:3] if x is not None)
            assert torch.equal(got_base[:, v:], args[1]._base[:, v:]), f"{name} wrote outside query and key"
        assert torch.equal(args[0], positions_before) and torch.equal(args[4], cache_before), f"{name} clobbered an input"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_embedding_backends_match_reference(dtype, device):
    cases = CASES + (GPU_CASES if device == "cuda" else [])
    for i, case in enumerate(cases):
        # Alternate the cache dtype (fp32 / the q dtype) and the positions dtype over the cases.
        _check_backends(case, device, dtype, dtype if i % 2 else torch.float32, torch.int32 if i % 3 == 1 else torch.int64,
                        strided_positions=i % 4 == 3)


def _tilelang_rotary_embedding(*args):
    from torch_kernels.families.rope import tilelang as tilelang_rope
    return tilelang_rope.rotary_embedding(*args)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["registered op", "tilelang"])
def test_rotary_embedding_large_offsets_past_int32(impl):
    """A query of more than 2^31 elements: token offsets need 64 bits. Checked on the first and last
    tokens against the reference run on those tokens alone, for the op (Triton serves it first) and
    for the TileLang kernel, which computes its own offsets."""
    if impl == "tilelang":
        pytest.importorskip("tilelang")
    rotary_embedding = torch.ops.deepinfer.rotary_embedding if impl == "registered op" else _tilelang_rotary_embedding
    t, hq, hk, hs = (1 << 31) // (32 * 128) + 5, 32, 8, 128
    positions = torch.randint(0, 8192, (t,), device="cuda")
    cache = rope.make_cos_sin_cache(8192, hs, device="cuda")
    q = torch.randn(t, hq * hs, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hk * hs, device="cuda", dtype=torch.bfloat16)
    rows = torch.tensor([0, 1, t - 2, t - 1], device="cuda")
    want_q, want_k = q[rows].clone(), k[rows].clone()
    REFERENCE(positions[rows], want_q, want_k, hs, cache, True)
    rotary_embedding(positions, q, k, hs, cache, True)
    assert_close(q[rows], want_q)
    assert_close(k[rows], want_k)


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_embedding_triton_out_of_cache_position_reads_nothing_and_gives_nan(device):
    """With the data check off (as inside a CUDA graph capture), a position outside the cache makes
    the Triton kernel write NaN for that token, not read outside the cache; other tokens are right."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs on CPU only in its interpreter")
    args = _args((4, 2, 1, 32, 32, True, "2d"), device, torch.float32)
    positions = args[0].clone()
    positions[1], positions[2] = 1 << 40, -3
    args = (positions,) + args[1:]
    got, _ = _copy(args)
    registry.BY_OP[OP][Backend.TRITON].load()(*got)
    for g, x in zip(got[1:3], args[1:3]):
        assert g[1:3].isnan().all()
        want = x[[0, 3]].clone()  # the reference on the in-cache tokens alone
        REFERENCE(positions[[0, 3]], want, None, *args[3:])
        assert_close(g[[0, 3]], want)



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_embedding_triton_other_configs_match_reference(dtype, device):
    """The entry point under launches other than the heuristic's: a head per tile, chunks of several
    tiles that split query and key heads, one chunk of every head, more warps; both pairings,
    partial rotary, no key, the fused qkv layout."""
    triton_rope = triton_here("rope", device)
    Config = triton_rope.TritonRopeConfig
    for case in ((3, 4, 2, 128, 128, False, "2d"), (5, 3, 1, 96, 48, True, "qkv"), (2, 3, 0, 64, 32, True, "qkv"),
                 (3, 37, 5, 16, 8, True, "3d")):
        args = _args(case, device, dtype)
        want, _ = _copy(args)
        REFERENCE(*want)
        block_d = 1 << (args[4].shape[1] // 2 - 1).bit_length()  # pairs a tile: the next power of two >= rot_dim/2
        for config in (Config(1, 1, block_d, 1), Config(3, 1, block_d, 2), Config(4, 2, block_d, 1),
                       Config(64, 8, block_d, 4)):
            got, _ = _copy(args)
            assert triton_rope.rotary_embedding(*got, config=config) is None
            assert_close(got[1], want[1], msg=f"{_ids(case)}: query, {config}")
            if got[2] is not None:
                assert_close(got[2], want[2], msg=f"{_ids(case)}: key, {config}")


def test_rotary_embedding_triton_heuristic_picks_the_measured_launch():
    """Tiles of 1024 pairs over 4 warps; from 1024 tokens one chunk of every head (cos/sin loaded once
    a token), fewer tokens split the heads in chunks of whole tiles until there are 1024 programs;
    traced (tokens unknown), one tile a program."""
    Config = triton_here("rope", "cpu").TritonRopeConfig
    assert Config.for_shape(8192, 40, 64) == Config(48, 16, 64, 4)  # 32 + 8 heads of 128: 3 tiles of 16
    assert Config.for_shape(1024, 40, 64) == Config(48, 16, 64, 4)
    assert Config.for_shape(1023, 40, 64) == Config(32, 16, 64, 4)  # 2 chunks
    assert Config.for_shape(1, 40, 64) == Config(16, 16, 64, 4)
    assert Config.for_shape(None, 40, 64) == Config(16, 16, 64, 4)
    assert Config.for_shape(32, 3, 8) == Config(4, 4, 8, 1)
    assert Config.for_shape(4096, 160, 32) == Config(160, 32, 32, 4)
    assert Config.for_shape(512, 160, 32) == Config(96, 32, 32, 4)  # 5 tiles in 2 chunks


def test_rotary_embedding_inplace_op_refuses_autograd():
    positions, q, k, hs, cache, neox = _args(CASES[0], "cpu", torch.float32)
    q.requires_grad_()
    with pytest.raises(RuntimeError, match=rf"deepinfer::{OP} does not support autograd"):
        torch_kernels.families.rope.ops.rotary_embedding(positions, q, k, hs, cache, neox)
    with torch.no_grad():
        torch_kernels.families.rope.ops.rotary_embedding(positions, q, k, hs, cache, neox)


# --- bad input -----------------------------------------------------------------------------------

def _bad_cases(device):
    positions = torch.randint(0, 16, (4,), device=device)
    q, k = torch.randn(4, 2 * 32, device=device), torch.randn(4, 32, device=device)
    cache = rope.make_cos_sin_cache(16, 32, device=device)

    def args(positions=positions, q=q, k=k, head_size=32, cache=cache):
        return (positions, q, k, head_size, cache, True)
    return [
        ("query width not a multiple of head_size", args(q=torch.randn(4, 70, device=device)), ValueError, "query"),
        ("key width not a multiple of head_size", args(k=torch.randn(4, 48, device=device)), ValueError, "key"),
        ("3-D query of another head_size", args(q=torch.randn(4, 2, 64, device=device)), ValueError, "query"),
        ("1-D query", args(q=torch.randn(64, device=device)), ValueError, "query"),
        ("query not contiguous in its last dim", args(q=torch.randn(64, 4, device=device).t()), ValueError, "query"),
        ("integer query", args(q=torch.ones(4, 64, dtype=torch.int32, device=device)), TypeError, "query"),
        ("zero heads", args(q=torch.randn(4, 0, device=device)), ValueError, "query"),
        ("odd rot_dim", args(cache=torch.randn(16, 31, device=device)), ValueError, "cos_sin_cache"),
        ("rot_dim of 0", args(cache=torch.randn(16, 0, device=device)), ValueError, "cos_sin_cache"),
        ("rot_dim larger than head_size", args(cache=rope.make_cos_sin_cache(16, 64, device=device)), ValueError, "cos_sin_cache"),
        ("1-D cache", args(cache=torch.randn(32, device=device)), ValueError, "cos_sin_cache"),
        ("fp16 cache for fp32 query", args(cache=cache.half()), TypeError, "cos_sin_cache"),
        ("integer cache", args(cache=cache.int()), TypeError, "cos_sin_cache"),
        ("cache not contiguous in its last dim", args(cache=torch.randn(32, 16, device=device).t()), ValueError, "cos_sin_cache"),
        ("position past the cache", args(positions=torch.tensor([0, 3, 16, 2], device=device)), ValueError, "positions"),
        ("negative position", args(positions=torch.tensor([0, -1, 5, 2], device=device, dtype=torch.int32)), ValueError, "positions"),
        ("float positions", args(positions=positions.float()), TypeError, "positions"),
        ("int16 positions", args(positions=positions.short()), TypeError, "positions"),
        # vLLM refuses (B, S) positions with (B*S, ...) rows too ("the same batch_size and seq_len")
        ("(B, S) positions with (B*S, H*D) rows", args(positions=positions.view(2, 2)), ValueError, "query"),
        ("3-D positions", args(positions=positions.view(2, 2, 1)), ValueError, "positions"),
        ("(B, S) positions, key of another (B, S)",
         args(positions=positions.view(2, 2), q=q.view(2, 2, 64), k=k.view(4, 1, 32)), ValueError, "key"),
        ("(B, S) positions, rows of a sliced sequence dim that do not collapse",
         args(positions=positions.view(2, 2), q=torch.randn(2, 3, 64, device=device)[:, :2], k=k.view(2, 2, 32)),
         ValueError, "query"),
        ("positions for another token count", args(positions=positions[:3]), ValueError, "positions"),
        ("key of another dtype", args(k=k.double()), TypeError, "key"),
        ("key for another token count", args(k=torch.randn(5, 32, device=device)), ValueError, "key"),
        ("key that is the query", args(k=q), ValueError, "key"),
        ("zero head_size", args(head_size=0), ValueError, "head_size"),
        ("negative head_size", args(head_size=-32), ValueError, "head_size"),
        ("key on another device", args(k=torch.randn(4, 32, device="meta")), ValueError, "key"),
        ("cache on another device", args(cache=cache.to("meta")), ValueError, "cos_sin_cache"),
        ("positions on another device", args(positions=positions.to("meta")), ValueError, "positions"),
    ]


@pytest.fixture
def check_indices():
    """``check_indices(asked)``: ``configure(check_indices=asked)`` for the rest of the test."""
    previous = []

    def ask(asked):
        saved = dispatch.configure(check_indices=asked)
        if not previous:
            previous.append(saved)
    yield ask
    if previous:
        dispatch.configure(previous[0])


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_embedding_bad_input_names_the_op_and_the_argument(device, check_indices):
    """On CUDA the positions' values are checked only when asked (a sync): asked here."""
    if device == "cuda":
        check_indices(True)
    assert_bad_inputs_raise(OP, _bad_cases(device))


def test_rotary_embedding_bad_input_raises_at_trace_time():
    """The fake function's checks (no data check there) fire while compiling."""
    compiled = torch.compile(lambda p, q, c: torch.ops.deepinfer.rotary_embedding(p, q, None, 32, c, True),
                             backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=rf"deepinfer::{OP}: argument 'cos_sin_cache' must have a rot_dim"):
        compiled(torch.zeros(4, dtype=torch.int64), torch.randn(4, 64), torch.randn(16, 64))


def test_rotary_embedding_check_positions_can_be_switched_off(check_indices):
    """With ``configure(check_indices=False)`` the eager entry does not read positions, on the CPU
    either: the token outside the cache gets NaN in its rotated dims (the reference reads no row outside
    it), the others are exact; ``None`` gives the CPU its check back."""
    args = _args((3, 4, 2, 128, 64, False, "2d"), "cpu", torch.float32)
    bad = (args[0].clone(),) + args[1:]
    bad[0][1] = 37
    with pytest.raises(ValueError, match=rf"^deepinfer::{OP}: argument 'positions' must lie in \[0, 37\)"):
        torch.ops.deepinfer.rotary_embedding.default(*_copy(bad)[0])
    check_indices(False)
    got, _ = _copy(bad)
    torch.ops.deepinfer.rotary_embedding.default(*got)
    _assert_nan_at_bad_tokens(got, bad, [1])
    check_indices(None)
    with pytest.raises(ValueError, match=rf"^deepinfer::{OP}: argument 'positions' must lie in \[0, 37\)"):
        torch.ops.deepinfer.rotary_embedding.default(*_copy(bad)[0])


@pytest.mark.gpu
def test_rotary_embedding_checks_no_positions_on_cuda_by_default(check_indices):
    """On CUDA the default eager call reads no position back (no device sync): the token outside the
    cache gets NaN in its rotated dims on the chosen backend; ``configure(check_indices=True)`` raises."""
    args = _args((3, 4, 2, 128, 64, True, "2d"), "cuda", torch.bfloat16)
    bad = (args[0].clone(),) + args[1:]
    bad[0][1] = 37
    got, _ = _copy(bad)
    torch.ops.deepinfer.rotary_embedding.default(*got)
    _assert_nan_at_bad_tokens(got, bad, [1])
    check_indices(True)
    got, _ = _copy(bad)
    with pytest.raises(ValueError, match=rf"^deepinfer::{OP}: argument 'positions' must lie in \[0, 37\)"):
        torch.ops.deepinfer.rotary_embedding.default(*got)
    assert torch.equal(got[1], bad[1])


def _assert_nan_at_bad_tokens(got, args, bad_tokens):
    """NaN in every rotated dim of the bad tokens (pass-through dims kept), the reference elsewhere."""
    positions, hs, rot_dim = args[0], args[3], args[4].shape[1]
    good = [t for t in range(positions.shape[0]) if t not in bad_tokens]
    for g, x in zip(got[1:3], args[1:3]):
        heads, before = g.unflatten(-1, (-1, hs)), x.unflatten(-1, (-1, hs))
        assert heads[bad_tokens, :, :rot_dim].isnan().all()
        assert torch.equal(heads[bad_tokens, :, rot_dim:], before[bad_tokens, :, rot_dim:])
        want = x[good].clone()
        REFERENCE(positions[good], want, None, *args[3:])
        assert_close(g[good], want)


@pytest.mark.parametrize("route", ["decompose", "opaque"])
def test_rotary_embedding_out_of_cache_positions_under_compile(route):
    """Compiled, no position is checked on the data at trace time. Decomposed, the reference reads no
    row outside the cache (-1 is not the last row, max_position no index error): NaN for those
    tokens, as the kernels give. Opaque, the op's eager check runs: the eager error."""
    torch_kernels.configure(compile_route={OP: route})
    torch._dynamo.reset()
    fn = lambda p, q, k, c: torch.ops.deepinfer.rotary_embedding(p, q, k, 16, c, True)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True)
    args = _args((6, 3, 1, 16, 16, True, "2d"), "cpu", torch.float32, max_position=23)
    positions = args[0].clone()
    positions[1], positions[3], positions[4] = -1, 23, 1 << 40
    bad = (positions,) + args[1:]
    got, _ = _copy(bad)
    if route == "opaque":
        with pytest.raises(ValueError, match=rf"^deepinfer::{OP}: argument 'positions' must lie in \[0, 23\)"):
            compiled(got[0], got[1], got[2], got[4])
        assert torch.equal(got[1], args[1]) and torch.equal(got[2], args[2])
    else:
        compiled(got[0], got[1], got[2], got[4])
        _assert_nan_at_bad_tokens(got, bad, [1, 3, 4])


def test_rotary_embedding_without_key_compiles_fullgraph():
    """``key=None`` (the optional mutated argument) traces and compiles; the shared registration
    tests cover calls with a key."""
    def block(p, q, c):
        q = q * 2
        torch.ops.deepinfer.rotary_embedding(p, q, None, 32, c, False)
        return q + 1
    p, q, _, _, c, _ = _args((5, 3, 0, 32, 16, False, "2d"), "cpu", torch.float32)
    assert_close(torch.compile(block, fullgraph=True)(p, q, c), block(p, q, c))


# --- memory overlap ------------------------------------------------------------------------------

def _overlapping(device):
    """(what, positions, query, key, cache, the argument named, the other or None for an internal overlap)."""
    positions, q, k, hs, cache, _ = _args((4, 2, 1, 32, 32, True, "2d"), device, torch.float32, max_position=16)
    qkv, flat = torch.randn(4, 4 * 32, device=device), torch.zeros(4, 2 * 32, device=device)
    return [
        ("key a view of query", positions, q, q[:, :32], cache, "key", "query"),
        ("key a 3-D view of query", positions, q, q.view(4, 2, 32)[:, 1:], cache, "key", "query"),
        ("overlapping columns of one qkv", positions, qkv[:, :64], qkv[:, 32:64], cache, "key", "query"),
        ("overlapping rows of one buffer", positions, qkv.view(-1)[:256].view(4, 64), qkv.view(-1)[128:256].view(4, 32),
         cache, "key", "query"),
        ("stride-0 query", positions, torch.randn(1, 64, device=device).expand(4, 64), k, cache, "query", None),
        ("stride-0 key", positions, q, torch.randn(32, device=device).expand(4, 32), cache, "key", None),
        ("query rows overlapping each other", positions, qkv.view(-1).as_strided((4, 64), (32, 1)), k, cache, "query", None),
        ("cache a view of query", positions, q, k, q.view(8, 32)[:5], "cos_sin_cache", "query"),
        ("cache a view of key", positions, q, k, k, "cos_sin_cache", "key"),
        ("positions a view of query", flat.view(torch.int32)[0, :4], flat, k, cache, "query", "positions"),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_embedding_refuses_overlapping_memory_before_writing(device):
    call = torch.ops.deepinfer.rotary_embedding.default
    for what, positions, q, k, cache, arg, other in _overlapping(device):
        bases = {}
        for t in (positions, q, k, cache):
            base = t._base if t._base is not None else t
            bases[id(base)] = base
        before = [b.clone() for b in bases.values()]
        said = f"overlaps argument '{other}' in memory$" if other else "has elements that share memory"
        with pytest.raises(ValueError, match=rf"^deepinfer::{OP}: argument '{arg}' {said}"):
            call(positions, q, k, 32, cache, True)
        assert all(torch.equal(b, a) for b, a in zip(before, bases.values())), f"{what}: written"


# each builds (query, key) from one (5, 8*16) buffer: query and key share no element
_APART = {
    "qkv slices": lambda b: (b[:, :64], b[:, 64:96]),
    "key before query in each row": lambda b: (b[:, 32:96], b[:, :32]),
    "3-D head views of qkv slices": lambda b: (b[:, :64].unflatten(1, (4, 16)), b[:, 96:128].unflatten(1, (2, 16))),
    "every other head": lambda b: (b.unflatten(1, (8, 16))[:, 0::2], b.unflatten(1, (8, 16))[:, 1::2]),
    "consecutive in one buffer": lambda b: (b.view(-1)[:5 * 64].view(5, 64), b.view(-1)[5 * 64:5 * 96].view(5, 32)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(_APART))
def test_rotary_embedding_takes_disjoint_views_of_one_buffer(device, layout):
    """Query and key sharing a buffer but no element (vLLM's fused qkv slices, interleaved heads)
    are accepted, with an expanded positions tensor, and every backend writes the reference's values."""
    make, base = _APART[layout], torch.randn(5, 8 * 16, device=device)
    positions = torch.randint(0, 37, (1,), device=device).expand(5)
    cache = rope.make_cos_sin_cache(37, 16, device=device)
    want = base.clone()
    REFERENCE(positions, *make(want), 16, cache, True)
    for name, fn in _backends(device):
        got = base.clone()
        fn(positions, *make(got), 16, cache, True)
        assert_close(got, want, msg=f"{name}: {layout}")


def test_rotary_embedding_overlap_raises_at_trace_time():
    compiled = torch.compile(lambda p, q, c: torch.ops.deepinfer.rotary_embedding(p, q, q[:, 16:32], 16, c, True),
                             backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=rf"deepinfer::{OP}: argument 'key' overlaps argument 'query' in memory"):
        compiled(torch.zeros(4, dtype=torch.int64), torch.randn(4, 64), rope.make_cos_sin_cache(8, 16))


@pytest.mark.gpu
def test_rotary_embedding_tensors_on_cuda_and_cpu_raise_before_any_kernel():
    args = _args(CASES[1], "cuda", torch.float32)
    with pytest.raises(ValueError, match=rf"^deepinfer::{OP}: argument 'cos_sin_cache' is on cpu but 'query' is on cuda"):
        torch.ops.deepinfer.rotary_embedding.default(*args[:4], args[4].cpu(), args[5])
    with pytest.raises(ValueError, match=rf"^deepinfer::{OP}: argument 'positions' is on cpu but 'query' is on cuda"):
        torch.ops.deepinfer.rotary_embedding.default(args[0].cpu(), *args[1:])
    torch.cuda.synchronize()  # the CUDA context is intact


@pytest.mark.gpu
def test_rotary_embedding_cuda_graph_capture_skips_the_data_check_and_replays():
    """The position check reads data back, which a capture forbids: it is skipped while capturing,
    and the captured op matches the reference on replay."""
    args = _args(GPU_CASES[1], "cuda", torch.bfloat16)
    want, _ = _copy(args)
    REFERENCE(*want)
    torch.ops.deepinfer.rotary_embedding.default(*_copy(args)[0])  # compile and select outside the capture
    got, _ = _copy(args)
    start = tuple(t.clone() for t in got[1:3])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.deepinfer.rotary_embedding.default(*got)
    for t, s in zip(got[1:3], start):  # capture does not run it: restore, then replay once
        t.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(got[1], want[1])
    assert_close(got[2], want[2])


@pytest.mark.gpu
def test_rotary_embedding_cuda_default_selection_is_a_kernel():
    from torch_kernels import dispatch
    chain, notice = dispatch.plan(OP)
    assert chain[0].backend is not Backend.TORCH and notice is None


# --- vLLM's batched form: positions (B, S), query and key (B, S, ...) ------------------------------

QK_OP = "qk_rmsnorm_rope"
# (batch, seq_len, q heads, k heads, head_size, rot_dim, is_neox, layout): (B, S, H*hs) rows, strided
# (B, S, ...) slices of a fused qkv tensor, (B, S, H, hs) views, one token, GPT-J and partial rotary
BATCHED_CASES = [(2, 3, 4, 2, 64, 64, True, "2d"), (3, 5, 3, 1, 96, 48, False, "qkv"),
                 (2, 4, 5, 3, 32, 16, True, "3d"), (1, 1, 1, 1, 64, 64, False, "2d"), (4, 2, 2, 0, 64, 64, True, "qkv")]


def _batched_pair(op, case, device, dtype):
    """The flat call's arguments and the batched form of copies of them (views of the copies' tensors)."""
    b, sl, hq, hk, hs, rd, neox, layout = case
    make = rope.make_args if op == OP else rope.make_qk_args
    flat = make(b * sl, hq, hk, hs, rd, neox, layout, device, dtype)
    if flat[2] is None and op == QK_OP:
        flat = flat[:4] + (None,) + flat[5:]
    copy = lambda a: a if not isinstance(a, torch.Tensor) else clone_keep_strides(a)  # noqa: E731
    return flat, rope.batched(tuple(copy(a) for a in flat), b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", [OP, QK_OP])
def test_batched_positions_are_the_flattened_call_bit_for_bit(op, dtype, device):
    """On every backend here: in place on the caller's (B, S, ...) tensors, equal to the (B*S, ...) call."""
    for case in BATCHED_CASES:
        for name, fn in implementations_on(op, device):
            flat, bat = _batched_pair(op, case, device, dtype)
            before = bat[1].clone()
            q_ptr = bat[1].data_ptr()
            assert fn(*flat) is None and fn(*bat) is None
            assert bat[1].data_ptr() == q_ptr and bat[1].shape[:2] == bat[0].shape
            assert not torch.equal(bat[1], before), f"{name}: query not rotated"
            for i, what in ((1, "query"), (2, "key")):
                if flat[i] is not None:
                    assert torch.equal(bat[i].reshape(flat[i].shape), flat[i]), f"{name} {case}: {what}"


@pytest.mark.parametrize("op", [OP, QK_OP])
def test_batched_positions_reach_tilelang_as_token_rows(op, monkeypatch):
    """TileLang's launchers flatten before they pick a kernel: 1-D positions and (B*S, ...) views of
    the caller's tensors (checked without a GPU)."""
    from torch_kernels.families.rope import tilelang as tl_rope

    seen = []
    monkeypatch.setattr(tl_rope, "_qk_function" if op == QK_OP else "_function",
                        lambda *key: (lambda *args: seen.append((key, args))))
    if op == QK_OP:
        monkeypatch.setattr(tl_rope, "_qk_aligned", lambda *a: True)
    flat, bat = _batched_pair(op, (2, 3, 4, 2, 64, 64, True, "qkv"), "cpu", torch.bfloat16)
    getattr(tl_rope, op)(*flat)
    getattr(tl_rope, op)(*bat)
    (key_flat, args_flat), (key_bat, args_bat) = seen
    assert key_flat == key_bat
    p, q, k = args_bat[:3]
    assert p.shape == (6,) and q.shape == flat[1].shape and q.stride() == flat[1].stride()
    assert q.data_ptr() == bat[1].data_ptr() and k.data_ptr() == bat[2].data_ptr()


@pytest.mark.parametrize("unbacked", [False, True], ids=["dynamic", "unbacked"])
@pytest.mark.parametrize("op", [OP, QK_OP])
def test_batched_positions_compile_to_one_node_without_recompiling(op, unbacked):
    """Dynamic (or unbacked: contiguous rows) batch and sequence sizes: one graph, one node of the op,
    for every (B, S)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = getattr(torch.ops.deepinfer, op).default

    def block(*args):
        fn(*args)
        return args[1] + 0, args[2] + 0

    compiled = torch.compile(block, backend=counter, fullgraph=True, dynamic=not unbacked)
    frames = []
    for b, sl in ((2, 3), (3, 5), (4, 7)):
        flat, bat = _batched_pair(op, (b, sl, 4, 2, 64, 64, True, "2d" if unbacked else "qkv"), "cpu", torch.float32)
        want = block(*flat)
        for t in bat[:3] if unbacked else ():
            torch._dynamo.decorators.mark_unbacked(t, 0)
            torch._dynamo.decorators.mark_unbacked(t, 1)
        got = compiled(*bat)
        frames.append(counter.frame_count)
        for g, w in zip(got, want):
            assert torch.equal(g.reshape(w.shape), w)
    assert frames[0] == frames[-1], frames  # (qk_rmsnorm_rope's first call also counts a frame with an empty graph)
    calls = [n for g in counter.graphs for n in g.graph.nodes if n.op == "call_function" and "deepinfer" in str(n.target)]
    assert len(calls) == 1, calls


@pytest.mark.parametrize("op", [OP, QK_OP])
def test_batched_positions_bad_shapes_raise_at_trace_time(op):
    """The fake function flattens as the eager validator does: (B, S) positions with (B*S, ...) rows
    fail while compiling, naming query."""
    flat, _ = _batched_pair(op, (2, 3, 4, 2, 64, 64, True, "2d"), "cpu", torch.float32)
    args = (flat[0].view(2, 3),) + flat[1:]
    fn = getattr(torch.ops.deepinfer, op).default
    compiled = torch.compile(lambda *a: fn(*a), backend="eager", fullgraph=True)
    for call in (fn, compiled):
        with pytest.raises(Exception, match=rf"deepinfer::{op}: argument 'query' must be \(B, S, H \* head_size\)"):
            call(*args)
