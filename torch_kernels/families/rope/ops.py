"""The rotary embedding family: ``rotary_embedding``, and ``qk_rmsnorm_rope`` (per-head RMSNorm of query
and key, then the same rotation).

Semantics and schema of vLLM's ``_custom_ops.rotary_embedding`` (``RotaryEmbedding.forward_native``);
the reference is ``torch_kernels/families/rope/reference.py``.

Positions outside the cache: vLLM does not check them (its CUDA kernel reads out of bounds). Here
no backend reads outside the cache: a token at such a position gets NaN in the rotated dims of each
of its heads (the other tokens are exact). The eager entry also raises for them where reading the
data costs no device sync: positions on the CPU, by default (:func:`positions_checked`).
"""

from typing import Iterator, Optional

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_true

from ... import checks as check
from ...opdef import BenchCase, OpDef, Peer
from ...rotary import make_cos_sin_cache  # noqa: F401  (callers build caches with it)
from .tokens import collapses, flat_tokens

OP = "rotary_embedding"
_POSITION_DTYPES = (torch.int32, torch.int64)


def _validate_full(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int,
                   cos_sin_cache: Tensor, is_neox: bool, OP: str = OP, reads: tuple = ()) -> None:
    """The full checks of ``op`` (default ``rotary_embedding``); ``reads``: more ``(name, tensor)``
    arguments read only, proven apart from query and key."""
    check.tensor(OP, "positions", positions)
    check.tensor(OP, "query", query)
    check.tensor(OP, "cos_sin_cache", cos_sin_cache)
    if positions.dtype not in _POSITION_DTYPES:
        check.fail(OP, "positions", f"must be an int32 or int64 tensor, got {positions.dtype}", TypeError)
    check.require(positions.dim() == 1, OP, "positions",
                  lambda: f"must be 1-D (num_tokens,) or 2-D (batch, seq_len), got shape {tuple(positions.shape)}")
    check.floating(OP, "query", query)
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 1:
        check.fail(OP, "head_size", f"must be a positive int, got {head_size!r}")
    check.heads(OP, "query", query, head_size)
    check.require(positions.shape[0] == query.shape[0], OP, "positions",
                  lambda: f"must have one position per token of 'query' ({query.shape[0]}), got shape {tuple(positions.shape)}")
    check.same_device(OP, "positions", positions, "query", query)
    if key is not None:
        check.tensor(OP, "key", key)
        if key.dtype != query.dtype:
            check.fail(OP, "key", f"must have the dtype of 'query' ({query.dtype}), got {key.dtype}", TypeError)
        check.heads(OP, "key", key, head_size)
        check.require(key.shape[0] == query.shape[0], OP, "key",
                      lambda: f"must have one row per token of 'query' ({query.shape[0]}), got shape {tuple(key.shape)}")
        check.same_device(OP, "key", key, "query", query)
        if key is query:
            check.fail(OP, "key", "must not be the same tensor as 'query' (both are rotated in place)")
    if cos_sin_cache.dtype not in (torch.float32, query.dtype):
        check.fail(OP, "cos_sin_cache", f"must be float32 or the dtype of 'query' ({query.dtype}), got {cos_sin_cache.dtype}", TypeError)
    check.require(cos_sin_cache.dim() == 2, OP, "cos_sin_cache",
                  lambda: f"must be 2-D (max_position, rot_dim), got shape {tuple(cos_sin_cache.shape)}")
    rot_dim = cos_sin_cache.shape[1]
    check.require(rot_dim % 2 == 0, OP, "cos_sin_cache",
                  lambda: f"must have an even rot_dim (its second dimension: cos then sin halves), got {rot_dim}")
    check.require(rot_dim >= 2, OP, "cos_sin_cache", lambda: f"must have a rot_dim (second dimension) of at least 2, got {rot_dim}")
    check.require(rot_dim <= head_size, OP, "cos_sin_cache",
                  lambda: f"must have a rot_dim (second dimension) of at most head_size={head_size}, got {rot_dim}")
    check.last_dim_contiguous(OP, "cos_sin_cache", cos_sin_cache)
    check.same_device(OP, "cos_sin_cache", cos_sin_cache, "query", query)
    check.no_overlap(OP, (("positions", positions, False), ("query", query, True), ("key", key, True),
                          ("cos_sin_cache", cos_sin_cache, False), *((n, t, False) for n, t in reads)))


