"""The activation family's inventory: who implements which op, and how each op compiles."""

from ...manifest import HALF, kernels, reference
from ...spec import OPAQUE, Backend, Family, HostCall, OpInfo

OPS = ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul")
# the C++ entry calls TileLang's act_and_mul(X, O); not gelu_and_mul: a string argument has no HostCall role
_HOST_CALLS = {op: HostCall("r", "h", (0, -1)) for op in ("silu_and_mul", "gelu_tanh_and_mul")}

FAMILY = Family(
    __package__,
    # like the norms: our kernel alone, decomposed after a pointwise op (docs/design/compile.md)
    ops=tuple(OpInfo(op, OPAQUE, decompose_after_pointwise=True) for op in OPS),
    kernels=(
        *reference(__package__, OPS),
        *kernels(__package__, Backend.TRITON, OPS, "flat grid of 1024-element tiles, short rows packed several to a tile"),
        *kernels(__package__, Backend.TILELANG, OPS,
                 "flat grid of 1024-output tiles, 8 a thread in 16-byte vectors; every size and stride (misaligned rows via a copy)",
                 host_calls=_HOST_CALLS),
        *kernels(__package__, Backend.FLASHINFER, OPS, "flashinfer.activation.<act>_and_mul; contiguous rows", HALF, checks=True),
    ),
)
