"""The quant family's inventory: who implements which op, and how each op compiles."""

from ...manifest import kernels, reference
from ...spec import INDUCTOR_TRITON, OPAQUE, Backend, Family, HostCall, OpInfo

OPS = ("per_token_group_quant_fp8", "scaled_fp8_quant")
TRITON_OPS = ("per_token_group_quant_fp8", "scaled_fp8_quant")
TILELANG_OPS = ("per_token_group_quant_fp8", "scaled_fp8_quant")
# how the C++ entry calls TileLang's host functions: group quant (X, Q, S, eps), eps in the signature (it picks
# the kernel); scaled quant (X, Q, S[, static scale or bound]); q and the scales laid out per signature
_HOST_CALLS = {"per_token_group_quant_fp8": HostCall("riebb", "p", (0, -1, -2, 2)),
               "scaled_fp8_quant": HostCall("robo", "p", (0, -1, -2, 1, 3))}

FAMILY = Family(
    __package__,
    # compile 2078 GB/s against ours 4125 (8192x7168 g128); in a block opaque 30.6 µs, inductor_triton 40.0
    ops=(OpInfo("per_token_group_quant_fp8", OPAQUE, decompose_after_pointwise=True),
         OpInfo("scaled_fp8_quant", OPAQUE,
                no_compile_route=() if "scaled_fp8_quant" in TRITON_OPS else ((INDUCTOR_TRITON, "no Triton kernel"),))),
    kernels=(
        *reference(__package__, OPS),
        *kernels(__package__, Backend.TRITON, TRITON_OPS,
                 "group quant a program per block of rows x groups; scaled quant 4096-value tiles, per token a "
                 "program per row block, per tensor an atomic amax then a quantising pass; hardware e4m3 cvt, "
                 "emulated in the interpreter", out_ops=TRITON_OPS),
        *kernels(__package__, Backend.TILELANG, TILELANG_OPS,
                 "group quant 16 values a thread in 16-byte vectors, a group's lanes reduce by shfl.xor; scaled quant "
                 "row kernels, per tensor an atomic max then a quantising pass; hardware e4m3 cvt; every size and stride",
                 host_calls=_HOST_CALLS, out_ops=TILELANG_OPS),
    ),
)
