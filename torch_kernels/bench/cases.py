"""What the benchmarks share, per op: the inputs at a (tokens, hidden) shape, the bytes one call moves,
and FlashInfer's own API as a peer. ``suite.py`` (``python -m torch_kernels bench``) sweeps them over
the shape set; the per-family ``benchmarks/bench_<family>.py`` scripts of the source checkout take
their byte models and FlashInfer peers from here.

Shapes (``PROFILES``): norm and activations over tokens x hidden (an activation's hidden is its ``d``,
input ``(T, 2d)``); FP8 quant over tokens x 7168 (DeepSeek-V3), group 128; rope over tokens x (32 query
+ 8 key heads) x 128, neox, fp32 cache of 8192 positions; ``merge_attn_states`` over tokens x 32 heads
x 128; the routers over tokens x 256 experts, top-8 (``grouped_topk``: DeepSeek-V3's 8 groups, 4 kept,
sigmoid + bias, x2.5); sampling over batch rows (the token count capped at 64) x 128256 (Llama-3's
vocabulary), top_k 50, top_p 0.9. The CPU profile keeps the structure at sizes that run in seconds.

Imports no kernel framework: FlashInfer is imported by :func:`flashinfer_api` when asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Union

import torch

from ..families.rope import ops as rope_op
from ..families.moe.ops import grouped_topk_args

EPS = 1e-6
QUANT_EPS = 1e-10
LOG2E = 1.0 / math.log(2.0)
TOP_K, TOP_P = 50, 0.9

NORM = ("rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm")
ACTIVATION = ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul")
ROUTERS = ("topk_softmax", "grouped_topk")
SAMPLING = ("top_k_renorm_probs", "top_p_renorm_probs", "top_k_top_p_sampling_from_probs")
#: Ops whose time is bytes over bandwidth: the issue's "0.95 of copy" goal applies to them. The routers
#: and the samplers do rounds of selection over each row, so their goal is against the peers only.
MEMORY_BOUND = (*NORM, *ACTIVATION, "rotary_embedding", "per_token_group_quant_fp8", "merge_attn_states")
#: Ops whose shapes have a hidden size taken from the profile's ``hidden`` (else a fixed one).
HIDDEN_OPS = (*NORM, *ACTIVATION)


@dataclass(frozen=True)
class Profile:
    """The shape set of one kind of machine."""

    name: str
    tokens: Tuple[int, ...]  # the token counts of the full set
    quick_tokens: Tuple[int, ...]  # --shapes quick
    hidden: Tuple[int, ...]  # norm and activation (d) hidden sizes; quick takes the first
    quant_hidden: int
    quant_group: int
    rope: Tuple[int, int, int, int]  # query heads, key heads, head size, cached positions
    merge: Tuple[int, int]  # heads, head size
    router: Tuple[int, int, int, int]  # experts, top-k, groups, groups kept
    vocab: int
    rows_cap: int  # sampling: batch rows = min(tokens, rows_cap)


PROFILES = {
    "gpu": Profile("gpu", tokens=(1, 32, 512, 4096, 16384), quick_tokens=(1, 32, 4096), hidden=(4096, 7168, 8192),
                   quant_hidden=7168, quant_group=128, rope=(32, 8, 128, 8192), merge=(32, 128),
                   router=(256, 8, 8, 4), vocab=128256, rows_cap=64),
    # small enough that the whole CPU set (4 ops, reference and op) runs in a few seconds
    "cpu": Profile("cpu", tokens=(1, 16, 256), quick_tokens=(1, 16), hidden=(512,), quant_hidden=512, quant_group=128,
                   rope=(4, 2, 64, 256), merge=(4, 64), router=(64, 4, 8, 2), vocab=1024, rows_cap=8),
}


def shape_of(op: str, tokens: int, hidden: Optional[int], profile: Profile) -> Tuple[int, Optional[int], str]:
    """(rows, hidden, label) of ``op`` at ``tokens`` (and ``hidden`` for the ops that have one; FP8
    quant's defaults to ``profile.quant_hidden``)."""
    if op in HIDDEN_OPS:
        return tokens, hidden, f"{tokens}x2*{hidden}" if op in ACTIVATION else f"{tokens}x{hidden}"
    if op == "per_token_group_quant_fp8":
        hidden = hidden or profile.quant_hidden
        return tokens, hidden, f"{tokens}x{hidden} g{profile.quant_group}"
    if op == "rotary_embedding":
        hq, hk, hs, _ = profile.rope
        return tokens, None, f"{tokens}x({hq}+{hk})x{hs}"
    if op == "merge_attn_states":
        return tokens, None, f"{tokens}x{profile.merge[0]}x{profile.merge[1]}"
    if op in ROUTERS:
        return tokens, None, f"{tokens}x{profile.router[0]} top{profile.router[1]}"
    rows = min(tokens, profile.rows_cap)
    return rows, None, f"{rows}x{profile.vocab}"


def build(op: str, rows: int, hidden: Optional[int], profile: Profile, device, dtype: torch.dtype) -> tuple:
    """Fresh random arguments of ``op`` (never zeros). ``dtype`` is the data dtype of the norm,
    activation, rope, quant and merge ops; the routers take fp32 logits (DeepSeek-V3's router runs in
    fp32) and the samplers fp32 probabilities (the only dtype of the family's kernels)."""
    randn = lambda *shape, dt=dtype: torch.randn(*shape, device=device, dtype=dt)  # noqa: E731
    if op in ("rmsnorm", "gemma_rmsnorm"):
        return randn(rows, hidden), randn(hidden), EPS
    if op in ("fused_add_rmsnorm", "gemma_fused_add_rmsnorm"):
        return randn(rows, hidden), randn(rows, hidden), randn(hidden), EPS
    if op in ACTIVATION:
        x = randn(rows, 2 * hidden) * 2
        return (x, "none") if op == "gelu_and_mul" else (x,)
    if op == "rotary_embedding":
        hq, hk, hs, max_pos = profile.rope
        return rope_op.make_args(rows, hq, hk, hs, hs, True, "2d", device, dtype, torch.float32, torch.int64, max_pos)
    if op == "per_token_group_quant_fp8":
        return randn(rows, hidden) * 4, profile.quant_group, QUANT_EPS, False, False
    if op == "merge_attn_states":
        return merge_inputs(rows, *profile.merge, device, dtype)
    experts, topk, groups, kept = profile.router
    if op == "topk_softmax":
        return randn(rows, experts, dt=torch.float32) * 2, topk, True
    if op == "grouped_topk":
        return grouped_topk_args(rows, experts, None, topk, True, groups, kept, "sigmoid", torch.float32, 2.5,
                                 device=device, dtype=torch.float32)
    probs = torch.softmax(randn(rows, profile.vocab, dt=torch.float32) * 3, -1)
    top_k = torch.full((rows,), TOP_K, dtype=torch.int32, device=device)
    top_p = torch.full((rows,), TOP_P, device=device)
    if op == "top_k_renorm_probs":
        return probs, top_k
    if op == "top_p_renorm_probs":
        return probs, top_p
    return probs, top_k, top_p, torch.tensor(1234, device=device), torch.tensor(0, device=device)


def merge_inputs(tokens: int, heads: int, head_size: int, device, dtype=torch.bfloat16) -> tuple:
    """``(v_a, lse_a, v_b, lse_b)``: random partial results and natural-log LSEs around 3."""
    v_a = torch.randn(tokens, heads, head_size, device=device, dtype=dtype)
    v_b = torch.randn(tokens, heads, head_size, device=device, dtype=dtype)
    lse_a = torch.randn(tokens, heads, device=device) * 2 + 3
    lse_b = torch.randn(tokens, heads, device=device) * 2 + 3
    return v_a, lse_a, v_b, lse_b


def _size(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def nbytes(op: str, args: tuple) -> int:
    """Bytes one call of ``op`` on ``args`` reads and writes at the least (each tensor once)."""
    x = args[0]
    if op in ("rmsnorm", "gemma_rmsnorm"):
        return 2 * _size(x) + _size(args[1])  # read x, write the output, read w
    if op in ("fused_add_rmsnorm", "gemma_fused_add_rmsnorm"):
        return 4 * _size(x) + _size(args[2])  # read x and r, write both, read w
    if op in ACTIVATION:
        return _size(x) * 3 // 2  # read (T, 2d), write (T, d)
    if op == "rotary_embedding":
        positions, q, k, head_size, cache, _ = args
        rot = cache.shape[1]
        # query and key read and written (their rotated dims), the positions, one cache row a token
        return (2 * (_size(q) + _size(k)) * rot // head_size + _size(positions)
                + positions.numel() * rot * cache.element_size())
    if op == "per_token_group_quant_fp8":
        return _size(x) + x.numel() + x.numel() // args[1] * 4  # read x, write fp8 q and fp32 scales
    if op in ROUTERS:
        bias = args[6] if op == "grouped_topk" else None
        return _size(x) + x.shape[0] * args[1] * 8 + _size(bias)  # logits, fp32 weights + int32 ids, bias
    if op == "merge_attn_states":
        v_a, lse_a = args[0], args[1]
        return 3 * _size(v_a) + 3 * lse_a.numel() * 4  # read two v and two LSEs, write one of each
    # the samplers: one read of the probabilities (the renormalisers also write them): a floor
    return _size(x) * (1 if op == "top_k_top_p_sampling_from_probs" else 2)


@dataclass(frozen=True)
class Peer:
    """FlashInfer's own function for an op: ``fn(*prepare(args))`` is timed; ``prepare`` runs once,
    outside the timed region; ``adapt`` maps its outputs to the reference's conventions for the check;
    ``compare(got, want, dtype)``, where given, replaces the op's own comparison."""

    name: str
    fn: Callable
    prepare: Callable[[tuple], tuple] = lambda args: args
    adapt: Callable[[list], list] = lambda outs: outs
    compare: Optional[Callable[[list, list, torch.dtype], None]] = None


def _compare_base2_merge(got: list, want: list, dtype: torch.dtype) -> None:
    """FlashInfer's merge: ``v`` at its dtype's tolerance; the LSE at fp16's only, as FlashInfer's
    ``exp2``/``log2`` are approximate instructions (tests/test_attention.py checks the same)."""
    from ..testing import assert_close

    assert_close(got[0], want[0], dtype, msg="v")
    assert_close(got[1], want[1], torch.float16, msg="lse")


def flashinfer_api(op: str, args: tuple) -> Union[Peer, str]:
    """FlashInfer's own API for ``op`` on ``args``, or why there is none. Only FlashInfer functions
    whose JIT modules build in seconds (norm, activation, rope, cascade, sampling) are called: the
    routers' fused_moe module builds for minutes."""
    if op in ("per_token_group_quant_fp8",):
        return "FlashInfer 0.7.4 has no per-token-group FP8 quantisation"
    if op in ROUTERS:
        return "not timed: FlashInfer's routers (fused_moe) build a JIT module for several minutes"
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # noqa: BLE001  (reported in the results)
        return f"FlashInfer not importable: {type(e).__name__}: {e}"[:200]
    if op in NORM:
        import flashinfer.norm
        return Peer(f"flashinfer.norm.{op}", getattr(flashinfer.norm, op))
    if op in ACTIVATION:
        import flashinfer.activation
        name = "gelu_tanh_and_mul" if op == "gelu_and_mul" and args[1] == "tanh" else op
        fn = getattr(flashinfer.activation, name)
        return Peer(f"flashinfer.activation.{name}", lambda x, *_: fn(x))
    if op == "rotary_embedding":
        import flashinfer.rope
        return Peer("flashinfer.rope.apply_rope_with_cos_sin_cache_inplace",
                    lambda p, q, k, hs, cache, neox: flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
                        p, q, k, hs, cache, is_neox=neox))
    if op == "merge_attn_states":
        import flashinfer.cascade
        # its LSEs are base 2: converted once outside the timed call (an engine built on FlashInfer
        # keeps base-2 LSEs throughout), and its output LSE back for the check
        return Peer("flashinfer.cascade.merge_state (base-2 LSE)", flashinfer.cascade.merge_state,
                    prepare=lambda a: (a[0], (a[1] * LOG2E).contiguous(), a[2], (a[3] * LOG2E).contiguous()),
                    adapt=lambda outs: [outs[0], outs[1] / LOG2E], compare=_compare_base2_merge)
    return flashinfer_sampling(op, args)["flashinfer"]


def flashinfer_sampling(op: str, args: tuple) -> Dict[str, Union[Peer, str]]:
    """FlashInfer's sampling peers of a call: ``{name: Peer, or a string saying why there is none}``.
    Only its sampling JIT module is used (saved on the host): with per-row ``top_k`` tensors its
    default ``top_k_first`` order is ``top_k_renorm_probs`` then ``top_p_sampling_from_probs``, both in
    that module, and is our semantics (top-p over the renormalised top-k survivors); ``joint`` (one
    kernel) is another filter, timed for reference. Seed and offset are passed as ints where the API
    takes them (graph capture then reads no generator state)."""
    try:
        import inspect

        import flashinfer.sampling as fs
    except Exception as e:  # noqa: BLE001
        return {"flashinfer": f"not importable: {type(e).__name__}: {e}"[:200]}
    if op == "top_k_renorm_probs":
        return {"flashinfer": Peer("flashinfer.sampling.top_k_renorm_probs", fs.top_k_renorm_probs)}
    if op == "top_p_renorm_probs":
        return {"flashinfer": Peer("flashinfer.sampling.top_p_renorm_probs", fs.top_p_renorm_probs)}
    probs, k, p, seed, offset = args
    rng = {}
    if "seed" in inspect.signature(fs.top_p_sampling_from_probs).parameters:
        rng = dict(seed=int(seed), offset=int(offset))
    if int(k.max()) <= 0:  # top-k off: FlashInfer's top-p sampling alone
        return {"flashinfer": Peer("flashinfer.sampling.top_p_sampling_from_probs",
                                   lambda probs, k, p, *_: fs.top_p_sampling_from_probs(probs, p, **rng))}
    return {"flashinfer": Peer("flashinfer.sampling.top_k_top_p_sampling_from_probs (top_k_first)",
                               lambda probs, k, p, *_: fs.top_k_top_p_sampling_from_probs(
                                   probs, k, p, filter_apply_order="top_k_first", **rng)),
            "flashinfer joint (other filter)": Peer(
                "flashinfer.sampling.top_k_top_p_sampling_from_probs (joint)",
                lambda probs, k, p, *_: fs.top_k_top_p_sampling_from_probs(probs, k, p, filter_apply_order="joint", **rng))}


def kept_set(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``(B, V)`` bool: the tokens the reference's top-k then top-p filter keeps (where any correct
    sampler's ids must fall, whatever its random stream)."""
    from ..families.sampling import reference

    bits = reference.value_bits(probs)
    q = reference.fixed_point(bits, bits.amax(-1, keepdim=True), reference.fixed_point_bits(probs.shape[1]))
    return reference.kept_mask(bits, q, top_k, top_p)[0]