def positions_checked(positions: Tensor) -> bool:
    """Whether the eager entry checks ``0 <= positions < max_position`` on the data: as
    ``configure(check_indices=)`` (``DEEPINFER_OPS_CHECK_INDICES``) asks, by default for positions on
    the CPU only. On CUDA the check syncs the device, 6 µs of the device's time a call at 32 tokens (and
    never runs inside a CUDA graph capture, which a read back would break); the C++ entry serves no call
    whose positions this would check, and every configure() drops what it published."""
    return check.index_check_runs(positions, positions.device.type == "cpu")


def _check_positions_in_cache(positions: Tensor, max_position: int, num_tokens: int, OP: str = OP) -> None:
    """``0 <= positions < max_position`` on the data, where :func:`positions_checked` asks for it: one
    reduction and one read back (a sync on a GPU)."""
    if num_tokens and positions_checked(positions):
        positions_in_cache(positions, max_position, OP)


def positions_in_cache(positions: Tensor, max_position: int, OP: str = OP) -> None:
    """Raise, naming ``OP``, unless ``0 <= positions < max_position``: one reduction and one read back."""
    lo, hi = torch.stack(torch.aminmax(positions)).tolist()
    if lo < 0 or hi >= max_position:
        check.fail(OP, "positions", f"must lie in [0, {max_position}) (the rows of 'cos_sin_cache'), got values from {lo} to {hi}")


# The eager validator first tests the common valid call in as few tensor attribute reads as it can;
# anything else goes through the full checks, which name the argument at fault. The positions are
# checked on the data in eager calls only (the fake function sees no data). Memory, proven from the
# data pointers for the common layouts: rows at least as far apart as they are wide; key's bytes
# apart from query's, or, with one row stride, its columns between query's (modulo that stride: the
# slices of a fused qkv tensor); positions and cache apart from both.


def _fast_ok(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int, cos_sin_cache: Tensor,
             reads: tuple = ()) -> bool:
    """Whether the common valid call is proven valid (then only the positions' data check remains);
    ``reads``: ``(start, end)`` byte spans of more read-only arguments, proven apart from query and key."""
    try:
        qd, qs, ps, cs, dev = query.dtype, query.shape, positions.shape, cos_sin_cache.shape, query.device
        pd, cd, qst, cst = positions.dtype, cos_sin_cache.dtype, query.stride(), cos_sin_cache.stride()
        if (pd in _POSITION_DTYPES and qd in check.FLOATING and cd in (torch.float32, qd)
                and len(qs) == 2 and len(ps) == 1 and len(cs) == 2 and type(head_size) is int and head_size > 0
                and qs[1] and qs[1] % head_size == 0 and ps[0] == qs[0] and 0 < cs[1] <= head_size and not cs[1] & 1
                and qst[1] == 1 and cst[1] == 1 and positions.device == dev and cos_sin_cache.device == dev):
            t, r, isz = qs[0] - 1, qst[0], qd.itemsize
            if key is None:
                ok = t < 1 or r >= qs[1]
                if ok and t >= 0:
                    q, p, c = query.data_ptr(), positions.data_ptr(), cos_sin_cache.data_ptr()
                    qe = q + t * r * isz + qs[1] * isz
                    pe = p + (t * positions.stride()[0] + 1) * pd.itemsize
                    ce = c + ((cs[0] - 1) * cst[0] + cs[1]) * cd.itemsize
                    ok = not (p < qe and q < pe or c < qe and q < ce)
            else:
                ks, kst = key.shape, key.stride()
                ok = (key.dtype == qd and len(ks) == 2 and ks[0] == qs[0] and ks[1] and ks[1] % head_size == 0
                      and kst[1] == 1 and key.device == dev and key is not query
                      and (t < 1 or r >= qs[1] and kst[0] >= ks[1]))
                if ok and t >= 0:
                    q, k, qw, kw = query.data_ptr(), key.data_ptr(), qs[1] * isz, ks[1] * isz
                    qe, ke = q + t * r * isz + qw, k + t * kst[0] * isz + kw
                    p, c = positions.data_ptr(), cos_sin_cache.data_ptr()
                    pe = p + (t * positions.stride()[0] + 1) * pd.itemsize
                    ce = c + ((cs[0] - 1) * cst[0] + cs[1]) * cd.itemsize
                    # spans apart, or one row stride with key's columns between query's modulo it
                    ok = ((not (q < ke and k < qe) or kst[0] == r and t > 0 and qw <= (k - q) % (r * isz) <= r * isz - kw)
                          and not (p < qe and q < pe or p < ke and k < pe or c < qe and q < ce or c < ke and k < ce))
            if ok and reads and t >= 0:
                q, qe = query.data_ptr(), query.data_ptr() + t * r * isz + qs[1] * isz
                k, ke = (q, qe) if key is None else (key.data_ptr(), key.data_ptr() + t * key.stride(0) * isz + key.shape[1] * isz)
                ok = not any(a < qe and q < b or a < ke and k < b for a, b in reads)
            return ok
    except (AttributeError, IndexError, RuntimeError, TypeError):  # not tensors, 0-d: the full checks say what
        pass
    return False


