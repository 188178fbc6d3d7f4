"""Reference sampling family: ``top_k_renorm_probs``, ``top_p_renorm_probs``, ``top_k_top_p_sampling_from_probs``
(below), and the logits ops ``softmax``, ``top_k_mask_logits`` and ``min_p_sampling_from_probs`` (at the
end; their wrappers' docstrings in ``ops.py`` define them, min-p with the masses and stream below).

The semantics every backend reproduces EXACTLY (the kept sets and the sampled ids are bit-identical;
only the renormalised values differ, by rounding):

* **Values.** ``p = probs`` as fp32, with NaN, negatives and ``-0.0`` read as ``0`` and ``+inf`` as
  the largest finite fp32. Non-negative fp32 values order like their bit patterns, so every
  threshold below is an exact comparison of int32 bit patterns ``bits(p)``.
* **Mass.** Masses are summed in 64-bit fixed point, so that they do not depend on summation order:
  ``q = floor(p * 2^s)`` with ``s`` chosen per row so that the row's largest value lands in
  ``[2^(Q-1), 2^Q)``, ``Q = min(44, 62 - bit_length(V - 1))``: a row of ``V`` values sums below
  ``2^62``. (``q`` is exact for the larger values; values below ``2^-Q`` of the row's largest have no
  mass at all, far below fp32 resolution of the row's sum.)
* **top-k.** ``k = top_k`` if ``0 < top_k < V``, else ``V`` (keep all). ``t_k`` = the k-th largest
  value; kept: ``p >= t_k`` (ties at the threshold are all kept, as FlashInfer's pivot does).
* **top-p**, on the top-k survivors: ``M_k`` = their mass, ``G(i)`` = the mass of the survivors
  strictly larger than ``p_i``; survivor ``i`` is kept iff ``G(i) == 0`` (the largest value is always
  kept) or ``double(G(i)) < double(top_p) * double(M_k)`` (IEEE fp64, the same in every backend):
  the smallest set of largest probabilities whose mass reaches ``top_p``, the token crossing the
  threshold included, ties included. ``top_p >= 1`` keeps every survivor with mass.
* **Sampling.** ``r = philox4x32_10(counter=(row, offset_lo, offset_hi, 0), key=(seed_lo, seed_hi))[0] >> 1``
  (31 random bits; the row's own stream, independent of the batch size); ``M`` = the kept mass;
  ``target = floor(r * M / 2^31)``, computed exactly in int64; the result is the first token, in
  index order, whose inclusive cumulative kept mass exceeds ``target``. It always has mass, so it is
  always kept; each kept token ``i`` is drawn with probability ``q_i / M`` up to 2^-31. A row with no
  mass at all (all zero) returns 0. Per-row ``seed``/``offset`` tensors (``(B,)``, either, the other
  broadcast) key each row with its own and put 0 in the counter's row word: a row draws as it would alone.
* **sampling_from_probs** (with ``sampling_from_logits``, its composition with ``softmax``, and the
  residual or bonus draw of ``chain_speculative_sampling``) puts its masses at the larger of the row's
  largest exponent and that of 1.0 (``ONE_EXPONENT``): a row of probabilities (every value below 2)
  has them at a scale fixed in advance, ``q = floor(p * 2^(Q-1))``, so a kernel reads the row once (a
  mass and the row's largest together), not twice. A value below ``2^-(Q-1)`` then has no mass
  (``Q = 44`` at ``V = 128256``: below 1.1e-13), where the other ops' threshold sits ``Q-1`` binades
  below the row's largest: each token's draw probability moves by at most that. A row whose largest
  value is at least 1 draws the ids ``top_k_top_p_sampling_from_probs`` draws with the filters off.
* **joint** (``filter_apply_order="joint"``, FlashInfer's other order): the top-p test compares
  ``G(i)`` with ``top_p * M`` over the whole row's mass ``M`` instead of ``M_k``, keeping the tokens that
  pass both filters on the original distribution (a superset of top-k-first's).
* **indices** (``(N,)``): output row ``i`` draws from ``probs[indices[i]]`` with that row's
  ``top_k``/``top_p``, its random stream that of output row ``i``.

The renormalising ops return ``where(kept, p / sum(p[kept]), 0)`` in fp32 (the sum in fp64; a row
whose kept sum is 0 returns zeros).
"""

from typing import Optional

import torch
from torch import Tensor

