"""torch_kernels: the non-GEMM kernels of an LLM inference engine as ``torch.ops.deepinfer.*``.

``import torch_kernels`` registers every op (eager, ``torch.compile`` and ``opcheck`` ready) and
imports no kernel framework; backends load on the first CUDA call of each op.
"""

import importlib.util as _util

from .spec import Backend, Platform, __version__

# Where torch is not installed the inventory (spec, registry) still imports and lists every op.
_HAS_TORCH = _util.find_spec("torch") is not None

if _HAS_TORCH:
    from . import library  # noqa: F401  (registers the ops)
    from .dispatch import KernelUnavailableError, Selection, configure, selection
    from .ops.activation import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul
    from .ops.attention import merge_attn_states
    from .ops.moe import grouped_topk, topk_softmax
    from .ops.norm import fused_add_rmsnorm, gemma_fused_add_rmsnorm, gemma_rmsnorm, rmsnorm
    from .ops.quant import per_token_group_quant_fp8
    from .ops.rope import rotary_embedding
    from .ops.sampling import top_k_renorm_probs, top_k_top_p_sampling_from_probs, top_p_renorm_probs
else:
    def __getattr__(name: str):
        raise AttributeError(f"torch_kernels.{name} needs torch, which is not installed; without it only the "
                          "inventory imports (torch_kernels.spec, torch_kernels.registry)")

__all__ = [
    "Backend", "KernelUnavailableError", "Platform", "Selection", "configure", "selection",
    "rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm",
    "silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul", "rotary_embedding", "per_token_group_quant_fp8",
    "topk_softmax", "grouped_topk", "merge_attn_states",
    "top_k_renorm_probs", "top_p_renorm_probs", "top_k_top_p_sampling_from_probs",
]
