"""The paged KV-cache family: ``reshape_and_cache_flash``, ``rotary_embedding_and_cache``.

Semantics and schema of vLLM's ``_custom_ops.reshape_and_cache_flash`` (``csrc/cache_kernels.cu``);
the reference is ``torch_kernels/families/kv_cache/reference.py``.

Slots: vLLM skips a negative slot (padding) and writes any other wherever it points. Here a slot
outside ``[0, num_blocks * block_size)`` is skipped too, on every backend, so that no call writes
outside the cache; a slot named by several tokens ends with, element by element, the value of one of
them (which one is unspecified, as in vLLM). Checking the slots on the data needs a read back to the
host, a device sync on CUDA, so it is off by default: :data:`CHECK_SLOTS` (or
``DEEPINFER_CHECK_KV_SLOTS=1`` in the environment) turns it on for eager calls outside a CUDA graph
capture, and a slot below -1, past the cache or repeated then raises ``ValueError``.
"""

import os
from typing import Iterator, Optional

import torch
from torch import Tensor

from ... import checks as check
from ... import fp8 as _fp8
from ... import rotary
from ...opdef import BenchCase, OpDef, Peer
from ...rotary import make_cos_sin_cache  # noqa: F401  (callers build caches with it)

OP = "reshape_and_cache_flash"
#: ``kv_cache_dtype`` values: the cache in the key's dtype, or float8_e4m3fn with per-tensor scales
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Check the slots on the data in eager calls (see the module docstring): one reduction and a read back
#: per call, a device sync on CUDA. Default from ``DEEPINFER_CHECK_KV_SLOTS=1``; ``configure(check_indices=)``
#: (``DEEPINFER_OPS_CHECK_INDICES``), where set, decides instead.
CHECK_SLOTS = os.environ.get("DEEPINFER_CHECK_KV_SLOTS", "").strip() == "1"


def _is_data(t: Tensor) -> bool:
    """A tensor with data to read: not fake, meta or functional (traced)."""
    return type(t) is Tensor and t.device.type != "meta"


def indices_checked(t: Tensor) -> bool:
    """Whether the eager data checks run for a call with index tensor ``t``: asked for (the selection's
    ``check_indices``, else :data:`CHECK_SLOTS`), data (not traced) and not inside a CUDA graph capture
    (a read back would break it)."""
    return _is_data(t) and check.index_check_runs(t, CHECK_SLOTS)


def check_slots(op: str, slot_mapping: Tensor, num_slots: int) -> None:
    """With :data:`CHECK_SLOTS`: every slot in ``[-1, num_slots)`` and no slot >= 0 twice, on the data."""
    if slot_mapping.numel() == 0 or not indices_checked(slot_mapping):
        return
    s = slot_mapping
    used = torch.where(s >= 0, s, torch.arange(-2, -2 - s.shape[0], -1, device=s.device))  # -1s made distinct
    repeats = s.shape[0] - torch.unique(used).shape[0]
    lo, hi = torch.stack(torch.aminmax(s)).tolist()
    if lo < -1 or hi >= num_slots:
        check.fail(op, "slot_mapping", f"must lie in [-1, {num_slots}) (-1: skip; the cache has {num_slots} slots), "
                                        f"got values from {lo} to {hi}")
    if repeats:
        check.fail(op, "slot_mapping", f"names {repeats} slot(s) more than once (each token needs its own slot)")


def _scale(op: str, arg: str, scale, key: Tensor) -> None:
    check.tensor(op, arg, scale)
    if scale.dtype != torch.float32:
        check.fail(op, arg, f"must be a float32 tensor, got {scale.dtype}", TypeError)
    if scale.dim() > 1 or scale.numel() != 1:
        check.fail(op, arg, f"must have shape () or (1,) (one scale for the tensor), got {tuple(scale.shape)}")
    check.same_device(op, arg, scale, "key", key)


def validate_cache(op: str, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                   kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor, key_arg: str = "key") -> None:
    """The cache arguments against ``key``/``value``, validated ``(T, H, D)`` tensors (``key_arg``: how
    the op calls the key; ``value`` has key's shape and dtype)."""
    tokens, heads, head_size = key.shape
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        check.fail(op, "kv_cache_dtype", f"must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {kv_cache_dtype!r}")
    quant = kv_cache_dtype != "auto"
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check.tensor(op, name, cache)
        if cache.dtype not in ((_fp8.FP8, torch.uint8) if quant else (key.dtype,)):
            what = f"float8_e4m3fn (or uint8 holding its bits) with kv_cache_dtype={kv_cache_dtype!r}" if quant else \
                f"the dtype of '{key_arg}' ({key.dtype}) with kv_cache_dtype='auto'"
            check.fail(op, name, f"must be {what}, got {cache.dtype}", TypeError)
        check.require(cache.dim() == 4, op, name,
                      lambda cache=cache: f"must be 4-D (num_blocks, block_size, num_kv_heads, head_size), got shape {tuple(cache.shape)}")
        check.require(cache.shape[2] == heads, op, name,
                      lambda cache=cache: f"must have {heads} kv heads (dimension 2) as '{key_arg}' has, got shape {tuple(cache.shape)}")
        check.require(cache.shape[3] == head_size, op, name,
                      lambda cache=cache: f"must have a head size (dimension 3) of {head_size} as '{key_arg}' has, got shape {tuple(cache.shape)}")
        check.last_dim_contiguous(op, name, cache)
        check.same_device(op, name, cache, key_arg, key)
    check.same_shape(op, "value_cache", value_cache, "key_cache", key_cache)
    if value_cache.dtype != key_cache.dtype:
        check.fail(op, "value_cache", f"must have the dtype of 'key_cache' ({key_cache.dtype}), got {value_cache.dtype}", TypeError)
    check.tensor(op, "slot_mapping", slot_mapping)
    if slot_mapping.dtype != torch.int64:
        check.fail(op, "slot_mapping", f"must be an int64 tensor, got {slot_mapping.dtype}", TypeError)
    check.require(slot_mapping.dim() == 1, op, "slot_mapping", lambda: f"must be 1-D (num_tokens,), got shape {tuple(slot_mapping.shape)}")
    check.require(slot_mapping.shape[0] == tokens, op, "slot_mapping",
                  lambda: f"must have one slot per token of '{key_arg}' ({tokens}), got shape {tuple(slot_mapping.shape)}")
    check.same_device(op, "slot_mapping", slot_mapping, key_arg, key)
    _scale(op, "k_scale", k_scale, key)
    _scale(op, "v_scale", v_scale, key)