FLT_MAX = 3.4028234663852886e38
_U32 = 0xFFFFFFFF
# Philox4x32-10 (Salmon et al., SC'11; the constants of Random123 and triton.language.random).
PHILOX_ROUND_A, PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
PHILOX_KEY_A, PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85


#: the exponent field of 1.0: ``sampling_from_probs``' masses are at no smaller exponent
ONE_EXPONENT = 127


def fixed_point_bits(vocab: int) -> int:
    """``Q``: the bits of the row's largest value in the fixed point, so a row sums below ``2^62``."""
    return min(44, 62 - (vocab - 1).bit_length())


def value_bits(probs: Tensor) -> Tensor:
    """``bits(p)`` (int32, >= 0) of the sanitised fp32 values: NaN/negative -> 0, +inf -> FLT_MAX."""
    p = probs.float()
    return torch.where(p > 0, p.clamp(max=FLT_MAX), 0.0).view(torch.int32)


def fixed_point(bits: Tensor, max_bits: Tensor, q_bits: int) -> Tensor:
    """``floor(p * 2^s)`` as int64 from the bit patterns: ``p = m * 2^(e-150)`` with the 24-bit
    significand ``m``; the row's largest value (``max_bits``, ``(B, 1)``) maps to ``[2^(Q-1), 2^Q)``."""
    b = bits.long()
    exp = b >> 23
    m = (b & 0x7FFFFF) | torch.where(exp > 0, 0x800000, 0)
    e_max = (max_bits.long() >> 23).clamp(min=1)
    shift = exp.clamp(min=1) - e_max + (q_bits - 24)
    left = m << shift.clamp(min=0)
    right = m >> (-shift).clamp(min=0, max=31)
    return torch.where(b > 0, torch.where(shift >= 0, left, right), 0)


def fixed_point_from_one(bits: Tensor, q_bits: int) -> Tensor:
    """:func:`fixed_point` at the larger of the row's largest exponent and 1.0's (``ONE_EXPONENT``)."""
    return fixed_point(bits, bits.amax(-1, keepdim=True).clamp(min=ONE_EXPONENT << 23), q_bits)


def _mulhilo(a: int, b: Tensor):
    """``(hi, lo)`` 32-bit halves of ``a * b`` for a 32-bit constant ``a`` and int64 ``b`` holding
    unsigned 32-bit values; in 16-bit pieces so nothing overflows int64."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    x, y = a * b_hi, a * b_lo  # < 2^48 each
    hi = (x + (y >> 16)) >> 16
    lo = (((x & 0xFFFF) << 16) + y) & _U32
    return hi, lo


def philox4x32_10(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: Tensor, k1: Tensor):
    """Philox4x32 with 10 rounds on int64 tensors holding uint32 values (broadcasting); returns the
    four output words. The same rounds as ``triton.language.random.philox_impl``."""
    for _ in range(10):
        hi_b, lo_b = _mulhilo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + PHILOX_KEY_A) & _U32, (k1 + PHILOX_KEY_B) & _U32
    return c0, c1, c2, c3


def random_bits31(rows: int, seed: Tensor, offset: Tensor, device) -> Tensor:
    """``(rows,)`` int64: 31 random bits per row, from counter ``(row, offset_lo, offset_hi, 0)`` and
    key ``(seed_lo, seed_hi)``. Per-row ``seed``/``offset`` (either of ``rows`` elements, the other of
    one, broadcast): counter ``(0, offset_lo, offset_hi, 0)``, so a row draws as it would alone."""
    seed, offset, row = rng_rows(rows, seed, offset, device)
    zero = torch.zeros_like(row)
    c0, _, _, _ = philox4x32_10(row, offset & _U32, (offset >> 32) & _U32, zero, seed & _U32, (seed >> 32) & _U32)
    return c0 >> 1


def per_row_rng(seed: Tensor, offset: Tensor) -> bool:
    """Whether ``seed``/``offset`` give each row its own stream: either holds other than one value."""
    return seed.numel() != 1 or offset.numel() != 1


def rng_rows(rows: int, seed: Tensor, offset: Tensor, device):
    """``(seed, offset, counter row word)``, each ``(rows,)`` int64: one seed and offset with the row's
    index, or per-row ones with row word 0 (a row's stream is that of calling it alone)."""
    per_row = per_row_rng(seed, offset)
    seed = seed.reshape(-1).to(device=device, dtype=torch.int64).expand(rows)
    offset = offset.reshape(-1).to(device=device, dtype=torch.int64).expand(rows)
    row = torch.arange(rows, device=device, dtype=torch.int64)
    return seed, offset, torch.zeros_like(row) if per_row else row


def per_row(value, rows: int, dtype, device) -> Tensor:
    """A per-row tensor as it is, or a scalar as ``(rows,)`` of ``dtype`` (a top_p float rounded to fp32,
    as a kernel argument is)."""
    return value if isinstance(value, Tensor) else torch.full((rows,), value, dtype=dtype, device=device)


def kept_mask(bits: Tensor, q: Tensor, top_k, top_p, joint: bool = False):
    """``(kept (B, V) bool, mass of the kept set (B,) int64)``; ``top_k``/``top_p`` a ``(B,)`` tensor or
    a scalar for every row, ``None``: no filter. ``joint``: top-p measured against the whole row's mass
    instead of the top-k survivors' (FlashInfer's ``filter_apply_order="joint"``)."""
    B, V = bits.shape
    if top_k is not None:
        top_k = per_row(top_k, B, torch.int64, bits.device)
    if top_p is not None:
        top_p = per_row(top_p, B, torch.float32, bits.device)
    if top_k is None:
        kept = torch.ones_like(bits, dtype=torch.bool)
    else:
        k = top_k.long()
        k = torch.where((k > 0) & (k < V), k, V)
        t_k = bits.sort(-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))  # the k-th largest
        kept = bits >= t_k
    qk = torch.where(kept, q, 0)
    m_k = qk.sum(-1)
    if top_p is None:
        return kept, m_k
    # G(i): the kept mass strictly above p_i = M_k - (kept mass <= p_i), from an ascending sort.
    asc, order = bits.sort(-1)
    cum = qk.gather(-1, order).cumsum(-1)
    last_le = torch.searchsorted(asc, bits, right=True) - 1  # >= 0: bits itself is in the row
    above = m_k.unsqueeze(-1) - cum.gather(-1, last_le)
    m_p = q.sum(-1) if joint else m_k
    limit = top_p.double().unsqueeze(-1) * m_p.double().unsqueeze(-1)
    kept = kept & ((above == 0) | (above.double() < limit))
    return kept, torch.where(kept, q, 0).sum(-1)