def _batched(positions, query, key, OP: str = OP) -> tuple:
    """vLLM's batched form, ``positions (B, S)`` with ``query``/``key`` ``(B, S, ...)``, as the ``(B*S, ...)``
    views the backends take (``tokens.py``); any other call as it is. vLLM refuses ``(B, S)`` positions
    with ``(B*S, ...)`` rows, and so does this; batch and sequence dims that do not collapse into one
    token stride (vLLM steps them by the sequence stride alone) are refused here."""
    if not (isinstance(positions, Tensor) and positions.dim() == 2):
        return positions, query, key
    lead = tuple(positions.shape)
    for name, t in (("query", query), ("key", key)):
        if t is None and name == "key":
            continue
        check.tensor(OP, name, t)
        shape = lambda: (f"must be (B, S, H * head_size) or (B, S, H, head_size) with positions (B, S) = "  # noqa: E731
                         f"{lead}, got shape {tuple(t.shape)}")
        check.require(t.dim() in (3, 4), OP, name, shape)
        for size, want in zip(t.shape[:2], lead):  # one SymBool each: unbacked sizes trace
            check.require(size == want, OP, name, shape)
        # undecided on unbacked sizes: the fake lets it pass, the eager entry of the traced call checks it
        check.require(guard_or_true(collapses(t)), OP, name,
                      lambda: f"must have batch and sequence dims that collapse into one token stride with positions "
                              f"(B, S), got strides {t.stride()}")
    return flat_tokens(positions, query, key)


def validate(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int, cos_sin_cache: Tensor,
             is_neox: bool) -> None:
    if _fast_ok(positions, query, key, head_size, cos_sin_cache):
        _check_positions_in_cache(positions, cos_sin_cache.shape[0], positions.shape[0])
        return
    flat = _batched(positions, query, key)
    if flat[0] is not positions and _fast_ok(*flat, head_size, cos_sin_cache):  # the batched form's common call
        _check_positions_in_cache(flat[0], cos_sin_cache.shape[0], flat[0].shape[0])
        return
    positions, query, key = flat
    _validate_full(positions, query, key, head_size, cos_sin_cache, is_neox)
    _check_positions_in_cache(positions, cos_sin_cache.shape[0], positions.numel())


def _fake(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int, cos_sin_cache: Tensor,
          is_neox: bool) -> None:
    positions, query, key = _batched(positions, query, key)
    _validate_full(positions, query, key, head_size, cos_sin_cache, is_neox)


# ----------------------------------------------------------------------------------------------
# Typed wrapper: what IDEs show, and what docs/ops.md is generated from.


