"""The inventory: every implementation of every op, and the order in which CUDA prefers them.

The union of the family manifests (``torch_kernels/families/<family>/manifest.py``): data, not
branches. Standard library only (see ``spec.py``).

    python -c "from torch_kernels import registry; print(*registry.KERNELS, sep='\\n')"
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

from .spec import COMPILE_ROUTES, DECOMPOSE, INDUCTOR_TRITON, OPAQUE, Backend, Family, KernelSpec, OpInfo  # noqa: F401

FAMILIES_PACKAGE = f"{__package__}.families"


def discover(package: str = FAMILIES_PACKAGE) -> Tuple[Family, ...]:
    """The ``FAMILY`` of every subpackage of ``package`` that has a ``manifest`` module, in the package's
    ``ORDER``, then by name."""
    families = importlib.import_module(package)
    root = Path(families.__file__).parent
    order = getattr(families, "ORDER", ())
    found = sorted((m.name for m in pkgutil.iter_modules([str(root)]) if m.ispkg and (root / m.name / "manifest.py").exists()),
                   key=lambda name: (order.index(name) if name in order else len(order), name))
    return tuple(importlib.import_module(f"{package}.{name}.manifest").FAMILY for name in found)


FAMILIES: Tuple[Family, ...] = discover()
INFO: Dict[str, OpInfo] = {info.name: info for f in FAMILIES for info in f.ops}
KERNELS: Tuple[KernelSpec, ...] = tuple(k for f in FAMILIES for k in f.kernels)

#: The order in which the CUDA platform default tries backends, per op; the first one whose
#: capability is met serves the op, the later ones take calls it cannot (dtype, size).
#: TileLang first as in the DeepInfer dispatcher; Triton before FlashInfer: rmsnorm 4092 against 2762 GB/s
#: at 16384x8192 bf16 (H200; the measurements behind each order: docs/design/<family>.md).
DEFAULT_CUDA_PRIORITY: Tuple[Backend, ...] = (Backend.TILELANG, Backend.TRITON, Backend.FLASHINFER, Backend.TORCH)
#: Per-op exceptions (``OpInfo.cuda_priority``)
CUDA_PRIORITY: Dict[str, Tuple[Backend, ...]] = {op: i.cuda_priority for op, i in INFO.items() if i.cuda_priority}

#: Implementations that sample from the reference's kept set with their own random stream: for one
#: (seed, offset) their ids differ from the reference's. Tests and the self-check hold them to the kept
#: set and the distribution instead of the reference's ids; the first call says so on stderr.
OWN_RANDOM_STREAM = frozenset((k.op, k.backend) for k in KERNELS if k.own_random_stream)

#: The route of each op where no pointwise op computes its data input (``OpInfo.compile_route``).
COMPILE_ROUTE: Dict[str, str] = {op: i.compile_route for op, i in INFO.items()}
#: Ops that decompose instead when the graph computes their data input with a pointwise op.
DECOMPOSE_AFTER_POINTWISE = frozenset(op for op, i in INFO.items() if i.decompose_after_pointwise)
#: Routes an op cannot take, and why: a route forced for all ops falls back to the op's own route
#: for these (saying so), forcing one for this op alone raises.
NO_COMPILE_ROUTE: Dict[Tuple[str, str], str] = {(op, route): why for op, i in INFO.items() for route, why in i.no_compile_route}
#: Ops whose torch reference Inductor cannot compile (the benchmarks skip that peer for them).
REFERENCE_NOT_COMPILABLE = {op: why for (op, route), why in NO_COMPILE_ROUTE.items() if route == DECOMPOSE}
#: Ops that stay opaque on devices other than CUDA (there, every route runs the reference).
OPAQUE_OFF_CUDA = frozenset(op for op, i in INFO.items() if i.opaque_off_cuda)


def validate(kernels: Iterable[KernelSpec]) -> Dict[str, Dict[Backend, KernelSpec]]:
    """Index ``kernels`` by op then backend; raise if a backend implements an op twice or an op
    has no torch reference (the reference is the fallback on every device)."""
    index: Dict[str, Dict[Backend, KernelSpec]] = {}
    for k in kernels:
        per_op = index.setdefault(k.op, {})
        if k.backend in per_op:
            raise RuntimeError(f"backend {k.backend.value!r} implements op {k.op!r} twice: "
                               f"{per_op[k.backend].target} and {k.target}")
        per_op[k.backend] = k
    for op, per_op in index.items():
        if Backend.TORCH not in per_op:
            raise RuntimeError(f"op {op!r} has no torch reference in the inventory")
        if op not in INFO:
            raise RuntimeError(f"op {op!r} has kernels but no OpInfo in its family's manifest")
    for op in INFO.keys() - index.keys():
        raise RuntimeError(f"op {op!r} of a manifest has no implementation")
    return index


BY_OP: Dict[str, Dict[Backend, KernelSpec]] = validate(KERNELS)
OPS: Tuple[str, ...] = tuple(BY_OP)


def compile_routes(op: str) -> List[str]:
    """The routes ``op`` can take under torch.compile, its own (``COMPILE_ROUTE``) first."""
    own = COMPILE_ROUTE[op]
    return [own] + [r for r in COMPILE_ROUTES if r != own and (op, r) not in NO_COMPILE_ROUTE]


def _check_compile_routes() -> None:
    for op in OPS:
        route = COMPILE_ROUTE.get(op)
        if route not in COMPILE_ROUTES or (op, route) in NO_COMPILE_ROUTE:
            raise RuntimeError(f"op {op!r} needs a compiled route in COMPILE_ROUTE, one of {COMPILE_ROUTES} "
                               f"it can take; got {route!r}")
        if (op, INDUCTOR_TRITON) not in NO_COMPILE_ROUTE and Backend.TRITON not in BY_OP[op]:
            raise RuntimeError(f"op {op!r} has no Triton kernel for the {INDUCTOR_TRITON!r} route")
        if op in DECOMPOSE_AFTER_POINTWISE and (op, DECOMPOSE) in NO_COMPILE_ROUTE:
            raise RuntimeError(f"op {op!r} in DECOMPOSE_AFTER_POINTWISE cannot decompose")


_check_compile_routes()


def cuda_priority(op: str) -> Tuple[Backend, ...]:
    return CUDA_PRIORITY.get(op, DEFAULT_CUDA_PRIORITY)


def implementations(op: str) -> List[KernelSpec]:
    """Every implementation of ``op``, in CUDA priority order."""
    return [BY_OP[op][b] for b in cuda_priority(op) if b in BY_OP[op]]


def backends_of(op: str) -> List[Backend]:
    return [k.backend for k in implementations(op)]


def ops_of(backend: Backend) -> List[str]:
    return [op for op in OPS if backend in BY_OP[op]]
