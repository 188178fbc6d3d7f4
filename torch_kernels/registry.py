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
    *_backend(Backend.TILELANG, _TILELANG, "norm", ("rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm"),
              "row over a power of two of threads, 16 values each in 16-byte vectors, short rows several to a "
              "block; rows wider than 16384 in two passes; every size and stride (misaligned rows via a copy)"),
    *_backend(Backend.TILELANG, _TILELANG, "activation", ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"),
              "flat grid of 1024-output tiles, 8 a thread in 16-byte vectors; every size and stride (misaligned rows via a copy)"),
    *_backend(Backend.TILELANG, _TILELANG, "rope", ("rotary_embedding",),
              "a thread per (token, lane of pairs in 16-byte vectors): cos/sin loaded once, the lane rotated in "
              "every head of the token (q then k); every size and stride (misaligned views value by value)"),
    *_backend(Backend.TILELANG, _TILELANG, "quant", ("per_token_group_quant_fp8",),
              "16 values a thread in 16-byte vectors, a group's lanes reduce by shfl.xor, hardware e4m3 cvt; "
              "every group size and stride (misaligned rows value by value)"),
    *_backend(Backend.TILELANG, _TILELANG, "attention", ("merge_attn_states",),
              "up to 16 values of one head a thread in 16-byte vectors, fp32 merge; every size and stride "
              "(misaligned partials value by value)"),
)

FLASHINFER_KERNELS: Tuple[KernelSpec, ...] = (
    *_backend(Backend.FLASHINFER, _FLASHINFER, "norm", ("rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm"),
              "FlashInfer's CUDA norm kernels (get_norm_module); weight in the input's dtype, rows aligned to their loads",
              ("float16", "bfloat16"), checks=True),
    *_backend(Backend.FLASHINFER, _FLASHINFER, "activation", ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"),
              "flashinfer.activation.<act>_and_mul; contiguous rows", ("float16", "bfloat16"), checks=True),
    *_backend(Backend.FLASHINFER, _FLASHINFER, "rope", ("rotary_embedding",),
              "apply_rope_with_cos_sin_cache_inplace; key present, fp32 cache, head_size 64/128/256/512",
              ("float16", "bfloat16"), checks=True),
    *_backend(Backend.FLASHINFER, _FLASHINFER, "attention", ("merge_attn_states",),
              "cascade.merge_state on base-2 LSE, empty partials restored; head size 64/128/256/512",
              ("float16", "bfloat16"), checks=True),
    *_backend(Backend.FLASHINFER, _FLASHINFER, "sampling", ("top_k_top_p_sampling_from_probs",),
              "top_k_renorm_probs + top_p_sampling_from_probs: same kept set, FlashInfer's random stream",
              ("float32",), checks=True),
)

#: Implementations that sample from the reference's kept set with their own random stream: for one
#: (seed, offset) their ids differ from the reference's, and FlashInfer decides the top-p boundary in
#: fp32 (a token within ~1e-6 of the boundary may go either way). Tests and the self-check hold them to
#: the kept set and the distribution instead of the reference's ids; the first call says so on stderr.
OWN_RANDOM_STREAM = frozenset({("top_k_top_p_sampling_from_probs", Backend.FLASHINFER)})

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
#: TileLang first as in the DeepInfer dispatcher; Triton before FlashInfer: rmsnorm 4092 against 2762 GB/s
#: at 16384x8192 bf16 (H200; the measurements behind each order: docs/design/<family>.md).
DEFAULT_CUDA_PRIORITY: Tuple[Backend, ...] = (Backend.TILELANG, Backend.TRITON, Backend.FLASHINFER, Backend.TORCH)
#: Per-op exceptions: rope takes Triton first, 85.8 against 86.0 µs at 16384 tokens when chosen (the
#: latest suite has TileLang ahead at every size: docs/design/rope.md).
_TRITON_FIRST = (Backend.TRITON, Backend.TILELANG, Backend.FLASHINFER, Backend.TORCH)
CUDA_PRIORITY: Dict[str, Tuple[Backend, ...]] = {"rotary_embedding": _TRITON_FIRST}

# ------------------------------------------------------------------------------------------------
# Compiled routes: what an op becomes below Dynamo's one node when torch.compile traces it on CUDA
# (docs/compile.md). The measurements behind each choice: docs/design/compile.md (H200, bf16).