def rotary_embedding(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int,
                     cos_sin_cache: Tensor, is_neox: bool) -> None:
    """``x1, x2 = x1 * cos[p] - x2 * sin[p], x2 * cos[p] + x1 * sin[p]`` for every head of ``query`` and ``key``, in place

    Rotary position embedding (RoFormer) with vLLM's semantics (``_custom_ops.rotary_embedding``,
    ``RotaryEmbedding.forward_native``). For token ``t`` at position ``p = positions[t]``, with
    ``r = cos_sin_cache.shape[1]`` (the rotary dim), ``cos = cos_sin_cache[p, :r/2]`` and
    ``sin = cos_sin_cache[p, r/2:]``, each head ``x`` of the token is rotated pair by pair, ``i < r/2``:
    ``(x1, x2) = (x[i], x[i + r/2])`` if ``is_neox`` (GPT-NeoX, Llama), else ``(x[2i], x[2i+1])`` (GPT-J).
    Dims ``r..head_size`` of each head (partial rotary) are neither read nor written. Computed in fp32
    (fp64 for fp64 input) and rounded once.

    Batched form (vLLM's): ``positions (B, S)`` with ``query``/``key`` ``(B, S, H * head_size)`` or
    ``(B, S, H, head_size)``, whose batch and sequence dims collapse into one token stride; bit for bit
    the call on their ``(B*S, ...)`` views, in place. ``(B, S)`` positions with ``(B*S, ...)`` rows are
    refused, as vLLM refuses them.

    Args:
        positions: ``(T,)`` (or ``(B, S)``) int32 or int64, each in ``[0, max_position)``: checked in
            eager calls on the CPU (on every device with ``torch_kernels.configure(check_indices=True)``
            or ``DEEPINFER_OPS_CHECK_INDICES=1``: on CUDA the check syncs the device); where unchecked
            (on CUDA, under ``torch.compile``), a token outside the cache gets NaN in its rotated dims,
            on every backend and route.
        query: ``(T, Hq * head_size)`` or ``(T, Hq, head_size)``, fp16/bf16/fp32/fp64, last dimension
            contiguous (rows and heads may be strided, e.g. slices of a fused qkv tensor). Rotated in place.
        key: ``(T, Hk * head_size)`` or ``(T, Hk, head_size)`` with the dtype of ``query``, or ``None``.
            Rotated in place. ``query`` and ``key`` may be disjoint column slices of one tensor, but
            no element of either may share memory with another element or argument (``ValueError``).
        head_size: dims per head.
        cos_sin_cache: ``(max_position, r)``, float32 or the dtype of ``query``, ``r`` even and at most
            ``head_size``; each row holds ``r/2`` cosines then ``r/2`` sines.
        is_neox: neox (halves) pairing if True, GPT-J (interleaved) pairing if False.

    Not differentiable: requesting a gradient through it raises.
    """
    torch.ops.deepinfer.rotary_embedding.default(positions, query, key, head_size, cos_sin_cache, is_neox)


# ----------------------------------------------------------------------------------------------
# Sample arguments for opcheck, the self-check and the tests: awkward shapes, never zeros.


def make_args(num_tokens: int, num_q_heads: int, num_k_heads: int, head_size: int, rot_dim: int, is_neox: bool,
              layout: str = "2d", device=None, dtype=torch.float32, cache_dtype=torch.float32,
              positions_dtype=torch.int64, max_position: int = 37) -> tuple:
    """Random arguments. ``num_k_heads=0``: no key. ``layout``: ``"2d"`` contiguous ``(T, H*head_size)``;
    ``"qkv"`` query and key as column slices of one fused ``(T, (Hq + 2*Hk)*head_size)`` tensor
    (strided rows, as vLLM passes them); ``"3d"`` the same as ``(T, H, head_size)`` views."""
    positions = torch.randint(0, max_position, (num_tokens,), device=device, dtype=positions_dtype)
    cache = make_cos_sin_cache(max_position, rot_dim, device=device, dtype=cache_dtype)
    if layout == "2d":
        query = torch.randn(num_tokens, num_q_heads * head_size, device=device, dtype=dtype)
        key = torch.randn(num_tokens, num_k_heads * head_size, device=device, dtype=dtype) if num_k_heads else None
    else:
        qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_k_heads) * head_size, device=device, dtype=dtype)
        query, key = qkv[:, :num_q_heads * head_size], qkv[:, num_q_heads * head_size:(num_q_heads + num_k_heads) * head_size]
        if layout == "3d":
            query, key = query.unflatten(1, (num_q_heads, head_size)), key.unflatten(1, (num_k_heads, head_size))
        if not num_k_heads:
            key = None
    return positions, query, key, head_size, cache, is_neox


