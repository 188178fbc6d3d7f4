"""The decoder layer of ``decoder_layer.py`` with a paged KV cache, as a serving engine runs a prefill:
each token's rotated key and its value written once into ``(num_blocks, block_size, kv_heads,
head_dim)`` caches at its slot, then the sequence's keys and values gathered back from the caches for
SDPA.

    python examples/paged_decoder_layer.py [--device cuda] [--tokens 32] [--qk-norm] [--tiny]

The sequence's blocks are a random permutation of the cache's (``block_table``), so both the write
and the read are paged; ``slots(positions, block_table)`` maps a position to its slot. Three variants
over one set of weights (those of ``DecoderLayer`` with the same ``seed``, plus Qwen3's per-head q and
k norm weights with ``qk_norm``), each ``forward(positions, hidden_states, key_cache, value_cache,
slot_mapping) -> (output, residual)``, the caches written:

* ``"fused"``: ``rotary_embedding_and_cache`` (q rotated in place, the rotated k and v into the cache in
  one pass); with ``qk_norm``, ``qk_rmsnorm_rope`` then ``reshape_and_cache_flash``;
* ``"unfused"``: ``rotary_embedding`` (with ``qk_norm``, ``rmsnorm`` of each head first) then
  ``reshape_and_cache_flash``: the same bits as ``"fused"``, and without ``qk_norm`` the same output as
  ``DecoderLayer``'s own ops (the cache holds exactly the rotated keys);
* ``"plain"``: plain torch, out of place: the rotary formula, ``index_copy_`` into the flattened caches,
  ``index_select`` out of them.

``benchmarks/bench_paged_layer.py`` times them beside the cacheless layer; ``tests/test_compile.py``
checks them.
"""

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decoder_layer import LLAMA_8B, TINY, Config, DecoderLayer, _rmsnorm, _rope, inputs, relative_error  # noqa: E402

VARIANTS = ("fused", "unfused", "plain")
BLOCK_SIZE = 16  # vLLM's default block size


class PagedDecoderLayer(DecoderLayer):
    """``DecoderLayer`` (the same weights for the same ``seed``) whose attention writes and reads a
    paged KV cache, written as ``variant``; ``qk_norm``: Qwen3's RMSNorm of every q and k head before
    the rotary embedding."""

    def __init__(self, cfg: Config = LLAMA_8B, variant: str = "fused", device=None, dtype=torch.float32, seed: int = 0,
                 qk_norm: bool = False):
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        super().__init__(cfg, variant != "plain", device, dtype, seed)
        self.variant, self.qk_norm, self.dtype = variant, qk_norm, dtype
        g = torch.Generator().manual_seed(seed + 1)  # DecoderLayer's weights stay those of `seed`
        for name in ("q_norm", "k_norm"):  # random around 1, never zeros
            w = (1 + 0.1 * torch.randn(cfg.head_dim, generator=g)).to(device=device, dtype=dtype)
            self.register_parameter(name, torch.nn.Parameter(w, requires_grad=False))
        self.register_buffer("scale", torch.ones((), device=device))  # k_scale, v_scale: unused by "auto" caches

    def new_caches(self, num_blocks: int, generator=None):
        """``(key_cache, value_cache)``, ``(num_blocks, BLOCK_SIZE, kv_heads, head_dim)``, random (a slot
        read before it is written shows)."""
        shape = (num_blocks, BLOCK_SIZE, self.cfg.kv_heads, self.cfg.head_dim)
        return tuple(torch.randn(shape, generator=generator).to(device=self.cos_sin_cache.device, dtype=self.dtype)
                     for _ in range(2))

    def forward(self, positions, hidden_states, key_cache, value_cache, slot_mapping):
        """``positions (T,)`` int64 of one sequence's tokens 0..T-1, ``hidden_states (T, hidden)``, the
        caches and each token's ``slot_mapping (T,)`` int64 -> ``(mlp output, residual)``; the caches
        hold the sequence's keys and values afterwards."""
        attend = functools.partial(self._paged_attention, key_cache=key_cache, value_cache=value_cache,
                                   slot_mapping=slot_mapping)
        return (self._plain if self.variant == "plain" else self._ours)(positions, hidden_states, attend)

    def _paged_attention(self, positions, q, k, v, key_cache, value_cache, slot_mapping):
        cfg, ops, hd = self.cfg, torch.ops.deepinfer, self.cfg.head_dim

        def heads(x):  # (T, H*hd) -> (T, H, hd), a view
            return x.unflatten(-1, (-1, hd))

        if self.variant == "plain":
            if self.qk_norm:
                q, k = (_rmsnorm(heads(x), w, cfg.eps).flatten(-2) for x, w in ((q, self.q_norm), (k, self.k_norm)))
            cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
            q, k = _rope(q, cos, sin, hd), _rope(k, cos, sin, hd)
            key_cache.flatten(0, 1).index_copy_(0, slot_mapping, heads(k))
            value_cache.flatten(0, 1).index_copy_(0, slot_mapping, heads(v))
        else:
            cache, fused = (key_cache, value_cache, slot_mapping, "auto", self.scale, self.scale), self.variant == "fused"
            if fused and not self.qk_norm:  # the rotary embedding and the cache write in one pass
                ops.rotary_embedding_and_cache(positions, q, k, v, hd, self.cos_sin_cache, True, *cache)
            else:
                if fused:
                    ops.qk_rmsnorm_rope(positions, q, k, self.q_norm, self.k_norm, cfg.eps, hd, self.cos_sin_cache, True)
                else:
                    for x, w in ((q, self.q_norm), (k, self.k_norm)) if self.qk_norm else ():
                        heads(x).copy_(ops.rmsnorm(heads(x), w, cfg.eps))  # over the projection's views
                    ops.rotary_embedding(positions, q, k, hd, self.cos_sin_cache, True)
                ops.reshape_and_cache_flash(heads(k), heads(v), *cache)
        # the sequence's keys and values, read back from the caches at its slots
        k, v = (c.flatten(0, 1).index_select(0, slot_mapping).flatten(1) for c in (key_cache, value_cache))
        return self._attention(q, k, v)