def _filtered(probs: Tensor, top_k, top_p, joint: bool = False):
    bits = value_bits(probs)
    q = fixed_point(bits, bits.amax(-1, keepdim=True), fixed_point_bits(probs.shape[-1]))
    kept, mass = kept_mask(bits, q, top_k, top_p, joint)
    return bits, q, kept, mass


def _renorm(probs: Tensor, kept: Tensor, bits: Tensor) -> Tensor:
    p = torch.where(kept, bits.view(torch.float32).double(), 0.0)
    total = p.sum(-1, keepdim=True)
    return torch.where(total > 0, p / total.clamp(min=1e-300), 0.0).float().to(probs.dtype).contiguous()


def top_k_renorm_probs(probs: Tensor, maybe_top_k_arr: Optional[Tensor], top_k_val: int = 0) -> Tensor:
    if probs.shape[0] == 0:
        return probs.new_empty(probs.shape)
    bits, _, kept, _ = _filtered(probs, top_k_val if maybe_top_k_arr is None else maybe_top_k_arr, None)
    return _renorm(probs, kept, bits)


def top_p_renorm_probs(probs: Tensor, maybe_top_p_arr: Optional[Tensor], top_p_val: float = 1.0) -> Tensor:
    if probs.shape[0] == 0:
        return probs.new_empty(probs.shape)
    bits, _, kept, _ = _filtered(probs, None, top_p_val if maybe_top_p_arr is None else maybe_top_p_arr)
    return _renorm(probs, kept, bits)


def sample_kept(q: Tensor, kept: Tensor, mass: Tensor, r31: Tensor) -> Tensor:
    """The first token whose inclusive cumulative kept mass exceeds ``floor(r31 * mass / 2^31)``."""
    hi, lo = mass >> 31, mass & 0x7FFFFFFF  # mass < 2^62: both below 2^31, no product overflows
    target = r31 * hi + ((r31 * lo) >> 31)
    cum = torch.where(kept, q, 0).cumsum(-1)
    return (cum > target.unsqueeze(-1)).int().argmax(-1).int()  # no hit (no mass): 0


def gather_rows(indices: Optional[Tensor], probs: Tensor, *per_row_args):
    """``probs`` and its per-row arguments (tensors; scalars pass) at the rows ``indices`` names
    (FlashInfer's ``indices``: output row ``i`` draws from ``probs[indices[i]]``); as they are without."""
    if indices is None:
        return (probs, *per_row_args)
    idx = indices.long()
    return (probs.index_select(0, idx),
            *(a.index_select(0, idx) if isinstance(a, Tensor) else a for a in per_row_args))