#: (tokens, q heads, k heads, head_size, rot_dim, is_neox, layout, positions dtype, cache in the q/k
#: dtype): one token, GPT-J, partial rotary with a non-power-of-two half, zero tokens, strided rows of
#: a fused qkv tensor, 3-D head views. No sample without key: the shared harness compares every
#: mutated argument, and a ``None`` one has nothing to compare (tests/test_rope.py covers it).
SAMPLE_CASES = (
    (1, 1, 1, 64, 64, True, "2d", torch.int64, False),
    (3, 4, 2, 128, 128, False, "2d", torch.int32, True),
    (5, 3, 1, 96, 48, True, "qkv", torch.int64, False),
    (4, 2, 1, 80, 80, False, "2d", torch.int64, True),
    (0, 4, 2, 64, 32, True, "2d", torch.int64, False),
    (6, 5, 3, 32, 16, False, "3d", torch.int32, False),
    (2, 3, 1, 40, 24, False, "qkv", torch.int64, False),
)


def batched(args: tuple, batch: int) -> tuple:
    """vLLM's batched form of ``args`` (from :func:`make_args` or :func:`make_qk_args`, ``batch`` dividing
    its token count): positions ``(B, S)``, query and key ``(B, S, ...)`` views of the same tensors."""
    positions, query, key = args[0], args[1], args[2]
    s = positions.shape[0] // batch
    return (positions.view(batch, s), query.view(batch, s, *query.shape[1:]),
            None if key is None else key.view(batch, s, *key.shape[1:]), *args[3:])


#: the batched form: (batch, seq_len, then SAMPLE_CASES' fields): strided (B, S, ...) slices of a fused
#: qkv tensor, as vLLM passes them; one only, since each sample may cost a recompile where the tests
#: compile them all (at most 8); tests/test_rope.py covers the other layouts
BATCHED_SAMPLE_CASES = ((3, 2, 3, 1, 96, 48, False, "qkv", torch.int32, False),)


def _samples(device, dtype) -> Iterator[tuple]:
    for t, hq, hk, hs, rd, neox, layout, pdt, cache_in_dtype in SAMPLE_CASES:
        yield make_args(t, hq, hk, hs, rd, neox, layout, device, dtype, dtype if cache_in_dtype else torch.float32, pdt)
    for b, sl, hq, hk, hs, rd, neox, layout, pdt, cache_in_dtype in BATCHED_SAMPLE_CASES:
        yield batched(make_args(b * sl, hq, hk, hs, rd, neox, layout, device, dtype,
                                dtype if cache_in_dtype else torch.float32, pdt), max(b, 1))


def _tokens(n: int, device) -> tuple:
    return make_args(n, 4, 2, 16, 16, True, "2d", device, max_position=32), (0, 1, 2)


# ----------------------------------------------------------------------------------------------
# Benchmark case: tokens x (query + key heads) x head size, neox, full rotary, an fp32 cache.

#: per profile: (query heads, key heads, head size, cached positions); gpu: Llama-3-8B's attention
BENCH_SIZES = {"gpu": (32, 8, 128, 8192), "cpu": (4, 2, 64, 256)}


def _bench_shape(tokens: int, hidden: Optional[int], profile: str):
    hq, hk, hs, _ = BENCH_SIZES[profile]
    return tokens, None, f"{tokens}x({hq}+{hk})x{hs}"


def _bench_args(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    hq, hk, hs, max_pos = BENCH_SIZES[profile]
    return make_args(rows, hq, hk, hs, hs, True, "2d", device, dtype, torch.float32, torch.int64, max_pos)


def _bench_nbytes(args: tuple) -> int:
    positions, q, k, head_size, cache, _ = args
    rot = cache.shape[1]
    size = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
    # query and key read and written (their rotated dims), the positions, one cache row a token
    return (2 * (size(q) + size(k)) * rot // head_size + size(positions)
            + positions.numel() * rot * cache.element_size())


def _flashinfer(args: tuple):
    try:
        import flashinfer.rope
    except Exception as e:  # noqa: BLE001  (reported in the results)
        return f"FlashInfer not importable: {type(e).__name__}: {e}"[:200]
    return Peer("flashinfer.rope.apply_rope_with_cos_sin_cache_inplace",
                lambda p, q, k, hs, cache, neox: flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
                    p, q, k, hs, cache, is_neox=neox))


# ----------------------------------------------------------------------------------------------
# qk_rmsnorm_rope: per-head RMSNorm of query and key (rounded to their dtype), then rotary_embedding.