def build(cfg: Config = LLAMA_8B, device=None, dtype=torch.float32, seed: int = 0, qk_norm: bool = False) -> dict:
    """``{variant: layer}``, the three variants over the same weights."""
    return {v: PagedDecoderLayer(cfg, v, device, dtype, seed, qk_norm) for v in VARIANTS}


def block_table(tokens: int, num_blocks: int, generator=None) -> torch.Tensor:
    """The blocks of a sequence of ``tokens``: distinct, a random choice among ``num_blocks``."""
    need = -(-tokens // BLOCK_SIZE)
    if need > num_blocks:
        raise ValueError(f"{tokens} tokens need {need} blocks of {BLOCK_SIZE}; the cache has {num_blocks}")
    return torch.randperm(num_blocks, generator=generator)[:need]


def slots(positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Each position's slot: ``table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE``."""
    return table.to(positions.device)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE


def paged_inputs(cfg: Config, tokens: int, num_blocks: int, device=None, dtype=torch.float32, seed: int = 1):
    """``(positions, hidden_states, slot_mapping)`` of a prefill of ``tokens`` tokens in a cache of
    ``num_blocks`` blocks."""
    positions, hidden_states = inputs(cfg, tokens, device, dtype, seed)
    table = block_table(tokens, num_blocks, torch.Generator().manual_seed(seed))
    return positions, hidden_states, slots(positions, table)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--qk-norm", action="store_true", help="Qwen3's per-head q and k RMSNorm")
    p.add_argument("--tiny", action="store_true", help="a small layer (hidden 64) instead of Llama-8B's")
    a = p.parse_args(argv)
    cfg, dtype = (TINY if a.tiny else LLAMA_8B), getattr(torch, a.dtype)
    layers = build(cfg, a.device, dtype, qk_norm=a.qk_norm)
    num_blocks = 2 * -(-a.tokens // BLOCK_SIZE) + 1
    positions, hidden_states, slot_mapping = paged_inputs(cfg, a.tokens, num_blocks, a.device, dtype)
    with torch.inference_mode():
        results = {}
        for name, layer in layers.items():
            caches = layer.new_caches(num_blocks, torch.Generator().manual_seed(2))
            results[name] = layer(positions, hidden_states, *caches, slot_mapping), caches
    (want, _), (fused, fused_caches), (unfused, unfused_caches) = results["plain"], results["fused"], results["unfused"]
    same = all(torch.equal(x, y) for x, y in zip((*fused, *fused_caches), (*unfused, *unfused_caches)))
    # with qk_norm on CUDA the unfused ops come from two backends (rmsnorm's and rotary_embedding's
    # defaults), whose last ulps may differ from the fused op's one backend
    print(f"fused = unfused, bit for bit (outputs and caches): {same}")
    for name in ("fused", "unfused"):
        errors = ", ".join(f"{relative_error(g, w):.2e}" for g, w in zip(results[name][0], want))
        print(f"{name:8s} against plain, relative error (output, residual): {errors}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
