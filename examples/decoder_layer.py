"""A Llama-style decoder layer written with ``torch.ops.deepinfer``, and the same layer in plain torch.

    python examples/decoder_layer.py [--device cuda] [--tokens 32] [--dtype bfloat16] [--tiny]

Ours: ``rmsnorm`` -> QKV projection -> ``rotary_embedding`` (in place on the q and k views of the
projection's output) -> SDPA attention (causal, grouped-query) -> O projection ->
``fused_add_rmsnorm`` (the residual updated in place, the normalised sum written over the attention
output) -> gate/up projection -> ``silu_and_mul`` -> down projection. Plain: the same formulas in
torch, out of place. Both return ``(hidden_states, residual)`` as vLLM's layers do (the next layer's
norm adds the residual). ``main`` checks ours against plain, eager and ``torch.compile``d;
``tests/test_compile.py`` and ``benchmarks/bench_compile.py`` use the classes.
"""

import argparse
import dataclasses

import torch
import torch.nn.functional as F

import torch_kernels  # noqa: F401  (registers torch.ops.deepinfer)
from torch_kernels.families.rope.ops import make_cos_sin_cache


@dataclasses.dataclass(frozen=True)
class Config:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    eps: float = 1e-5
    rope_base: float = 500000.0
    max_position: int = 8192


LLAMA_8B = Config()  # Llama-3-8B's shapes
TINY = Config(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, max_position=64)


class DecoderLayer(torch.nn.Module):
    """One decoder layer; ``ours`` picks the deepinfer ops or plain torch. Two layers built with the
    same ``seed`` hold the same weights."""

    def __init__(self, cfg: Config = LLAMA_8B, ours: bool = True, device=None, dtype=torch.float32, seed: int = 0):
        super().__init__()
        self.cfg, self.ours = cfg, ours
        g = torch.Generator().manual_seed(seed)

        def param(*shape, scale=None, offset=0.0):  # random, never zeros; projections scaled by 1/sqrt(fan-in)
            t = torch.randn(*shape, generator=g) * (scale if scale is not None else shape[-1] ** -0.5) + offset
            return torch.nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)

        self.q_size, self.kv_size = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.input_norm = param(cfg.hidden, scale=0.1, offset=1.0)
        self.qkv_proj = param(self.q_size + 2 * self.kv_size, cfg.hidden)
        self.o_proj = param(cfg.hidden, self.q_size)
        self.post_norm = param(cfg.hidden, scale=0.1, offset=1.0)
        self.gate_up_proj = param(2 * cfg.intermediate, cfg.hidden)
        self.down_proj = param(cfg.hidden, cfg.intermediate)
        self.register_buffer("cos_sin_cache", make_cos_sin_cache(cfg.max_position, cfg.head_dim, cfg.rope_base, device=device))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor):
        """``positions (T,)`` int64, ``hidden_states (T, hidden)`` -> ``(mlp output, residual)``."""
        return (self._ours if self.ours else self._plain)(positions, hidden_states)

    def _attention(self, q, k, v):
        """Causal grouped-query SDPA over the T tokens (one sequence): ``(T, heads*head_dim)`` out."""
        T, hd = q.shape[0], self.cfg.head_dim
        # (1, heads, T, head_dim): SDPA's fused kernels take 4-D inputs only (3-D ran the fp32 math path,
        # 2.1 of 2.9 ms of the FP8 layer at 2048 tokens)
        q, k, v = (t.reshape(1, T, -1, hd).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(T, self.q_size)

    def _rope_attention(self, positions, q, k, v):
        """``rotary_embedding`` in place on the q and k views, then :meth:`_attention`."""
        torch.ops.deepinfer.rotary_embedding(positions, q, k, self.cfg.head_dim, self.cos_sin_cache, True)
        return self._attention(q, k, v)

    def _plain_rope_attention(self, positions, q, k, v):
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        hd = self.cfg.head_dim
        return self._attention(_rope(q, cos, sin, hd), _rope(k, cos, sin, hd), v)

    def _ours(self, positions, hidden_states, attend=None):
        """``attend(positions, q, k, v)``: the rotary embedding and the attention (default
        :meth:`_rope_attention`), over the projection's q, k and v views."""
        cfg, ops = self.cfg, torch.ops.deepinfer
        # updated in place by fused_add_rmsnorm: a copy, so that the caller's tensor (which may be a
        # CUDA graph's input) is not written
        residual = hidden_states.clone()
        h = ops.rmsnorm(hidden_states, self.input_norm, cfg.eps)
        q, k, v = F.linear(h, self.qkv_proj).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        attend = self._rope_attention if attend is None else attend
        o = F.linear(attend(positions, q, k, v), self.o_proj)
        ops.fused_add_rmsnorm(o, residual, self.post_norm, cfg.eps)  # residual += o; o = rmsnorm(residual)
        return F.linear(ops.silu_and_mul(F.linear(o, self.gate_up_proj)), self.down_proj), residual

    def _plain(self, positions, hidden_states, attend=None):
        cfg = self.cfg
        residual = hidden_states
        h = _rmsnorm(hidden_states, self.input_norm, cfg.eps)
        q, k, v = F.linear(h, self.qkv_proj).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        attend = self._plain_rope_attention if attend is None else attend
        residual = residual + F.linear(attend(positions, q, k, v), self.o_proj)
        gate, up = F.linear(_rmsnorm(residual, self.post_norm, cfg.eps), self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj), residual


def _rmsnorm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _rope(x, cos, sin, head_dim):
    """Neox rotary embedding of ``x (T, heads*head_dim)``, out of place, in fp32."""
    xf = x.float().unflatten(-1, (-1, head_dim))
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)


def inputs(cfg: Config, tokens: int, device=None, dtype=torch.float32, seed: int = 1):
    """``(positions, hidden_states)`` for a prefill of ``tokens`` tokens (positions 0..T-1)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(tokens, device=device) % cfg.max_position
    return positions, torch.randn(tokens, cfg.hidden, generator=g).to(device=device, dtype=dtype)


def relative_error(got, want) -> float:
    """``|got - want| / |want|`` in the Frobenius norm, over fp32 copies."""
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--tiny", action="store_true", help="a small layer (hidden 64) instead of Llama-8B's")
    a = p.parse_args(argv)
    cfg, dtype = (TINY if a.tiny else LLAMA_8B), getattr(torch, a.dtype)
    ours, plain = (DecoderLayer(cfg, flag, a.device, dtype) for flag in (True, False))
    args = inputs(cfg, a.tokens, a.device, dtype)
    with torch.inference_mode():
        want = plain(*args)
        results = {"eager": ours(*args), "compiled": torch.compile(ours, fullgraph=True)(*args),
                   "plain compiled": torch.compile(plain, fullgraph=True)(*args)}
    for name, got in results.items():
        errors = ", ".join(f"{relative_error(g, w):.2e}" for g, w in zip(got, want))
        print(f"{name:15s} against plain eager, relative error (output, residual): {errors}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
