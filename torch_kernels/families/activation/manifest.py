"""The activation family's inventory: who implements which op, and how each op compiles."""

from ...manifest import HALF, kernels, reference
from ...spec import INDUCTOR_TRITON, OPAQUE, Backend, Family, HostCall, OpInfo

OPS = ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul")
QUANT_OPS = ("silu_and_mul_fp8_quant",)
# the FP8 op each backend implements: bit for bit that backend's silu_and_mul, then its own quant op
TRITON_QUANT_OPS = QUANT_OPS
TILELANG_QUANT_OPS = QUANT_OPS
# the C++ entry calls TileLang's act_and_mul(X, O); gelu_and_mul's approximate is part of the signature
_HOST_CALLS = {**{op: HostCall("r", "h", (0, -1)) for op in ("silu_and_mul", "gelu_tanh_and_mul")},
               "gelu_and_mul": HostCall("rs", "h", (0, -1)),
               # (X, Q, S[, static scale]), q and the scales laid out per signature
               "silu_and_mul_fp8_quant": HostCall("roibb", "p", (0, -1, -2, 1))}
# every op here is functional: each kernel writes its out overload's tensors itself (vLLM's silu_and_mul(out, x))
_OUT = OPS + QUANT_OPS

FAMILY = Family(
    __package__,
    # like the norms: our kernel alone, decomposed after a pointwise op (docs/design/compile.md)
    ops=tuple(OpInfo(op, OPAQUE, decompose_after_pointwise=True) for op in OPS)
        + tuple(OpInfo(op, OPAQUE, no_compile_route=() if op in TRITON_QUANT_OPS else ((INDUCTOR_TRITON, "no Triton kernel"),))
                for op in QUANT_OPS),
    kernels=(
        *reference(__package__, OPS + QUANT_OPS),
        *kernels(__package__, Backend.TRITON, OPS + TRITON_QUANT_OPS, "flat grid of 1024-element tiles, short rows packed several to a tile",
                 out_ops=_OUT),
        *kernels(__package__, Backend.TILELANG, OPS + TILELANG_QUANT_OPS,
                 "flat grid of 1024-output tiles, 8 a thread in 16-byte vectors; every size and stride (misaligned rows via a copy)",
                 host_calls=_HOST_CALLS, out_ops=_OUT),
        *kernels(__package__, Backend.FLASHINFER, OPS, "flashinfer.activation.<act>_and_mul; contiguous rows", HALF, checks=True,
                 out_ops=OPS),
    ),
)