def top_k_top_p_sampling_from_probs(probs: Tensor, maybe_top_k_arr: Optional[Tensor], maybe_top_p_arr: Optional[Tensor],
                                    seed: Tensor, offset: Tensor, top_k_val: int = 0, top_p_val: float = 1.0,
                                    filter_apply_order: str = "top_k_first", indices: Optional[Tensor] = None) -> Tensor:
    probs, maybe_top_k_arr, maybe_top_p_arr = gather_rows(indices, probs, maybe_top_k_arr, maybe_top_p_arr)
    B = probs.shape[0]
    if B == 0:
        return torch.empty(0, dtype=torch.int32, device=probs.device)
    _, q, kept, mass = _filtered(probs, top_k_val if maybe_top_k_arr is None else maybe_top_k_arr,
                                 top_p_val if maybe_top_p_arr is None else maybe_top_p_arr, filter_apply_order == "joint")
    return sample_kept(q, kept, mass, random_bits31(B, seed, offset, probs.device))


# ----------------------------------------------------------------------------------------------
# Logits ops (FlashInfer's ``softmax``, ``top_k_mask_logits``): each takes its per-row parameter as an
# optional tensor beside a scalar used where the tensor is None, as FlashInfer's own ops do.


def inverse_temperature(temperature_arr, temperature_val: float, rows: int, device) -> Tensor:
    """``(rows, 1)`` fp32 ``1 / t`` (FlashInfer: 0 where ``t == 0``), ``t`` read as fp32."""
    if temperature_arr is None:
        t = torch.full((rows, 1), temperature_val, dtype=torch.float32, device=device)
    else:
        t = temperature_arr.float().reshape(rows, 1)
    return torch.where(t == 0, 0.0, 1.0 / t)


def softmax(logits: Tensor, maybe_temperature_arr=None, temperature_val: float = 1.0) -> Tensor:
    B, V = logits.shape
    x = logits.float() * inverse_temperature(maybe_temperature_arr, temperature_val, B, logits.device)
    x = torch.where(logits == float("-inf"), float("-inf"), x)  # -inf stays -inf at any temperature
    m = x.amax(-1, keepdim=True)  # all -inf: -inf, and exp(-inf - -inf) is NaN, as FlashInfer's
    e = torch.exp(x - m)
    return (e / e.sum(-1, keepdim=True)).contiguous()


def order_key(logits: Tensor) -> Tensor:
    """int32 keys that order like the fp32 values (NaN as -inf, -0.0 as +0.0): ``a >= b`` iff
    ``key(a) >= key(b)``."""
    x = logits.float()
    bits = torch.where(torch.isnan(x), float("-inf"), torch.where(x == 0, 0.0, x)).view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def top_k_keep_from(keys: Tensor, k: Tensor) -> Tensor:
    """``(B, 1)`` the k-th largest key per row; ``k`` ``(B,)`` in ``[1, V]``."""
    return keys.sort(-1, descending=True).values.gather(-1, (k.long() - 1).unsqueeze(-1))


def top_k_mask_logits(logits: Tensor, maybe_top_k_arr=None, top_k_val: int = 0) -> Tensor:
    B, V = logits.shape
    if B == 0:
        return logits.new_empty(logits.shape)
    if maybe_top_k_arr is None:
        k = torch.full((B,), top_k_val, dtype=torch.int64, device=logits.device)
    else:
        k = maybe_top_k_arr.long()
    k = torch.where((k > 0) & (k < V), k, V)
    keys = order_key(logits)
    kept = keys >= top_k_keep_from(keys, k)
    return torch.where(kept, logits, float("-inf")).contiguous()


def min_p_threshold(bits: Tensor, maybe_min_p_arr, min_p_val: float) -> Tensor:
    """``(B, 1)`` int32: the pattern of ``min(fp32(min_p * max(p)), max(p))`` (0 where not positive):
    FlashInfer's pivot, kept ``p >= pivot``; the largest value is kept whatever ``min_p`` (NaN, > 1)."""
    B = bits.shape[0]
    m_bits = bits.amax(-1, keepdim=True)
    m = m_bits.view(torch.float32)
    if maybe_min_p_arr is None:
        min_p = torch.full((B, 1), min_p_val, dtype=torch.float32, device=bits.device)
    else:
        min_p = maybe_min_p_arr.float().reshape(B, 1)
    pivot = min_p * m
    below_max = pivot <= m  # NaN (min_p NaN) and pivots above the largest keep the largest only
    pivot = torch.where(pivot > 0, pivot, 0.0)
    return torch.where(below_max, pivot.view(torch.int32), m_bits)


