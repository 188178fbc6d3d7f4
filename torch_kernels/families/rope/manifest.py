"""The rope family's inventory: who implements which op, and how each op compiles."""

from ...manifest import HALF, kernels, reference
from ...spec import OPAQUE, Backend, Family, OpInfo

OPS = ("rotary_embedding",)

FAMILY = Family(
    __package__,
    # compile 1213 GB/s against ours 3912 (8192 tokens); opaque rotates QKV views in their buffer, no copy.
    # Triton first: 85.8 against TileLang's 86.0 µs at 16384 tokens when chosen (docs/design/rope.md)
    ops=(OpInfo("rotary_embedding", OPAQUE, decompose_after_pointwise=True,
                cuda_priority=(Backend.TRITON, Backend.TILELANG, Backend.FLASHINFER, Backend.TORCH)),),
    kernels=(
        *reference(__package__, OPS),
        *kernels(__package__, Backend.TRITON, OPS, "one program per (token, chunk of heads); cos/sin loaded once per program"),
        *kernels(__package__, Backend.TILELANG, OPS,
                 "a thread per (token, lane of pairs in 16-byte vectors): cos/sin loaded once, the lane rotated in "
                 "every head of the token (q then k); every size and stride (misaligned views value by value)"),
        *kernels(__package__, Backend.FLASHINFER, OPS,
                 "apply_rope_with_cos_sin_cache_inplace; key present, fp32 cache, head_size 64/128/256/512", HALF, checks=True),
    ),
)
