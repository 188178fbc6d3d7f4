"""The rope family's inventory: who implements which op, and how each op compiles."""

from ...manifest import HALF, kernels, reference
from ...spec import OPAQUE, Backend, Family, HostCall, OpInfo

OPS = ("rotary_embedding", "qk_rmsnorm_rope")
# how the C++ entry calls TileLang's host function: rope(positions, query, key, cos_sin_cache), in place;
# head_size and is_neox are part of the signature
_HOST_CALLS = {"rotary_embedding": HostCall("ttticb", "", (0, 1, 2, 4))}

FAMILY = Family(
    __package__,
    ops=(
        # compile 1213 GB/s against ours 3912 (8192 tokens); opaque rotates QKV views in their buffer, no copy.
        # TileLang first (the default order): 1.58 / 2.72 / 84.6 µs against Triton's 1.71 / 3.46 / 85.0 at
        # 1 / 512 / 16384 tokens, a third of its host time (docs/design/rope.md)
        OpInfo("rotary_embedding", OPAQUE, decompose_after_pointwise=True),
        # as rotary_embedding: opaque, in place on the views of a fused qkv buffer; Triton first, ahead at
        # every size measured: 1.68 / 23.1 / 99.4 µs against TileLang's 1.97 / 40.4 / 158 at 1 / 4096 / 16384
        OpInfo("qk_rmsnorm_rope", OPAQUE, decompose_after_pointwise=True,
               cuda_priority=(Backend.TRITON, Backend.TILELANG, Backend.TORCH)),
    ),
    kernels=(
        *reference(__package__, OPS),
        *kernels(__package__, Backend.TRITON, ("rotary_embedding",),
                 "one program per (token, chunk of heads); cos/sin loaded once per program"),
        *kernels(__package__, Backend.TRITON, ("qk_rmsnorm_rope",),
                 "one program per (token, chunk of heads), two heads a warp: each head's sum of squares in the "
                 "layout of the rmsnorm kernel's rows (so its bits), normalised and rotated in registers"),
        *kernels(__package__, Backend.TILELANG, ("rotary_embedding",),
                 "a thread per (token, lane of pairs in 16-byte vectors): cos/sin loaded once, the lane rotated in "
                 "every head of the token (q then k); every size and stride (misaligned views value by value)",
                 host_calls=_HOST_CALLS),
        *kernels(__package__, Backend.TILELANG, ("qk_rmsnorm_rope",),
                 "(token, head) rows in rmsnorm's row layout and reduction, several to a block; normalised rows "
                 "through shared memory to the rotation; misaligned views via aligned copies"),
        *kernels(__package__, Backend.FLASHINFER, ("rotary_embedding",),
                 "apply_rope_with_cos_sin_cache_inplace; key present, fp32 cache, head_size 64/128/256/512", HALF, checks=True),
    ),
    notes=("FlashInfer 0.7.4's flashinfer.norm.fused_qk_rmsnorm_rope is no implementation of qk_rmsnorm_rope: it "
           "normalises across all heads of a token (weights of num_heads * head_dim) and computes a 3-D "
           "(frame, height, width) RoPE of video DiTs from a base, with no positions or cos/sin cache",),
)