QK_OP = "qk_rmsnorm_rope"


def _validate_weight(arg: str, w, head_size: int, query: Tensor) -> None:
    check.tensor(QK_OP, arg, w)
    check.floating(QK_OP, arg, w)
    check.require(w.dim() == 1 and w.shape[0] == head_size, QK_OP, arg,
                  lambda: f"must have shape ({head_size},) (head_size), got {tuple(w.shape)}")
    check.last_dim_contiguous(QK_OP, arg, w)
    check.same_device(QK_OP, arg, w, "query", query)


def _qk_validate_full(positions: Tensor, query: Tensor, key: Optional[Tensor], q_weight: Tensor,
                      k_weight: Optional[Tensor], eps: float, head_size: int, cos_sin_cache: Tensor,
                      is_neox: bool) -> None:
    check.tensor(QK_OP, "query", query)
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 1:
        check.fail(QK_OP, "head_size", f"must be a positive int, got {head_size!r}")
    _validate_weight("q_weight", q_weight, head_size, query)
    if key is None and k_weight is not None:
        check.fail(QK_OP, "k_weight", "must be None when 'key' is None")
    if key is not None:
        if k_weight is None:
            check.fail(QK_OP, "k_weight", "must be given with 'key' (None only without key)")
        _validate_weight("k_weight", k_weight, head_size, query)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0.0:
        check.fail(QK_OP, "eps", f"must be a non-negative float, got {eps!r}")
    _validate_full(positions, query, key, head_size, cos_sin_cache, is_neox, QK_OP,
                   (("q_weight", q_weight), ("k_weight", k_weight)))


def _span(w: Tensor) -> tuple:
    return w.data_ptr(), w.data_ptr() + w.shape[0] * w.itemsize


def qk_validate(positions: Tensor, query: Tensor, key: Optional[Tensor], q_weight: Tensor,
                k_weight: Optional[Tensor], eps: float, head_size: int, cos_sin_cache: Tensor, is_neox: bool) -> None:
    # The common valid call: rotary_embedding's proof, the weights' bytes apart from query's and key's.
    try:
        fl, dev = check.FLOATING, query.device
        if (q_weight.dtype in fl and q_weight.dim() == 1 and q_weight.shape[0] == head_size
                and q_weight.stride(0) == 1 and q_weight.device == dev and type(eps) is float and eps >= 0.0
                and (key is None and k_weight is None
                     or key is not None and k_weight.dtype in fl and k_weight.dim() == 1
                     and k_weight.shape[0] == head_size and k_weight.stride(0) == 1 and k_weight.device == dev)):
            reads = (_span(q_weight),) + (() if k_weight is None else (_span(k_weight),))
            if _fast_ok(positions, query, key, head_size, cos_sin_cache, reads):
                _check_positions_in_cache(positions, cos_sin_cache.shape[0], positions.shape[0], QK_OP)
                return
    except (AttributeError, IndexError, RuntimeError, TypeError):  # not tensors, 0-d: the full checks say what
        pass
    positions, query, key = _batched(positions, query, key, QK_OP)
    _qk_validate_full(positions, query, key, q_weight, k_weight, eps, head_size, cos_sin_cache, is_neox)
    _check_positions_in_cache(positions, cos_sin_cache.shape[0], positions.numel(), QK_OP)


def _qk_fake(positions: Tensor, query: Tensor, key: Optional[Tensor], q_weight: Tensor, k_weight: Optional[Tensor],
             eps: float, head_size: int, cos_sin_cache: Tensor, is_neox: bool) -> None:
    positions, query, key = _batched(positions, query, key, QK_OP)
    _qk_validate_full(positions, query, key, q_weight, k_weight, eps, head_size, cos_sin_cache, is_neox)


