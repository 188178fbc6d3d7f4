"""The collective family's inventory: who implements which op, and how each op compiles."""

from ...manifest import reference
from ...spec import DECOMPOSE, INDUCTOR_TRITON, OPAQUE, Family, OpInfo

OPS = ("all_reduce_fused_add_rmsnorm", "all_reduce_fused_add_rmsnorm_fp8_quant")

FAMILY = Family(
    __package__,
    ops=tuple(OpInfo(op, OPAQUE, no_compile_route=(
        (DECOMPOSE, "its reference all-reduces in place through torch.distributed, outside any graph"),
        (INDUCTOR_TRITON, "no Triton kernel"))) for op in OPS),
    kernels=reference(__package__, OPS),
    notes=("all_reduce_fused_add_rmsnorm and its FP8 form run torch.distributed's all_reduce, then fused_add_rmsnorm: "
           "no kernel fuses the all-reduce yet (one- and two-shot kernels over symmetric memory need a multi-GPU host "
           "to be verified)",),
)
