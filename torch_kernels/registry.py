"""The inventory: every implementation of every op, and the order in which CUDA prefers them.

Data, not branches: adding a backend implementation is one ``KernelSpec`` line here plus its module
under ``torch_kernels/impl/<backend>/``. Standard library only (see ``spec.py``).

    python -c "from torch_kernels import registry; print(*registry.KERNELS, sep='\\n')"
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

from .spec import FRAMEWORK_PACKAGE, Backend, Capability, KernelSpec

_TORCH = Capability()  # the reference runs wherever torch does
_TRITON = Capability(device_types=("cuda",), min_compute_capability=(7, 0), package=FRAMEWORK_PACKAGE[Backend.TRITON])

_TILELANG = Capability(device_types=("cuda",), min_compute_capability=(8, 0), package=FRAMEWORK_PACKAGE[Backend.TILELANG])
_FLASHINFER = Capability(device_types=("cuda",), min_compute_capability=(8, 0), package=FRAMEWORK_PACKAGE[Backend.FLASHINFER])

_FLOATS = ("float16", "bfloat16", "float32")


def _family(family: str, ops: Tuple[str, ...], triton_dtypes: Tuple[str, ...] = _FLOATS, triton: str = "",
            triton_checks: bool = False) -> Tuple[KernelSpec, ...]:
    """The torch reference and the Triton kernel of each op of ``family`` (``impl/<backend>/<family>.py``).
    Dtypes the ops accept but the kernels do not (fp64) go to the next backend, the reference; with
    ``triton_checks``, ``<op>_refuses`` in the Triton module turns away calls beyond its limits."""
    return tuple(spec for op in ops for spec in (
        KernelSpec(op, Backend.TORCH, f"torch_kernels.impl.torch.{family}:{op}", _TORCH,
                   description="torch-native reference (fp32 compute)"),
        KernelSpec(op, Backend.TRITON, f"torch_kernels.impl.triton.{family}:{op}", _TRITON, triton_dtypes,
                   check=f"torch_kernels.impl.triton.{family}:{op}_refuses" if triton_checks else None,
                   description=triton),
    ))


def _backend(backend: Backend, capability: Capability, family: str, ops: Tuple[str, ...], description: str,
             dtypes: Tuple[str, ...] = _FLOATS, checks: bool = False) -> Tuple[KernelSpec, ...]:
    """``backend``'s implementation of each op of ``family`` (``impl/<backend>/<family>.py``); with
    ``checks``, ``<op>_refuses`` in that module turns away the calls it cannot take."""
    module = f"torch_kernels.impl.{backend.value}.{family}"
    return tuple(KernelSpec(op, backend, f"{module}:{op}", capability, dtypes,
                            check=f"{module}:{op}_refuses" if checks else None, description=description)
                 for op in ops)


# One line per family a backend implements (``_backend(Backend.TILELANG, _TILELANG, "norm", (...), "...")``).
TILELANG_KERNELS: Tuple[KernelSpec, ...] = (
)

FLASHINFER_KERNELS: Tuple[KernelSpec, ...] = (
)

KERNELS: Tuple[KernelSpec, ...] = (
    *_family("norm", ("rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm"),
             triton="one program per row; rows wider than 16384 in two passes"),
    *_family("activation", ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"),
             triton="flat grid of 1024-element tiles, short rows packed several to a tile"),
    *_family("rope", ("rotary_embedding",), triton="one program per (token, chunk of heads); cos/sin loaded once per program"),
    *_family("quant", ("per_token_group_quant_fp8",),
             triton="one pass, a program per block of rows x groups; fp8 rounding done in fp32, exact in the interpreter too"),
    *_family("moe", ("topk_softmax", "grouped_topk"), triton_checks=True,
             triton="one kernel for both routers: 8-16 tokens a program, topk rounds of argmax; up to 8192 padded experts"),
    *_family("attention", ("merge_attn_states",), triton="whole heads of one token per program, fp32 merge"),
    *_family("sampling", ("top_k_renorm_probs", "top_p_renorm_probs", "top_k_top_p_sampling_from_probs"),
             triton_dtypes=("float32",),
             triton="one program per row: candidate buffer in one read (top_k <= 1024), else multi-pivot passes; bit-exact with the reference"),
    *TILELANG_KERNELS,
    *FLASHINFER_KERNELS,
)

#: The order in which the CUDA platform default tries backends, per op; the first one whose
#: capability is met serves the op, the later ones take calls it cannot (dtype, size).
#: TileLang first as in the DeepInfer dispatcher; Triton before FlashInfer because the one-row Triton
#: rmsnorm measured 4092 GB/s against FlashInfer's 2762 at 16384x8192 bf16 (shared/gpu/README.md).
DEFAULT_CUDA_PRIORITY: Tuple[Backend, ...] = (Backend.TILELANG, Backend.TRITON, Backend.FLASHINFER, Backend.TORCH)
CUDA_PRIORITY: Dict[str, Tuple[Backend, ...]] = {}


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
    return index


BY_OP: Dict[str, Dict[Backend, KernelSpec]] = validate(KERNELS)
OPS: Tuple[str, ...] = tuple(BY_OP)


def cuda_priority(op: str) -> Tuple[Backend, ...]:
    return CUDA_PRIORITY.get(op, DEFAULT_CUDA_PRIORITY)


def implementations(op: str) -> List[KernelSpec]:
    """Every implementation of ``op``, in CUDA priority order."""
    return [BY_OP[op][b] for b in cuda_priority(op) if b in BY_OP[op]]


def backends_of(op: str) -> List[Backend]:
    return [k.backend for k in implementations(op)]


def ops_of(backend: Backend) -> List[str]:
    return [op for op in OPS if backend in BY_OP[op]]