def min_p_sampling_from_probs(probs: Tensor, maybe_min_p_arr, min_p_val: float, seed: Tensor, offset: Tensor,
                              indices: Optional[Tensor] = None) -> Tensor:
    probs, maybe_min_p_arr = gather_rows(indices, probs, maybe_min_p_arr)
    B = probs.shape[0]
    if B == 0:
        return torch.empty(0, dtype=torch.int32, device=probs.device)
    bits = value_bits(probs)
    q = fixed_point(bits, bits.amax(-1, keepdim=True), fixed_point_bits(probs.shape[1]))
    kept = bits >= min_p_threshold(bits, maybe_min_p_arr, min_p_val)
    mass = torch.where(kept, q, 0).sum(-1)
    return sample_kept(q, kept, mass, random_bits31(B, seed, offset, probs.device))


# ----------------------------------------------------------------------------------------------
# Chain speculative sampling (FlashInfer's ``chain_speculative_sampling``; the wrapper's docstring in
# ``ops.py`` is the definition). Its Philox counters have the top bit of the last word set, so its
# uniforms never meet the family's draws (whose last counter word is 0) on the same (seed, offset).

#: ``c3`` of the speculative sampler's Philox counter at position ``i``: ``SPECULATIVE_COUNTER + i``
SPECULATIVE_COUNTER = 0x80000000
#: the smallest normal fp32: smaller values count as 0, so flushing subnormals changes no result
FLT_TINY = 2.0**-126


def speculative_words(rows: int, positions: int, seed: Tensor, offset: Tensor, device):
    """``(w0, w1)``, each ``(rows, positions)`` int64 uint32 values: words 0 and 1 of Philox4x32-10 with
    counter ``(row, offset_lo, offset_hi, SPECULATIVE_COUNTER + i)`` and key ``(seed_lo, seed_hi)``
    (per-row seeds or offsets: row word 0, as ``rng_rows``)."""
    seed, offset, row = (t[:, None].expand(rows, positions) for t in rng_rows(rows, seed, offset, device))
    pos = torch.arange(positions, device=device, dtype=torch.int64)[None, :].expand(rows, positions)
    w0, w1, _, _ = philox4x32_10(row, offset & _U32, (offset >> 32) & _U32, pos + SPECULATIVE_COUNTER,
                                 seed & _U32, (seed >> 32) & _U32)
    return w0, w1


def speculative_values(x: Tensor) -> Tensor:
    """fp32 values as the speculative sampler reads them: NaN, negatives and subnormals 0, +inf FLT_MAX."""
    x = x.float()
    return torch.where(x >= FLT_TINY, x.clamp(max=FLT_MAX), 0.0)


def _residual_fixed(t: Tensor, d: Tensor, q_bits: int):
    """``(fixed-point masses (B, V), their sum (B,))`` of ``max(t - d, 0)`` (fp32, subnormals 0), at the
    larger of its largest exponent and 1.0's, as ``sampling_from_probs``' masses."""
    r = t - d
    bits = torch.where(r >= FLT_TINY, r, 0.0).view(torch.int32)
    q = fixed_point_from_one(bits, q_bits)
    return q, q.sum(-1)