def qk_rmsnorm_rope(positions: Tensor, query: Tensor, key: Optional[Tensor], q_weight: Tensor,
                    k_weight: Optional[Tensor], eps: float, head_size: int, cos_sin_cache: Tensor,
                    is_neox: bool) -> None:
    """``x = rope(round(x * rsqrt(mean(x^2) + eps) * w))`` for every head ``x`` of ``query`` (``w = q_weight``) and of ``key`` (``w = k_weight``), in place

    The QK-norm of Qwen3, Gemma 3 and OLMo 2 fused with the rotary embedding (vLLM's
    ``fused_qk_norm_rope``): each head of ``head_size`` dims is RMS-normalised over its dims in fp32
    (fp64 for fp64 input), scaled by the weight and rounded to the input's dtype, exactly as
    ``rmsnorm`` on ``(T*H, head_size)`` rows gives; then ``rotary_embedding`` rotates its first
    ``r = cos_sin_cache.shape[1]`` dims (``x1, x2 = x1 * cos[p] - x2 * sin[p], x2 * cos[p] + x1 * sin[p]``
    with ``p = positions[t]``, neox or GPT-J pairs) in fp32 and rounds once; dims ``r..head_size``
    (partial rotary) keep the normalised value. Each backend gives, bit for bit, its own ``rmsnorm``
    then its own ``rotary_embedding`` (:func:`unfused`).

    Takes ``rotary_embedding``'s batched form too: ``positions (B, S)``, ``query``/``key`` ``(B, S, ...)``.

    Args:
        positions: ``(T,)`` (or ``(B, S)``) int32 or int64 in ``[0, max_position)``, checked as
            ``rotary_embedding`` checks them (``configure(check_indices=)``).
        query: ``(T, Hq * head_size)`` or ``(T, Hq, head_size)``, fp16/bf16/fp32/fp64, last dimension
            contiguous (rows and heads may be strided: slices of a fused qkv tensor). Normalised and
            rotated in place.
        key: ``(T, Hk * head_size)`` or ``(T, Hk, head_size)`` with the dtype of ``query``, or ``None``;
            in place. ``query`` and ``key`` may be disjoint column slices of one tensor; no element may
            share memory with another element or argument (``ValueError``).
        q_weight: ``(head_size,)``, any float dtype, contiguous: the norm's weight of the query heads.
        k_weight: ``(head_size,)`` likewise for the key heads; ``None`` exactly when ``key`` is ``None``.
        eps: added to the mean of squares, non-negative (Qwen3: 1e-6).
        head_size: dims per head.
        cos_sin_cache: ``(max_position, r)``, float32 or the dtype of ``query``, ``r`` even and at most
            ``head_size``; each row holds ``r/2`` cosines then ``r/2`` sines.
        is_neox: neox (halves) pairing if True, GPT-J (interleaved) pairing if False.

    Not differentiable: requesting a gradient through it raises.
    """
    torch.ops.deepinfer.qk_rmsnorm_rope.default(positions, query, key, q_weight, k_weight, eps, head_size,
                                                cos_sin_cache, is_neox)


