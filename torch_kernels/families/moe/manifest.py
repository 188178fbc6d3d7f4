"""The MoE routing family's inventory: who implements which op, and how each op compiles."""

from ...manifest import kernels, reference
from ...spec import OPAQUE, Backend, Family, OpInfo

OPS = ("topk_softmax", "grouped_topk")

FAMILY = Family(
    __package__,
    # compile 112 µs against ours 14 (8192x256 top-8); opaque keeps `auto`'s per-call choice under compile
    ops=tuple(OpInfo(op, OPAQUE) for op in OPS),
    kernels=(
        *reference(__package__, OPS),
        *kernels(__package__, Backend.TRITON, OPS,
                 "one kernel for both routers: 8-16 tokens a program, topk rounds of argmax; up to 8192 padded experts",
                 checks=True),
    ),
)