def validate_rows(op: str, arg: str, x: Tensor) -> None:
    check.tensor(op, arg, x)
    if x.dtype not in DTYPES:
        check.fail(op, arg, f"must be float16, bfloat16, float32 or float64, got {x.dtype}", TypeError)
    check.require(x.dim() == 3, op, arg, lambda: f"must be 3-D (num_tokens, num_kv_heads, head_size), got shape {tuple(x.shape)}")
    check.last_dim_contiguous(op, arg, x)


def _validate_full(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                   kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor) -> None:
    validate_rows(OP, "key", key)
    check.tensor(OP, "value", value)
    if value.dtype != key.dtype:
        check.fail(OP, "value", f"must have the dtype of 'key' ({key.dtype}), got {value.dtype}", TypeError)
    check.same_shape(OP, "value", value, "key", key)
    check.last_dim_contiguous(OP, "value", value)
    check.same_device(OP, "value", value, "key", key)
    validate_cache(OP, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    check.no_overlap(OP, (("key", key, False), ("value", value, False), ("key_cache", key_cache, True),
                          ("value_cache", value_cache, True), ("slot_mapping", slot_mapping, False),
                          ("k_scale", k_scale, False), ("v_scale", v_scale, False)))


# The eager validators first test the common valid call in attribute reads (the full checks cost 41 µs
# a call on the CPU machine, 37 of them the exact overlap test); anything else goes through the full
# checks, which name the argument at fault. Memory, proven from data pointers for the common layouts:
# every tensor's byte span apart from the written ones', or, for two tensors of one row stride (the
# caches kv[:, 0] and kv[:, 1], the q and k slices of a qkv buffer), rows that sit apart modulo it.


def _span(t: Tensor):
    """``(first byte, end, row stride, row bytes)`` of a non-empty tensor (the row: all dims but the
    first, as one extent), or ``None`` when empty."""
    shape, stride, isz, p = t.shape, t.stride(), t.element_size(), t.data_ptr()
    if not shape:
        return p, p + isz, 0, isz
    inner = 1
    for i in range(1, len(shape)):
        n = shape[i]
        if not n:
            return None
        inner += (n - 1) * stride[i]
    n = shape[0]
    if not n:
        return None
    return p, p + ((n - 1) * stride[0] + inner) * isz, (stride[0] if n > 1 else 0) * isz, inner * isz


def _apart(a, b) -> bool:
    """Two spans share no byte: disjoint, or rows of one stride apart modulo it."""
    if a is None or b is None or a[1] <= b[0] or b[1] <= a[0]:
        return True
    stride = a[2] or b[2]
    if not stride or (a[2] and b[2] and a[2] != b[2]):
        return False
    return a[3] <= (b[0] - a[0]) % stride <= stride - b[3]


def _rows_apart(t: Tensor) -> bool:
    """A written 4-D cache has no two elements at one address: its strides, largest first, each at
    least the extent of the dims inside it (any order of the first three: NHD or HND views)."""
    shape, stride = t.shape, t.stride()
    dims = sorted((stride[i], shape[i]) for i in range(len(shape)) if shape[i] > 1)
    extent = 1
    for st, n in dims:
        if st < extent:
            return False
        extent += (n - 1) * st
    return True


def _storage_span(t: Tensor):
    """The byte range of ``t``'s storage, which holds every element of ``t``."""
    s = t.untyped_storage()
    p = s.data_ptr()
    return p, p + s.nbytes()


def _written_apart(written, read) -> bool:
    """No written tensor shares a byte with itself or another argument. Only pairs whose storages share
    bytes are compared element-wise (the caches kv[:, 0] and kv[:, 1], q and k of one qkv buffer): a
    storage range is 3 attribute reads against a span's ~12, and the decode call's validation took 9.3
    against 14.2 µs (reshape_and_cache_flash) and 15.0 against 20.4 (rotary_embedding_and_cache) on a
    2-core x86 host."""
    reads = [(t, _storage_span(t)) for t in read]
    writes = [(t, _storage_span(t)) for t in written]
    for i, (w, ws) in enumerate(writes):
        if not (w.is_contiguous() or _rows_apart(w)):
            return False
        span = None
        for r, rs in reads + writes[i + 1:]:
            if rs[1] <= ws[0] or ws[1] <= rs[0]:
                continue
            span = span or _span(w)
            if not _apart(span, _span(r)):
                return False
    return True


def _cache_ok(rows: tuple, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor, kv_cache_dtype: str,
              k_scale: Tensor, v_scale: Tensor, dtype, device) -> bool:
    """The cache arguments of a common valid call, against the ``(T, H, D)`` shape ``rows``."""
    cd, cs = key_cache.dtype, key_cache.shape
    if kv_cache_dtype == "auto":
        dtype_ok = cd == dtype
    else:
        dtype_ok = kv_cache_dtype in KV_CACHE_DTYPES and (cd == _fp8.FP8 or cd == torch.uint8)
    return (dtype_ok and value_cache.dtype == cd and len(cs) == 4 and cs[2] == rows[1] and cs[3] == rows[2]
            and value_cache.shape == cs and key_cache.stride(3) == 1 and value_cache.stride(3) == 1
            and slot_mapping.dtype == torch.int64 and slot_mapping.shape == rows[:1]
            and k_scale.dtype == torch.float32 and v_scale.dtype == torch.float32
            and k_scale.numel() == 1 and v_scale.numel() == 1 and k_scale.dim() <= 1 and v_scale.dim() <= 1
            and key_cache.device == device and value_cache.device == device and slot_mapping.device == device
            and k_scale.device == device and v_scale.device == device)


def _fast_ok(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
             kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor) -> bool:
    kd, ks = key.dtype, key.shape
    return (kd in DTYPES and value.dtype == kd and len(ks) == 3 and value.shape == ks and key.stride(2) == 1
            and value.stride(2) == 1 and value.device == key.device
            and _cache_ok(ks, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, kd, key.device)
            and _written_apart((key_cache, value_cache), (key, value, slot_mapping, k_scale, v_scale)))


def validate(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
             kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor) -> None:
    try:
        ok = _fast_ok(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    except (AttributeError, IndexError, RuntimeError, TypeError):  # not tensors: the full checks say what
        ok = False
    if not ok:
        _validate_full(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    check_slots(OP, slot_mapping, key_cache.shape[0] * key_cache.shape[1])


def _fake(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
          kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor) -> None:
    _validate_full(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


# ----------------------------------------------------------------------------------------------
# Typed wrapper: what IDEs show, and what docs/ops.md is generated from.


def reshape_and_cache_flash(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                            kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor) -> None:
    """``key_cache[s // B, s % B] = q(key[t], k_scale)``, ``value_cache[s // B, s % B] = q(value[t], v_scale)`` for ``s = slot_mapping[t]`` in the cache, in place

    The paged KV-cache write of vLLM's ``reshape_and_cache_flash`` (FlashAttention's layout). For
    each token ``t`` whose slot ``s = slot_mapping[t]`` lies in ``[0, num_blocks * B)`` (``B`` the
    block size), every head of ``key[t]`` and ``value[t]`` is stored at block ``s // B``, offset
    ``s % B``. ``q`` is the identity with ``kv_cache_dtype="auto"``; with ``"fp8"``/``"fp8_e4m3"``
    it is ``fp8(clamp(fp32(x) / scale, -448, 448))`` (vLLM's division, not a product by the
    reciprocal; saturating like its ``__NV_SATFINITE`` cast, NaN kept, rounded to nearest even).
    Cache entries that no token's slot names are left as they are.

    Args:
        key: ``(T, H, D)``, fp16/bf16/fp32/fp64, last dimension contiguous (token and head strides
            free: a slice of a fused qkv tensor viewed as heads).
        value: the shape and dtype of ``key``, any such strides.
        key_cache: ``(num_blocks, B, H, D)``, in ``key``'s dtype (``"auto"``) or float8_e4m3fn (``"fp8"``; or
            uint8 holding its bits, as vLLM allocates it),
            last dimension contiguous (block, slot and head strides free, e.g. ``kv[:, 0]`` of a
            ``(num_blocks, 2, B, H, D)`` buffer, or a view of an HND one). Written in place.
        value_cache: the shape and dtype of ``key_cache``. Written in place.
        slot_mapping: ``(T,)`` int64. -1 (padding) skips the token; so does any slot outside the cache
            (no write, on every backend). A slot named by several tokens gets, element by element,
            one of their values. ``torch_kernels.configure(check_indices=True)``
            (``DEEPINFER_OPS_CHECK_INDICES=1``, or ``DEEPINFER_CHECK_KV_SLOTS=1``) makes eager calls check the
            slots on the data and raise for one below -1, past the cache or repeated (a device sync on
            CUDA; skipped in a CUDA graph capture).
        kv_cache_dtype: ``"auto"``, ``"fp8"`` or ``"fp8_e4m3"``.
        k_scale, v_scale: float32 tensors of shape ``()`` or ``(1,)``, the per-tensor scales (read on
            the device; unused with ``"auto"``).

    Not differentiable.
    """
    torch.ops.deepinfer.reshape_and_cache_flash.default(key, value, key_cache, value_cache, slot_mapping,
                                                         kv_cache_dtype, k_scale, v_scale)


# ----------------------------------------------------------------------------------------------
# Sample arguments: awkward shapes, random caches (never zeros), padded and strided.


def _fp8_random(shape, device) -> Tensor:
    """Random finite float8_e4m3fn values (bits 0..125 and their negatives: NaN is 0x7F/0xFF)."""
    bits = torch.randint(0, 126, shape, dtype=torch.uint8, device=device)
    bits |= torch.randint(0, 2, shape, dtype=torch.uint8, device=device) << 7
    return bits.view(_fp8.FP8)


def make_caches(num_blocks: int, block_size: int, heads: int, head_size: int, dtype, device, layout: str = "nhd"):
    """Random ``(key_cache, value_cache)``. ``layout``: ``"nhd"`` two contiguous caches; ``"kv"``
    ``kv[:, 0]`` and ``kv[:, 1]`` of one ``(num_blocks, 2, B, H, D)`` buffer (FlashInfer's); ``"hnd"``
    views of ``(num_blocks, H, B, D)`` buffers."""
    if layout == "kv":
        shape = (num_blocks, 2, block_size, heads, head_size)
    elif layout == "hnd":
        shape = (2, num_blocks, heads, block_size, head_size)
    else:
        shape = (2, num_blocks, block_size, heads, head_size)
    buf = _fp8_random(shape, device) if dtype == _fp8.FP8 else torch.randn(shape, device=device, dtype=dtype)
    if layout == "kv":
        return buf[:, 0], buf[:, 1]
    if layout == "hnd":
        buf = buf.transpose(2, 3)
    return buf[0], buf[1]


def make_slots(tokens: int, num_slots: int, padded: int = 0, device=None) -> Tensor:
    """Distinct random slots, the last ``padded`` of them -1 (a padded batch)."""
    if tokens > num_slots:
        raise ValueError(f"{tokens} distinct slots asked of a cache of {num_slots}")
    slots = torch.randperm(num_slots, device=device)[:tokens].to(torch.int64)
    if padded:
        slots[tokens - padded:] = -1
    return slots


def make_kv(tokens: int, heads: int, head_size: int, dtype, device, fused_q_heads: int = 0):
    """Random ``(key, value)`` ``(T, H, D)``; ``fused_q_heads``: slices of one ``(T, (Hq + 2H) * D)``
    qkv tensor viewed as heads (strided rows)."""
    if fused_q_heads:
        qkv = torch.randn(tokens, (fused_q_heads + 2 * heads) * head_size, device=device, dtype=dtype)
        k = qkv[:, fused_q_heads * head_size:(fused_q_heads + heads) * head_size]
        v = qkv[:, (fused_q_heads + heads) * head_size:]
        return k.unflatten(1, (heads, head_size)), v.unflatten(1, (heads, head_size))
    return (torch.randn(tokens, heads, head_size, device=device, dtype=dtype),
            torch.randn(tokens, heads, head_size, device=device, dtype=dtype))


def make_scales(device):
    """Per-tensor scales that are not powers of two (so the division rounds), one 0-d, one (1,)."""
    return (torch.tensor(0.0371, device=device), torch.tensor([0.6523], device=device))


#: (tokens, kv heads, head size, blocks, block size, padded tokens, fused q heads (0: contiguous k/v),
#: cache layout, fp8): one token, zero tokens, padded slots, qkv slices, block size 1, heads 64/128/256
SAMPLE_CASES = (
    (1, 1, 64, 2, 16, 0, 0, "nhd", False),
    (0, 2, 64, 2, 16, 0, 0, "nhd", False),
    (5, 2, 128, 3, 16, 2, 4, "nhd", False),
    (7, 3, 64, 9, 1, 0, 2, "kv", False),
    (4, 2, 256, 2, 16, 1, 0, "hnd", False),
    (6, 2, 128, 2, 16, 2, 4, "kv", True),
    (3, 1, 80, 4, 1, 0, 0, "nhd", True),
)


def cache_args(tokens, heads, head_size, blocks, block_size, padded, fused, layout, quant, device, dtype):
    k, v = make_kv(tokens, heads, head_size, dtype, device, fused)
    kc, vc = make_caches(blocks, block_size, heads, head_size, _fp8.FP8 if quant else dtype, device, layout)
    slots = make_slots(tokens, blocks * block_size, padded, device)
    ks, vs = make_scales(device)
    if quant:  # values spread over e4m3's range, some past 448 (saturating)
        k, v = k * 6, v * 100
    return k, v, kc, vc, slots, "fp8" if quant else "auto", ks, vs


def _samples(device, dtype) -> Iterator[tuple]:
    """fp8 caches as uint8 (vLLM's allocation): ``opcheck``'s schema check compares every argument
    with ``allclose``, which float8_e4m3fn lacks (tests/test_kv_cache.py covers float8_e4m3fn caches)."""
    for case in SAMPLE_CASES:
        args = cache_args(*case, device, dtype)
        if case[-1]:
            args = (*args[:2], args[2].view(torch.uint8), args[3].view(torch.uint8), *args[4:])
        yield args


#: the token-count cases' cache: 16384 slots, one per token at the largest count the tests take
_TOKENS_BLOCKS = 2048


def caches_apart(args: tuple, at: int) -> tuple:
    """``args`` with its caches (``args[at]``, ``args[at + 1]``) in buffers of their own. Compiled with
    both caches views of one buffer as graph inputs, Inductor copies the whole buffer around the op
    (pytorch/pytorch#139628; an illegal address on CUDA, torch 2.11): docs/design/kv_cache.md."""
    return (*args[:at], args[at].clone(), args[at + 1].clone(), *args[at + 2:])


def _tokens(n: int, device) -> tuple:
    args = cache_args(n, 2, 16, _TOKENS_BLOCKS, 8, min(n, 1), 0, "nhd", False, device, torch.float32)
    return caches_apart(args, 2), (0, 1, 4)


def compare(got: list, want: list, dtype=None) -> None:
    """The caches bit for bit (a write moves or converts values the same way on every backend)."""
    assert len(got) == len(want), f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, f"output {i}: {g.dtype} {tuple(g.shape)}, expected {w.dtype} {tuple(w.shape)}"
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[g.element_size()]
        differ = g.view(bits) != w.to(g.device).view(bits)
        assert not differ.any(), f"output {i}: {int(differ.sum())} of {g.numel()} values differ from the reference"


def compare_rope(got: list, want: list, dtype=None) -> None:
    """``(query, key_cache, value_cache)``: the rotated values (query, key cache) within the dtype's
    tolerance, an fp8 key cache within one e4m3 step (a backend may round the rotation differently:
    FMA on the GPU, the interpreter's bf16 cast), the value cache bit for bit."""
    from ...opdef import assert_close

    assert len(got) == len(want) and len(got) % 3 == 0, f"{len(got)} outputs, expected {len(want)} (threes)"
    for i in range(0, len(got), 3):  # a compiled block may return the written arguments twice
        (q, kc, vc), (q_ref, kc_ref, vc_ref) = got[i:i + 3], [t.to(got[i].device) for t in want[i:i + 3]]
        assert_close(q, q_ref, dtype or q_ref.dtype, msg="query")
        if kc.dtype in (_fp8.FP8, torch.uint8):
            _fp8.assert_steps("key_cache", kc.view(_fp8.FP8), kc_ref.view(_fp8.FP8), 1)
        else:
            assert_close(kc, kc_ref, dtype or kc_ref.dtype, msg="key_cache")
        compare([vc], [vc_ref])


# ----------------------------------------------------------------------------------------------
# Benchmark case: Qwen3-8B's kv heads; bytes read (k, v) and written (their cache rows).

#: per profile: (kv heads, head size, block size); gpu: Qwen3-8B
BENCH_SIZES = {"gpu": (8, 128, 16), "cpu": (2, 64, 16)}


def _bench_shape(tokens: int, hidden: Optional[int], profile: str):
    h, d, b = BENCH_SIZES[profile]
    return tokens, None, f"{tokens}x{h}x{d} B{b}"


def bench_kv(rows: int, profile: str, device, dtype, fused_q_heads: int = 0) -> tuple:
    """key, value, caches of twice the tokens' slots (blocks of ``B``), slots a random permutation."""
    h, d, b = BENCH_SIZES[profile]
    blocks = -(-2 * max(rows, 1) // b)
    k, v = make_kv(rows, h, d, dtype, device, fused_q_heads)
    kc, vc = make_caches(blocks, b, h, d, dtype, device)
    return k, v, kc, vc, make_slots(rows, blocks * b, 0, device)


def _bench_args(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    k, v, kc, vc, slots = bench_kv(rows, profile, device, dtype)
    ks, vs = make_scales(device)
    return k, v, kc, vc, slots, "auto", ks, vs


def cache_nbytes(key: Tensor, value: Tensor, key_cache: Tensor, slot_mapping: Tensor) -> int:
    # key and value read, their rows written, the slots read
    rows = key.numel() + value.numel()
    return rows * key.element_size() + rows * key_cache.element_size() + slot_mapping.numel() * 8


def _bench_nbytes(args: tuple) -> int:
    key, value, key_cache, _, slots = args[:5]
    return cache_nbytes(key, value, key_cache, slots)


def flashinfer_pages(slot_mapping: Tensor, key_cache: Tensor) -> tuple:
    """FlashInfer's paged indices for our slots: one request owning every page in order, so that
    its position ``p`` is page ``p // B``, entry ``p % B`` (every slot >= 0)."""
    blocks = key_cache.shape[0]
    dev = slot_mapping.device
    i32 = torch.int32
    return (torch.zeros_like(slot_mapping, dtype=i32), slot_mapping.to(i32), torch.arange(blocks, dtype=i32, device=dev),
            torch.tensor([0, blocks], dtype=i32, device=dev), torch.tensor([key_cache.shape[1]], dtype=i32, device=dev))


def _flashinfer(args: tuple):
    try:
        import flashinfer.page
    except Exception as e:  # noqa: BLE001  (reported in the results)
        return f"FlashInfer not importable: {type(e).__name__}: {e}"[:200]

    def prepare(a):  # the paged indices built once, outside the timed call; the caches stay at 2 and 3
        k, v, kc, vc, slots = a[:5]
        return (k, v, kc, vc, *flashinfer_pages(slots, kc))

    return Peer("flashinfer.page.append_paged_kv_cache",
                lambda k, v, kc, vc, batch, pos, indices, indptr, last: flashinfer.page.append_paged_kv_cache(
                    k, v, batch, pos, (kc, vc), indices, indptr, last), prepare=prepare)


# ----------------------------------------------------------------------------------------------
# rotary_embedding_and_cache: rotary_embedding of query and key, then the cache write of the rotated
# key and the value, in one pass; the key itself is left as it is.

OP_ROPE = "rotary_embedding_and_cache"
_POSITION_DTYPES = (torch.int32, torch.int64)


def _validate_rope_full(positions: Tensor, query: Tensor, key: Tensor, value: Tensor, head_size: int,
                        cos_sin_cache: Tensor, is_neox: bool, key_cache: Tensor, value_cache: Tensor,
                        slot_mapping: Tensor, kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor) -> None:
    op = OP_ROPE
    for name, t in (("positions", positions), ("query", query), ("key", key), ("value", value),
                    ("cos_sin_cache", cos_sin_cache)):
        check.tensor(op, name, t)
    if positions.dtype not in _POSITION_DTYPES:
        check.fail(op, "positions", f"must be an int32 or int64 tensor, got {positions.dtype}", TypeError)
    check.require(positions.dim() == 1, op, "positions", lambda: f"must be 1-D (num_tokens,), got shape {tuple(positions.shape)}")
    if query.dtype not in DTYPES:
        check.fail(op, "query", f"must be float16, bfloat16, float32 or float64, got {query.dtype}", TypeError)
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 1:
        check.fail(op, "head_size", f"must be a positive int, got {head_size!r}")
    check.heads(OP_ROPE, "query", query, head_size)
    tokens = query.shape[0]
    check.require(positions.shape[0] == tokens, op, "positions",
                  lambda: f"must have one position per token of 'query' ({tokens}), got shape {tuple(positions.shape)}")
    check.same_device(op, "positions", positions, "query", query)
    for name, x in (("key", key), ("value", value)):
        if x.dtype != query.dtype:
            check.fail(op, name, f"must have the dtype of 'query' ({query.dtype}), got {x.dtype}", TypeError)
        check.heads(OP_ROPE, name, x, head_size)
        check.require(x.shape[0] == tokens, op, name,
                      lambda x=x: f"must have one row per token of 'query' ({tokens}), got shape {tuple(x.shape)}")
        check.same_device(op, name, x, "query", query)
    check.same_shape(op, "value", value, "key", key)
    if cos_sin_cache.dtype not in (torch.float32, query.dtype):
        check.fail(op, "cos_sin_cache", f"must be float32 or the dtype of 'query' ({query.dtype}), got {cos_sin_cache.dtype}", TypeError)
    check.require(cos_sin_cache.dim() == 2, op, "cos_sin_cache",
                  lambda: f"must be 2-D (max_position, rot_dim), got shape {tuple(cos_sin_cache.shape)}")
    rot_dim = cos_sin_cache.shape[1]
    check.require(rot_dim % 2 == 0, op, "cos_sin_cache",
                  lambda: f"must have an even rot_dim (its second dimension: cos then sin halves), got {rot_dim}")
    check.require(rot_dim >= 2, op, "cos_sin_cache", lambda: f"must have a rot_dim (second dimension) of at least 2, got {rot_dim}")
    check.require(rot_dim <= head_size, op, "cos_sin_cache",
                  lambda: f"must have a rot_dim (second dimension) of at most head_size={head_size}, got {rot_dim}")
    check.last_dim_contiguous(op, "cos_sin_cache", cos_sin_cache)
    check.same_device(op, "cos_sin_cache", cos_sin_cache, "query", query)
    validate_cache(op, rotary.heads(key, head_size), rotary.heads(value, head_size), key_cache, value_cache, slot_mapping,
                   kv_cache_dtype, k_scale, v_scale)
    check.no_overlap(op, (("positions", positions, False), ("query", query, True), ("key", key, False),
                          ("value", value, False), ("cos_sin_cache", cos_sin_cache, False),
                          ("key_cache", key_cache, True), ("value_cache", value_cache, True),
                          ("slot_mapping", slot_mapping, False), ("k_scale", k_scale, False), ("v_scale", v_scale, False)))


def _rope_fast_ok(positions: Tensor, query: Tensor, key: Tensor, value: Tensor, head_size: int,
                  cos_sin_cache: Tensor, is_neox: bool, key_cache: Tensor, value_cache: Tensor,
                  slot_mapping: Tensor, kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor) -> bool:
    """The common valid call in attribute reads (see the note above :func:`_span`)."""
    qd, qs, ks, cs, dev = query.dtype, query.shape, key.shape, cos_sin_cache.shape, query.device
    if not (type(head_size) is int and head_size > 0 and qd in DTYPES and key.dtype == qd and value.dtype == qd
            and len(qs) == len(ks) and value.shape == ks and positions.dtype in _POSITION_DTYPES
            and positions.shape == qs[:1] and ks[0] == qs[0] and cos_sin_cache.dtype in (torch.float32, qd)
            and len(cs) == 2 and 0 < cs[1] <= head_size and not cs[1] & 1 and cos_sin_cache.stride(1) == 1
            and query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
            and positions.device == dev and key.device == dev and value.device == dev and cos_sin_cache.device == dev):
        return False
    if len(qs) == 2:
        if not (qs[1] and ks[1] and qs[1] % head_size == 0 and ks[1] % head_size == 0):
            return False
        rows = (ks[0], ks[1] // head_size, head_size)
    elif len(qs) == 3:
        if not (qs[2] == head_size and ks[2] == head_size and qs[1] and ks[1]):
            return False
        rows = ks
    else:
        return False
    return (_cache_ok(rows, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, qd, dev)
            and _written_apart((query, key_cache, value_cache),
                               (positions, key, value, cos_sin_cache, slot_mapping, k_scale, v_scale)))


def validate_rope(positions: Tensor, query: Tensor, key: Tensor, value: Tensor, head_size: int,
                  cos_sin_cache: Tensor, is_neox: bool, key_cache: Tensor, value_cache: Tensor,
                  slot_mapping: Tensor, kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor) -> None:
    args = (positions, query, key, value, head_size, cos_sin_cache, is_neox, key_cache, value_cache, slot_mapping,
            kv_cache_dtype, k_scale, v_scale)
    try:
        ok = _rope_fast_ok(*args)
    except (AttributeError, IndexError, RuntimeError, TypeError):  # not tensors: the full checks say what
        ok = False
    if not ok:
        _validate_rope_full(*args)
    check_slots(OP_ROPE, slot_mapping, key_cache.shape[0] * key_cache.shape[1])
    if positions.numel() and indices_checked(positions):
        lo, hi = torch.stack(torch.aminmax(positions)).tolist()
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            check.fail(OP_ROPE, "positions", f"must lie in [0, {cos_sin_cache.shape[0]}) (the rows of 'cos_sin_cache'), "
                                             f"got values from {lo} to {hi}")


def _fake_rope(*args) -> None:
    _validate_rope_full(*args)


def rotary_embedding_and_cache(positions: Tensor, query: Tensor, key: Tensor, value: Tensor, head_size: int,
                               cos_sin_cache: Tensor, is_neox: bool, key_cache: Tensor, value_cache: Tensor,
                               slot_mapping: Tensor, kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor) -> None:
    """``rotary_embedding(positions, query, k, ...)`` on ``query`` in place and on a copy ``k`` of ``key``, then ``reshape_and_cache_flash(k, value, key_cache, value_cache, slot_mapping, ...)``, in one pass

    The rotary embedding of vLLM's ``rotary_embedding`` fused with the paged KV-cache write of
    ``reshape_and_cache_flash``: for token ``t`` at ``p = positions[t]``, every head of ``query[t]``
    is rotated in place (``x1, x2 = x1 * cos[p] - x2 * sin[p], x2 * cos[p] + x1 * sin[p]``, neox or
    GPT-J pairs over the first ``r = cos_sin_cache.shape[1]`` dims, computed in fp32 and rounded to the
    dtype), and so is every head of ``key[t]``, but into the cache: the rotated key (rounded to its
    dtype, then quantised as ``reshape_and_cache_flash`` does) and ``value[t]`` are stored at slot
    ``slot_mapping[t]``. **``key`` itself is not written** (the schema marks it read-only): an
    engine that needs the rotated key outside the cache calls ``rotary_embedding`` instead. Equal,
    bit for bit on each backend, to ``rotary_embedding`` followed by ``reshape_and_cache_flash``.

    Args:
        positions: ``(T,)`` int32 or int64, in ``[0, max_position)``. Not checked on the data by
            default (that would sync the device): a token at a position outside the cache gets NaN in
            its rotated dims (query and cached key), on every backend; ``DEEPINFER_CHECK_KV_SLOTS=1``
            checks positions and slots in eager calls and raises instead.
        query: ``(T, Hq * head_size)`` or ``(T, Hq, head_size)``, fp16/bf16/fp32/fp64, last dimension
            contiguous (rows and heads may be strided: slices of a fused qkv tensor). Rotated in place.
        key: ``(T, Hk * head_size)`` or ``(T, Hk, head_size)``, the dtype of ``query``. Read only.
        value: the shape and dtype of ``key``. Read only.
        head_size: dims per head (the caches' last dimension).
        cos_sin_cache: ``(max_position, r)``, float32 or the dtype of ``query``, ``r`` even and at most
            ``head_size``; ``r/2`` cosines then ``r/2`` sines a row.
        is_neox: neox (halves) pairing if True, GPT-J (interleaved) pairing if False.
        key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale: as in
            ``reshape_and_cache_flash`` (caches ``(num_blocks, B, Hk, head_size)``, written in place;
            slot -1 or outside the cache: nothing written for the token, its query still rotated).

    Not differentiable.
    """
    torch.ops.deepinfer.rotary_embedding_and_cache.default(positions, query, key, value, head_size, cos_sin_cache,
                                                            is_neox, key_cache, value_cache, slot_mapping,
                                                            kv_cache_dtype, k_scale, v_scale)


def rope_args(tokens, q_heads, kv_heads, head_size, rot_dim, is_neox, layout, blocks, block_size, padded, quant,
              device, dtype, positions_dtype=torch.int64, cache_in_dtype=False, max_position=37) -> tuple:
    """Random arguments. ``layout``: ``"2d"`` contiguous ``(T, H*hs)`` tensors; ``"qkv"`` column slices
    of one fused ``(T, (Hq + 2Hk) * hs)`` tensor (strided rows, as vLLM passes them); ``"3d"`` the same
    as ``(T, H, hs)`` views."""
    positions = torch.randint(0, max_position, (tokens,), device=device, dtype=positions_dtype)
    cos_sin = make_cos_sin_cache(max_position, rot_dim, device=device, dtype=dtype if cache_in_dtype else torch.float32)
    if layout == "2d":
        q, k, v = (torch.randn(tokens, h * head_size, device=device, dtype=dtype) for h in (q_heads, kv_heads, kv_heads))
    else:
        qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_size, device=device, dtype=dtype)
        q, k, v = qkv.split([q_heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=1)
        if layout == "3d":
            q, k, v = (x.unflatten(1, (-1, head_size)) for x in (q, k, v))
    kc, vc = make_caches(blocks, block_size, kv_heads, head_size, _fp8.FP8 if quant else dtype, device,
                         "kv" if layout == "qkv" else "nhd")
    slots = make_slots(tokens, blocks * block_size, padded, device)
    ks, vs = make_scales(device)
    if quant:
        k, v = k * 6, v * 100
    return positions, q, k, v, head_size, cos_sin, is_neox, kc, vc, slots, "fp8" if quant else "auto", ks, vs


#: (tokens, q heads, kv heads, head size, rot_dim, neox, layout, blocks, block size, padded, fp8,
#: positions dtype, cos/sin in the q dtype): one token, zero tokens, GPT-J, partial rotary, qkv slices,
#: 3-D heads, block size 1, head sizes 64/128/256, padded slots, fp8 caches
ROPE_CASES = (
    (1, 1, 1, 64, 64, True, "2d", 2, 16, 0, False, torch.int64, False),
    (0, 4, 2, 64, 32, True, "2d", 2, 16, 0, False, torch.int64, False),
    (5, 4, 2, 128, 128, True, "qkv", 3, 16, 2, False, torch.int64, False),
    (4, 2, 1, 128, 128, False, "2d", 4, 1, 1, False, torch.int32, True),
    (6, 5, 3, 32, 16, False, "3d", 2, 16, 0, False, torch.int32, False),
    (3, 3, 1, 96, 48, True, "qkv", 4, 1, 1, True, torch.int64, False),
    (4, 2, 2, 256, 256, True, "2d", 2, 16, 1, True, torch.int64, False),
    (2, 3, 1, 40, 24, False, "qkv", 2, 16, 0, True, torch.int64, False),
)


def rope_case_args(case, device, dtype) -> tuple:
    t, hq, hk, hs, rot, neox, layout, blocks, bs, padded, quant, pdt, in_dtype = case
    return rope_args(t, hq, hk, hs, rot, neox, layout, blocks, bs, padded, quant, device, dtype, pdt, in_dtype)


def _rope_samples(device, dtype) -> Iterator[tuple]:
    """fp8 caches as uint8, as in ``reshape_and_cache_flash``'s samples (opcheck's schema check)."""
    for case in ROPE_CASES:
        args = rope_case_args(case, device, dtype)
        if case[10]:
            args = (*args[:7], args[7].view(torch.uint8), args[8].view(torch.uint8), *args[9:])
        yield args


def _rope_tokens(n: int, device) -> tuple:
    args = rope_args(n, 4, 2, 16, 16, True, "2d", _TOKENS_BLOCKS, 8, min(n, 1), False, device, torch.float32)
    return caches_apart(args, 7), (0, 1, 2, 3, 9)


def _rope_bench_shape(tokens: int, hidden: Optional[int], profile: str):
    hq, hk, hs, b, _ = ROPE_BENCH_SIZES[profile]
    return tokens, None, f"{tokens}x({hq}+{hk}+{hk})x{hs} B{b}"


#: per profile: (q heads, kv heads, head size, block size, cached positions); gpu: Qwen3-8B
ROPE_BENCH_SIZES = {"gpu": (32, 8, 128, 16, 8192), "cpu": (4, 2, 64, 16, 256)}


def _rope_bench_args(rows: int, hidden: Optional[int], profile: str, device, dtype) -> tuple:
    hq, hk, hs, b, max_pos = ROPE_BENCH_SIZES[profile]
    blocks = -(-2 * max(rows, 1) // b)
    return rope_args(rows, hq, hk, hs, hs, True, "qkv", blocks, b, 0, False, device, dtype, max_position=max_pos)


def _rope_bench_nbytes(args: tuple) -> int:
    positions, q, k, v, hs, cos_sin, _, kc, _, slots = args[:10]
    rot = cos_sin.shape[1]
    # query's rotated dims read and written, key and value read, their cache rows written, one cos/sin
    # row a token, the positions and the slots
    return (2 * q.numel() * q.element_size() * rot // hs + cache_nbytes(k, v, kc, slots)
            + positions.numel() * (rot * cos_sin.element_size() + positions.element_size()))


def _unfused(positions, q, k, v, hs, cos_sin, neox, kc, vc, slots, dt, ks, vs):
    """Our two ops, as an engine calls them without the fused one (the key rotated in place)."""
    torch.ops.deepinfer.rotary_embedding(positions, q, k, hs, cos_sin, neox)
    torch.ops.deepinfer.reshape_and_cache_flash(rotary.heads(k, hs), rotary.heads(v, hs), kc, vc, slots, dt, ks, vs)


def _with_own_key(args: tuple) -> tuple:
    """The arguments with a copy of ``key``, which the unfused peers rotate in place."""
    return (*args[:2], args[2].clone(), *args[3:])


UNFUSED_PEER = Peer("unfused", _unfused, prepare=_with_own_key)


def _rope_flashinfer(args: tuple):
    try:
        import flashinfer.page
        import flashinfer.rope
    except Exception as e:  # noqa: BLE001  (reported in the results)
        return f"FlashInfer not importable: {type(e).__name__}: {e}"[:200]
    if args[10] != "auto":
        return "FlashInfer's append_paged_kv_cache has no k_scale/v_scale"

    def prepare(a):  # a copy of the key (rotated in place) and the paged indices, outside the timed call
        a = _with_own_key(a)
        return (*a, *flashinfer_pages(a[9], a[7]))

    def call(positions, q, k, v, hs, cos_sin, neox, kc, vc, slots, dt, ks, vs, batch, pos, indices, indptr, last):
        flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, hs, cos_sin, is_neox=neox)
        flashinfer.page.append_paged_kv_cache(rotary.heads(k, hs), rotary.heads(v, hs), batch, pos, (kc, vc), indices,
                                              indptr, last)

    return Peer("flashinfer rope.apply_rope_with_cos_sin_cache_inplace + page.append_paged_kv_cache", call,
                prepare=prepare)


OPS = (
    OpDef("reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
          "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()",
          validate, _fake, reshape_and_cache_flash, _samples, _tokens,
          no_grad_reason="it writes the caches in place", compare=compare,
          bench=BenchCase(_bench_shape, _bench_args, _bench_nbytes, memory_bound=True, flashinfer=_flashinfer)),
    OpDef("rotary_embedding_and_cache(Tensor positions, Tensor(a!) query, Tensor key, Tensor value, int head_size, "
          "Tensor cos_sin_cache, bool is_neox, Tensor(b!) key_cache, Tensor(c!) value_cache, Tensor slot_mapping, "
          "str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()",
          validate_rope, _fake_rope, rotary_embedding_and_cache, _rope_samples, _rope_tokens, data_arg=1,
          no_grad_reason="it rotates query and writes the caches in place", compare=compare_rope,
          bench=BenchCase(_rope_bench_shape, _rope_bench_args, _rope_bench_nbytes, memory_bound=True,
                          flashinfer=_rope_flashinfer, peers=(UNFUSED_PEER,))),
)