def unfused(positions: Tensor, query: Tensor, key: Optional[Tensor], q_weight: Tensor, k_weight: Optional[Tensor],
            eps: float, head_size: int, cos_sin_cache: Tensor, is_neox: bool, rmsnorm=None, rotary=None) -> None:
    """The pair :func:`qk_rmsnorm_rope` equals: ``rmsnorm`` over each tensor's ``(T, H, head_size)`` heads,
    written back, then ``rotary_embedding``; ``rmsnorm``/``rotary`` default to the registered ops (a test
    passes one backend's)."""
    rmsnorm = rmsnorm or torch.ops.deepinfer.rmsnorm.default
    rotary = rotary or torch.ops.deepinfer.rotary_embedding.default
    for x, w in ((query, q_weight), (key, k_weight)):
        if x is not None:
            heads = x if x.dim() == 3 else x.view(x.shape[0], x.shape[1] // head_size, head_size)
            heads.copy_(rmsnorm(heads, w, eps))
    rotary(positions, query, key, head_size, cos_sin_cache, is_neox)


def make_qk_args(num_tokens: int, num_q_heads: int, num_k_heads: int, head_size: int, rot_dim: int, is_neox: bool,
                 layout: str = "2d", device=None, dtype=torch.float32, weight_dtype=None, cache_dtype=torch.float32,
                 positions_dtype=torch.int64, max_position: int = 37, eps: float = 1e-6) -> tuple:
    """:func:`make_args` with the weights (``weight_dtype`` default the dtype; around 1, as trained QK-norm
    weights are) and ``eps``: ``(positions, query, key, q_weight, k_weight, eps, head_size, cache, is_neox)``."""
    positions, query, key, _, cache, _ = make_args(num_tokens, num_q_heads, num_k_heads, head_size, rot_dim, is_neox,
                                                   layout, device, dtype, cache_dtype, positions_dtype, max_position)
    wd = weight_dtype or dtype
    q_weight = (1 + 0.3 * torch.randn(head_size, device=device)).to(wd)
    k_weight = (1 + 0.3 * torch.randn(head_size, device=device)).to(wd) if key is not None else None
    return positions, query, key, q_weight, k_weight, eps, head_size, cache, is_neox


#: (tokens, q heads, k heads, head_size, rot_dim, is_neox, layout, fp32 weights, positions dtype): one
#: token, zero tokens, head sizes 64/128/256, partial rotary, GPT-J, odd head counts, fused qkv slices
#: and 3-D head views, a head size that is no power of two, weights of another dtype than q/k.
QK_SAMPLE_CASES = (
    (1, 1, 1, 64, 64, True, "2d", False, torch.int64),
    (3, 4, 2, 128, 128, False, "2d", True, torch.int32),
    (5, 3, 1, 128, 64, True, "qkv", False, torch.int64),
    (0, 4, 2, 64, 32, True, "2d", False, torch.int64),
    (2, 5, 3, 256, 256, True, "qkv", True, torch.int64),
    (3, 7, 1, 256, 128, False, "3d", False, torch.int32),
    (2, 3, 1, 80, 40, False, "qkv", False, torch.int64),
)


def _qk_samples(device, dtype) -> Iterator[tuple]:
    for t, hq, hk, hs, rd, neox, layout, fp32_weight, pdt in QK_SAMPLE_CASES:
        yield make_qk_args(t, hq, hk, hs, rd, neox, layout, device, dtype, torch.float32 if fp32_weight else dtype,
                           positions_dtype=pdt)
    for b, sl, hq, hk, hs, rd, neox, layout, pdt, _ in BATCHED_SAMPLE_CASES:
        yield batched(make_qk_args(b * sl, hq, hk, hs, rd, neox, layout, device, dtype, positions_dtype=pdt), max(b, 1))


def _qk_tokens(n: int, device) -> tuple:
    return make_qk_args(n, 4, 2, 16, 16, True, "2d", device, max_position=32), (0, 1, 2)


def _qk_bench_args(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    hq, hk, hs, max_pos = BENCH_SIZES[profile]
    return make_qk_args(rows, hq, hk, hs, hs, True, "qkv", device, dtype, max_position=max_pos)


def _qk_bench_nbytes(args: tuple) -> int:
    positions, q, k, qw, kw, _, head_size, cache, _ = args
    size = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
    # query and key read and written whole (the norm reads every dim), the weights, the positions, a cache row a token
    return (2 * (size(q) + size(k)) + size(qw) + size(kw) + size(positions)
            + positions.numel() * cache.shape[1] * cache.element_size())


#: the peer: our unfused pair as the default selection serves it (rmsnorm, written back, then rotary_embedding)
UNFUSED_PEER = Peer("unfused", unfused)


OPS = (
    OpDef("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, "
          "Tensor cos_sin_cache, bool is_neox) -> ()",
          validate, _fake, rotary_embedding, _samples, _tokens, data_arg=1,
          no_grad_reason="it rotates query and key in place; differentiate through the torch reference "
                         "(reference.py) on copies instead",
          bench=BenchCase(_bench_shape, _bench_args, _bench_nbytes, memory_bound=True, flashinfer=_flashinfer)),
    OpDef("qk_rmsnorm_rope(Tensor positions, Tensor(a!) query, Tensor(b!)? key, Tensor q_weight, Tensor? k_weight, "
          "float eps, int head_size, Tensor cos_sin_cache, bool is_neox) -> ()",
          qk_validate, _qk_fake, qk_rmsnorm_rope, _qk_samples, _qk_tokens, data_arg=1,
          no_grad_reason="it normalises and rotates query and key in place; differentiate through the torch "
                         "reference (reference.py) on copies instead",
          bench=BenchCase(_bench_shape, _qk_bench_args, _qk_bench_nbytes, memory_bound=True,
                          flashinfer=lambda args: "FlashInfer 0.7.4 has no fused QK-norm with RoPE",
                          peers=(UNFUSED_PEER,))),
)
