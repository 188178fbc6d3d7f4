"""The paged KV-cache family: ``reshape_and_cache_flash``.

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
from ...opdef import BenchCase, OpDef, Peer

OP = "reshape_and_cache_flash"
#: ``kv_cache_dtype`` values: the cache in the key's dtype, or float8_e4m3fn with per-tensor scales
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Check the slots on the data in eager calls (see the module docstring): one reduction and a read back
#: per call, a device sync on CUDA. Default from ``DEEPINFER_CHECK_KV_SLOTS=1``.
CHECK_SLOTS = os.environ.get("DEEPINFER_CHECK_KV_SLOTS", "").strip() == "1"


def _is_data(t: Tensor) -> bool:
    """A tensor with data to read: not fake, meta or functional (traced)."""
    return type(t) is Tensor and t.device.type != "meta"


def check_slots(op: str, slot_mapping: Tensor, num_slots: int) -> None:
    """With :data:`CHECK_SLOTS`: every slot in ``[-1, num_slots)`` and no slot >= 0 twice, on the data."""
    if not CHECK_SLOTS or slot_mapping.numel() == 0 or not _is_data(slot_mapping):
        return
    if slot_mapping.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # a read back would break the capture; the kernels skip such slots
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


def validate(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
             kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor) -> None:
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
            one of their values. ``DEEPINFER_CHECK_KV_SLOTS=1`` (or
            ``torch_kernels.families.kv_cache.ops.CHECK_SLOTS = True``) makes eager calls check the
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


def _tokens(n: int, device) -> tuple:
    return cache_args(n, 2, 16, 40, 8, min(n, 1), 0, "nhd", False, device, torch.float32), (0, 1, 4)


def compare(got: list, want: list, dtype=None) -> None:
    """The caches bit for bit (a write moves or converts values the same way on every backend)."""
    assert len(got) == len(want), f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, f"output {i}: {g.dtype} {tuple(g.shape)}, expected {w.dtype} {tuple(w.shape)}"
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[g.element_size()]
        differ = g.view(bits) != w.to(g.device).view(bits)
        assert not differ.any(), f"output {i}: {int(differ.sum())} of {g.numel()} values differ from the reference"


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


OPS = (
    OpDef("reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
          "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()",
          validate, _fake, reshape_and_cache_flash, _samples, _tokens,
          no_grad_reason="it writes the caches in place", compare=compare,
          bench=BenchCase(_bench_shape, _bench_args, _bench_nbytes, memory_bound=True, flashinfer=_flashinfer)),
)