#: The reference formula, inlined, so that Inductor fuses the op with its neighbours.
DECOMPOSE = "decompose"
#: Our Triton kernel, launched by Inductor itself (``torch.library.wrap_triton``, as in ``triton_op``);
#: Inductor cannot fuse into a user kernel, so the neighbours stay separate kernels.
INDUCTOR_TRITON = "inductor_triton"
#: One opaque call to the backend ``dispatch.plan`` selects, as in eager mode.
OPAQUE = "opaque"
COMPILE_ROUTES: Tuple[str, ...] = (DECOMPOSE, INDUCTOR_TRITON, OPAQUE)

#: The route of each op where no pointwise op computes its data input (alone, after a matmul, on the
#: graph's inputs; DECOMPOSE_AFTER_POINTWISE covers the other case): the neighbours decide.
COMPILE_ROUTE: Dict[str, str] = {
    # Alone our kernel beats Inductor's for the reference: rmsnorm 4096x4096 17.8 against 20.7 µs
    "rmsnorm": OPAQUE,
    "gemma_rmsnorm": OPAQUE,
    "fused_add_rmsnorm": OPAQUE,
    "gemma_fused_add_rmsnorm": OPAQUE,
    "silu_and_mul": OPAQUE,
    "gelu_and_mul": OPAQUE,
    "gelu_tanh_and_mul": OPAQUE,
    # compile 1213 GB/s against ours 3912 (8192 tokens); opaque rotates QKV views in their buffer, no copy
    "rotary_embedding": OPAQUE,
    # compile 2078 GB/s against ours 4125 (8192x7168 g128); in a block opaque 30.6 µs, inductor_triton 40.0
    "per_token_group_quant_fp8": OPAQUE,
    # compile 112 µs against ours 14 (8192x256 top-8); opaque keeps `auto`'s per-call choice under compile
    "topk_softmax": OPAQUE,
    "grouped_topk": OPAQUE,
    # alone opaque 25.7 against 28.1 µs decomposed (4096x32x128)
    "merge_attn_states": OPAQUE,
    # no decomposition worth it (sort-based; Inductor failed on the reference's int64 cumsum)
    "top_k_renorm_probs": OPAQUE,
    "top_p_renorm_probs": OPAQUE,
    "top_k_top_p_sampling_from_probs": OPAQUE,
}

#: Ops that decompose instead of taking their own route when the graph computes their data input with a
#: pointwise op (followed through views): Inductor then fuses that producer, and the neighbours after it,
#: into the op's formula: x*2 -> rmsnorm -> +1 at 4096x4096 20.4 µs decomposed, 20.2 plain, 50.1 opaque.
DECOMPOSE_AFTER_POINTWISE = frozenset({
    "rmsnorm", "gemma_rmsnorm", "fused_add_rmsnorm", "gemma_fused_add_rmsnorm", "silu_and_mul", "gelu_and_mul",
    "gelu_tanh_and_mul", "rotary_embedding", "per_token_group_quant_fp8", "merge_attn_states"})

#: Routes an op cannot take, and why: a route forced for all ops falls back to the op's own route
#: for these (saying so), forcing one for this op alone raises.
#: Ops whose torch reference Inductor cannot compile (the benchmarks skip that peer for them).
REFERENCE_NOT_COMPILABLE = {op: "the reference sorts the vocabulary; torch.compile of it failed in Inductor "
                                "(SplitScan codegen on the int64 cumsum)"
                            for op in ("top_k_renorm_probs", "top_p_renorm_probs", "top_k_top_p_sampling_from_probs")}

NO_COMPILE_ROUTE: Dict[Tuple[str, str], str] = {
    **{(op, DECOMPOSE): why for op, why in REFERENCE_NOT_COMPILABLE.items()},
    **{(op, INDUCTOR_TRITON): "its Triton kernel has no launch through wrap_triton"
       for op in ("top_k_renorm_probs", "top_p_renorm_probs", "top_k_top_p_sampling_from_probs")},
}

#: Ops that stay opaque on devices other than CUDA (there, every route runs the reference): Inductor's
#: C++ backend (torch 2.13) fails to compile the decomposed in-place norms when both tensors are graph
#: inputs (KeyError in try_outer_loop_fusion_with_local_buf; the same block in plain torch fails alike).
OPAQUE_OFF_CUDA = frozenset({"fused_add_rmsnorm", "gemma_fused_add_rmsnorm"})


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