def chain_speculative_sampling(draft_probs: Tensor, draft_token_ids: Tensor, target_probs: Tensor, seed: Tensor,
                               offset: Tensor):
    B, n, V = draft_probs.shape
    dev = draft_probs.device
    if B == 0:
        return (torch.empty((0, n + 1), dtype=torch.int32, device=dev), torch.empty(0, dtype=torch.int32, device=dev),
                torch.empty(0, dtype=torch.int32, device=dev))
    w0, w1 = speculative_words(B, n + 1, seed, offset, dev)
    ids = draft_token_ids.long()
    valid = (ids >= 0) & (ids < V)  # an id outside the vocabulary has probability 0: rejected
    safe = torch.where(valid, ids, 0).unsqueeze(-1)
    q = torch.where(valid, speculative_values(draft_probs.gather(2, safe)).squeeze(-1), 0.0)
    p = torch.where(valid, speculative_values(target_probs[:, :n].gather(2, safe)).squeeze(-1), 0.0)
    # u * q < p with u = (w0 >> 8) / 2^24: both sides exact in fp64 (24 x 24 significand bits)
    accept = (w0[:, :n] >> 8).double() * q.double() < p.double() * 2.0**24
    accepted = accept.sum(1)
    emitted = accept.long().cumprod(1).sum(1)  # the accepted prefix
    pos = emitted
    t = speculative_values(target_probs.gather(1, pos.view(B, 1, 1).expand(B, 1, V)).squeeze(1))
    if n:
        d = speculative_values(draft_probs.gather(1, pos.clamp(max=n - 1).view(B, 1, 1).expand(B, 1, V)).squeeze(1))
        d = torch.where((pos < n).unsqueeze(-1), d, 0.0)  # the bonus token: the target row itself
    else:
        d = torch.zeros_like(t)
    q_bits = fixed_point_bits(V)
    qr, mass = _residual_fixed(t, d, q_bits)
    qt, mass_t = _residual_fixed(t, torch.zeros_like(t), q_bits)
    none = mass == 0  # only when the rows' sums differ: the target row instead (no mass either: token 0)
    qr, mass = torch.where(none.unsqueeze(-1), qt, qr), torch.where(none, mass_t, mass)
    r31 = w1.gather(1, pos.unsqueeze(-1)).squeeze(-1) >> 1
    token = sample_kept(qr, torch.ones_like(qr, dtype=torch.bool), mass, r31).long()
    col = torch.arange(n + 1, device=dev)[None, :]
    drafts = torch.cat([ids, torch.zeros((B, 1), dtype=torch.int64, device=dev)], 1)
    out = torch.where(col < pos[:, None], drafts, torch.where(col == pos[:, None], token[:, None], -1))
    return out.int(), accepted.int(), emitted.int()

# FlashInfer's ``sampling_from_probs``, ``sampling_from_logits`` and ``top_k_top_p_sampling_from_logits``:
# the family's draw without a filter, and ``softmax`` (above) followed by the probs-in ops, composed.


def sampling_from_probs(probs: Tensor, seed: Tensor, offset: Tensor, indices: Optional[Tensor] = None) -> Tensor:
    (probs,) = gather_rows(indices, probs)
    B = probs.shape[0]
    if B == 0:
        return torch.empty(0, dtype=torch.int32, device=probs.device)
    bits = value_bits(probs)
    q = fixed_point_from_one(bits, fixed_point_bits(probs.shape[1]))
    every = torch.ones_like(bits, dtype=torch.bool)
    return sample_kept(q, every, q.sum(-1), random_bits31(B, seed, offset, probs.device))


def sampling_from_logits(logits: Tensor, seed: Tensor, offset: Tensor) -> Tensor:
    return sampling_from_probs(softmax(logits), seed, offset)


def top_k_top_p_sampling_from_logits(logits: Tensor, maybe_top_k_arr, top_k_val: int, maybe_top_p_arr, top_p_val: float,
                                     maybe_temperature_arr, temperature_val: float, seed: Tensor, offset: Tensor,
                                     filter_apply_order: str = "top_k_first") -> Tensor:
    probs = softmax(logits, maybe_temperature_arr, temperature_val)
    return top_k_top_p_sampling_from_probs(probs, maybe_top_k_arr, maybe_top_p_arr, seed, offset, top_k_val, top_p_val,
                                           filter_apply_order)


# ----------------------------------------------------------------------------------------------
# The log-probabilities of sampled tokens (what vLLM's sampler returns beside the ids): the wrapper's
# docstring in ``ops.py`` is the definition.


def sampled_token_logprobs(logits: Tensor, token_ids: Tensor, maybe_temperature_arr=None, temperature_val: float = 1.0):
    B, V = logits.shape
    x = logits.float() * inverse_temperature(maybe_temperature_arr, temperature_val, B, logits.device)
    x = torch.where(logits == float("-inf"), float("-inf"), x)  # softmax's reading
    ids = token_ids.long()
    valid = (ids >= 0) & (ids < V)
    x_tok = x.gather(1, torch.where(valid, ids, 0).unsqueeze(-1))
    m = x.amax(-1, keepdim=True)
    s = torch.exp(x - m).sum(-1, keepdim=True)
    logprob = (x_tok - m - torch.log(s)).squeeze(-1)
    rank = (x >= x_tok).sum(-1)
    return torch.where(valid, logprob, float("nan")), torch.where(valid, rank, 0)
