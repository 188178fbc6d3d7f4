"""An FP8 Llama-style decoder layer: weights in float8_e4m3fn, each GEMM's input quantised per token,
three ways (our fused ops, our unfused ops, plain torch) over the same weights.

    python examples/fp8_decoder_layer.py [--device cuda] [--tokens 32] [--tiny] [--compile]

Every projection is ``torch._scaled_mm`` with row-wise scales: the activation quantised dynamically
per token (``scale_a (T, 1)``), the weight per output channel (``scale_b (1, N)``, fp32), the output
in the activation dtype (bf16). The variants, which differ only in how the norms, the activation
and the quantisations are written:

* ``"fused"``: ``rmsnorm_fp8_quant`` -> QKV -> ``rotary_embedding`` -> SDPA -> ``scaled_fp8_quant``
  -> O -> ``fused_add_rmsnorm_fp8_quant`` -> gate/up -> ``silu_and_mul_fp8_quant`` -> down;
* ``"unfused"``: ``rmsnorm`` / ``fused_add_rmsnorm`` / ``silu_and_mul`` each followed by
  ``scaled_fp8_quant(per_token=True)``: the graph that ``torch_kernels.passes.install_fp8_fusion()``
  rewrites into the fused one. The fused ops return what the pairs return bit for bit, so the two
  variants' outputs are equal;
* ``"plain"``: plain torch (the rmsnorm formula, ``F.silu(g) * u``, vLLM's ``QuantFP8.forward_native``
  per-token quantisation, the rotary formula out of place): close to the others, not equal (the
  residual sum is rounded before the norm, the scale divided by a Python scalar).

Where ``torch._scaled_mm`` refuses FP8 on the device (older torch on the CPU), :func:`fp8_linear`
multiplies the dequantised operands in fp32 instead. ``main`` checks fused against unfused (equal)
and both against plain; ``benchmarks/bench_fp8_layer.py`` and ``tests/test_fp8_layer.py`` use the classes.
"""

import argparse
import contextlib
import copy
import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_kernels  # noqa: E402,F401  (registers torch.ops.deepinfer)
from decoder_layer import LLAMA_8B, TINY, Config, DecoderLayer, _rmsnorm, _rope, inputs, relative_error  # noqa: E402,F401
from torch_kernels.families.rope.ops import make_cos_sin_cache  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor of a dynamic scale
VARIANTS = ("fused", "unfused", "plain")
#: relative errors (output, residual) allowed against plain eager: a bf16 ulp of difference in front of
#: a quantisation moves values a whole e4m3 step. Measured at hidden 1024: ours 3.7-4.9% (output) and 0;
#: plain compiled 7.2% and 2.4% (Inductor skips the bf16 roundings ahead of the quants; equal with
#: ``emulate_precision_casts``)
PLAIN_TOLERANCE = (0.15, 0.05)


@functools.lru_cache(maxsize=None)
def scaled_mm_supported(device_type: str) -> bool:
    """Whether ``torch._scaled_mm`` takes FP8 with row-wise scales on ``device_type`` (probed once)."""
    a = torch.ones(16, 16, device=device_type).to(FP8)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device_type),
                         scale_b=torch.ones(1, 16, device=device_type), out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def fp8_linear(x_q, x_scale, weight, weight_scale, out_dtype, native: bool = True):
    """``(x_q * x_scale) @ (weight * weight_scale).T``: ``x_q (T, K)`` fp8 with ``x_scale (T, 1)``,
    ``weight (N, K)`` fp8 with ``weight_scale (1, N)``, fp32 scales -> ``(T, N)`` ``out_dtype``. By
    ``torch._scaled_mm``; ``native=False`` (a device where it refuses FP8): the fp8 operands upcast to
    fp32, multiplied, then scaled, as the GEMM computes it."""
    if native:
        return torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=out_dtype)
    return (x_q.float() @ weight.float().t() * x_scale * weight_scale).to(out_dtype)


