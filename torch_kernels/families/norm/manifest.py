"""The norm family's inventory: who implements which op, and how each op compiles."""

from ...manifest import HALF, kernels, reference
from ...spec import INDUCTOR_TRITON, OPAQUE, Backend, Family, HostCall, OpInfo

OPS = ("rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm")
QUANT_OPS = ("rmsnorm_fp8_quant", "fused_add_rmsnorm_fp8_quant", "gemma_rmsnorm_fp8_quant",
             "gemma_fused_add_rmsnorm_fp8_quant")
# the FP8 ops each backend implements: each bit for bit that backend's norm, then its own quant op
TRITON_QUANT_OPS = QUANT_OPS
TILELANG_QUANT_OPS = QUANT_OPS
_IN_PLACE = ("fused_add_rmsnorm", "gemma_fused_add_rmsnorm")
# the ops whose out overload the kernels write themselves: the functional ones (vLLM's rms_norm(out, ...))
_OUT = ("rmsnorm", "gemma_rmsnorm", "rmsnorm_fp8_quant", "gemma_rmsnorm_fp8_quant")
# how the C++ entry calls TileLang's host functions: norm(X, W, O, eps); fused(X, R, W, eps), in place;
# with the FP8 epilogue (X, [R,] W, Q, S, [static scale,] eps), q and the scales laid out per signature
_HOST_CALLS = {**{op: HostCall("rrwf", "", (0, 1, 2, 3)) if op in _IN_PLACE else HostCall("rwf", "r", (0, 1, -1, 2))
                  for op in OPS},
               **{op: HostCall("rrwfoibb", "p", (0, 1, 2, -1, -2, 4, 3)) if "fused" in op
                  else HostCall("rwfoibb", "p", (0, 1, -1, -2, 3, 2)) for op in QUANT_OPS}}

FAMILY = Family(
    __package__,
    # alone our kernel beats Inductor's for the reference: rmsnorm 4096x4096 17.8 against 20.7 µs; after a
    # pointwise op decomposed: x*2 -> rmsnorm -> +1 20.4 µs, against 50.1 opaque
    ops=tuple(OpInfo(op, OPAQUE, decompose_after_pointwise=True,
                     # Inductor's C++ backend (torch 2.13) fails on the decomposed in-place norms with both
                     # tensors graph inputs (KeyError in try_outer_loop_fusion_with_local_buf)
                     opaque_off_cuda=op in _IN_PLACE)
              for op in OPS)
        + tuple(OpInfo(op, OPAQUE, no_compile_route=() if op in TRITON_QUANT_OPS else ((INDUCTOR_TRITON, "no Triton kernel"),))
                for op in QUANT_OPS),
    kernels=(
        *reference(__package__, OPS + QUANT_OPS),
        *kernels(__package__, Backend.TRITON, OPS + TRITON_QUANT_OPS, "one program per row; rows wider than 16384 in two passes",
                 out_ops=_OUT),
        *kernels(__package__, Backend.TILELANG, OPS + TILELANG_QUANT_OPS,
                 "row over a power of two of threads, 16 values each in 16-byte vectors, short rows several to a "
                 "block; rows wider than 16384 in two passes; every size and stride (misaligned rows via a copy)",
                 host_calls=_HOST_CALLS, out_ops=_OUT),
        *kernels(__package__, Backend.FLASHINFER, OPS,
                 "FlashInfer's CUDA norm kernels (get_norm_module); weight in the input's dtype, rows aligned to their loads",
                 HALF, checks=True, out_ops=("rmsnorm", "gemma_rmsnorm")),
    ),
    notes=("FlashInfer's rmsnorm_quant and fused_add_rmsnorm_quant are benchmark peers, not implementations of "
           "rmsnorm_fp8_quant and fused_add_rmsnorm_fp8_quant: they quantise the fp32 norm instead of the value "
           "rounded to the input's dtype (one e4m3 step apart near rounding boundaries) and clamp NaN to 448, so the fused op would "
           "no longer equal the unfused pair",),
)
