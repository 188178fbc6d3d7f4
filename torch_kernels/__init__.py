"""torch_kernels: the non-GEMM kernels of an LLM inference engine as ``torch.ops.deepinfer.*``.

``import torch_kernels`` registers every op (eager, ``torch.compile`` and ``opcheck`` ready) and
imports no kernel framework; backends load on the first CUDA call of each op.
"""

import importlib.util as _util

from .spec import Backend, Platform, __version__

# Where torch is not installed the inventory (spec, registry) still imports and lists every op.
_HAS_TORCH = _util.find_spec("torch") is not None

_CORE = ["Backend", "KernelUnavailableError", "Platform", "Selection", "configure", "selection"]

if _HAS_TORCH:
    from . import library  # noqa: F401  (registers the ops)
    from .dispatch import KernelUnavailableError, Selection, configure, selection
    from .ops import ALL as _ALL

    # every op's typed wrapper, by the op's name: torch_kernels.rmsnorm(...), and the functions over it
    globals().update({_d.name: _d.wrapper for _d in _ALL})
    globals().update({_f.__name__: _f for _d in _ALL for _f in _d.aliases})
    __all__ = _CORE + [_d.name for _d in _ALL] + [_f.__name__ for _d in _ALL for _f in _d.aliases]

    def __getattr__(name: str):
        # torch_kernels.passes on first use: it imports Inductor, which a plain import must not pay
        if name == "passes":
            import importlib

            return importlib.import_module(f"{__name__}.passes")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
else:
    def __getattr__(name: str):
        raise AttributeError(f"torch_kernels.{name} needs torch, which is not installed; without it only the "
                          "inventory imports (torch_kernels.spec, torch_kernels.registry)")

    __all__ = ["Backend", "Platform"]