def quantize_weight(w: torch.Tensor):
    """Per output channel (row of ``w (N, K)``): ``(fp8 (N, K), fp32 scales (1, N))``."""
    scale = (w.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.reshape(1, -1).contiguous()


def plain_quant_per_token(x: torch.Tensor):
    """vLLM's ``QuantFP8.forward_native``, dynamic per token: ``(fp8 (T, K), fp32 (T, 1))``."""
    amax = x.abs().max(dim=-1).values.unsqueeze(-1).to(torch.float32)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.to(torch.float32) * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@contextlib.contextmanager
def fp8_fusion(enabled: bool = True):
    """``torch_kernels.passes.install_fp8_fusion()`` for the compiles inside (Inductor applies its
    post-grad passes when it compiles: at a compiled function's first call at each shape)."""
    if not enabled:
        yield
        return
    from torch_kernels import passes

    passes.install_fp8_fusion()
    try:
        yield
    finally:
        passes.uninstall_fp8_fusion()


class FP8DecoderLayer(torch.nn.Module):
    """One decoder layer with FP8 weights, written as ``variant`` (``"fused"``, ``"unfused"`` or
    ``"plain"``). Two layers built with the same ``seed`` hold the same weights; :meth:`as_variant`
    shares them instead."""

    def __init__(self, cfg: Config = LLAMA_8B, variant: str = "fused", device=None, dtype=torch.bfloat16,
                 seed: int = 0):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.cfg, self.variant, self.dtype = cfg, variant, dtype
        g = torch.Generator().manual_seed(seed)

        def norm_weight():  # random around 1, never zeros
            return torch.nn.Parameter((1 + 0.1 * torch.randn(cfg.hidden, generator=g)).to(device=device, dtype=dtype),
                                      requires_grad=False)

        def proj(name, n, k):  # random, scaled by 1/sqrt(fan-in), then quantised per output channel
            q, s = quantize_weight(torch.randn(n, k, generator=g) * k ** -0.5)
            self.register_buffer(name, q.to(device))
            self.register_buffer(name + "_scale", s.to(device))

        self.q_size, self.kv_size = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.input_norm = norm_weight()
        proj("qkv_proj", self.q_size + 2 * self.kv_size, cfg.hidden)
        proj("o_proj", cfg.hidden, self.q_size)
        self.post_norm = norm_weight()
        proj("gate_up_proj", 2 * cfg.intermediate, cfg.hidden)
        proj("down_proj", cfg.hidden, cfg.intermediate)
        self.register_buffer("cos_sin_cache", make_cos_sin_cache(cfg.max_position, cfg.head_dim, cfg.rope_base, device=device))
        self.native_mm = scaled_mm_supported(self.qkv_proj.device.type)

    def as_variant(self, variant: str) -> "FP8DecoderLayer":
        """The same layer (the same weight tensors) written as ``variant``."""
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        other = copy.copy(self)
        other.__dict__["variant"] = variant
        return other

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor):
        """``positions (T,)`` int64, ``hidden_states (T, hidden)`` -> ``(mlp output, residual)``."""
        return self._plain(positions, hidden_states) if self.variant == "plain" else self._ours(positions, hidden_states)

    def _linear(self, x_q, x_scale, name):
        return fp8_linear(x_q, x_scale, getattr(self, name), getattr(self, name + "_scale"), self.dtype, self.native_mm)

    _attention = DecoderLayer._attention  # the bf16 layer's causal grouped-query SDPA

    def _ours(self, positions, hidden_states):
        cfg, ops, fused = self.cfg, torch.ops.deepinfer, self.variant == "fused"

        def quant(y):
            return ops.scaled_fp8_quant(y, None, True)

        if fused:
            x_q, x_s = ops.rmsnorm_fp8_quant(hidden_states, self.input_norm, cfg.eps, None, -1)
        else:
            x_q, x_s = quant(ops.rmsnorm(hidden_states, self.input_norm, cfg.eps))
        q, k, v = self._linear(x_q, x_s, "qkv_proj").split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        ops.rotary_embedding(positions, q, k, cfg.head_dim, self.cos_sin_cache, True)
        o = self._linear(*quant(self._attention(q, k, v)), "o_proj")
        if fused:  # o += hidden_states, the new residual in o's buffer (bit for bit the sum the other
            # way round); quantised rmsnorm of it. The caller's tensor (maybe a CUDA graph's input) is
            # left as it was
            x_q, x_s = ops.fused_add_rmsnorm_fp8_quant(hidden_states, o, self.post_norm, cfg.eps, None, -1)
            residual = o
        else:  # residual += o on a copy of the caller's tensor; o = rmsnorm(residual)
            residual = hidden_states.clone()
            ops.fused_add_rmsnorm(o, residual, self.post_norm, cfg.eps)
            x_q, x_s = quant(o)
        gate_up = self._linear(x_q, x_s, "gate_up_proj")
        x_q, x_s = ops.silu_and_mul_fp8_quant(gate_up, None, -1) if fused else quant(ops.silu_and_mul(gate_up))
        return self._linear(x_q, x_s, "down_proj"), residual

    def _plain(self, positions, hidden_states):
        cfg = self.cfg
        x_q, x_s = plain_quant_per_token(_rmsnorm(hidden_states, self.input_norm, cfg.eps))
        q, k, v = self._linear(x_q, x_s, "qkv_proj").split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        q, k = _rope(q, cos, sin, cfg.head_dim), _rope(k, cos, sin, cfg.head_dim)
        residual = hidden_states + self._linear(*plain_quant_per_token(self._attention(q, k, v)), "o_proj")
        x_q, x_s = plain_quant_per_token(_rmsnorm(residual, self.post_norm, cfg.eps))
        gate, up = self._linear(x_q, x_s, "gate_up_proj").chunk(2, dim=-1)
        return self._linear(*plain_quant_per_token(F.silu(gate) * up), "down_proj"), residual


def build(cfg: Config = LLAMA_8B, device=None, dtype=torch.bfloat16, seed: int = 0) -> dict:
    """``{variant: layer}``, the three variants over one set of weights."""
    layer = FP8DecoderLayer(cfg, "fused", device, dtype, seed)
    return {v: layer.as_variant(v) for v in VARIANTS}


def equal(got, want) -> bool:
    """Every output equal, bit for bit."""
    return all(torch.equal(g, w) for g, w in zip(got, want))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="a small layer (hidden 64) instead of Llama-8B's")
    p.add_argument("--compile", action="store_true", help="also the unfused layer compiled with and without the pass")
    a = p.parse_args(argv)
    cfg = TINY if a.tiny else LLAMA_8B
    layers = build(cfg, a.device)
    positions, hidden = inputs(cfg, a.tokens, a.device, torch.bfloat16)
    with torch.inference_mode():
        want = layers["plain"](positions, hidden)
        unfused = layers["unfused"](positions, hidden)
        results = {"fused": layers["fused"](positions, hidden), "unfused": unfused}
        if a.compile:
            for on in (False, True):
                torch._dynamo.reset()
                with fp8_fusion(on):
                    results[f"unfused compiled {'with' if on else 'no'} pass"] = \
                        torch.compile(layers["unfused"], fullgraph=True)(positions, hidden)
    failed = False
    for name, got in results.items():
        errors = ", ".join(f"{relative_error(g, w):.2e}" for g, w in zip(got, want))
        same = equal(got, unfused)
        failed |= name == "fused" and not same
        print(f"{name:26s} equal to unfused eager: {str(same):5s}  relative error against plain (output, residual): {errors}")
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
