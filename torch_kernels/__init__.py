"""torch_kernels: the non-GEMM kernels of an LLM inference engine as ``torch.ops.deepinfer.*``.

``import torch_kernels`` registers every op (eager, ``torch.compile`` and ``opcheck`` ready) and
imports no kernel framework; backends load on the first CUDA call of each op.
"""

from . import library  # noqa: F401  (registers the ops)
from .dispatch import KernelUnavailableError, Selection, configure, selection
from .ops.norm import fused_add_rmsnorm, gemma_fused_add_rmsnorm, gemma_rmsnorm, rmsnorm
from .spec import Backend, Platform

__version__ = "0.1.0"

__all__ = [
    "Backend", "KernelUnavailableError", "Platform", "Selection", "configure", "selection",
    "rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm",
]
