"""The attention family's inventory: who implements which op, and how each op compiles."""

from ...manifest import HALF, kernels, reference
from ...spec import OPAQUE, Backend, Family, HostCall, OpInfo

OPS = ("merge_attn_states",)
# how the C++ entry calls TileLang's host function: merge(v_a, lse_a, v_b, lse_b, out, out_lse), the
# partials and LSEs passed with their strides, the outputs shaped like v_a and lse_a
_HOST_CALLS = {"merge_attn_states": HostCall("tttt", "p", (0, 1, 2, 3, -1, -2))}

FAMILY = Family(
    __package__,
    # alone opaque 25.7 against 28.1 µs decomposed (4096x32x128)
    ops=(OpInfo("merge_attn_states", OPAQUE, decompose_after_pointwise=True),),
    kernels=(
        *reference(__package__, OPS),
        *kernels(__package__, Backend.TRITON, OPS, "whole heads of one token per program, fp32 merge", out_ops=OPS),
        *kernels(__package__, Backend.TILELANG, OPS,
                 "up to 16 values of one head a thread in 16-byte vectors, fp32 merge; every size and stride "
                 "(misaligned partials value by value)", host_calls=_HOST_CALLS, out_ops=OPS),
        *kernels(__package__, Backend.FLASHINFER, OPS,
                 "cascade.merge_state on base-2 LSE, empty partials restored; head size 64/128/256/512", HALF, checks=True),
    ),
)
